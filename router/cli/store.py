"""The store's engine on the command line: `--database-url` for `router boxes|aliases|keys|log`,
and `router store export|import`.

Rules:
1. `--database-url` (default $HUGPY_ROUTER_DATABASE_URL) makes `boxes`, `aliases`, `keys` and
   `log` work on the PostgreSQL store, as a router started with the same URL does
   (router.store.engines); unset, they work on the files, as before. A command migrates a new
   database first, so it may run before any router has.
2. `router store export --to URL` copies this machine's store file and boxes file into an empty
   PostgreSQL store; `router store import --from URL` copies one back into an empty store file
   and boxes file (router.store.pg.transfer). Each prints what moved, by table.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from router.boxes import config as boxes_config
from router.boxes.registry import registry_for
from router.store import engines, paths


def add_database_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", default=None,
                        help="postgresql://... : work on the PostgreSQL store that routers started with the "
                        f"same URL share (default ${engines.ENV}; unset: the local files)")


def database_of(args: argparse.Namespace) -> str | None:
    """The command's database URL (rule 1), migrated; None for the files. Raises ConfigError."""
    url = engines.database_url(args.database_url)
    if url is not None:
        engines.open_database(url)
    return url


def registry_of(args: argparse.Namespace) -> tuple[boxes_config.Registry, str]:
    """The command's boxes registry and how messages name it: the boxes file's path, or the
    database (rule 1)."""
    path = Path(os.path.realpath(args.boxes_file or boxes_config.default_path()))
    url = database_of(args)
    registry = registry_for(path, url)
    return registry, str(args.boxes_file or boxes_config.default_path()) if url is None else registry.where


def add_store_parser(sub) -> None:
    store = sub.add_parser("store", help="move the store between SQLite and PostgreSQL (several routers)")
    ssub = store.add_subparsers(dest="store_command", required=True)
    out = ssub.add_parser("export", help="copy the store file and boxes file into an empty PostgreSQL store")
    out.add_argument("--to", required=True, metavar="URL", help="postgresql://... of the database")
    back = ssub.add_parser("import", help="copy a PostgreSQL store into an empty store file and boxes file")
    back.add_argument("--from", required=True, dest="source", metavar="URL", help="postgresql://... of the database")
    for command in (out, back):
        command.add_argument("--store", type=Path, default=None,
                             help="the store file (default: $HUGPY_ROUTER_HOME/router.sqlite3, as serve uses)")
        command.add_argument("--boxes-file", type=Path, default=None,
                             help="the boxes file (default: $HUGPY_ROUTER_BOXES or <config dir>/router/boxes.json)")


def store_command(args: argparse.Namespace) -> int:
    """Rule 2: the tables by router.store.pg.transfer, the boxes and aliases beside them (in
    the same transaction on PostgreSQL). Raises ConfigError (main prints it, exit 2)."""
    from router.boxes import pg_registry
    from router.store.pg import transfer

    store_path = args.store or paths.db_path()
    boxes_path = args.boxes_file or boxes_config.default_path()
    if args.store_command == "export":
        boxes = boxes_config.load(boxes_path)
        moved = transfer.export(store_path, engines.database_url(args.to),
                                lambda conn: pg_registry.write(conn, boxes))
    else:
        url = engines.database_url(args.source)
        present = boxes_config.load(boxes_path)
        transfer.refuse_unless_empty({"boxes": len(present.boxes), "aliases": len(present.aliases)},
                                     f"boxes file {boxes_path}")
        moved = transfer.import_(url, store_path)
        boxes = pg_registry.PgRegistry(url).load()

        def replace(file: boxes_config.BoxesFile) -> None:
            file.boxes[:] = boxes.boxes
            file.aliases = dict(boxes.aliases)

        boxes_config.edit(boxes_path, replace)
    moved["boxes"], moved["aliases"] = len(boxes.boxes), len(boxes.aliases)
    print(" ".join(f"{table}={count}" for table, count in moved.items()))
    return 0
