"""The store (router/store): paths, opening and migrations, the route_log writer and the key
store, on real SQLite files in tmp_path. Each test names the docstring rule it pins."""

from __future__ import annotations

import gc
import os
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest

from router.core.access import hash_secret, parse_key
from router.core.errors import BadRequest, ConfigError
from router.store import db, keys as keys_mod, paths
from router.store.keys import KeyStore
from router.core.decide import decide
from router.core.types import BoxFacts, BoxKind, Call, Resident
from router.core.bounds import CLIP_MARK, TEXT_CHARS, clip
from router.store import route_log
from router.store.route_log import FLUSH_INTERVAL_S, MAX_BATCH_ROWS, Row, RouteLogWriter

from conftest import RouterProcess, wait_for, write_boxes

ROOT = Path(__file__).resolve().parent.parent


def row(i: int, **extra) -> Row:
    """A finished call's row, as the proxy records it."""
    fields = {
        "request_id": f"c{i}", "facade": "openai", "route": "/v1/chat/completions",
        "model": "llama3:latest", "options": None, "pin": None, "client": "127.0.0.1",
        "stream": True, "path": "serving",
        "decision": {"ranked": [["a", "serving"], ["b", "load"]], "refused": {}},
        "attempts": [{"box": "a", "status": 200, "refusal": None, "ms": 12.5}],
        "box": "a", "http_status": 200, "state": "done", "error": None,
        "received_at": 1000.0 + i, "first_byte_at": 1000.1 + i, "responded_at": 1000.2 + i,
        "bytes_in": 120, "bytes_out": 4096, **extra,
    }
    return Row(**fields)


def count(path: Path) -> int:
    conn = db.connect(path)
    try:
        return conn.execute("SELECT count(*) FROM route_log").fetchall()[0][0]
    finally:
        conn.close()


# --- paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"HUGPY_ROUTER_HOME": "/h", "STATE_DIRECTORY": "/s", "HUGPY_DATA_DIR": "/d"}, "/h"),
        ({"HUGPY_ROUTER_HOME": "~/r"}, os.path.expanduser("~/r")),
        ({"STATE_DIRECTORY": "/var/lib/hugpy-router:/var/lib/other", "HUGPY_DATA_DIR": "/d"},
         "/var/lib/hugpy-router"),
        ({"HUGPY_ROUTER_HOME": "", "STATE_DIRECTORY": "", "HUGPY_DATA_DIR": "/d"}, "/d/router"),
        ({"XDG_DATA_HOME": "/x"}, "/x/hugpy/router"),
        ({}, os.path.expanduser("~/.local/share/hugpy/router")),
    ],
)
def test_store_path_rules(env, expected, monkeypatch):
    for name in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "HUGPY_DATA_DIR", "HUGPY_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    if "XDG_DATA_HOME" in env:  # platformdirs reads XDG from the process environment
        monkeypatch.setenv("XDG_DATA_HOME", env["XDG_DATA_HOME"])
    assert paths.store_dir(env) == Path(expected)
    assert paths.db_path(env) == Path(expected) / "router.sqlite3"


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"HUGPY_ROUTER_BOXES": "/b.json", "HUGPY_CONFIG_DIR": "/c"}, "/b.json"),
        ({"HUGPY_CONFIG_DIR": "/c"}, "/c/router/boxes.json"),
        ({"XDG_CONFIG_HOME": "/x"}, "/x/hugpy/router/boxes.json"),
        ({}, os.path.expanduser("~/.config/hugpy/router/boxes.json")),
    ],
)
def test_boxes_path_rules_are_0_0_4s(env, expected, monkeypatch):
    for name in ("XDG_CONFIG_HOME", "HUGPY_CONFIG_DIR", "HUGPY_ROUTER_BOXES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert paths.boxes_path() == Path(expected)


def test_group_mode_shares_the_store_with_group_hugpy(tmp_path, monkeypatch):
    monkeypatch.setenv("HUGPY_ROUTER_STORE_MODE", "group")
    path = tmp_path / "home" / "router.sqlite3"
    db.open_store(path).close()
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert (mode(path.parent), mode(path)) == (0o750, 0o640)
    assert paths.store_modes({"HUGPY_ROUTER_STORE_MODE": "bogus"}) == paths.PRIVATE


# --- opening and migrations -------------------------------------------------------------------


def test_open_store_creates_a_private_file_and_applies_every_migration(tmp_path):
    path = tmp_path / "home" / "router.sqlite3"
    conn = db.open_store(path)
    steps = db.migrations()
    names = [name for _, name, _ in steps]
    assert names[:4] == ["router", "route_log_facades", "admission", "tenancy"]
    assert "route_log_affinity" in names[4:]  # numbered in landing order
    assert conn.pragma("user_version") == len(steps)
    assert conn.pragma("journal_mode") == "wal"
    assert conn.pragma("synchronous") == 1  # NORMAL
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"route_log", "api_keys"} <= tables
    conn.execute("INSERT INTO api_keys (id, name, scope, secret_hash, created_at) VALUES ('a', 'n', 'use', 'h', 1)")
    for name in ("router.sqlite3", "router.sqlite3-wal", "router.sqlite3-shm"):
        assert stat.S_IMODE(os.stat(path.parent / name).st_mode) == 0o600, name
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    conn.close()


