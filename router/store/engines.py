"""Which engine holds the store: the SQLite file (the default), or PostgreSQL when a database
URL is given (`--database-url`, HUGPY_ROUTER_DATABASE_URL).

Rules:
1. One place picks the engine for each part of the store (the keys, the route log, the batches;
   the boxes registry and aliases: router.boxes.registry), for the router and for every CLI
   alike; the parts' code is the same either way (router.store.keys, router.store.route_log,
   router.store.batches), behind small engine seams.
2. Opening PostgreSQL migrates it first (router.store.pg.conn.migrate, under its advisory lock),
   so the first router or CLI to touch a new database creates its tables.
3. Nothing of the PostgreSQL side is imported without a URL: a single router needs no driver.
"""

from __future__ import annotations

import os
from pathlib import Path

from router.store.batches import BatchStore
from router.store.keys import KeyStore
from router.store.route_log import RouteLogWriter

ENV = "HUGPY_ROUTER_DATABASE_URL"


def database_url(given: str | None = None) -> str | None:
    """The database URL: `given`, else $HUGPY_ROUTER_DATABASE_URL, else None (SQLite). Raises
    ConfigError for a URL that is not postgresql://."""
    url = given or os.environ.get(ENV, "").strip() or None
    if url is None:
        return None
    from router.store.pg import conn as pg

    return pg.check_url(url)


def open_database(url: str) -> None:
    """Rule 2. Raises ConfigError when the database cannot be reached or migrated."""
    from router.store.pg import conn as pg

    pg.require()
    pg.migrate(url)


def keys(store_path: Path, url: str | None) -> KeyStore:
    """The key store; on PostgreSQL once `open_database` ran."""
    if url is None:
        return KeyStore(store_path)
    from router.store.pg.keys import PgKeys

    return KeyStore(store_path, engine=PgKeys(url))


def batches(store_path: Path, url: str | None) -> BatchStore:
    """The batch store (files, batches, their lines); on PostgreSQL once `open_database` ran."""
    if url is None:
        return BatchStore(store_path)
    from router.store.pg.batches import PgBatches

    return BatchStore(store_path, engine=PgBatches(url))


def route_log(store_path: Path, url: str | None, retention_s: float | None = None,
              instance: str | None = None) -> RouteLogWriter:
    """The route-log writer (not started); on PostgreSQL its spill file lives beside `store_path`."""
    if url is None:
        return RouteLogWriter(store_path, retention_s, instance)
    from router.store.pg.route_log import PgRouteLogWriter

    return PgRouteLogWriter(url, store_path, retention_s, instance)

