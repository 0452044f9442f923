"""The route_log writer: one thread, one connection, batched transactions.

Rules:
1. `record(row)` never touches SQLite: it puts `(monotonic time, row)` on a `SimpleQueue` and
   bumps `queued`. It costs well under 1 µs (timeit), so it is fine on the event loop. The row
   belongs to the writer from then on: the caller must not change it afterwards.
2. One writer thread owns its own connection. It waits for a row, sleeps `FLUSH_INTERVAL_S`,
   then takes every row queued by then and writes them in transactions of at most
   `MAX_BATCH_ROWS`: one wake-up per flush window, however many calls arrived in it.
3. A row is a `Row` (the `route_log` columns by name: 0.0.4's, and this router's beside them,
   store/schema): one row per call, written once. A second row with the same `request_id` is
   refused by the table's UNIQUE index (rule 5).
4. The JSON columns (`decision`, `attempts`) take a dict, a list, or an object with a
   `log_doc()` method (a Decision) standing for the dict it returns; the writer thread encodes
   them as JSON text (orjson), so the caller never does.
5. A failed batch is rolled back and written again row by row; a row that still fails (a
   missing `request_id` or `received_at`, a duplicate) is dropped and counted in `dropped`. The log
   names the error, never the row's contents.
6. The backlog is bounded: while `MAX_BACKLOG_ROWS` rows wait, `record` sheds new rows
   (counted in `shed`) rather than grow the router's memory behind a stalled disk.
7. `stop()` queues a sentinel behind every recorded row; the thread writes them all, closes
   its connection and exits, and `stop()` joins it. Recording after `stop()` is a bug: the row
   is never written.
8. Each counter has one writing thread (`queued`, `shed`: the recording thread, which should
   be one, the event loop; `written`, `dropped`, `parked`, `outage_dropped`, `max_batch`,
   `last_flush_lag_s`: the writer), so they are read without locks. Backlog = queued - written
   - dropped - parked (`parked`: rows an engine holds back while its database is down, written
   when it returns; always 0 on SQLite; `outage_dropped`, the part of `dropped` lost that way).
9. A killed process loses only rows not yet committed: the open batch window plus any backlog.
   WAL keeps the file consistent, and it reopens clean.
10. The writer holds the GIL as little and as seldom as it can: every time it takes the GIL back
   from the event loop costs the loop a thread switch. So a batch goes in as a few multi-row
   INSERTs (at most one per power of two up to STATEMENT_ROWS rows): a binding pass with the GIL
   and a SQLite step without it each, every statement's text one APSW keeps prepared. While the
   loop is near idle (`loop_calls()`, the calls in flight, at most YIELD_MAX_CALLS), each hold is
   short: the rows' values are made YIELD_ROWS at a time, and the GIL let go between those and
   between statements, so a call that comes waits for one short hold. Under load it is not let
   go inside a batch: a busy loop gives the GIL back only when the switch interval forces it off,
   so each let-go cost the loop a forced switch. And it yields the CPU as well as the GIL: it
   runs at WRITER_NICE.
11. Retention: with `retention_s` set, the writer thread deletes rows received longer ago
   than that, at most PRUNE_BATCH_ROWS per transaction: once a PRUNE_INTERVAL_S, and every
   PRUNE_AGAIN_S while a full batch came out (a backlog), writing recorded rows in between.
   So a prune never holds the writer (nor the store's lock) long, and never runs on the loop.
12. A text column holds at most router.core.bounds.TEXT_CHARS characters and a marker
   (bounds rule 2), whatever the client or a box sent; the writer clips, off the loop.
13. Tenancy: the rows of a batch that name a key add their calls and tokens to `key_usage`
   (per key and UTC day of the call's end) in the same transaction, so the usage a key shows
   is exactly its rows'; retention prunes the days wholly before the cut-off with the rows.
   The increments go in one fixed order, by key id then day, whatever the batch's order: two
   writers (two routers on one database) then lock the same rows in the same order, and never
   deadlock each other.
14. The `router` column names the router that served the call (`--instance`, default
   host:port): the writer fills it in, off the loop, for a row that does not name one.
15. The engine is a few methods (`_open`, `_commit`, `_prune`, `_close`, `read`): this class is
   SQLite's; router.store.pg.route_log overrides them for PostgreSQL. The queue, the batching,
   the counters and the row encoding are this class's, whatever the engine.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import apsw
import orjson

from router.core.bounds import TEXT_CHARS, clip
from router.core.errors import UsageError
from router.store import db

log = logging.getLogger(__name__)

# A row waits at most this long for company before it is committed. 50 ms bounds what a
# killed router loses and how stale the admin view is, while still turning a burst of calls
# into one transaction: measured here, a row in its own transaction costs ~55 µs, a row in a
# 256-row batch 7-9 µs of writer CPU (a ~500 B row, WAL and checkpoints included; a row's
# size is most of its cost: ~900 B rows cost 15 µs), so per-row commits would cap the log
# near 18k calls/s on one core.
FLUSH_INTERVAL_S = 0.050
# A full batch commits at once: 256 rows take ~1.5 ms, short enough that a `router keys`
# command waiting on the lock is never noticeably delayed; past ~256 the per-row cost no
# longer falls. As one statement (rule 10): 256 rows × 26 columns = 6,656 bound values, under
# SQLite's limit of 32,766.
MAX_BATCH_ROWS = 256
# A typical row with its decision and attempts holds ~1.3 KB (tracemalloc), so the backlog
# stays under ~70 MB: 10 s of a stalled disk at 5k calls/s.
MAX_BACKLOG_ROWS = 50_000
# A multi-row INSERT's text is prepared once only while APSW's statement cache keeps it, and it
# keeps none over 16 KiB: 256 rows (22 KiB) were prepared anew on every flush (~0.6 ms), and a
# flush of any other size made a text of its own. So a batch is cut into statements of 128, 64,
# ... 1 rows (at most eight distinct texts, the largest 11 KiB): measured under load here (in
# process, c=64), the writer thread's CPU a call fell from 30-34 to 27 µs (tests/test_store.py
# checks they stay cached).
STATEMENT_ROWS = 128
# While at most YIELD_MAX_CALLS calls are in flight, the writer lets the GIL go (time.sleep(0))
# after making each YIELD_ROWS rows' values and after each statement: each hold is then a
# fraction of a millisecond, where a whole flush's values (~125 rows at one call at a time) held
# the event loop up to ~1 ms and set its p99 (rule 10); through Granian one call at a time, p99
# 1.72-1.75 ms with the let-gos, 1.95-2.28 without. Under load they cost more than they give:
# each was taken back only by a forced switch of the busy loop (wrk c=64 through Granian, one sim
# box: p99 22-27 ms and p99.9 47-62 with them at every load, 15-17 and 19-21 with them only near
# idle; 146-167 µs of CPU a call against 142-151).
YIELD_ROWS = 16
YIELD_MAX_CALLS = 2
# The writer thread runs at this nice level, the event loop at the process's: on a busy machine
# the scheduler then gives a core to the loop first, and the log waits (its backlog is bounded,
# rule 6). Measured one call at a time in process (bench/callpath_cpu.py's call, 4,000 calls, on
# this 2-core machine): p99 0.71-0.79 ms at the process's own level, 0.60-0.66 at 10.
WRITER_NICE = 10
# Retention (rule 11). A 1,000-row DELETE took 1.4-3 ms here (measured, ~500 B rows, three
# indexes to update), well within one flush window; one every PRUNE_AGAIN_S clears a backlog of
# old rows at ~80k rows/s while the writer stays free for new rows.
PRUNE_BATCH_ROWS = 1000
PRUNE_AGAIN_S = 0.010
# Without a backlog, old rows are looked for once a minute: one index probe on received_at.
PRUNE_INTERVAL_S = 60.0


class Row(NamedTuple):
    """One call's route_log row (rule 3). The INSERT names each column, so the field order
    need not follow the table's."""

    request_id: str  # the call's id
    state: str  # pending | done | failed | refused | cancelled
    facade: str | None = None
    route: str | None = None
    model: str | None = None
    options: str | None = None  # the call's settings (model@options)
    pin: str | None = None
    client: str | None = None
    stream: int | None = None
    path: str | None = None  # the decision's path: pin | serving | load | refused
    decision: Any = None  # JSON: the Decision's log_doc() (ranked boxes and tiers, refused)
    attempts: Any = None  # JSON: [{box, status, refusal, ms}, ...]
    box: str | None = None
    http_status: int | None = None
    error: str | None = None
    received_at: float | None = None
    first_byte_at: float | None = None
    responded_at: float | None = None
    bytes_in: int | None = None
    bytes_out: int | None = None
    waited_ms: float | None = None  # in the wait queue (None: it did not wait)
    key_id: str | None = None  # the caller's key (None: no key); tenancy, rule 13
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    tokens_estimated: int | None = None  # 1: the box reported no usage, the tokens are estimated
    affinity: str | None = None  # hit:<kind> | miss:<kind> | none (None: --affinity off)
    router: str | None = None  # the serving router's instance name (rule 14; the writer fills it)
    batch_id: str | None = None  # a batch line's batch (serve/batches.py); None: a client's call
    custom_id: str | None = None  # the batch line's own id, as its file gave it


