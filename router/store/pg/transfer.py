"""`router store export|import` (router.cli.store): a single router's store tables moved into
PostgreSQL, and back.

Rules:
1. What moves here: the keys (every column, the hashes included: the keys keep working), the
   usage by day, the route log (ids kept, the identity moved past them). The boxes and aliases
   move with them through the caller's `registry` step (they are the boxes room's).
2. The target must hold none of it (no key, usage, row, box or alias): a transfer copies, it
   never merges, so nothing is overwritten and no id collides. A target that is not empty
   raises ConfigError naming what it holds, and nothing is written.
3. Each direction is one transaction on the target (PostgreSQL: COPY for the tables, then the
   caller's `registry(conn)` in the same transaction; SQLite: BEGIN IMMEDIATE): a failed
   transfer leaves the target as it was. The source is only read.
4. On PostgreSQL the tables' triggers announce the new keys and boxes at commit, so routers
   already running on that database serve them within a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from router.core.errors import ConfigError
from router.store import batches, db, route_log
from router.store.keys import LIMIT_COLUMNS, USAGE_SUMS
from router.store.pg import conn as pg

TABLES = {
    "api_keys": ("id", "name", "scope", "secret_hash", "created_at", "created_by", "expires_at",
                 "last_used_at", "revoked_at", "priority", *LIMIT_COLUMNS),
    "key_usage": ("key_id", "day", *USAGE_SUMS),
    "route_log": ("id", *route_log.COLUMNS),
    **batches.TABLES,
}
ORDER = {"api_keys": "id", "key_usage": "key_id, day", "route_log": "id", "batch_files": "id", "batches": "id",
         "batch_lines": "batch_id, line_no"}
# Route-log rows read and written per round of the copy.
CHUNK_ROWS = 5000


def _select(table: str) -> str:
    return f"SELECT {', '.join(TABLES[table])} FROM {table} ORDER BY {ORDER[table]}"


def refuse_unless_empty(counts: dict[str, int], where: str) -> None:
    held = {name: n for name, n in counts.items() if n}
    if held:
        raise ConfigError(f"{where} is not empty ({', '.join(f'{n} {name}' for name, n in held.items())}): "
                          "a transfer copies into an empty store, it never merges")


def export(store_path: Path, url: str, registry: Callable[[object], None]) -> dict[str, int]:
    """The SQLite store into the database at `url`, `registry(conn)` writing the boxes and
    aliases in the same transaction (rules 1-4). Returns what moved, by table. Raises
    ConfigError."""
    pg.migrate(url)
    source = db.open_store(store_path)
    moved: dict[str, int] = {}
    try:
        with pg.connect(url, autocommit=False) as conn:
            held = {table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                    for table in (*TABLES, "boxes", "aliases")}
            refuse_unless_empty(held, f"database {pg.shown(url)}")
            for table, columns in TABLES.items():
                moved[table] = 0
                with conn.cursor() as cursor, cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
                    for row in source.execute(_select(table)):
                        copy.write_row(row)
                        moved[table] += 1
            conn.execute("SELECT setval(pg_get_serial_sequence('route_log', 'id'), coalesce(max(id), 0) + 1, false)"
                         " FROM route_log")
            registry(conn)
            conn.commit()
    except pg.psycopg.Error as exc:
        raise ConfigError(f"export into {pg.shown(url)} failed: {exc}") from None
    finally:
        source.close()
    return moved


def import_(url: str, store_path: Path) -> dict[str, int]:
    """The database at `url` into the SQLite store (rules 1-3). Returns what moved, by table.
    Raises ConfigError."""
    pg.migrate(url)
    target = db.open_store(store_path)
    moved: dict[str, int] = {}
    try:
        held = {table: target.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in TABLES}
        refuse_unless_empty(held, f"store {store_path}")
        with pg.connect(url, autocommit=False) as conn:
            with db.immediate(target):
                for table, columns in TABLES.items():
                    insert = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
                    moved[table] = 0
                    with conn.cursor(name=f"transfer_{table}") as cursor:  # server side: streamed
                        cursor.execute(_select(table))
                        while rows := cursor.fetchmany(CHUNK_ROWS):
                            target.executemany(insert, rows)
                            moved[table] += len(rows)
    except pg.psycopg.Error as exc:
        raise ConfigError(f"import from {pg.shown(url)} failed: {exc}") from None
    finally:
        target.close()
    return moved
