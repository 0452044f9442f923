"""`router keys [--router-port N] create | list | revoke | limits | usage`: the router's API keys.

Rules:
1. With a router port (`--router-port`, else `$HUGPY_ROUTER_PORT`, as 0.0.4) the command goes
   through that running router's admin API (`/v1/keys`) on `$HUGPY_ROUTER_HOST` (a wildcard
   host is reached on loopback), with `$HUGPY_ROUTER_KEY` as the bearer when it is set
   (loopback needs none). Without one it works on the store file
   (`router.store.paths`: `$HUGPY_ROUTER_HOME`, ...); a running router sees the change within
   a second (`KeyStore.refresh_if_changed`). Both ways print the same.
2. `create` prints the full key once, alone on stdout (so `KEY=$(router keys create ...)`
   works), with its id and a note on stderr. It is never shown again.
3. `list` never prints hashes (neither the store nor the API returns them); `--json` prints
   the admin API's document, `{"keys": [...]}`. `revoke` of an unknown id exits 1.
4. A bad name, scope, expiry or limit exits 2 with the reason, as a ConfigError does in `main`. A
   router that cannot be reached, or answers otherwise, exits 1 with its status and message
   (never a key: the API never echoes one in an error).
5. Limits (docs/tenancy.md): `create --rpm N --tpm N --max-parallel N --budget-tokens N
   --budget-period day|week|month --models a,b`, changed by `limits ID` with the same flags (0 or
   an empty `--models ''` removes one). `usage [ID] [--json]` prints each key's usage in its
   current and previous period; through a running router also what is left of each limit. On
   the store file, where a key has limits, stderr says why `left` is empty (a running router
   counts it, in memory) and how to ask one (the port of the router serving the boxes file,
   when its listeners record names one: router.boxes.listeners rule 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from typing import Any

from router.boxes import listeners
from router.boxes.config import default_path
from router.cli.store import add_database_option, database_of
from router.core.errors import BadRequest
from router.core.limits import PERIODS
from router.store import engines, paths
from router.store.keys import PRIORITIES, SCOPES, KeyStore

NOTE = "store this key now; it is not shown again"
API_TIMEOUT_S = 15.0
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class RouterUnreachable(Exception):
    """The running router could not be asked, or answered with an error (rule 4)."""


class ApiKeys:
    """The KeyStore's create / list / revoke, through a running router's admin API (rule 1)."""

    def __init__(self, host: str, port: str, admin_key: str | None) -> None:
        host = "127.0.0.1" if host in WILDCARD_HOSTS else host
        self.base = f"http://{f'[{host}]' if ':' in host and not host.startswith('[') else host}:{port}"
        self.headers = {"Content-Type": "application/json"}
        if admin_key:
            self.headers["Authorization"] = f"Bearer {admin_key}"

    def _ask(self, method: str, path: str, doc: dict | None = None) -> tuple[int, Any]:
        data = None if doc is None else json.dumps(doc).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=API_TIMEOUT_S) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                error = json.loads(exc.read()).get("error", {})
            except (ValueError, AttributeError):
                error = {}
            message = error.get("message") if isinstance(error, dict) else error
            if exc.code == 400:
                raise BadRequest(str(message)) from None
            return exc.code, str(message or exc.reason)
        except OSError as exc:
            raise RouterUnreachable(f"no router answered at {self.base}: {exc}") from None

    def create(self, name: str, scope: str, expires_days: float | None, created_by: str,
               priority: str = "normal", limits: dict | None = None) -> tuple[str, str]:
        status, doc = self._ask("POST", "/v1/keys", {"name": name, "scope": scope, "expires_days": expires_days,
                                                     "created_by": created_by, "priority": priority,
                                                     "limits": limits or None})
        if status != 201:
            raise RouterUnreachable(f"router answered {status}: {doc}")
        return doc["id"], doc["key"]

    def list(self, include_revoked: bool = False) -> list[dict[str, Any]]:
        status, doc = self._ask("GET", "/v1/keys" + ("?all=1" if include_revoked else ""))
        if status != 200:
            raise RouterUnreachable(f"router answered {status}: {doc}")
        return doc["keys"]

    def revoke(self, key_id: str) -> bool:
        status, doc = self._ask("POST", f"/v1/keys/{key_id}/revoke", {})
        if status == 404:
            return False
        if status != 200:
            raise RouterUnreachable(f"router answered {status}: {doc}")
        return True

    def set_limits(self, key_id: str, changes: dict) -> Any:
        status, doc = self._ask("PUT", f"/v1/keys/{key_id}/limits", changes)
        if status == 404:
            return None
        if status != 200:
            raise RouterUnreachable(f"router answered {status}: {doc}")
        return doc["limits"]

    def usage_report(self, key_ids: list[str] | None, now: float) -> list[dict[str, Any]]:
        status, doc = self._ask("GET", f"/v1/keys/{key_ids[0]}/usage" if key_ids else "/v1/keys/usage")
        if status == 404:
            return []
        if status != 200:
            raise RouterUnreachable(f"router answered {status}: {doc}")
        return doc["keys"] if not key_ids else [doc]

    def close(self) -> None:
        pass


def _why_no_left(args: argparse.Namespace) -> str:
    """Rule 5: why the store file's usage has no `left`, and the command that has it."""
    running = listeners.read_record(getattr(args, "boxes_top", None) or default_path())
    if running is not None and running.main is not None:
        how = f"a router runs on port {running.main}: router keys --router-port {running.main} usage"
    else:
        how = "with the router running: router keys --router-port PORT usage (or $HUGPY_ROUTER_PORT set)"
    return ("`left` is empty: what is left of each limit is counted by a running router, in memory, not in "
            f"the store; {how}")


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def add_keys_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds `keys` and its subcommands to `subparsers`. Returns the `keys` parser."""
    keys = subparsers.add_parser(
        "keys", help="manage API keys",
        description=f"API keys in the router's store ({paths.db_path()} here).",
    )
    keys.add_argument("--router-port", default=None,
                      help="go through the router running on this port (default $HUGPY_ROUTER_PORT; "
                      "neither: work on the store file)")
    add_database_option(keys)
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    create = ksub.add_parser("create", help="mint a key (printed once)")
    create.add_argument("--name", required=True, help="who or what the key is for")
    create.add_argument("--scope", choices=SCOPES, default="use",
                        help="use: call models; admin: also manage the router (default use)")
    create.add_argument("--expires-days", type=float, default=None, help="days until it expires (default never)")
    create.add_argument("--priority", choices=PRIORITIES, default="normal",
                        help="the class its calls wait in when boxes are full; a call may ask for "
                        "lower (X-Router-Priority), never higher (default normal)")
    _limit_flags(create)
    limits = ksub.add_parser("limits", help="change a key's limits (live in a running router)")
    limits.add_argument("id")
    _limit_flags(limits)
    usage = ksub.add_parser("usage", help="a key's (or every key's) usage and what is left of its limits")
    usage.add_argument("id", nargs="?")
    usage.add_argument("--json", action="store_true", help='print {"keys": [...]} as the admin API does')
    listing = ksub.add_parser("list", help="list keys (hashes are never shown)")
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    listing.add_argument("--json", action="store_true", help='print {"keys": [...]} as the admin API does')
    revoke = ksub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("id")
    return keys


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    """Rule 5's flags; a value is checked by router.core.limits.parse_limits (exit 2)."""
    for flag, what in (("--rpm", "requests a minute"), ("--tpm", "tokens (prompt + completion) a minute"),
                       ("--max-parallel", "calls in flight at once (more wait in the queue)"),
                       ("--budget-tokens", "tokens per budget period")):
        parser.add_argument(flag, type=int, default=None, help=f"{what} (0 removes the limit)")
    parser.add_argument("--budget-period", default=None, help=f"{' | '.join(PERIODS)}: UTC calendar periods (default day)")
    parser.add_argument("--models", default=None, help="the models it may call, comma-separated ('' removes the list)")