COLUMNS = Row._fields
_JSON_COLUMNS = tuple(COLUMNS.index(name) for name in ("decision", "attempts"))
# Columns whose text may carry what a client (model, pin, route, client address) or a box sent.
TEXT_COLUMNS = tuple(
    COLUMNS.index(name) for name in ("facade", "route", "model", "options", "pin", "client", "box", "error",
                                     "custom_id")
)
_ROUTER_COLUMN = COLUMNS.index("router")
_ONE_ROW = "(" + ", ".join("?" * len(COLUMNS)) + ")"
SECONDS_PER_DAY = 86_400
ADD_USAGE = (
    "INSERT INTO key_usage (key_id, day, requests, prompt_tokens, completion_tokens, cached_tokens, estimated)"
    " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key_id, day) DO UPDATE SET"
    " requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
    " completion_tokens = completion_tokens + excluded.completion_tokens,"
    " cached_tokens = cached_tokens + excluded.cached_tokens, estimated = estimated + excluded.estimated"
)


def usage_by_day(rows: list[Row]) -> list[tuple]:
    """The `key_usage` increments of `rows` (rule 13): one tuple per (key, day), ordered by key
    id then day."""
    sums: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        if row.key_id is None:
            continue
        day = int((row.responded_at or row.received_at or 0.0) // SECONDS_PER_DAY)
        total = sums.get((row.key_id, day))
        if total is None:
            total = sums[(row.key_id, day)] = [0, 0, 0, 0, 0]
        total[0] += 1
        total[1] += row.prompt_tokens or 0
        total[2] += row.completion_tokens or 0
        total[3] += row.cached_tokens or 0
        total[4] += row.tokens_estimated or 0
    return [(key, day, *total) for (key, day), total in sorted(sums.items())]


@functools.cache
def insert_sql(rows: int) -> str:
    """INSERT of `rows` rows in one statement (rule 10); APSW caches each distinct text."""
    return f"INSERT INTO route_log ({', '.join(COLUMNS)}) VALUES " + ", ".join([_ONE_ROW] * rows)


def statement_sizes(rows: int) -> list[int]:
    """How many rows each INSERT of a batch of `rows` takes (rule 10): STATEMENT_ROWS while that
    many are left, then the powers of two of the rest, largest first."""
    sizes = [STATEMENT_ROWS] * (rows // STATEMENT_ROWS)
    size = STATEMENT_ROWS >> 1
    rest = rows % STATEMENT_ROWS
    while rest:
        if rest >= size:
            sizes.append(size)
            rest -= size
        size >>= 1
    return sizes


_STOP = object()


def _json_default(value: Any) -> Any:
    log_doc = getattr(value, "log_doc", None)
    if log_doc is None:
        raise TypeError(f"{type(value).__name__} is not JSON")
    return log_doc()


class ReadFailed(Exception):
    """The route log could not be read now (the store is busy, gone, or unreachable)."""


def row_values(row: Row, router: str | None = None) -> list:
    """The row's values for binding, its text clipped (rule 12), its JSON columns encoded (rule
    4), its `router` filled in (rule 14)."""
    values = list(row)
    if values[_ROUTER_COLUMN] is None:
        values[_ROUTER_COLUMN] = router
    for index in TEXT_COLUMNS:
        value = values[index]
        if isinstance(value, str) and len(value) > TEXT_CHARS:
            values[index] = clip(value)
    for index in _JSON_COLUMNS:
        value = values[index]
        if value is not None:
            values[index] = orjson.dumps(
                value, default=_json_default, option=orjson.OPT_PASSTHROUGH_DATACLASS
            ).decode()
    return values


class RouteLogWriter:
    """Writes route_log rows from a background thread (rules 1-15).

    `retention_s`: rows received longer ago are deleted (rule 11); None keeps every row.
    `instance`: this router's name, for the rows' `router` column (rule 14).
    """

    # What one bad row can raise (rule 5); an engine's writer names its own.
    row_errors: tuple[type[BaseException], ...] = (apsw.Error, TypeError)

    def __init__(self, path: Path | str, retention_s: float | None = None, instance: str | None = None) -> None:
        self.path = Path(path)
        self.retention_s = retention_s
        self.instance = instance
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Bound once: record() is on the hot path.
        self._put = self._queue.put
        self._monotonic = time.monotonic
        self._conn: apsw.Connection | None = None
        self._thread: threading.Thread | None = None
        # The calls in flight on the event loop (rule 10), read by the writer thread; the server
        # names its count once the app is built.
        self.loop_calls: Callable[[], int] = lambda: 0
        # counters, recording thread
        self.queued = 0
        self.shed = 0
        # counters, writer thread
        self.written = 0
        self.dropped = 0
        self.max_batch = 0
        self.last_flush_lag_s = 0.0
        self.pruned = 0
        self.parked = 0
        self.outage_dropped = 0

    def start(self) -> None:
        """Opens (checks, migrates) the store and starts the writer thread.

        Raises ConfigError when the store cannot be opened; UsageError when already started.
        """
        if self._thread is not None:
            raise UsageError("RouteLogWriter.start() called twice")
        self._open()
        # A daemon, so a router that dies without stop() still exits; a clean stop joins it.
        self._thread = threading.Thread(target=self._run, name="route-log-writer", daemon=True)
        self._thread.start()

    def record(self, row: Row) -> None:
        """Queues one row for writing (rule 1). Never blocks, never raises for a bad row (the
        writer drops it, rule 5)."""
        if self.queued - self.written - self.dropped - self.parked >= MAX_BACKLOG_ROWS:
            self.shed += 1
            return
        self._put((self._monotonic(), row))
        self.queued += 1

    def stop(self, timeout: float | None = None) -> None:
        """Writes every recorded row, then stops the thread and closes its connection (rule 7).
        A no-op when not started."""
        if self._thread is None:
            return
        self._put(_STOP)
        self._thread.join(timeout)

    # --- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)  # this thread only (rule 10)
        get = self._queue.get
        get_nowait = self._queue.get_nowait
        stopping = False
        next_prune = time.monotonic()  # the first look comes at once
        try:
            while not stopping:
                waits = [wait for wait in (self._tick(), None if self.retention_s is None
                                           else max(0.0, next_prune - time.monotonic())) if wait is not None]
                try:
                    item = get(timeout=min(waits) if waits else None)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    break
                if self.retention_s is not None and time.monotonic() >= next_prune:
                    full = self._prune(time.time() - self.retention_s)
                    next_prune = time.monotonic() + (PRUNE_AGAIN_S if full else PRUNE_INTERVAL_S)
                if item is None:
                    continue
                # Sleep out the window, then drain: one wake-up per flush, not per row, so the
                # writer does not take the GIL from the event loop on every call.
                time.sleep(FLUSH_INTERVAL_S)
                batch = [item]
                while True:
                    try:
                        item = get_nowait()
                    except queue.Empty:
                        break
                    if item is _STOP:
                        stopping = True
                        break
                    batch.append(item)
                for start in range(0, len(batch), MAX_BATCH_ROWS):
                    chunk = batch[start : start + MAX_BATCH_ROWS]
                    try:
                        self._write(chunk)
                    except Exception:  # a bug here must not stop the log for the rest of the run
                        self.dropped += len(chunk)
                        log.exception("route_log: batch of %d rows lost", len(chunk))
        finally:
            self._close()

    # --- the engine (rule 15): SQLite here ---------------------------------------------------

    def _open(self) -> None:
        self._conn = db.open_store(self.path)

    def _close(self) -> None:
        self._conn.close()

    def _tick(self) -> float | None:
        """The engine's upkeep between rows; returns how soon to call it again without a row
        (None: only when one comes). SQLite has none."""
        return None

    def read(self, since: int = 0, limit: int = 500, tail: int | None = None,
             columns: tuple[str, ...] | None = None) -> dict:
        """`read_rows` on this writer's store. Raises ReadFailed."""
        try:
            return read_rows(self.path, since, limit, tail, columns)
        except apsw.Error as exc:
            raise ReadFailed(type(exc).__name__) from exc

    # --- the writer thread, whatever the engine ------------------------------------------------

    def _write(self, batch: list[tuple[float, Row]]) -> None:
        row_errors = self.row_errors
        try:
            self._commit(self._values(batch), usage_by_day([row for _, row in batch]))
            written = len(batch)
        except row_errors as exc:
            log.warning("route_log: batch failed (%s); writing its %d rows one by one", exc, len(batch))
            written = 0
            for _, row in batch:
                try:
                    self._commit([row_values(row, self.instance)], usage_by_day([row]))
                    written += 1
                except row_errors as row_exc:
                    self.dropped += 1
                    log.error("route_log: row dropped: %s", row_exc)
        self.written += written
        if len(batch) > self.max_batch:
            self.max_batch = len(batch)
        self.last_flush_lag_s = time.monotonic() - batch[0][0]

    def _lets_go(self) -> bool:
        """Whether the writer lets the GIL go inside a batch: only while the loop is near idle
        (rule 10)."""
        return self.loop_calls() <= YIELD_MAX_CALLS

    def _values(self, batch: list[tuple[float, Row]]) -> list[list]:
        """The rows as the INSERT binds them, made YIELD_ROWS at a time with the GIL let go in
        between while the loop is near idle, else at once (rule 10)."""
        instance, values = self.instance, []
        step = YIELD_ROWS if self._lets_go() else max(1, len(batch))
        for start in range(0, len(batch), step):
            if start:
                time.sleep(0)
            values += [row_values(row, instance) for _, row in batch[start:start + step]]
        return values

    def _prune(self, before: float) -> bool:
        """Deletes at most PRUNE_BATCH_ROWS rows received before `before` (epoch s); True when
        it deleted a full batch (more may be waiting). A failure is logged, never raised: the
        log must go on."""
        conn = self._conn
        try:  # each statement its own transaction; key_usage is small (keys × days)
            conn.execute("DELETE FROM key_usage WHERE day < ?", (int(before // SECONDS_PER_DAY),))
            conn.execute(
                "DELETE FROM route_log WHERE id IN (SELECT id FROM route_log WHERE received_at < ? LIMIT ?)",
                (before, PRUNE_BATCH_ROWS),
            )
            deleted = conn.changes()
        except apsw.Error as exc:
            log.warning("route_log: pruning old rows failed (%s)", exc)
            return False
        self.pruned += deleted
        return deleted == PRUNE_BATCH_ROWS

    def _commit(self, rows: list[list], usage: list[tuple] = ()) -> None:  # type: ignore[assignment]
        with db.immediate(self._conn) as conn:  # the whole batch, or none of it
            start, lets_go = 0, self._lets_go()
            for size in statement_sizes(len(rows)):
                if start and lets_go:
                    time.sleep(0)  # the GIL let go between statements (rule 10)
                conn.execute(insert_sql(size), [value for row in rows[start:start + size] for value in row])
                start += size
            if usage:
                conn.executemany(ADD_USAGE, usage)


def page_sql(tail: bool, columns: tuple[str, ...] | None) -> str:
    """The SELECT of one page of `read_rows` (parameters: since, then the limit), `?` style."""
    shown = ", ".join(columns) if columns else "*"
    return f"SELECT {shown} FROM route_log WHERE id > ? ORDER BY id {'DESC ' if tail else ''}LIMIT ?"


def page(rows: list[dict], since: int, limit: int, tail: int | None) -> dict:
    """`read_rows`' answer from the rows of `page_sql` (limit + 1 of them, or the tail newest
    first), the JSON columns decoded."""
    if tail is not None:
        rows = rows[::-1]
        more = False
    else:
        more = len(rows) > limit
        rows = rows[:limit]
    for row in rows:
        for column in ("decision", "attempts"):
            if isinstance(row.get(column), str):
                row[column] = orjson.loads(row[column])
    return {"table": "route_log", "rows": rows, "next": rows[-1]["id"] if rows else since, "more": more}


def read_rows(path: Path | str, since: int = 0, limit: int = 500, tail: int | None = None,
              columns: tuple[str, ...] | None = None) -> dict:
    """The route log as the admin API and `router log` read it: the rows after id `since`, at
    most `limit`, oldest first (0.0.4's cursor); or, with `tail`, the newest `tail` rows, still
    oldest first. `next` is the cursor to follow on from, `more` whether rows are left after
    this page. `columns`: only those (None: all). The JSON columns come back decoded. Runs in a
    worker thread, never on the loop."""
    conn = db.connect(path)
    # Rows as dicts, named while the statement runs (an empty result has no description after).
    conn.row_trace = lambda cursor, row: dict(zip((d[0] for d in cursor.get_description()), row))
    try:
        rows = list(conn.execute(page_sql(tail is not None, columns),
                                 (since, tail if tail is not None else limit + 1)))
    finally:
        conn.close()
    return page(rows, since, limit, tail)
