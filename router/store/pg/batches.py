"""BatchStore's engine on PostgreSQL (router.store.batches rule 9).

Rules:
1. The SQL is router.store.batches', written with `?`; this engine runs it in psycopg's `%s`
   (conn.psycopg_sql).
2. One connection (conn.Session), made again after it broke; a transaction holds it until it ends.
   Its statement timeout is STATEMENT_TIMEOUT_MS, longer than the other parts': a batch's file
   (up to --batch-max-file-bytes) goes in or out as one value.
3. A SELECT that takes lines locks them and skips the lines another router's transaction holds
   (`lock_rows`): two routers leasing at once take different lines (batches rule 2).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from router.store.pg import conn as pg

# 200 MB into a bytea over a LAN takes seconds; this still ends a statement stuck on a database
# in trouble, in a worker thread, never on the event loop.
STATEMENT_TIMEOUT_MS = 60_000


class _Statements:
    def __init__(self, conn) -> None:
        self.conn = conn

    def fetch(self, sql: str, params: tuple = ()) -> list[tuple]:
        return self.conn.execute(pg.psycopg_sql(sql), params).fetchall()

    def run(self, sql: str, params: tuple = ()) -> int:
        return self.conn.execute(pg.psycopg_sql(sql), params).rowcount

    def run_many(self, sql: str, rows: list[tuple]) -> None:
        if rows:
            with self.conn.cursor() as cursor:
                cursor.executemany(pg.psycopg_sql(sql), rows)


class PgBatches:
    """BatchStore's engine on PostgreSQL (router.store.batches.BatchEngine). Connects at the
    first statement; raises ConfigError when psycopg is missing."""

    lock_rows = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str) -> None:
        self.session = pg.Session(url, timeout_ms=STATEMENT_TIMEOUT_MS)
        import psycopg

        self.errors = (psycopg.Error,)

    def fetch(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self.session.use() as conn:
            return _Statements(conn).fetch(sql, params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_Statements]:
        with self.session.use() as conn, conn.transaction():
            yield _Statements(conn)

    def close(self) -> None:
        self.session.close()
