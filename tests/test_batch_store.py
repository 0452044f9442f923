"""The batch store (router/store/batches.py, router/store/pg/batches.py): files, batches, the
runner's leases and results, on a real SQLite file and on a real PostgreSQL database (each test
runs on both engines unless it names one). Each test names the docstring rule it pins."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.errors import UsageError
from router.store import db, engines
from router.store.batches import BatchStore, LineResult, SqliteBatches

ENDPOINT = "/v1/chat/completions"
DAY_S = 86_400.0


@pytest.fixture(params=["sqlite", "postgres"])
def opened(request, tmp_path):
    """A function that opens one more BatchStore on the same store: another router's."""
    url = None
    if request.param == "postgres":
        url = request.getfixturevalue("pg_url")
        engines.open_database(url)
    stores = []

    def open_store() -> BatchStore:
        stores.append(engines.batches(tmp_path / "router.sqlite3", url))
        return stores[-1]

    yield open_store
    for store in stores:
        store.close()


@pytest.fixture
def store(opened):
    return opened()


def _running(store: BatchStore, lines: int, now: float = 10.0, owner: str = "k1"):
    """An in_progress batch of `lines` lines (custom ids c1..cN)."""
    made = store.create(owner, ENDPOINT, "file-x", "24h", DAY_S, None, now)
    return store.validated(made.id, [(n, f"c{n}", b'{"n": %d}' % n) for n in range(1, lines + 1)], None, now)


def _result(batch_id: str, line_no: int, kind: str = "output", tokens: tuple = (3, 5, 1)) -> LineResult:
    return LineResult(batch_id, line_no, kind, json.dumps({"line": line_no, "kind": kind}).encode(), *tokens)


def _ids(lines) -> list[int]:
    return [line.line_no for line in lines]


# --- files --------------------------------------------------------------------------------------


def test_files_are_kept_listed_newest_first_by_page_and_deleted(store):
    made = [store.put_file("k1" if i % 2 == 0 else "k2", "batch", f"f{i}.jsonl", b"x" * i, 100.0 + i)
            for i in range(6)]
    output = store.put_file("k1", "batch_output", "out.jsonl", b"", 200.0)
    assert made[3].bytes == 3 and made[3].owner == "k2" and made[3].created_at == 103.0
    assert store.file(made[3].id) == made[3] and store.file("file-none") is None
    assert store.content(made[5].id) == b"xxxxx" and store.content("file-none") is None
    assert store.content(output.id) == b""
    # Rule 7: newest first; a page ends where `after` says; an unknown `after` lists nothing.
    assert [f.id for f in store.files(None, None, 100, None)] == [output.id] + [f.id for f in reversed(made)]
    assert [f.id for f in store.files("k1", None, 100, None)] == [output.id, made[4].id, made[2].id, made[0].id]
    assert [f.id for f in store.files("k1", "batch", 2, None)] == [made[4].id, made[2].id]
    assert [f.id for f in store.files("k1", "batch", 2, made[2].id)] == [made[0].id]
    assert [f.id for f in store.files(None, "batch_output", 10, None)] == [output.id]
    assert store.files(None, None, 10, "file-none") == []
    assert store.delete_file(made[0].id) and not store.delete_file(made[0].id)
    assert store.file(made[0].id) is None and store.content(made[0].id) is None


# --- batches ------------------------------------------------------------------------------------


def test_a_batch_is_created_validating_then_validated_once(store):
    made = store.create("k1", ENDPOINT, "file-x", "2h", 7200.0, '{"a": "b"}', 50.0)
    assert (made.status, made.owner, made.endpoint, made.input_file_id, made.completion_window) == (
        "validating", "k1", ENDPOINT, "file-x", "2h")
    assert (made.created_at, made.expires_at, made.metadata, made.total, made.completed) == (50.0, 7250.0, '{"a": "b"}', 0, 0)
    assert made.id.startswith("batch_") and len(made.id) == len("batch_") + 24
    ran = store.validated(made.id, [(1, "a", b"{}"), (3, "b", b"{}")], None, 51.0)
    assert (ran.status, ran.total, ran.in_progress_at) == ("in_progress", 2, 51.0)
    assert store.unfinished(made.id) == (2, 0)
    # Rule 4: validated a second time (another router) changes nothing.
    assert store.validated(made.id, [(1, "a", b"{}")], '{"data": []}', 52.0) == ran
    assert store.batch(made.id) == ran and store.batch("batch_none") is None
    assert store.validated("batch_none", [], None, 52.0) is None

    bad = store.create("k1", ENDPOINT, "file-x", "24h", DAY_S, None, 60.0)
    failed = store.validated(bad.id, [(1, "a", b"{}")], '{"object": "list", "data": []}', 61.0)
    assert (failed.status, failed.failed_at, failed.errors, failed.total) == (
        "failed", 61.0, '{"object": "list", "data": []}', 0)
    assert store.unfinished(bad.id) == (0, 0)


