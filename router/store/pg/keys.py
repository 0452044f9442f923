"""KeyStore's engine on PostgreSQL (router.store.keys rules 4 and 6).

Rules:
1. The SQL is router.store.keys', written with `?`; this engine runs it in psycopg's `%s`
   (conn.psycopg_sql).
2. One connection (conn.Session), made again after it broke.
3. `version` is the `keys` topic's number in `store_versions` (bumped by the table's triggers):
   the once-a-second look of refresh_if_changed is the fallback; the LISTEN task (listen.py)
   reloads at once on a notification, and on every reconnect.
4. `keep_on_error`: an unreadable database keeps the last map (issue 23: an outage never stops
   calls; a key revoked during it stops working when the database is back).
"""

from __future__ import annotations

from router.store.pg import conn as pg


class PgKeys:
    """KeyStore's engine on PostgreSQL (router.store.keys.KeyEngine). Connects at the first
    statement; raises ConfigError when psycopg is missing."""

    keep_on_error = True

    def __init__(self, url: str) -> None:
        self.session = pg.Session(url)
        import psycopg

        self.errors = (psycopg.Error,)
        self.duplicate = psycopg.errors.UniqueViolation

    def fetch(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self.session.use() as conn:
            return conn.execute(pg.psycopg_sql(sql), params).fetchall()

    def run(self, sql: str, params: tuple = ()) -> int:
        with self.session.use() as conn:
            return conn.execute(pg.psycopg_sql(sql), params).rowcount

    def run_many(self, sql: str, rows: list[tuple]) -> None:
        with self.session.use() as conn, conn.transaction(), conn.cursor() as cursor:
            cursor.executemany(pg.psycopg_sql(sql), rows)

    def version(self) -> object:
        found = self.fetch("SELECT version FROM store_versions WHERE topic = 'keys'")
        return found[0][0] if found else 0

    def close(self) -> None:
        self.session.close()
