"""`router keys create | list | revoke`: the router's API keys, straight in its store.

Rules:
1. The store is the router's own (`router.store.paths`: `$HUGPY_ROUTER_HOME`, ...). A running
   router sees a change within a second (`KeyStore.refresh_if_changed`), so no restart and no
   HTTP round trip are needed.
2. `create` prints the full key once, alone on stdout (so `KEY=$(router keys create ...)`
   works), with its id and a note on stderr. It is never shown again.
3. `list` never prints hashes (the store never returns them). `revoke` of an unknown id
   exits 1.
4. A bad name, scope or expiry exits 2 with the reason, as a ConfigError does in `main`.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone

from router.core.errors import BadRequest
from router.store import paths
from router.store.keys import PRIORITIES, SCOPES, KeyStore

NOTE = "store this key now; it is not shown again"


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
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    create = ksub.add_parser("create", help="mint a key (printed once)")
    create.add_argument("--name", required=True, help="who or what the key is for")
    create.add_argument("--scope", choices=SCOPES, default="use",
                        help="use: call models; admin: also manage the router (default use)")
    create.add_argument("--expires-days", type=float, default=None, help="days until it expires (default never)")
    create.add_argument("--priority", choices=PRIORITIES, default="normal",
                        help="the class its calls wait in when boxes are full; a call may ask for "
                        "lower (X-Router-Priority), never higher (default normal)")
    listing = ksub.add_parser("list", help="list keys (hashes are never shown)")
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    revoke = ksub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("id")
    return keys


def keys_command(args: argparse.Namespace) -> int:
    """Runs one `router keys` subcommand. Returns the exit status. Raises ConfigError when the
    store cannot be opened (main prints it and exits 2)."""
    store = KeyStore(paths.db_path())
    try:
        if args.keys_command == "create":
            try:
                key_id, key = store.create(args.name, args.scope, args.expires_days, created_by="cli",
                                           priority=args.priority)
            except BadRequest as exc:
                print(f"router keys: {exc}", file=sys.stderr)
                return 2
            print(f"key {key_id} ({args.scope}) created for {args.name.strip()}", file=sys.stderr)
            print(key)
            print(NOTE, file=sys.stderr)
            return 0
        if args.keys_command == "list":
            print("id\tname\tscope\tpriority\tcreated\texpires\tlast_used\trevoked")
            for row in store.list(include_revoked=args.all):
                print("\t".join((
                    row["id"], row["name"], row["scope"], row["priority"], _when(row["created_at"]),
                    _when(row["expires_at"]), _when(row["last_used_at"]), _when(row["revoked_at"]),
                )))
            return 0
        if store.revoke(args.id):
            print(f"key {args.id} revoked")
            return 0
        print(f"router keys: no key with id {args.id}", file=sys.stderr)
        return 1
    finally:
        store.close()