def test_batches_are_listed_newest_first_by_owner_and_page(store):
    made = [store.create(f"k{i % 2}", ENDPOINT, "file-x", "24h", DAY_S, None, 10.0 + i) for i in range(5)]
    assert [b.id for b in store.batches(None, 10, None)] == [b.id for b in reversed(made)]
    assert [b.id for b in store.batches("k0", 10, None)] == [made[4].id, made[2].id, made[0].id]
    assert [b.id for b in store.batches("k0", 1, made[4].id)] == [made[2].id]
    assert store.batches(None, 10, "batch_none") == []


def test_cancel_moves_validating_and_in_progress_batches_only(store):
    running = _running(store, 2)
    cancelling = store.cancel(running.id, 20.0)
    assert (cancelling.status, cancelling.cancelling_at) == ("cancelling", 20.0)
    assert store.cancel(running.id, 21.0) == cancelling  # again: unchanged
    assert store.cancel("batch_none", 21.0) is None
    assert store.lease(running.id, "r1", 5, 100.0, 22.0) == []  # rule 2: in_progress batches only
    # Cancelled while validating: the lines go in for the runner to end, the batch stays cancelling.
    made = store.create("k1", ENDPOINT, "file-x", "24h", DAY_S, None, 30.0)
    assert store.cancel(made.id, 31.0).status == "cancelling"
    judged = store.validated(made.id, [(1, "a", b"{}")], None, 32.0)
    assert (judged.status, judged.total) == ("cancelling", 1) and store.unfinished(made.id) == (1, 0)
    assert store.validated(made.id, [(1, "a", b"{}")], None, 32.5) == judged  # once (rule 4)
    assert store.validated(made.id, [], '{"data": []}', 32.5) == judged
    assert store.end_unrun(made.id, {}, "batch_cancelled", "cancelled", 33.0) == 1
    assert store.finalize(made.id, "cancelled", 34.0).status == "cancelled"
    assert store.cancel(made.id, 35.0).status == "cancelled"


def test_live_lists_the_batches_a_runner_works_on_oldest_first(store):
    first, second = _running(store, 1, now=5.0), _running(store, 1, now=6.0)
    store.create("k1", ENDPOINT, "file-x", "24h", DAY_S, None, 4.0)  # validating: not the runner's
    ended = _running(store, 0, now=3.0)
    store.finalize(ended.id, "completed", 7.0)
    store.cancel(second.id, 8.0)
    assert [b.id for b in store.live()] == [first.id, second.id]


# --- leases and results -------------------------------------------------------------------------


