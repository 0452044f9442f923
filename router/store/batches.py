"""Batches (OpenAI's Batch API, docs/batches.md) in the store: the uploaded and written files, the
batches, and each batch's lines, which the routers' runners lease, run and finish.

Rules:
1. Every method is sync and belongs off the event loop (a worker thread); each is one statement or
   one transaction. One lock per BatchStore serialises its methods on its one connection; several
   routers (PostgreSQL) or processes (SQLite) share the store each through a BatchStore of its own.
2. A line goes `pending` -> `running` (leased: `lease_owner`, the router's instance name, until
   `lease_until`) -> `done`; `put_back` returns a running line to pending (`not_before`, the
   refusal code it waits on, an attempt spent or not). `lease` takes up to n lines of an
   `in_progress` batch, in line order: pending ones whose `not_before` has come, and running ones
   whose lease ran out (a dead router's); `reclaim` returns a restarted router's own at once.
   No two routers hold one line: on PostgreSQL the lease locks the rows it takes and skips rows
   another router is taking (FOR UPDATE SKIP LOCKED); on SQLite its transaction holds the write
   lock.
3. Exactly one result per line: `finish` writes a result only where the line is `running` and
   leased by that router (a router whose lease ran out and was taken over gets False, and its
   result is not written), and adds the written ones to the batch's `completed` (kind output) or
   `failed` (kind error) and token sums in the same transaction. `end_unrun` ends the lines that
   nobody holds (pending, or running with a lease run out) with an error line (core.batches
   `unrun_line`), its code the one the line waited on (`code_for_waiting`) or the default.
4. A change of a batch's status that one router alone may make claims the batch's row with one
   guarded UPDATE before anything else (`validated`, `cancel`, `finalize`): of two routers racing,
   one changes the row and writes what goes with it, the other changes nothing and gets the row.
5. `finalize` (status completed, expired or cancelled; from in_progress, cancelling or finalizing)
   writes the output file, the results of kind output in line order, each line newline-terminated
   (written even when empty), and the error file likewise, only when it has a line; both owned by
   the batch's owner, purpose `batch_output`, named `<batch id>_output.jsonl` / `_error.jsonl`.
   Call it once no line is pending or running (`unfinished`): a line not done has no result.
6. Lock order (PostgreSQL; against deadlocks between routers): a transaction takes lines, in
   (batch, line) order, before batches' rows, in id order.
7. Listings are newest first (created_at, then id, descending); `after` is the id of the last row
   of the previous page, and an unknown `after` lists nothing.
8. Retention: `prune(before)` deletes the batches that ended (completed, failed, expired,
   cancelled) before `before` with their lines, and the files created before it.
9. The SQL is this module's, written with `?` parameters; an engine runs it: SQLite's here,
   PostgreSQL's in router.store.pg.batches. They differ only in `lock_rows`, what a SELECT that
   takes lines for a transaction ends with. Bodies, results and file contents are bytes, never
   logged.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Iterator, NamedTuple, Protocol

import apsw

from router.core.batches import OUTPUT_PURPOSE, new_id, unrun_line
from router.core.errors import UsageError
from router.store import db

KINDS = ("output", "error")
# The status finalize sets, and the time column that says when (rule 5).
FINAL_AT = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}
FINALIZED_FROM = ("in_progress", "cancelling", "finalizing")
CANCELLED_FROM = ("validating", "in_progress")
LIVE = ("in_progress", "cancelling", "finalizing")


class FileRow(NamedTuple):
    id: str
    owner: str
    purpose: str
    filename: str | None
    bytes: int
    created_at: float


class BatchRow(NamedTuple):
    """A `batches` row, its columns in table order (`errors`, `metadata`: JSON text)."""

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: float
    expires_at: float
    in_progress_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    expired_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    total: int
    completed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_file_id: str | None
    error_file_id: str | None
    errors: str | None
    metadata: str | None


class Line(NamedTuple):
    """A leased line (rule 2): `body` the request's JSON, `attempts` spent before this one."""

    batch_id: str
    line_no: int
    custom_id: str
    body: bytes
    attempts: int
    waiting_on: str | None


class LineResult(NamedTuple):
    """A line's result for `finish`: `result` one JSON line of the output or error file."""

    batch_id: str
    line_no: int
    kind: str  # output | error
    result: bytes
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


