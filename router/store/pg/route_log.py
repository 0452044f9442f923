"""The route log on PostgreSQL: router.store.route_log's writer, its engine methods for
PostgreSQL, and what it does while the database is down.

Rules:
1. The queue, the batching, the encoding and the counters are RouteLogWriter's (its rules
   1-14); a batch goes in as one COPY with its `key_usage` increments, in one transaction, on
   the writer thread's own connection (conn.py rule 1's timeouts). COPY costs the router ~9 µs
   of CPU a row where a multi-row INSERT cost ~170 µs (psycopg binds each value in Python; a
   loaded 2-core machine, 20k ~600 B rows). PostgreSQL's text cannot hold NUL, which a
   client's text may: it becomes U+FFFD here, so the row is kept, as SQLite keeps it.
2. Down is a connection error or a timeout (psycopg.OperationalError, InterfaceError): the
   batch is parked, not dropped. A refused row (a duplicate, a bad value) is dropped and
   counted, as on SQLite. A transaction that another one's locks rolled back (a deadlock, a
   serialization failure: OperationalErrors too) is no outage: it is tried again at once, up
   to CONFLICT_TRIES times, a short growing pause between; only a batch that keeps losing is
   parked, and said as a conflict, not as the database down.
3. Parked rows, encoded, wait in memory up to MAX_HELD_ROWS, then go to the spill file (JSON
   lines, beside the local SQLite store) up to SPILL_MAX_BYTES; past both, a row is dropped and
   counted in `outage_dropped` (and `dropped`). Nothing below the bounds is lost.
4. While rows are parked the writer tries the database every RETRY_S (each try bounded by the
   connect timeout), new batches parked behind them; once it answers, the held rows go first,
   then the spill file's, then new ones. A router stopping during an outage moves its held rows
   to the spill file, and the next start flushes the file the same way.
5. Retention pruning runs on exactly one router: the one whose writer connection holds the
   session advisory lock PRUNE_LOCK (pg_try_advisory_lock; a lease that ends with its session,
   so another router takes it over at its next look when the holder dies).
6. Reads (`read`) use a connection of their own, never the writer's, and raise ReadFailed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import orjson

from router.store import route_log as base
from router.store.pg import conn as pg
from router.store.route_log import MAX_BATCH_ROWS, PRUNE_BATCH_ROWS, SECONDS_PER_DAY, ReadFailed, Row

log = logging.getLogger("router.store")

# ~1.3 KB a row (route_log.py): ~13 MB held in memory, a minute of 170 calls/s.
MAX_HELD_ROWS = 10_000
# Past memory, the spill file: ~200k rows at ~1.3 KB. Beyond it rows are counted and dropped.
SPILL_MAX_BYTES = 256 << 20
SPILL_FILE = "route_log.spill.jsonl"
# How often a writer with parked rows asks whether the database is back.
RETRY_S = 1.0
# A batch rolled back by another writer's locks (rule 2): tries, and the pause before the next
# one (times the tries so far). Two writers' batches lock key_usage rows in one order
# (route_log.py rule 13), so a conflict is rare and the second try wins.
CONFLICT_TRIES = 5
CONFLICT_PAUSE_S = 0.02


COPY_SQL = f"COPY route_log ({', '.join(base.COLUMNS)}) FROM STDIN"


ADD_USAGE = pg.psycopg_sql(base.ADD_USAGE).replace(
    # PostgreSQL wants the target's columns named in the update (`key_usage.requests`).
    "= requests +", "= key_usage.requests +").replace(
    "= prompt_tokens +", "= key_usage.prompt_tokens +").replace(
    "= completion_tokens +", "= key_usage.completion_tokens +").replace(
    "= cached_tokens +", "= key_usage.cached_tokens +").replace(
    "= estimated +", "= key_usage.estimated +")


class PgRouteLogWriter(base.RouteLogWriter):
    """RouteLogWriter on PostgreSQL (rules 1-6). `path` is the local SQLite store's path: the
    spill file lives beside it."""

    def __init__(self, url: str, path: Path | str, retention_s: float | None = None,
                 instance: str | None = None) -> None:
        super().__init__(path, retention_s, instance)
        pg.require()
        import psycopg

        self.url = url
        self.row_errors = (psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError, TypeError)
        self._down_errors = (psycopg.OperationalError, psycopg.InterfaceError)
        self._conflicts = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)  # rule 2
        self._conn = None
        self._reader = None
        self._read_lock = threading.Lock()
        self.spill_path = Path(path).parent / SPILL_FILE
        self._held: list[list] = []  # parked rows in memory, encoded (rule 3)
        self._spilled = 0  # parked rows in the spill file
        self._spill_bytes = 0
        self._retry_at = 0.0
        self._down_since: float | None = None
        self._prune_lease = False

    # --- the engine -----------------------------------------------------------------------------

    def _open(self) -> None:
        if self.spill_path.exists():  # rule 4: a previous run's
            with open(self.spill_path, "rb") as spill:
                self._spilled = sum(1 for _ in spill)
            self._spill_bytes = self.spill_path.stat().st_size
            self.parked = self._spilled
            log.warning("route_log: %d rows spilled by an earlier run wait for the database", self._spilled)
        try:
            self._conn = pg.connect(self.url)
        except self._down_errors as exc:
            self._went_down(exc)

    def _close(self) -> None:
        if self._held:  # stopping while down: the next start flushes them (rule 4)
            held, self._held = self._held, []
            self.parked -= len(held)
            self._spill(held)
        for conn in (self._conn, self._reader):
            if conn is not None:
                conn.close()

    def _live(self):
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self._prune_lease = False  # a new session holds no lock (rule 5)
            conn = self._conn = pg.connect(self.url)
        return conn

    def _commit(self, rows: list[list], usage: list[tuple] = ()) -> None:  # type: ignore[assignment]
        for index in base.TEXT_COLUMNS:  # PostgreSQL's text holds no NUL (rule 1)
            for row in rows:
                value = row[index]
                if value.__class__ is str and "\x00" in value:
                    row[index] = value.replace("\x00", "\ufffd")
        for tries in range(1, CONFLICT_TRIES + 1):
            conn = self._live()
            try:
                with conn.transaction(), conn.cursor() as cursor:
                    with cursor.copy(COPY_SQL) as copy:
                        for row in rows:
                            copy.write_row(row)
                    if usage:
                        cursor.executemany(ADD_USAGE, usage)
                return
            except self._conflicts as exc:  # rolled back by another writer's locks (rule 2)
                if tries == CONFLICT_TRIES:
                    raise
                log.info("route_log: batch rolled back by another writer (%s), tried again", type(exc).__name__)
                time.sleep(CONFLICT_PAUSE_S * tries)

    def _prune(self, before: float) -> bool:
        try:
            conn = self._live()
            if not self._prune_lease:
                self._prune_lease = conn.execute("SELECT pg_try_advisory_lock(%s)", (pg.PRUNE_LOCK,)).fetchone()[0]
                if not self._prune_lease:
                    return False  # another router prunes (rule 5)
                log.info("route_log: this router prunes old rows (it holds the lease)")
            conn.execute("DELETE FROM key_usage WHERE day < %s", (int(before // SECONDS_PER_DAY),))
            deleted = conn.execute(
                "DELETE FROM route_log WHERE id IN (SELECT id FROM route_log WHERE received_at < %s LIMIT %s)",
                (before, PRUNE_BATCH_ROWS),
            ).rowcount
        except self._down_errors + self.row_errors as exc:
            log.warning("route_log: pruning old rows failed (%s)", type(exc).__name__)
            return False
        self.pruned += deleted
        return deleted == PRUNE_BATCH_ROWS

    def read(self, since: int = 0, limit: int = 500, tail: int | None = None,
             columns: tuple[str, ...] | None = None) -> dict:
        import psycopg
        from psycopg.rows import dict_row

        sql = pg.psycopg_sql(base.page_sql(tail is not None, columns))
        try:
            with self._read_lock:
                if self._reader is None or self._reader.closed or self._reader.broken:
                    self._reader = pg.connect(self.url)
                with self._reader.cursor(row_factory=dict_row) as cursor:
                    rows = cursor.execute(sql, (since, tail if tail is not None else limit + 1)).fetchall()
        except psycopg.Error as exc:
            raise ReadFailed(type(exc).__name__) from exc
        return base.page(rows, since, limit, tail)

    # --- down and back (rules 2-4) ----------------------------------------------------------------

    def _write(self, batch: list[tuple[float, Row]]) -> None:
        if self.parked and not self._flush_parked():
            self._park(batch)
            return
        try:
            super()._write(batch)
        except self._down_errors as exc:
            self._went_down(exc)
            self._park(batch)
            return
        self._came_back()

    def _tick(self) -> float | None:
        if not self.parked:
            return None
        self._flush_parked()
        return RETRY_S if self.parked else None

    def _went_down(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + RETRY_S
        if self._down_since is None:
            self._down_since = time.monotonic()
            if isinstance(exc, self._conflicts):
                log.warning("route_log: a batch kept conflicting with other writers (%s, %d tries); "
                            "its rows are held and tried again", type(exc).__name__, CONFLICT_TRIES)
            else:
                log.warning("route_log: database %s unreachable (%s); rows are held until it is back",
                            pg.shown(self.url), type(exc).__name__)

    def _park(self, batch: list[tuple[float, Row]]) -> None:
        """Holds `batch`'s rows in memory, then in the spill file, then drops them (rule 3)."""
        spill = []
        for _, row in batch:
            try:
                values = base.row_values(row, self.instance)
            except TypeError as exc:
                self.dropped += 1
                log.error("route_log: row dropped: %s", exc)
                continue
            if len(self._held) < MAX_HELD_ROWS:
                self._held.append(values)
                self.parked += 1
            else:
                spill.append(values)
        if spill:
            self._spill(spill)

    def _spill(self, rows: list[list]) -> None:
        """Appends encoded rows to the spill file up to SPILL_MAX_BYTES; drops and counts the
        rest (rule 3)."""
        lines = [orjson.dumps(values) + b"\n" for values in rows]
        kept = []
        for line in lines:
            if self._spill_bytes + len(line) > SPILL_MAX_BYTES:
                self.dropped += 1
                self.outage_dropped += 1
                continue
            self._spill_bytes += len(line)
            kept.append(line)
        if not kept:
            return
        try:
            with open(self.spill_path, "ab") as out:
                out.writelines(kept)
        except OSError as exc:
            self.dropped += len(kept)
            self.outage_dropped += len(kept)
            log.error("route_log: spill file %s unwritable (%s): %d rows lost", self.spill_path, exc, len(kept))
            return
        self._spilled += len(kept)
        self.parked += len(kept)

    def _flush_parked(self) -> bool:
        """Writes the parked rows, held then spilled, once the database answers and RETRY_S have
        passed since it last did not (rule 4). Returns True when nothing is parked any more."""
        if time.monotonic() < self._retry_at:
            return False
        try:
            while self._held:
                chunk = self._held[:MAX_BATCH_ROWS]
                self._write_values(chunk)
                del self._held[:len(chunk)]
                self.parked -= len(chunk)
            if self._spilled:
                self._flush_spill()
        except self._down_errors as exc:
            self._went_down(exc)
            return False
        self._came_back()
        return True

    def _came_back(self) -> None:
        if self._down_since is not None:
            log.warning("route_log: database back after %.1f s; parked rows written",
                        time.monotonic() - self._down_since)
            self._down_since = None

    def _flush_spill(self) -> None:
        """Writes the spill file's rows in batches; on an outage midway, keeps the rest in the
        file (rewritten atomically) and re-raises."""
        with open(self.spill_path, "rb") as spill:
            lines = spill.readlines()
        done = 0
        try:
            while done < len(lines):
                chunk = lines[done:done + MAX_BATCH_ROWS]
                self._write_values([orjson.loads(line) for line in chunk])
                done += len(chunk)
                self.parked -= len(chunk)
                self._spilled -= len(chunk)
        finally:
            rest = lines[done:]
            if rest:
                temp = self.spill_path.with_suffix(".tmp")
                with open(temp, "wb") as out:
                    out.writelines(rest)
                os.replace(temp, self.spill_path)
                self._spill_bytes = sum(len(line) for line in rest)
            else:
                self.spill_path.unlink(missing_ok=True)
                self._spill_bytes = 0

    def _write_values(self, rows: list[list]) -> None:
        """Encoded rows in one transaction; a refused batch row by row, a refused row dropped
        (rule 2). Raises a down error with nothing of `rows` counted."""
        usage = base.usage_by_day([Row(*values) for values in rows])
        try:
            self._commit(rows, usage)
            self.written += len(rows)
            return
        except self.row_errors as exc:
            log.warning("route_log: parked batch failed (%s); writing its %d rows one by one",
                        type(exc).__name__, len(rows))
        for values in rows:
            try:
                self._commit([values], base.usage_by_day([Row(*values)]))
                self.written += 1
            except self.row_errors as exc:
                self.dropped += 1
                log.error("route_log: row dropped: %s", type(exc).__name__)