def test_lease_takes_lines_in_order_put_back_returns_them_and_renew_extends(store):
    batch = _running(store, 5)
    first = store.lease(batch.id, "r1", 2, 100.0, 20.0)
    assert _ids(first) == [1, 2]
    assert (first[0].custom_id, first[0].body, first[0].attempts, first[0].waiting_on) == ("c1", b'{"n": 1}', 0, None)
    assert _ids(store.lease(batch.id, "r2", 2, 100.0, 20.0)) == [3, 4]
    assert store.unfinished(batch.id) == (1, 4)
    # Rule 2: a put-back line waits until not_before, keeping its code and attempts.
    assert store.put_back("r1", batch.id, 1, 50.0, "rate_limited", attempt=False)
    assert store.put_back("r1", batch.id, 2, 0.0, None, attempt=True)
    assert not store.put_back("r1", batch.id, 3, 0.0, None, attempt=True)  # r2's
    assert not store.put_back("r1", batch.id, 1, 0.0, None, attempt=True)  # no longer running
    assert [(line.line_no, line.attempts) for line in store.lease(batch.id, "r1", 9, 100.0, 30.0)] == [(2, 1), (5, 0)]
    again = store.lease(batch.id, "r1", 9, 100.0, 50.0)
    assert [(line.line_no, line.attempts, line.waiting_on) for line in again] == [(1, 0, "rate_limited")]
    assert store.lease(batch.id, "r3", 9, 200.0, 60.0) == []  # every lease still runs
    held = [(batch.id, n) for n in (1, 2, 3, 4, 5)]
    assert store.renew("r1", 300.0, held) == 3 and store.renew("r9", 300.0, held) == 0
    # r2's leases (until 100) ran out; r1's were renewed to 300.
    assert _ids(store.lease(batch.id, "r3", 9, 400.0, 150.0)) == [3, 4]


def test_release_returns_leased_lines_as_they_were(store):
    batch = _running(store, 3)
    store.lease(batch.id, "r1", 2, 100.0, 10.0)
    assert store.put_back("r1", batch.id, 2, 0.0, "rate_limited", attempt=True)
    store.lease(batch.id, "r1", 1, 100.0, 11.0)  # line 2 again, its code and attempt kept
    assert store.release("r2", [(batch.id, 1)]) == 0  # not r2's
    assert store.release("r1", [(batch.id, 1), (batch.id, 2)]) == 2
    again = store.lease(batch.id, "r3", 9, 100.0, 12.0)
    assert [(line.line_no, line.attempts, line.waiting_on) for line in again] == [(1, 0, None), (2, 1, "rate_limited"),
                                                                                (3, 0, None)]


def test_an_expired_lease_is_taken_over_and_the_late_finish_writes_nothing(opened):
    """Rules 2 and 3: router A's lease runs out, B takes the line; A's late result is refused."""
    a, b = opened(), opened()
    batch = _running(a, 2)
    assert _ids(a.lease(batch.id, "A", 2, 100.0, 10.0)) == [1, 2]
    assert b.lease(batch.id, "B", 2, 200.0, 99.0) == []
    assert _ids(b.lease(batch.id, "B", 1, 200.0, 101.0)) == [1]
    assert a.finish("A", [_result(batch.id, 1), _result(batch.id, 2)], 102.0) == [False, True]
    assert not a.put_back("A", batch.id, 1, 0.0, None, attempt=True)
    assert a.renew("A", 500.0, [(batch.id, 1), (batch.id, 2)]) == 0
    row = a.batch(batch.id)
    assert (row.completed, row.failed, row.prompt_tokens) == (1, 0, 3)
    assert b.finish("B", [_result(batch.id, 1, "error", (0, 0, 0))], 103.0) == [True]
    assert b.finish("B", [_result(batch.id, 1)], 104.0) == [False]  # once per line
    row = b.finalize(batch.id, "completed", 105.0)
    assert (row.completed, row.failed, row.prompt_tokens) == (1, 1, 3)
    assert [json.loads(line)["kind"] for line in b.content(row.error_file_id).splitlines()] == ["error"]


def test_a_restarted_router_reclaims_its_own_lines_at_once(opened):
    """Rule 2: `reclaim` puts back what a killed run of this router held, no attempt spent."""
    before, other = opened(), opened()
    batch = _running(before, 4)
    before.lease(batch.id, "r1#a", 2, 1000.0, 10.0)
    other.lease(batch.id, "r10#b", 1, 1000.0, 10.0)  # another instance whose name begins alike
    after = opened()  # r1 started again
    assert after.reclaim("r1") == 2 and after.reclaim("r1") == 0
    assert [(line.line_no, line.attempts) for line in after.lease(batch.id, "r1#c", 9, 1000.0, 11.0)] == [(1, 0), (2, 0), (4, 0)]
    assert after.unfinished(batch.id) == (0, 4)


