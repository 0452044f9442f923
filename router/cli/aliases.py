"""`router aliases set NAME MODEL [MODEL...] | list | remove NAME`: the boxes file's aliases.

Every change is one `router.boxes.config.edit` (locked, atomic), the code path of the admin
API's `PUT|DELETE /v1/aliases/<name>`; a running router applies it within a second (the fleet
watches the file). The command line has no view of the boxes' inventories, so `set` goes through
the running router's admin API where the boxes file's listeners record names one
(router.boxes.listeners rule 2; `$HUGPY_ROUTER_KEY` the bearer where it is set): an alias named
like a model a box serves now is refused there (409), and the command exits 2 with its line; a
model of the chain that no box lists now is said on stderr (the alias is kept: calls pass over
that model until a box lists it). `list` asks that router too, marking such a model, and reads
the file where none answers.
Where no router answers, the file is edited directly, said on stderr: `GET /v1/aliases` flags a
shadow, and a key's `models` still bound every model the alias reaches (serve/aliases.py rule 6).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from router.boxes import aliases as box_aliases
from router.boxes import listeners
from router.boxes.config import FileRegistry, default_path
from router.cli.store import add_database_option, registry_of
from router.core.errors import ConfigError

API_TIMEOUT_S = 15.0
UNLISTED_MARK = " (no box lists it)"  # `list`: a model of a chain that no box lists now


def _router_url(args: argparse.Namespace) -> str | None:
    """The admin API of the running router serving this boxes file, or None when none is known."""
    running = listeners.read_record(args.boxes_file or default_path())
    if running is None or running.main is None:
        return None
    host = "127.0.0.1" if running.host in ("", "0.0.0.0", "::") else running.host
    return f"http://{f'[{host}]' if ':' in host else host}:{running.main}"


def _ask(url: str, method: str, path: str, doc: dict | None = None) -> tuple[int, dict]:
    """(status, answer) of one admin API request. Raises urllib.error.HTTPError, OSError."""
    headers = {"Content-Type": "application/json"}
    if os.environ.get("HUGPY_ROUTER_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['HUGPY_ROUTER_KEY']}"
    data = None if doc is None else json.dumps(doc).encode()
    request = urllib.request.Request(url + path, data, headers, method=method)
    with urllib.request.urlopen(request, timeout=API_TIMEOUT_S) as resp:
        return resp.status, json.loads(resp.read())


def _set_through_router(args: argparse.Namespace) -> tuple[bool, list[str]] | None:
    """`set` through the running router's admin API: whether the alias is new and the models of
    its chain no box lists now, or None when no router serving this boxes file answers. Raises
    ConfigError with the router's refusal."""
    url = _router_url(args)
    if url is None:
        return None
    try:
        status, doc = _ask(url, "PUT", f"/v1/aliases/{quote(args.name, safe='')}", {"chain": args.models})
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise ConfigError(f"the router at {url} refused alias {args.name} ({exc.code}): {message}") from None
    except OSError as exc:
        print(f"no router answered at {url} ({exc}): the alias is written unchecked against the boxes' models",
              file=sys.stderr)
        return None
    return status == 201, doc.get("unlisted") or []


def _list_through_router(args: argparse.Namespace) -> list[dict] | None:
    """`GET /v1/aliases` of the running router serving this boxes file; None when none answers."""
    url = _router_url(args)
    if url is None:
        return None
    try:
        return _ask(url, "GET", "/v1/aliases")[1]["aliases"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def add_aliases_parser(sub) -> None:
    aliases = sub.add_parser("aliases", help="manage model aliases (a name and a chain of models)")
    aliases.add_argument("--boxes-file", type=Path, default=None)
    add_database_option(aliases)
    asub = aliases.add_subparsers(dest="aliases_command", required=True)
    define = asub.add_parser("set", help="define an alias: the models it tries, in order")
    define.add_argument("name")
    define.add_argument("models", nargs="+", metavar="MODEL")
    asub.add_parser("list", help="list aliases and their chains")
    remove = asub.add_parser("remove", help="remove an alias")
    remove.add_argument("name")


def aliases_command(args: argparse.Namespace) -> int:
    """Raises ConfigError for a definition the rules refuse (the CLI prints its one line)."""
    registry, path = registry_of(args)
    if args.aliases_command == "list":
        views = _list_through_router(args) if isinstance(registry, FileRegistry) else None
        if views is None:  # no router to ask what the boxes list: the file as it is
            views = [{"name": alias.name, "chain": alias.chain} for alias in registry.load().aliases.values()]
        for view in views:
            unlisted = view.get("unlisted") or ()
            chain = (model + UNLISTED_MARK if model in unlisted else model for model in view["chain"])
            print(f"{view['name']}\t{' -> '.join(chain)}")
        return 0
    if args.aliases_command == "set":
        through_router = _set_through_router(args) if isinstance(registry, FileRegistry) else None
        if through_router is None:
            added, unlisted = registry.edit(lambda boxes: box_aliases.set_alias(boxes, args.name, args.models)), []
        else:
            added, unlisted = through_router
        print(f"alias {args.name} {'added' if added else 'replaced'}: {' -> '.join(args.models)}")
        if unlisted:
            print(f"warning: no box lists {', '.join(unlisted)} now: calls for {args.name} pass over it until a box "
                  "does (a typo, or a model not pulled yet?)", file=sys.stderr)
        return 0
    try:
        registry.edit(lambda boxes: box_aliases.remove_alias(boxes, args.name))
    except box_aliases.UnknownAlias:
        print(f"no alias named {args.name} in {path}", file=sys.stderr)
        return 1
    print(f"alias {args.name} removed")
    return 0
