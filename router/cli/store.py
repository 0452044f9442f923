"""The store's engine on the command line: `--database-url` for `router boxes|aliases|keys|log`,
and `router store export|import`.

Rules:
1. `--database-url` (default $HUGPY_ROUTER_DATABASE_URL) makes `boxes`, `aliases`, `keys` and
   `log` work on the PostgreSQL store, as a router started with the same URL does
   (router.store.engines); unset, they work on the files, as before. A command migrates a new
   database first, so it may run before any router has.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from router.boxes import config as boxes_config
from router.store import engines


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
    registry = engines.registry(path, url)
    return registry, str(args.boxes_file or boxes_config.default_path()) if url is None else registry.where
