"""Which registry holds the boxes and aliases (router.boxes.config rule 8), for the router and
for every CLI alike: the boxes file, or the tables of router.boxes.pg_registry when a database is
named.

It sits above both, so that neither imports the other back; the PostgreSQL side is imported only
for a database (router.store.engines rule 3: a single router loads no driver).
"""

from __future__ import annotations

from pathlib import Path

from router.boxes.config import FileRegistry, Registry


def registry_for(path: Path, database_url: str | None) -> Registry:
    """The boxes file at `path`, or the registry in the database at `database_url`."""
    if database_url is None:
        return FileRegistry(path)
    from router.boxes.pg_registry import PgRegistry

    return PgRegistry(database_url)