FILE_COLUMNS = ", ".join(FileRow._fields)
# Every column of the three tables, as a store transfer copies them (router/store/pg/transfer.py)
TABLES = {
    "batch_files": (*FileRow._fields, "content"),
    "batches": BatchRow._fields,
    "batch_lines": ("batch_id", "line_no", "custom_id", "body", "state", "attempts", "lease_owner", "lease_until",
                    "not_before", "waiting_on", "result_kind", "result", "prompt_tokens", "completion_tokens",
                    "cached_tokens", "finished_at"),
}
BATCH_COLUMNS = ", ".join(BatchRow._fields)
SELECT_BATCH = f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = ?"
# Which batches have ended, and when (rule 8); NULL while one runs.
ENDED_AT = "coalesce(completed_at, failed_at, expired_at, cancelled_at)"
# The lines a lease may take (rule 2); `state <> 'done'` lets the partial index batch_lines_open
# (schema 0007) serve it, so a lease reads what is left of a batch, not all of it.
LEASABLE = ("batch_id = ? AND state <> 'done'"
            " AND ((state = 'pending' AND not_before <= ?) OR (state = 'running' AND lease_until < ?))")
UNHELD = "batch_id = ? AND state <> 'done' AND (state = 'pending' OR lease_until < ?)"
FINISH_LINE = ("UPDATE batch_lines SET state = 'done', result_kind = ?, result = ?, prompt_tokens = ?,"
               " completion_tokens = ?, cached_tokens = ?, finished_at = ?"
               " WHERE batch_id = ? AND line_no = ? AND state = 'running' AND lease_owner = ?")
ADD_COUNTS = ("UPDATE batches SET completed = completed + ?, failed = failed + ?,"
              " prompt_tokens = prompt_tokens + ?, completion_tokens = completion_tokens + ?,"
              " cached_tokens = cached_tokens + ? WHERE id = ?")


def _one_of(names: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"'{name}'" for name in names) + ")"


def _page(table: str, where: list[str], params: list, limit: int, after: str | None) -> tuple[str, tuple]:
    """Rule 7's page of `table`: the rows matching `where` older than `after`'s, newest first."""
    if after is not None:
        where.append(f"(created_at, id) < (SELECT created_at, id FROM {table} WHERE id = ?)")
        params.append(after)
    return (f" WHERE {' AND '.join(where) or 'TRUE'} ORDER BY created_at DESC, id DESC LIMIT ?",
            (*params, limit))


class Statements(Protocol):
    """One connection's statements, in a transaction or not (`?` parameters)."""

    def fetch(self, sql: str, params: tuple = ()) -> list[tuple]: ...

    def run(self, sql: str, params: tuple = ()) -> int:
        """Runs one change; returns the rows it changed."""

    def run_many(self, sql: str, rows: list[tuple]) -> None: ...


class BatchEngine(Protocol):
    """Runs BatchStore's SQL on one engine (rule 9)."""

    errors: tuple[type[BaseException], ...]  # what a failed statement raises
    lock_rows: str  # what a SELECT taking lines for its transaction ends with (rule 2)

    def fetch(self, sql: str, params: tuple = ()) -> list[tuple]:
        """One read on its own."""

    def transaction(self) -> contextlib.AbstractContextManager[Statements]:
        """One write transaction: committed when the block ends, rolled back when it raises."""

    def close(self) -> None: ...


class _SqliteStatements:
    def __init__(self, conn: apsw.Connection) -> None:
        self.conn = conn

    def fetch(self, sql: str, params: tuple = ()) -> list[tuple]:
        return list(self.conn.execute(sql, params))

    def run(self, sql: str, params: tuple = ()) -> int:
        self.conn.execute(sql, params)
        return self.conn.changes()

    def run_many(self, sql: str, rows: list[tuple]) -> None:
        self.conn.executemany(sql, rows)


class SqliteBatches:
    """BatchStore's engine on the SQLite store: BEGIN IMMEDIATE takes the write lock up front, so
    a transaction sees no other writer (rule 2 needs no row locks)."""

    errors = (apsw.Error,)
    lock_rows = ""

    def __init__(self, path: Path) -> None:
        self._conn = db.open_store(path)
        self._statements = _SqliteStatements(self._conn)

    def fetch(self, sql: str, params: tuple = ()) -> list[tuple]:
        return self._statements.fetch(sql, params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Statements]:
        with db.immediate(self._conn):
            yield self._statements

    def close(self) -> None:
        self._conn.close()