def _limit_changes(args: argparse.Namespace) -> dict:
    """The limit flags given, as the API's JSON (0 or '' is null: removed)."""
    changes: dict[str, Any] = {}
    for name in ("rpm", "tpm", "max_parallel", "budget_tokens"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value or None
    if args.budget_period is not None:
        changes["budget_period"] = args.budget_period
    if args.models is not None:
        changes["models"] = [m.strip() for m in args.models.split(",") if m.strip()] or None
    return changes


def _limits_text(limits: dict) -> str:
    shown = [f"{name}={value if name != 'models' else ','.join(value)}" for name, value in limits.items()
             if value is not None]
    return " ".join(shown) or "-"


def keys_command(args: argparse.Namespace) -> int:
    """Runs one `router keys` subcommand. Returns the exit status. Raises ConfigError when the
    store cannot be opened (main prints it and exits 2)."""
    port = args.router_port or os.environ.get("HUGPY_ROUTER_PORT", "").strip()
    if port:
        store: KeyStore | ApiKeys = ApiKeys(os.environ.get("HUGPY_ROUTER_HOST", "").strip(), port,
                                            os.environ.get("HUGPY_ROUTER_KEY") or None)
    else:
        store = engines.keys(paths.db_path(), database_of(args))
    try:
        return _run(store, args)
    except RouterUnreachable as exc:
        print(f"router keys: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()


def _run(store: KeyStore | ApiKeys, args: argparse.Namespace) -> int:
    """One subcommand on either backend; the same output both ways (rule 1)."""
    if args.keys_command == "create":
        try:
            key_id, key = store.create(args.name, args.scope, args.expires_days, created_by="cli",
                                       priority=args.priority, limits=_limit_changes(args))
        except BadRequest as exc:
            print(f"router keys: {exc}", file=sys.stderr)
            return 2
        print(f"key {key_id} ({args.scope}) created for {args.name.strip()}", file=sys.stderr)
        print(key)
        print(NOTE, file=sys.stderr)
        return 0
    if args.keys_command == "list":
        rows = store.list(include_revoked=args.all)
        if args.json:
            print(json.dumps({"keys": rows}, indent=1))
            return 0
        print("id\tname\tscope\tcreated\texpires\tlast_used\trevoked\tlimits")
        for row in rows:
            print("\t".join((
                row["id"], row["name"], row["scope"], _when(row["created_at"]),
                _when(row["expires_at"]), _when(row["last_used_at"]), _when(row["revoked_at"]),
                _limits_text(row["limits"]),
            )))
        return 0
    if args.keys_command == "limits":
        try:
            changed = store.set_limits(args.id, _limit_changes(args))
        except BadRequest as exc:
            print(f"router keys: {exc}", file=sys.stderr)
            return 2
        if changed is None:
            print(f"router keys: no key with id {args.id}", file=sys.stderr)
            return 1
        doc = changed if isinstance(changed, dict) else changed.doc()
        print(f"key {args.id} limits: {_limits_text(doc)}")
        return 0
    if args.keys_command == "usage":
        return _usage(store, args)
    if store.revoke(args.id):  # revoke
        print(f"key {args.id} revoked")
        return 0
    print(f"router keys: no key with id {args.id}", file=sys.stderr)
    return 1


def _usage(store: KeyStore | ApiKeys, args: argparse.Namespace) -> int:
    docs = store.usage_report([args.id] if args.id else None, time.time())
    if args.id and not docs:
        print(f"router keys: no key with id {args.id}", file=sys.stderr)
        return 1
    if isinstance(store, KeyStore) and any(v is not None for doc in docs for v in doc["limits"].values()):
        print(f"router keys: {_why_no_left(args)}", file=sys.stderr)
    if args.json:
        print(json.dumps({"keys": docs}, indent=1))
        return 0
    print("id\tname\tperiod\trequests\tprompt\tcompletion\tcached\tprevious_tokens\tleft\tlimits")
    for doc in docs:
        now, before = doc["current"], doc["previous"]
        left = doc.get("left") or {}
        shown_left = " ".join(f"{name}={value}" for name, value in left.items()
                              if value is not None and not name.endswith("_s")) or "-"
        print("\t".join(str(v) for v in (
            doc["id"], doc["name"], f"{doc['period']} from {_when(now['start'])}", now["requests"],
            now["prompt_tokens"], now["completion_tokens"], now["cached_tokens"],
            before["prompt_tokens"] + before["completion_tokens"], shown_left, _limits_text(doc["limits"]),
        )))
    return 0