def test_finish_writes_only_held_lines_in_one_transaction_and_counts_add_up(store):
    batch = _running(store, 4)
    store.lease(batch.id, "r1", 3, 100.0, 10.0)
    written = store.finish("r1", [_result(batch.id, 3, "error", (1, 0, 0)), _result(batch.id, 1),
                                  _result(batch.id, 4), _result(batch.id, 1)], 20.0)
    assert written == [True, True, False, False]  # 4: not leased; 1 twice: written once
    row = store.batch(batch.id)
    assert (row.completed, row.failed, row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (1, 1, 4, 5, 1)
    assert store.unfinished(batch.id) == (1, 1)
    with pytest.raises(UsageError):
        store.finish("r1", [_result(batch.id, 2), _result(batch.id, 2, "bogus")], 21.0)
    assert store.unfinished(batch.id) == (1, 1)  # nothing written, the good result included
    assert store.finish("r1", [], 22.0) == []


def test_end_unrun_ends_what_nobody_holds_with_the_code_it_waited_on(store):
    batch = _running(store, 5)
    store.lease(batch.id, "r1", 4, 100.0, 10.0)
    store.put_back("r1", batch.id, 1, 500.0, "budget_exceeded", attempt=False)  # waits past the end
    store.put_back("r1", batch.id, 2, 0.0, "rate_limited", attempt=False)
    store.lease(batch.id, "r2", 1, 300.0, 10.0)  # line 2 again, held until 300
    # Ending at 200: line 1 (pending), 4 (r1's lease ran out at 100), 5 (never leased); 2 held.
    codes = {"budget_exceeded": "budget_exceeded", "rate_limited": "rate_limited"}
    assert store.end_unrun(batch.id, codes, "batch_expired", "the window ended", 200.0) == 4
    assert store.unfinished(batch.id) == (0, 1)
    assert store.finish("r2", [_result(batch.id, 2)], 201.0) == [True]
    assert store.finish("r1", [_result(batch.id, 4)], 201.0) == [False]
    row = store.finalize(batch.id, "expired", 202.0)
    assert (row.status, row.completed, row.failed, row.expired_at) == ("expired", 1, 4, 202.0)
    errors = [json.loads(line) for line in store.content(row.error_file_id).splitlines()]
    assert [(e["custom_id"], e["response"], e["error"]) for e in errors] == [
        ("c1", None, {"code": "budget_exceeded", "message": "the window ended"}),
        ("c3", None, {"code": "batch_expired", "message": "the window ended"}),
        ("c4", None, {"code": "batch_expired", "message": "the window ended"}),
        ("c5", None, {"code": "batch_expired", "message": "the window ended"}),
    ]
    assert store.end_unrun(batch.id, codes, "batch_expired", "again", 203.0) == 0


def test_finalize_writes_both_files_in_line_order_once(store):
    """Rules 4 and 5."""
    batch = _running(store, 6, owner="k7")
    store.lease(batch.id, "r1", 6, 100.0, 10.0)
    order = [5, 2, 6, 1, 4, 3]  # finished out of line order, over three transactions
    kinds = {1: "output", 2: "error", 3: "output", 4: "output", 5: "error", 6: "output"}
    for chunk in (order[:2], order[2:5], order[5:]):
        assert store.finish("r1", [_result(batch.id, n, kinds[n]) for n in chunk], 20.0) == [True] * len(chunk)
    with pytest.raises(UsageError):
        store.finalize(batch.id, "failed", 30.0)
    files_before = len(store.files(None, None, 100, None))
    row = store.finalize(batch.id, "completed", 30.0)
    assert (row.status, row.completed, row.failed, row.completed_at, row.finalizing_at) == ("completed", 4, 2, 30.0, 30.0)
    output, error = store.content(row.output_file_id), store.content(row.error_file_id)
    assert output.endswith(b"\n") and error.endswith(b"\n")
    assert [json.loads(line)["line"] for line in output.splitlines()] == [1, 3, 4, 6]
    assert [json.loads(line)["line"] for line in error.splitlines()] == [2, 5]
    out_file = store.file(row.output_file_id)
    assert (out_file.owner, out_file.purpose, out_file.filename, out_file.bytes) == (
        "k7", "batch_output", f"{batch.id}_output.jsonl", len(output))
    assert store.file(row.error_file_id).filename == f"{batch.id}_error.jsonl"
    # A second finalize (another router, another status) changes nothing and writes no file.
    assert store.finalize(batch.id, "expired", 40.0) == row
    assert len(store.files(None, None, 100, None)) == files_before + 2
    assert store.finalize("batch_none", "completed", 40.0) is None
    # No error line: no error file; the output file is written even when empty.
    clean = _running(store, 0)
    ended = store.finalize(clean.id, "completed", 50.0)
    assert ended.error_file_id is None and store.content(ended.output_file_id) == b""


def test_prune_deletes_ended_batches_with_their_lines_and_old_files(store):
    old, recent, running = _running(store, 2, now=10.0), _running(store, 2, now=10.0), _running(store, 2, now=10.0)
    for batch, at in ((old, 100.0), (recent, 300.0)):
        store.end_unrun(batch.id, {}, "batch_cancelled", "cancelled", at)
        store.finalize(batch.id, "cancelled", at)
    failed = store.create("k1", ENDPOINT, "file-x", "24h", DAY_S, None, 10.0)
    store.validated(failed.id, [], '{"data": []}', 150.0)
    upload = store.put_file("k1", "batch", "in.jsonl", b"x", 50.0)
    # Deleted: old and failed, the upload, and old's two files (written at 100).
    assert store.prune(200.0) == 5
    assert store.batch(old.id) is None and store.batch(failed.id) is None and store.file(upload.id) is None
    assert store._db.fetch("SELECT count(*) FROM batch_lines WHERE batch_id = ?", (old.id,)) == [(0,)]
    assert store.batch(recent.id) is not None and store.batch(running.id) is not None
    assert store.file(store.batch(recent.id).error_file_id) is not None
    assert store.unfinished(running.id) == (2, 0)
    assert store.prune(200.0) == 0


# --- several routers ----------------------------------------------------------------------------


def test_two_routers_leasing_at_once_never_get_the_same_line(opened):
    """Rule 2 (PostgreSQL: FOR UPDATE SKIP LOCKED; SQLite: the write lock), two stores, threads."""
    routers = {"A": opened(), "B": opened()}
    batch = _running(routers["A"], 300)
    taken: dict[str, list[int]] = {"A": [], "B": []}
    start, holding = threading.Barrier(2), threading.Barrier(2)

    def run(name: str) -> None:
        store = routers[name]
        start.wait()
        lines = store.lease(batch.id, name, 7, 1e9, 10.0)
        holding.wait()  # both hold lines before either finishes any
        while lines:
            taken[name] += _ids(lines)
            assert store.finish(name, [_result(batch.id, n) for n in _ids(lines)], 11.0) == [True] * len(lines)
            lines = store.lease(batch.id, name, 7, 1e9, 10.0)

    threads = [threading.Thread(target=run, args=(name,)) for name in routers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert taken["A"] and taken["B"] and not set(taken["A"]) & set(taken["B"])
    assert sorted(taken["A"] + taken["B"]) == list(range(1, 301))
    row = routers["B"].batch(batch.id)
    assert (row.completed, row.failed, row.prompt_tokens) == (300, 0, 900)


def test_two_routers_finalizing_at_once_write_one_set_of_files(opened):
    """Rule 4: one wins; the other changes nothing and gets the winner's row."""
    a, b = opened(), opened()
    batch = _running(a, 20)
    a.lease(batch.id, "A", 20, 100.0, 10.0)
    a.finish("A", [_result(batch.id, n, "error" if n % 3 == 0 else "output") for n in range(1, 21)], 11.0)
    rows = {}
    start = threading.Barrier(2)

    def run(name, store, status):
        start.wait()
        rows[name] = store.finalize(batch.id, status, 12.0)

    threads = [threading.Thread(target=run, args=args) for args in (("A", a, "completed"), ("B", b, "expired"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert rows["A"] == rows["B"] and rows["A"].status in ("completed", "expired")
    assert {f.id for f in a.files(None, "batch_output", 100, None)} == {rows["A"].output_file_id, rows["A"].error_file_id}


def test_the_migrations_add_the_tables_and_the_route_log_columns(store):
    """Schema 0007 (SQLite), 0003 (PostgreSQL)."""
    if isinstance(store._db, SqliteBatches):
        conn = db.connect(store.path)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        columns = {r[1] for r in conn.execute("PRAGMA table_info(route_log)")}
        conn.close()
    else:
        with store._db.session.use() as conn:
            tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
            columns = {r[0] for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'route_log'")}
    assert {"batch_files", "batches", "batch_lines"} <= tables and {"batch_id", "custom_id"} <= columns


# --- a plain model ------------------------------------------------------------------------------


class LinesModel:
    """What rules 2 and 3 say of one batch's lines, plainly: line -> [state, owner, until,
    not_before, attempts, kind]."""

    def __init__(self, n: int) -> None:
        self.lines = {no: ["pending", None, None, 0.0, 0, None] for no in range(1, n + 1)}

    def lease(self, router, n, until, now) -> list[int]:
        free = [no for no, (state, _, held_until, not_before, *_) in sorted(self.lines.items())
                if (state == "pending" and not_before <= now) or (state == "running" and held_until < now)][:n]
        for no in free:
            self.lines[no][:3] = ["running", router, until]
        return free

    def holds(self, router, no) -> bool:
        return self.lines[no][0] == "running" and self.lines[no][1] == router

    def finish(self, router, nos, kind) -> list[bool]:
        written = []
        for no in nos:
            written.append(self.holds(router, no))
            if written[-1]:
                self.lines[no][0], self.lines[no][5] = "done", kind
        return written

    def put_back(self, router, no, not_before, attempt) -> bool:
        if not self.holds(router, no):
            return False
        line = self.lines[no]
        line[:4] = ["pending", None, None, not_before]
        line[4] += attempt
        return True


LINES = 6
ROUTERS = st.sampled_from(["A", "B"])
STEPS = st.lists(st.one_of(
    st.tuples(st.just("lease"), ROUTERS, st.integers(1, 4), st.integers(0, 30)),
    st.tuples(st.just("finish"), ROUTERS, st.lists(st.integers(1, LINES), max_size=4), st.sampled_from(["output", "error"])),
    st.tuples(st.just("put_back"), ROUTERS, st.integers(1, LINES), st.integers(0, 30), st.booleans()),
    st.tuples(st.just("wait"), st.integers(1, 20)),
), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_leases_results_and_put_backs_follow_the_plain_model(tmp_path_factory, steps):
    """Rules 2 and 3 on SQLite against LinesModel: what each call returns, the counts, the files."""
    store = BatchStore(tmp_path_factory.mktemp("model") / "router.sqlite3")
    try:
        batch = _running(store, LINES, now=0.0)
        model, now = LinesModel(LINES), 0.0
        for step in steps:
            if step[0] == "lease":
                _, router, n, lasts = step
                assert _ids(store.lease(batch.id, router, n, now + lasts, now)) == model.lease(router, n, now + lasts, now)
            elif step[0] == "finish":
                _, router, nos, kind = step
                results = [_result(batch.id, no, kind, (1, 0, 0)) for no in nos]
                assert store.finish(router, results, now) == model.finish(router, nos, kind)
            elif step[0] == "put_back":
                _, router, no, later, attempt = step
                assert store.put_back(router, batch.id, no, now + later, None, attempt) == model.put_back(
                    router, no, now + later, attempt)
            else:
                now += step[1]
        states = [line[0] for line in model.lines.values()]
        assert store.unfinished(batch.id) == (states.count("pending"), states.count("running"))
        kinds = {no: line[5] for no, line in model.lines.items()}
        row = store.batch(batch.id)
        assert (row.completed, row.failed, row.prompt_tokens) == (
            list(kinds.values()).count("output"), list(kinds.values()).count("error"), states.count("done"))
        now += 100  # every lease ran out: end what is left, then the files hold each line once
        store.end_unrun(batch.id, {}, "batch_expired", "ended", now)
        row = store.finalize(batch.id, "expired", now)
        outputs = [json.loads(line)["line"] for line in store.content(row.output_file_id).splitlines()]
        assert outputs == [no for no, kind in kinds.items() if kind == "output"]
        errors = store.content(row.error_file_id).splitlines() if row.error_file_id else []
        assert len(outputs) + len(errors) == LINES == row.completed + row.failed
    finally:
        store.close()