class BatchStore:
    """Batch files, batches and their lines in the store (rules 1-9)."""

    def __init__(self, path: Path | str, engine: BatchEngine | None = None) -> None:
        """Opens (checks, migrates) the SQLite store at `path`, or uses `engine` when given (`path`
        then only names the router's folder). Raises ConfigError."""
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db: BatchEngine = engine if engine is not None else SqliteBatches(self.path)

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        """What a store error raises here (the engine's)."""
        return self._db.errors

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _fetch(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.fetch(sql, params)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Statements]:
        with self._lock, self._db.transaction() as sql:
            yield sql

    # --- files ------------------------------------------------------------------------------------

    def put_file(self, owner: str, purpose: str, filename: str | None, data: bytes, now: float) -> FileRow:
        with self._transaction() as sql:
            return _insert_file(sql, owner, purpose, filename, data, now)

    def file(self, file_id: str) -> FileRow | None:
        found = self._fetch(f"SELECT {FILE_COLUMNS} FROM batch_files WHERE id = ?", (file_id,))
        return FileRow(*found[0]) if found else None

    def files(self, owner: str | None, purpose: str | None, limit: int, after: str | None) -> list[FileRow]:
        """Newest first (rule 7); every owner's for None, every purpose's for None."""
        where, params = [], []
        for column, value in (("owner", owner), ("purpose", purpose)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        page, params = _page("batch_files", where, params, limit, after)
        found = self._fetch(f"SELECT {FILE_COLUMNS} FROM batch_files" + page, params)
        return [FileRow(*row) for row in found]

    def content(self, file_id: str) -> bytes | None:
        found = self._fetch("SELECT content FROM batch_files WHERE id = ?", (file_id,))
        return bytes(found[0][0]) if found else None

    def delete_file(self, file_id: str) -> bool:
        with self._transaction() as sql:
            return sql.run("DELETE FROM batch_files WHERE id = ?", (file_id,)) > 0

    # --- batches ----------------------------------------------------------------------------------

    def create(self, owner: str, endpoint: str, input_file_id: str, window: str, window_s: float,
               metadata_json: str | None, now: float) -> BatchRow:
        """A new batch, `validating`, expiring `window_s` after `now`."""
        batch_id = new_id("batch_")
        with self._transaction() as sql:
            sql.run("INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status,"
                    " created_at, expires_at, metadata) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?)",
                    (batch_id, owner, endpoint, input_file_id, window, now, now + window_s, metadata_json))
            return _batch(sql, batch_id)

    def validated(self, batch_id: str, lines: list[tuple[int, str, bytes]], errors_json: str | None,
                  now: float) -> BatchRow | None:
        """The input file's verdict, once (rule 4): without errors the lines (line_no, custom_id,
        body) go in, `total` is set and a validating batch goes in_progress (one cancelled while it
        validated stays cancelling, its lines to be ended); with errors it goes failed. A batch
        validated before is returned unchanged; None: no such batch."""
        unjudged = "id = ? AND status IN ('validating', 'cancelling') AND in_progress_at IS NULL AND failed_at IS NULL"
        with self._transaction() as sql:
            if errors_json is not None:
                sql.run(f"UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE {unjudged}",
                        (now, errors_json, batch_id))
            elif sql.run("UPDATE batches SET total = ?, in_progress_at = ?,"
                         " status = CASE status WHEN 'validating' THEN 'in_progress' ELSE status END"
                         f" WHERE {unjudged}", (len(lines), now, batch_id)):
                sql.run_many("INSERT INTO batch_lines (batch_id, line_no, custom_id, body) VALUES (?, ?, ?, ?)",
                             [(batch_id, line_no, custom_id, body) for line_no, custom_id, body in lines])
            return _batch(sql, batch_id)

    def batch(self, batch_id: str) -> BatchRow | None:
        found = self._fetch(SELECT_BATCH, (batch_id,))
        return BatchRow(*found[0]) if found else None

    def batches(self, owner: str | None, limit: int, after: str | None) -> list[BatchRow]:
        """Newest first (rule 7); every owner's for None."""
        where, params = (["owner = ?"], [owner]) if owner is not None else ([], [])
        page, params = _page("batches", where, params, limit, after)
        found = self._fetch(f"SELECT {BATCH_COLUMNS} FROM batches" + page, params)
        return [BatchRow(*row) for row in found]

    def cancel(self, batch_id: str, now: float) -> BatchRow | None:
        """A validating or in_progress batch goes cancelling; any other is returned unchanged.
        None: no such batch."""
        with self._transaction() as sql:
            sql.run(f"UPDATE batches SET status = 'cancelling', cancelling_at = ?"
                    f" WHERE id = ? AND status IN {_one_of(CANCELLED_FROM)}", (now, batch_id))
            return _batch(sql, batch_id)

    # --- the runner's -----------------------------------------------------------------------------

    def live(self) -> list[BatchRow]:
        """The batches a runner works on (in_progress, cancelling, finalizing), oldest first."""
        found = self._fetch(f"SELECT {BATCH_COLUMNS} FROM batches WHERE status IN {_one_of(LIVE)}"
                            " ORDER BY created_at, id")
        return [BatchRow(*row) for row in found]

    def lease(self, batch_id: str, router: str, n: int, lease_until: float, now: float) -> list[Line]:
        """Up to `n` lines of an in_progress batch, in line order, leased to `router` (rule 2)."""
        with self._transaction() as sql:
            if sql.fetch("SELECT status FROM batches WHERE id = ?", (batch_id,)) != [("in_progress",)]:
                return []
            taken = sql.fetch("SELECT batch_id, line_no, custom_id, body, attempts, waiting_on FROM batch_lines"
                              f" WHERE {LEASABLE} ORDER BY line_no LIMIT ?{self._db.lock_rows}",
                              (batch_id, now, now, n))
            sql.run_many("UPDATE batch_lines SET state = 'running', lease_owner = ?, lease_until = ?"
                         " WHERE batch_id = ? AND line_no = ?",
                         [(router, lease_until, batch_id, line_no) for _, line_no, *_ in taken])
        return [Line(b, line_no, custom_id, bytes(body), attempts, waiting_on)
                for b, line_no, custom_id, body, attempts, waiting_on in taken]

    def renew(self, router: str, lease_until: float, lines: list[tuple[str, int]]) -> int:
        """Extends the leases `router` holds of `lines` ((batch, line) pairs: those it runs now;
        one it lost track of lapses). Returns how many it extended."""
        with self._transaction() as sql:
            return sum(sql.run("UPDATE batch_lines SET lease_until = ? WHERE batch_id = ? AND line_no = ?"
                               " AND state = 'running' AND lease_owner = ?", (lease_until, batch_id, line_no, router))
                       for batch_id, line_no in lines)

    def release(self, router: str, lines: list[tuple[str, int]]) -> int:
        """The `lines` ((batch, line) pairs) `router` leased but never started go back to pending
        as they were, in one transaction. Returns how many."""
        with self._transaction() as sql:
            return sum(sql.run("UPDATE batch_lines SET state = 'pending', lease_owner = NULL, lease_until = NULL"
                               " WHERE batch_id = ? AND line_no = ? AND state = 'running' AND lease_owner = ?",
                               (batch_id, line_no, router)) for batch_id, line_no in lines)

    def reclaim(self, instance: str) -> int:
        """Every line a run of router `instance` holds (its lease owner `<instance>#<run>`) goes
        back to pending, no attempt spent: a router starting again under its instance name takes
        back at once what its killed run held, instead of waiting for the leases to run out.
        Instance names are unique among live routers (the `routers` table's key). Returns how many
        lines."""
        prefix = instance + "#"
        with self._transaction() as sql:
            return sql.run("UPDATE batch_lines SET state = 'pending', lease_owner = NULL, lease_until = NULL"
                           " WHERE state = 'running' AND substr(lease_owner, 1, ?) = ?", (len(prefix), prefix))

    def finish(self, router: str, results: list[LineResult], now: float) -> list[bool]:
        """Writes each result where `router` still holds its line, all in one transaction (rule 3).
        Returns, for each result in order, whether it was written. Raises UsageError for a kind
        other than output or error, writing nothing."""
        for result in results:
            if result.kind not in KINDS:
                raise UsageError(f"a line's result is output or error, not {result.kind!r}")
        written = [False] * len(results)
        sums: dict[str, list[int]] = {}  # batch id -> completed, failed, the three token counts
        order = sorted(range(len(results)), key=lambda i: (results[i].batch_id, results[i].line_no))  # rule 6
        with self._transaction() as sql:
            for i in order:
                r = results[i]
                written[i] = sql.run(FINISH_LINE, (r.kind, r.result, r.prompt_tokens, r.completion_tokens,
                                                   r.cached_tokens, now, r.batch_id, r.line_no, router)) > 0
                if written[i]:
                    add = sums.setdefault(r.batch_id, [0, 0, 0, 0, 0])
                    add[0 if r.kind == "output" else 1] += 1
                    add[2] += r.prompt_tokens
                    add[3] += r.completion_tokens
                    add[4] += r.cached_tokens
            for batch_id in sorted(sums):
                sql.run(ADD_COUNTS, (*sums[batch_id], batch_id))
        return written

    def put_back(self, router: str, batch_id: str, line_no: int, not_before: float, waiting_on: str | None,
                 attempt: bool) -> bool:
        """A line `router` holds goes back to pending until `not_before`, waiting on `waiting_on`,
        an attempt spent when `attempt`. Returns False (changing nothing) when `router` does not
        hold it."""
        with self._transaction() as sql:
            return sql.run("UPDATE batch_lines SET state = 'pending', lease_owner = NULL, lease_until = NULL,"
                           " not_before = ?, waiting_on = ?, attempts = attempts + ?"
                           " WHERE batch_id = ? AND line_no = ? AND state = 'running' AND lease_owner = ?",
                           (not_before, waiting_on, int(attempt), batch_id, line_no, router)) > 0

    def end_unrun(self, batch_id: str, code_for_waiting: dict[str, str], default_code: str, message: str,
                  now: float) -> int:
        """Ends every line nobody holds with an error line (rule 3; the window ran out, the batch
        was cancelled). Returns how many lines it ended."""
        with self._transaction() as sql:
            unheld = sql.fetch(f"SELECT line_no, custom_id, waiting_on FROM batch_lines WHERE {UNHELD}"
                               f" ORDER BY line_no{self._db.lock_rows}", (batch_id, now))
            sql.run_many(
                "UPDATE batch_lines SET state = 'done', result_kind = 'error', result = ?, prompt_tokens = 0,"
                " completion_tokens = 0, cached_tokens = 0, finished_at = ? WHERE batch_id = ? AND line_no = ?",
                [(unrun_line(custom_id, code_for_waiting.get(waiting_on, default_code), message), now, batch_id,
                  line_no) for line_no, custom_id, waiting_on in unheld])
            if unheld:
                sql.run(ADD_COUNTS, (0, len(unheld), 0, 0, 0, batch_id))
        return len(unheld)

    def unfinished(self, batch_id: str) -> tuple[int, int]:
        """(pending, running) lines of the batch."""
        ((pending, running),) = self._fetch(
            "SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'running')"
            " FROM batch_lines WHERE batch_id = ? AND state <> 'done'", (batch_id,))
        return pending, running

    def finalize(self, batch_id: str, status: str, now: float) -> BatchRow | None:
        """The batch ends `status` with its files, once (rules 4 and 5); a batch that ended before
        is returned unchanged. None: no such batch. Raises UsageError for another status."""
        if status not in FINAL_AT:
            raise UsageError(f"a batch is finalized {', '.join(FINAL_AT)}, not {status!r}")
        with self._transaction() as sql:
            if sql.run(f"UPDATE batches SET status = ?, finalizing_at = coalesce(finalizing_at, ?),"
                       f" {FINAL_AT[status]} = ? WHERE id = ? AND status IN {_one_of(FINALIZED_FROM)}",
                       (status, now, now, batch_id)):
                ((owner,),) = sql.fetch("SELECT owner FROM batches WHERE id = ?", (batch_id,))
                done = sql.fetch("SELECT result_kind, result FROM batch_lines WHERE batch_id = ? AND state = 'done'"
                                 " ORDER BY line_no", (batch_id,))
                files = {}
                for kind in KINDS:
                    lines = [bytes(result) for result_kind, result in done if result_kind == kind]
                    if lines or kind == "output":
                        content = b"".join(line + b"\n" for line in lines)
                        files[kind] = _insert_file(sql, owner, OUTPUT_PURPOSE, f"{batch_id}_{kind}.jsonl",
                                                   content, now).id
                sql.run("UPDATE batches SET output_file_id = ?, error_file_id = ? WHERE id = ?",
                        (files["output"], files.get("error"), batch_id))
            return _batch(sql, batch_id)

    def prune(self, before: float) -> int:
        """Rule 8. Returns how many batches and files it deleted, together."""
        with self._transaction() as sql:
            sql.run(f"DELETE FROM batch_lines WHERE batch_id IN (SELECT id FROM batches WHERE {ENDED_AT} < ?)",
                    (before,))
            batches = sql.run(f"DELETE FROM batches WHERE {ENDED_AT} < ?", (before,))
            return batches + sql.run("DELETE FROM batch_files WHERE created_at < ?", (before,))


def _insert_file(sql: Statements, owner: str, purpose: str, filename: str | None, data: bytes,
                 now: float) -> FileRow:
    row = FileRow(new_id("file-"), owner, purpose, filename, len(data), now)
    sql.run(f"INSERT INTO batch_files ({FILE_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?, ?)", (*row, data))
    return row


def _batch(sql: Statements, batch_id: str) -> BatchRow | None:
    found = sql.fetch(SELECT_BATCH, (batch_id,))
    return BatchRow(*found[0]) if found else None