def test_migrations_are_idempotent_and_resume_from_user_version(tmp_path):
    path = tmp_path / "router.sqlite3"
    conn = db.connect(path)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(db.migrations()[0][2])
    conn.pragma("user_version", 1)
    conn.execute("COMMIT")
    latest = len(db.migrations())
    assert db.migrate(conn) == latest  # only 0002 onwards left to apply
    assert db.migrate(conn) == latest  # nothing left: no error, no change
    conn.close()
    for _ in range(2):
        db.open_store(path).close()
    conn = db.connect(path)
    assert conn.pragma("user_version") == latest
    conn.close()


def test_a_store_newer_than_the_code_is_refused(tmp_path):
    path = tmp_path / "router.sqlite3"
    conn = db.open_store(path)
    conn.pragma("user_version", 99)
    conn.close()
    with pytest.raises(ConfigError, match="newer than this router"):
        db.open_store(path)


def test_a_file_that_is_not_a_database_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "router.sqlite3"
    junk = b"this is not sqlite" * 300
    path.write_bytes(junk)
    with pytest.raises(ConfigError, match="corrupt.*will not recreate"):
        db.open_store(path)
    assert path.read_bytes() == junk


def test_a_damaged_page_fails_the_integrity_check_and_is_left_alone(tmp_path):
    path = tmp_path / "router.sqlite3"
    writer = RouteLogWriter(path)
    writer.start()
    for i in range(2000):
        writer.record(row(i))
    writer.stop()  # the last connection closes: WAL checkpointed into the file
    page = db.connect(path).pragma("page_size")
    data = bytearray(path.read_bytes())
    assert len(data) > 20 * page
    middle = (len(data) // page // 2) * page
    data[middle : middle + page] = b"\xa5" * page  # one b-tree page of route_log, overwritten
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="corrupt"):
        db.open_store(path)
    assert path.read_bytes() == bytes(data)


# --- the route_log writer ---------------------------------------------------------------------


