"""`router store export|import`: a single router's store moved into PostgreSQL, and back.

Rules:
1. What moves: the keys (every column, the hashes included: the keys keep working), the usage
   by day, the route log (ids kept, the identity moved past them), the boxes and the aliases.
   Exactly what the PostgreSQL store holds beyond its migrations.
2. The target must hold none of it (no key, usage, row, box or alias): a transfer copies, it
   never merges, so nothing is overwritten and no id collides. A target that is not empty
   raises ConfigError naming what it holds, and nothing is written.
3. Each direction is one transaction on the target (PostgreSQL: COPY for the tables, the
   registry's own writer for boxes and aliases; SQLite: BEGIN IMMEDIATE, then the boxes file's
   own edit): a failed transfer leaves the target as it was. The source is only read.
4. On PostgreSQL the tables' triggers announce the new keys and boxes at commit, so routers
   already running on that database serve them within a second.
"""

from __future__ import annotations

from pathlib import Path

from router.boxes import config as boxes_config
from router.core.errors import ConfigError
from router.store import db, route_log
from router.store.keys import LIMIT_COLUMNS, USAGE_SUMS
from router.store.pg import conn as pg
from router.store.pg import registry as pg_registry

TABLES = {
    "api_keys": ("id", "name", "scope", "secret_hash", "created_at", "created_by", "expires_at",
                 "last_used_at", "revoked_at", "priority", *LIMIT_COLUMNS),
    "key_usage": ("key_id", "day", *USAGE_SUMS),
    "route_log": ("id", *route_log.COLUMNS),
}
ORDER = {"api_keys": "id", "key_usage": "key_id, day", "route_log": "id"}
# Route-log rows read and written per round of the copy.
CHUNK_ROWS = 5000


def _select(table: str) -> str:
    return f"SELECT {', '.join(TABLES[table])} FROM {table} ORDER BY {ORDER[table]}"


def _refuse_unless_empty(counts: dict[str, int], where: str) -> None:
    held = {name: n for name, n in counts.items() if n}
    if held:
        raise ConfigError(f"{where} is not empty ({', '.join(f'{n} {name}' for name, n in held.items())}): "
                          "a transfer copies into an empty store, it never merges")


def export(store_path: Path, boxes_path: Path, url: str) -> dict[str, int]:
    """The SQLite store and the boxes file into the database at `url` (rules 1-4). Returns what
    moved, by table. Raises ConfigError."""
    pg.migrate(url)
    boxes = boxes_config.load(boxes_path)
    source = db.open_store(store_path)
    moved: dict[str, int] = {}
    try:
        with pg.connect(url, autocommit=False) as conn:
            held = {table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                    for table in (*TABLES, "boxes", "aliases")}
            _refuse_unless_empty(held, f"database {pg.shown(url)}")
            for table, columns in TABLES.items():
                moved[table] = 0
                with conn.cursor() as cursor, cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
                    for row in source.execute(_select(table)):
                        copy.write_row(row)
                        moved[table] += 1
            conn.execute("SELECT setval(pg_get_serial_sequence('route_log', 'id'), coalesce(max(id), 0) + 1, false)"
                         " FROM route_log")
            pg_registry.write(conn, boxes)
            conn.commit()
    except pg.psycopg.Error as exc:
        raise ConfigError(f"export into {pg.shown(url)} failed: {exc}") from None
    finally:
        source.close()
    moved["boxes"], moved["aliases"] = len(boxes.boxes), len(boxes.aliases)
    return moved


def import_(url: str, store_path: Path, boxes_path: Path) -> dict[str, int]:
    """The database at `url` into the SQLite store and the boxes file (rules 1-3). Returns what
    moved, by table. Raises ConfigError."""
    pg.migrate(url)
    boxes = pg_registry.PgRegistry(url).load()
    present = boxes_config.load(boxes_path)
    if present.boxes or present.aliases:
        raise ConfigError(f"boxes file {boxes_path} is not empty: a transfer copies into an empty store, "
                          "it never merges")
    target = db.open_store(store_path)
    moved: dict[str, int] = {}
    try:
        held = {table: target.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in TABLES}
        _refuse_unless_empty(held, f"store {store_path}")
        with pg.connect(url, autocommit=False) as conn:
            target.execute("BEGIN IMMEDIATE")
            try:
                for table, columns in TABLES.items():
                    insert = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
                    moved[table] = 0
                    with conn.cursor(name=f"transfer_{table}") as cursor:  # server side: streamed
                        cursor.execute(_select(table))
                        while rows := cursor.fetchmany(CHUNK_ROWS):
                            target.executemany(insert, rows)
                            moved[table] += len(rows)
                target.execute("COMMIT")
            except BaseException:
                if target.in_transaction:
                    target.execute("ROLLBACK")
                raise
    except pg.psycopg.Error as exc:
        raise ConfigError(f"import from {pg.shown(url)} failed: {exc}") from None
    finally:
        target.close()

    def replace(file: boxes_config.BoxesFile) -> None:
        file.boxes[:] = boxes.boxes
        file.aliases = dict(boxes.aliases)

    boxes_config.edit(boxes_path, replace)
    moved["boxes"], moved["aliases"] = len(boxes.boxes), len(boxes.aliases)
    return moved
