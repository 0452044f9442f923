"""`router aliases set NAME MODEL [MODEL...] | list | remove NAME`: the boxes file's aliases.

Every change is one `router.boxes.config.edit` (locked, atomic), the code path of the admin
API's `PUT|DELETE /v1/aliases/<name>`; a running router applies it within a second (the fleet
watches the file). The command line has no view of the boxes' inventories, so it cannot refuse
an alias that shadows a served model: the admin API does, and `GET /v1/aliases` flags one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from router.boxes import aliases as box_aliases
from router.cli.store import add_database_option, registry_of


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
        for alias in registry.load().aliases.values():
            print(f"{alias.name}\t{' -> '.join(alias.chain)}")
        return 0
    if args.aliases_command == "set":
        added = registry.edit(lambda boxes: box_aliases.set_alias(boxes, args.name, args.models))
        print(f"alias {args.name} {'added' if added else 'replaced'}: {' -> '.join(args.models)}")
        return 0
    try:
        registry.edit(lambda boxes: box_aliases.remove_alias(boxes, args.name))
    except box_aliases.UnknownAlias:
        print(f"no alias named {args.name} in {path}", file=sys.stderr)
        return 1
    print(f"alias {args.name} removed")
    return 0