def test_ten_thousand_rows_without_blocking_and_stop_flushes_them_all(tmp_path):
    path = tmp_path / "router.sqlite3"
    writer = RouteLogWriter(path)
    writer.start()
    rows = [row(i) for i in range(10_000)]
    # Another connection holds the write lock, as a `router keys` command or a slow disk
    # might. The first row's batch parks the writer thread in SQLite's busy wait (which holds
    # no GIL); the other rows must still go in at once (rule 1).
    blocker = db.connect(path)
    blocker.execute("BEGIN IMMEDIATE")
    writer.record(rows[0])
    time.sleep(FLUSH_INTERVAL_S * 4)
    # Each call is timed, and the thread's context switches are counted around it: a
    # voluntary switch means the call waited on something (a lock, the GIL, I/O); an
    # involuntary one means the OS preempted the test itself, which on a busy machine can
    # stretch any call past 5 ms without record() being at fault.
    usage, thread = resource.getrusage, resource.RUSAGE_THREAD
    clock = time.perf_counter_ns
    worst_ns, waits, slow_unpreempted = 0, 0, []
    # A full GC pass over the test session's objects can land inside any call and take
    # several ms; it is not record() waiting on anything, so it is kept out of the measure.
    gc.disable()
    try:
        for r in rows[1:]:
            before = usage(thread)
            t0 = clock()
            writer.record(r)
            spent = clock() - t0
            after = usage(thread)
            waits += after.ru_nvcsw - before.ru_nvcsw
            worst_ns = max(worst_ns, spent)
            if spent >= 5_000_000 and after.ru_nivcsw == before.ru_nivcsw:
                slow_unpreempted.append(spent)
    finally:
        gc.enable()
    assert writer.queued == 10_000
    assert writer.written == 0  # nothing could be committed yet
    blocker.execute("ROLLBACK")
    blocker.close()
    writer.stop()  # rule 7: every recorded row is written before the thread ends
    assert waits == 0, "record() waited on something"
    assert slow_unpreempted == [], f"record() took {max(slow_unpreempted, default=0) / 1e6:.2f} ms"
    print(f"record(): worst {worst_ns / 1e3:.0f} µs over 9,999 calls")
    assert (writer.written, writer.dropped, writer.shed) == (10_000, 0, 0)
    assert 1 <= writer.max_batch <= MAX_BATCH_ROWS
    assert writer.last_flush_lag_s > 0
    assert count(path) == 10_000
    conn = db.connect(path)
    got = conn.execute("SELECT request_id, stream, decision, attempts FROM route_log WHERE request_id = 'c7'").fetchall()
    assert got == [("c7", 1, orjson.dumps(rows[7].decision).decode(), orjson.dumps(rows[7].attempts).decode())]
    conn.close()


def test_a_batch_goes_in_as_statements_apsw_keeps_prepared(tmp_path):
    """Rule 10: a batch of any size is cut into at most eight distinct INSERT texts, each under
    APSW's largest cacheable statement, so a flush prepares nothing it prepared before."""
    for rows in range(0, 3 * route_log.STATEMENT_ROWS + 1):
        sizes = route_log.statement_sizes(rows)
        assert sum(sizes) == rows
        assert all(size & (size - 1) == 0 and size <= route_log.STATEMENT_ROWS for size in sizes), sizes
        rest = [size for size in sizes if size < route_log.STATEMENT_ROWS]
        assert sizes == sorted(sizes, reverse=True) and len(set(rest)) == len(rest), sizes
    writer = RouteLogWriter(tmp_path / "router.sqlite3")
    writer._open()  # the engine alone, on this thread
    try:
        conn = writer._conn
        assert len(route_log.insert_sql(route_log.STATEMENT_ROWS)) <= conn.cache_stats()["max_cacheable_bytes"]
        batch = [(0.0, row(i)) for i in range(MAX_BATCH_ROWS - 1)]  # 255 rows: 128 + 64 + ... + 1
        writer._write(batch)
        misses = conn.cache_stats()["misses"]
        writer._write([(0.0, row(i)) for i in range(1000, 1000 + len(batch))])
        assert conn.cache_stats()["misses"] == misses  # the second flush prepared nothing
        assert writer.written == 2 * len(batch) and count(tmp_path / "router.sqlite3") == 2 * len(batch)
    finally:
        writer._close()


