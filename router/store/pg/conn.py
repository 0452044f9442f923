"""Connections to PostgreSQL, and its migrations.

Rules:
1. Every connection is made with a short connect timeout (CONNECT_TIMEOUT_S) and a statement
   timeout (STATEMENT_TIMEOUT_MS), and TCP keepalives: no round trip to the database waits
   longer than a few seconds, and none runs on the event loop (the LISTEN task's are async).
2. Migrations are `pg/schema/NNNN_name.sql`, numbered 1..N without gaps (PostgreSQL's own
   series: its first step is the SQLite store's schema as of 0006, in PostgreSQL's types).
   `migrate` takes the session advisory lock MIGRATE_LOCK, reads `schema_migrations`, and
   applies each missing step in its own transaction with its row; so routers starting together
   apply each step once, one after the other. A database newer than this code raises
   ConfigError.
3. A URL is shown only without its password (`shown`).
4. Every change that other routers must see is announced on CHANNEL by the tables' own
   triggers (schema 0001), with the topic as payload: `keys`, or `boxes` (boxes and aliases);
   so any writer (this router, another, the CLI, psql) is seen by every router.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

from router.core.errors import ConfigError
from router.store import db

try:
    import psycopg
except ImportError:  # the `shared` extra is missing: said when a URL is given (`require`)
    psycopg = None  # type: ignore[assignment]

CONNECT_TIMEOUT_S = 2
# A statement that takes longer is a database in trouble: the writer keeps its rows, a key
# reload keeps the last map, an edit answers an error.
STATEMENT_TIMEOUT_MS = 3000
# A router migrating waits for another one's migration, which may take longer than a statement.
MIGRATE_TIMEOUT_MS = 120_000
CHANNEL = "hugpy_router"
# pg_advisory_lock keys: any stable 64-bit numbers that no other application on the database uses.
MIGRATE_LOCK = 0x68_75_67_70_79_01  # "hugpy" 1
PRUNE_LOCK = 0x68_75_67_70_79_02  # "hugpy" 2: retention pruning on one router
REGISTRY_LOCK = 0x68_75_67_70_79_03  # "hugpy" 3: one boxes/aliases edit at a time
URL_SCHEMES = ("postgresql", "postgres")


def psycopg_sql(sql: str) -> str:
    """A statement of the store's parts, written with SQLite's `?` placeholders, in psycopg's `%s`
    (the statements hold no other `?` and no `%`)."""
    return sql.replace("?", "%s")


def require() -> None:
    """Raises ConfigError when psycopg (the `shared` extra) is not installed."""
    if psycopg is None:
        raise ConfigError("a PostgreSQL store needs the shared extra: pip install 'hugpy-router[shared]'")


def shown(url: str) -> str:
    """The URL without its password (rule 3)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def check_url(url: str) -> str:
    """Returns `url` when it is a postgresql:// URL. Raises ConfigError."""
    if urlsplit(url).scheme not in URL_SCHEMES:
        raise ConfigError(f"--database-url must be a postgresql:// URL, not {shown(url)!r}")
    return url


def connect(url: str, *, autocommit: bool = True, timeout_ms: int = STATEMENT_TIMEOUT_MS) -> "psycopg.Connection":
    """A connection with rule 1's timeouts. Raises psycopg.OperationalError when unreachable."""
    require()
    return psycopg.connect(
        url, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT_S,
        options=f"-c statement_timeout={timeout_ms}", keepalives=1, keepalives_idle=5,
        keepalives_interval=2, keepalives_count=2, application_name="hugpy-router",
    )


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every shipped PostgreSQL migration, in order (rule 2)."""
    return db.migrations("router.store.pg", "PostgreSQL")


def migrate(url: str) -> int:
    """Applies the migrations the database lacks, under MIGRATE_LOCK (rule 2). Returns the schema
    version. Raises ConfigError when the database is unreachable, newer than this code, or a
    step fails."""
    steps = migrations()
    latest = steps[-1][0]
    try:
        with connect(url, timeout_ms=MIGRATE_TIMEOUT_MS) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATE_LOCK,))
            try:
                conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations ("
                             " version integer PRIMARY KEY, name text NOT NULL,"
                             " applied_at timestamptz NOT NULL DEFAULT now())")
                applied = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
                if applied and max(applied) > latest:
                    raise ConfigError(f"database schema version {max(applied)} is newer than this router "
                                      f"knows ({latest}); upgrade the router")
                for version, name, sql in steps:
                    if version in applied:
                        continue
                    with conn.transaction():
                        conn.execute(sql)
                        conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                                     (version, name))
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATE_LOCK,))
    except psycopg.Error as exc:
        raise ConfigError(f"database {shown(url)}: cannot migrate: {exc}") from None
    return latest


class Session:
    """One connection shared by worker threads, one statement or transaction at a time, made
    again when it broke (a restarted database): an outage costs a failed statement, never a
    stuck one (rule 1)."""

    def __init__(self, url: str, timeout_ms: int = STATEMENT_TIMEOUT_MS) -> None:
        require()
        self.url = url
        self.timeout_ms = timeout_ms
        self._lock = threading.Lock()
        self._conn = None

    @contextlib.contextmanager
    def use(self) -> Iterator["psycopg.Connection"]:
        """The live connection, held by this thread until the block ends. Raises psycopg.Error."""
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed or conn.broken:
                conn = self._conn = connect(self.url, timeout_ms=self.timeout_ms)
            yield conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