def test_the_writer_lets_the_gil_go_inside_a_batch_only_while_the_loop_is_near_idle(tmp_path, monkeypatch):
    """Rule 10: with at most YIELD_MAX_CALLS calls in flight, a batch's values are made YIELD_ROWS
    at a time and the GIL let go between those and between statements; with more, not once (a
    busy loop takes each let-go back only by a forced switch). The rows are the same either way."""
    path = tmp_path / "router.sqlite3"
    writer = RouteLogWriter(path)
    writer._open()  # the engine alone, on this thread
    let_go = []
    sleep = time.sleep
    monkeypatch.setattr(route_log.time, "sleep", lambda s: let_go.append(s) if s == 0 else sleep(s))
    try:
        batch = [(0.0, row(i)) for i in range(MAX_BATCH_ROWS - 1)]  # 255 rows: 8 statements
        in_flight = route_log.YIELD_MAX_CALLS
        writer.loop_calls = lambda: in_flight
        writer._write(batch)
        chunks = -(-len(batch) // route_log.YIELD_ROWS)
        assert len(let_go) == (chunks - 1) + (len(route_log.statement_sizes(len(batch))) - 1)
        let_go.clear()
        in_flight = route_log.YIELD_MAX_CALLS + 1
        writer._write([(0.0, row(i)) for i in range(1000, 1000 + len(batch))])
        assert let_go == []
        assert writer.written == 2 * len(batch) and count(path) == 2 * len(batch)
    finally:
        writer._close()


def test_a_bad_row_in_a_later_statement_rolls_back_the_whole_batch(tmp_path):
    """Rules 10 and 2: a batch's statements share one transaction, so a bad row in its last
    statement undoes the rows its first statements wrote; then each row goes in alone, every
    good row exactly once."""
    path = tmp_path / "router.sqlite3"
    writer = RouteLogWriter(path)
    writer._open()  # the engine alone, on this thread
    try:
        batch = [(0.0, row(i)) for i in range(MAX_BATCH_ROWS - 1)]  # 255 rows: 128 + 64 + ... + 1
        batch[-1] = (0.0, row(3, box="b"))  # the last statement repeats a call of the first
        batch[200] = (0.0, Row("bad-state", "exploded", received_at=1.0))
        writer._write(batch)
        assert (writer.written, writer.dropped) == (MAX_BATCH_ROWS - 3, 2)
        conn = writer._conn
        assert sorted(r[0] for r in conn.execute("SELECT request_id FROM route_log")) == sorted(
            f"c{i}" for i in range(MAX_BATCH_ROWS - 2) if i != 200)
        assert conn.execute("SELECT box FROM route_log WHERE request_id = 'c3'").fetchall() == [("a",)]
    finally:
        writer._close()


def test_bad_rows_are_dropped_alone(tmp_path):
    path = tmp_path / "router.sqlite3"
    writer = RouteLogWriter(path)
    writer.start()
    writer.record(row(1))
    writer.record(Row(None, "done", received_at=1.0))  # no request_id
    writer.record(Row("bad-state", "exploded", received_at=1.0))
    writer.record(row(1, box="b"))  # the same call twice: the first row stands
    writer.record(row(3, attempts=[object()]))  # not JSON
    writer.record(row(2))
    extra = MAX_BATCH_ROWS + 3  # good rows beside the bad ones, in the failed batch and the next: all kept
    for i in range(10, 10 + extra):
        writer.record(row(i))
    writer.stop()
    writer2 = RouteLogWriter(path)  # a second run appends
    writer2.start()
    writer2.record(row(4, decision=None, attempts=None))
    writer2.stop()
    assert (writer.written, writer.dropped) == (2 + extra, 4)
    assert (writer2.written, writer2.dropped) == (1, 0)
    conn = db.connect(path)
    assert sorted(r[0] for r in conn.execute("SELECT request_id FROM route_log")) == sorted(
        ["c1", "c2", "c4"] + [f"c{i}" for i in range(10, 10 + extra)]
    )
    assert conn.execute("SELECT box FROM route_log WHERE request_id = 'c1'").fetchall() == [("a",)]
    conn.close()


def test_a_decision_is_logged_as_its_ranking_and_refusals(tmp_path):
    boxes = [
        BoxFacts(id="a", kind=BoxKind.HUGPY, order=0, catalog=frozenset({"m"})),
        BoxFacts(id="b", kind=BoxKind.HUGPY, order=1, residents={"m": Resident("m")}),
        BoxFacts(id="c", kind=BoxKind.HUGPY, order=2),
    ]
    decision = decide(Call(model="m", kinds=frozenset({BoxKind.HUGPY})), boxes)
    path = tmp_path / "router.sqlite3"
    writer = RouteLogWriter(path)
    writer.start()
    writer.record(row(1, decision=decision))
    writer.stop()
    conn = db.connect(path)
    (text,) = conn.execute("SELECT decision FROM route_log").fetchall()[0]
    conn.close()
    assert orjson.loads(text) == {
        "boxes": ["b", "a"], "why": {"b": "serving", "a": "load"},
        "refused": {"c": decision.ruled_out["c"].text()},
    }


def test_client_text_in_a_row_is_clipped(tmp_path):
    """A row's text columns stay bounded whatever a client or a box sent (rule 12)."""
    path = tmp_path / "router.sqlite3"
    writer = RouteLogWriter(path)
    writer.start()
    huge = "m" * 100_000
    writer.record(row(1, model=huge, pin="p" * 5000, client="c" * 3000, route="/" + "r" * 9000,
                      error="e" * 2000))
    writer.record(row(2, model="x" * TEXT_CHARS))  # at the bound: kept whole
    writer.stop()
    conn = db.connect(path)
    got = dict(conn.execute("SELECT request_id, model FROM route_log").fetchall())
    (texts,) = conn.execute("SELECT pin, client, route, error FROM route_log WHERE request_id = 'c1'").fetchall()
    conn.close()
    assert got["c1"] == clip(huge) and got["c1"].startswith("m" * TEXT_CHARS)
    assert got["c1"].endswith(CLIP_MARK % (100_000 - TEXT_CHARS))
    assert got["c2"] == "x" * TEXT_CHARS
    assert all(len(text) <= TEXT_CHARS + 32 for text in texts)


def test_retention_prunes_old_rows_in_bounded_batches_on_the_writer_thread(tmp_path, monkeypatch):
    """Rows stamped in the past go, recent rows stay; each DELETE takes at most a batch, and
    rows recorded meanwhile are written at once (rule 11)."""
    monkeypatch.setattr(route_log, "PRUNE_BATCH_ROWS", 100)
    path = tmp_path / "router.sqlite3"
    now = time.time()
    day = 86_400.0
    seed = RouteLogWriter(path)  # no retention: writes every row, old or not
    seed.start()
    for i in range(1050):
        seed.record(row(i, received_at=now - 40 * day - i))
    for i in range(1050, 1060):
        seed.record(row(i, received_at=now - 29 * day))
    seed.stop()
    assert count(path) == 1060 and seed.pruned == 0
    batches: list[int] = []
    prune = RouteLogWriter._prune

    def counted(self, before):
        full = prune(self, before)
        batches.append(self._conn.changes())
        return full

    monkeypatch.setattr(RouteLogWriter, "_prune", counted)
    writer = RouteLogWriter(path, retention_s=30 * day)
    writer.start()
    writer.record(row(2000, received_at=now))
    deadline = time.monotonic() + 10
    while writer.pruned < 1050 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(FLUSH_INTERVAL_S * 2)
    assert writer.written == 1, "a row recorded during the prune was not written"
    writer.stop()
    assert writer.pruned == 1050
    assert max(batches) == 100 and len(batches) >= 11
    conn = db.connect(path)
    left = sorted(r[0] for r in conn.execute("SELECT request_id FROM route_log"))
    conn.close()
    assert left == sorted([f"c{i}" for i in range(1050, 1060)] + ["c2000"])


def test_retention_zero_keeps_every_row(tmp_path):
    path = tmp_path / "router.sqlite3"
    writer = RouteLogWriter(path, retention_s=None)
    writer.start()
    writer.record(row(1, received_at=0.0))
    writer.stop()
    assert count(path) == 1 and writer.pruned == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("days,left", [("30", ["c1"]), ("0", ["c0", "c1"])])
def test_router_serve_prunes_by_its_retention_flag(tmp_path, days, left):
    """`router serve --log-retention-days N`: the store's rows stamped over N days ago go at
    start; 0 keeps them."""
    home = tmp_path / "home"  # RouterProcess's HUGPY_ROUTER_HOME
    seed = RouteLogWriter(home / paths.DB_FILE)
    seed.start()
    seed.record(row(0, received_at=time.time() - 31 * 86_400))
    seed.record(row(1, received_at=time.time() - 29 * 86_400))
    seed.stop()
    router = RouterProcess(write_boxes(tmp_path / "boxes.json", []), "--log-retention-days", days)
    try:
        def rows() -> list[str]:
            conn = db.connect(home / paths.DB_FILE)
            try:
                return sorted(r[0] for r in conn.execute("SELECT request_id FROM route_log"))
            finally:
                conn.close()

        if days == "0":
            time.sleep(0.5)
        assert wait_for(lambda: rows() == left, timeout=10), rows()
    finally:
        assert router.stop() == 0


def test_the_retention_flag(tmp_path):
    from router.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--port", "1"]).log_retention_days == 30
    assert parser.parse_args(["serve", "--port", "1", "--log-retention-days", "0"]).log_retention_days == 0
    assert parser.parse_args(["serve", "--port", "1", "--log-retention-days", "0.5"]).log_retention_days == 0.5
    for bad in ("-1", "nan", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--port", "1", "--log-retention-days", bad])


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from router.store.route_log import Row, RouteLogWriter
    writer = RouteLogWriter(sys.argv[1])
    writer.start()
    i = 0
    while True:
        for _ in range(200):
            writer.record(Row(f"c{i}", "done", box="a", decision={"ranked": [["a", "serving"]]},
                              attempts=[{"box": "a", "status": 200}], received_at=float(i)))
            i += 1
        print(writer.written, flush=True)
        time.sleep(0.002)
    """
)


def test_a_writer_killed_mid_burst_leaves_a_clean_file(tmp_path):
    path = tmp_path / "router.sqlite3"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    written = 0
    try:
        while written < 5_000:
            line = proc.stdout.readline()
            assert line, "the writer process died on its own"
            written = int(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    conn = db.open_store(path)  # integrity_check passes, or this raises ConfigError
    rows, top = conn.execute("SELECT count(*), max(id) FROM route_log").fetchall()[0]
    conn.close()
    # Every commit the writer reported survived, and commits are whole and in order.
    assert rows >= written
    assert top == rows


# --- keys -------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    s = KeyStore(tmp_path / "router.sqlite3")
    yield s
    s.close()


def test_create_mints_hugpy_shaped_keys_and_scope_of_checks_them(store):
    use_id, use_key = store.create("laptop", "use")
    admin_id, admin_key = store.create("ops", "admin", created_by="cli")
    parsed = parse_key(use_key)
    assert parsed is not None and parsed[0] == use_id
    assert len(use_id) == 10 and int(use_id, 16) >= 0
    assert len(parsed[1]) == 43  # token_urlsafe(32)
    now = time.time()
    assert store.scope_of(use_key, now, None) == "use"
    assert store.scope_of(admin_key, now, None) == "admin"
    assert store.scope_of(use_key[:-1] + ("A" if use_key[-1] != "A" else "B"), now, None) is None
    assert store.scope_of(f"hpk_0000000000_{parsed[1]}", now, None) is None  # unknown id
    assert store.scope_of("garbage", now, None) is None
    assert store.scope_of("s3cret-admin", now, "s3cret-admin") == "admin"  # HUGPY_ROUTER_KEY
    assert store.scope_of("s3cret-admin", now, None) is None
    assert store.scope_of("s3cret-admi\udcff", now, "s3cret-admin") is None
    assert [(k["id"], k["name"], k["scope"], k["created_by"]) for k in store.list()] == [
        (use_id, "laptop", "use", None), (admin_id, "ops", "admin", "cli")
    ]
    assert all("secret_hash" not in k for k in store.list(include_revoked=True))


@pytest.mark.parametrize(
    "name, scope, days, code",
    [(" ", "use", None, "invalid_name"), ("x", "root", None, "invalid_scope"), ("x", "use", 0, "invalid_expiry"),
     ("x", "use", float("nan"), "invalid_expiry"),
     # issue 20 item 13: names are printable (no NUL, control or bidi characters)
     ("a\x00b", "use", None, "invalid_name"), ("ops\r\nFAKE LINE", "use", None, "invalid_name"),
     ("\x1b[31mred", "use", None, "invalid_name"), ("evil\u202etxt.exe", "use", None, "invalid_name"),
     ("a\u2066b", "use", None, "invalid_name"), ("a\u200fb", "use", None, "invalid_name")],
)
def test_create_rejects_bad_input(store, name, scope, days, code):
    with pytest.raises(BadRequest) as err:
        store.create(name, scope, days)
    assert err.value.code == code


def test_printable_names_of_any_script_are_kept(store):
    for name in ("laptop 2", "Jürgen's box", "研究室", "ops-α"):
        key_id, _ = store.create(name, "use")
        assert next(k["name"] for k in store.list() if k["id"] == key_id) == name


def test_expiry_is_strictly_after_expires_at(store):
    key_id, key = store.create("temp", "use", expires_days=2)
    (entry,) = store.list()
    expires_at = entry["expires_at"]
    assert abs(expires_at - (entry["created_at"] + 2 * 86_400)) < 1e-6
    assert store.scope_of(key, expires_at - 1, None) == "use"
    assert store.scope_of(key, expires_at, None) == "use"  # hugpy: expires_at < now is expired
    assert store.scope_of(key, expires_at + 0.001, None) is None


def test_revoke(store):
    key_id, key = store.create("gone", "admin")
    assert store.revoke(key_id) is True
    assert store.scope_of(key, time.time(), None) is None
    (entry,) = store.list(include_revoked=True)
    first = entry["revoked_at"]
    assert store.revoke(key_id) is True  # again: keeps the first revocation time
    assert store.list(include_revoked=True)[0]["revoked_at"] == first
    assert store.list() == []
    assert store.revoke("nope") is False


def test_changes_from_another_connection_are_seen_after_refresh(store, tmp_path, monkeypatch):
    other = KeyStore(tmp_path / "router.sqlite3")  # as `router keys create` in another process
    key_id, key = other.create("late", "use")
    assert store.scope_of(key, time.time(), None) is None  # no I/O per call: not seen yet
    assert store.refresh_if_changed() is True
    assert store.scope_of(key, time.time(), None) == "use"
    other.revoke(key_id)
    assert store.refresh_if_changed() is False  # looked less than REFRESH_EVERY_S ago
    assert store.scope_of(key, time.time(), None) == "use"
    monkeypatch.setattr(keys_mod, "REFRESH_EVERY_S", 0.0)
    assert store.refresh_if_changed() is True
    assert store.scope_of(key, time.time(), None) is None
    assert store.refresh_if_changed() is False  # nothing new committed
    other.close()


def test_last_used_is_written_lazily(store, tmp_path):
    key_id, key = store.create("busy", "use")

    def stored() -> float | None:
        conn = db.connect(tmp_path / "router.sqlite3")
        try:
            return conn.execute("SELECT last_used_at FROM api_keys WHERE id = ?", (key_id,)).fetchall()[0][0]
        finally:
            conn.close()

    assert store.scope_of(key, 1000.0, None) == "use"
    assert stored() is None  # scope_of wrote nothing
    assert store.list()[0]["last_used_at"] == 1000.0  # but list shows the noted use
    assert store.flush_last_used(1000.0) == 1 and stored() == 1000.0
    store.scope_of(key, 1010.0, None)
    assert store.flush_last_used(1010.0) == 0 and stored() == 1000.0  # within 60 s of the write
    assert store.flush_last_used(1059.9) == 0
    assert store.flush_last_used(1060.0) == 1 and stored() == 1010.0
    assert store.flush_last_used(5000.0) == 0  # no newer use
    store.scope_of(key[:-2], 6000.0, None)  # a failed check is not a use
    assert store.flush_last_used(7000.0) == 0


def test_a_key_secret_never_reaches_the_store_file(tmp_path):
    path = tmp_path / "router.sqlite3"
    store = KeyStore(path)
    key_id, key = store.create("canary", "admin")
    secret = parse_key(key)[1]
    assert store.scope_of(key, time.time(), None) == "admin"
    store.flush_last_used(time.time())
    store.revoke(store.create("other", "use")[0])

    def file_bytes() -> bytes:
        return b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("router.sqlite3"))

    def assert_only_the_hash(blob: bytes) -> None:
        assert secret.encode() not in blob
        assert key.encode() not in blob
        assert hash_secret(secret).encode() in blob

    assert_only_the_hash(file_bytes())  # the file and its WAL, while open
    store.close()
    assert_only_the_hash(file_bytes())  # checkpointed into the file


def test_an_unusable_folder_is_a_config_error_not_corruption(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot create store"):
        db.connect(blocker / "router.sqlite3")  # the folder is a file: not corruption
