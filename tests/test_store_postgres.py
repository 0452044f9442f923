"""The store on PostgreSQL (router/store/pg, router/store/engines.py): migrations under their
advisory lock, keys, the route log and the boxes registry on a real throw-away cluster
(tests/engines.py). Each test names the docstring rule it pins."""

from __future__ import annotations

import json
import multiprocessing
import time

import psycopg
import pytest

from router.boxes import aliases as box_aliases
from router.boxes.config import BoxConfig, UnknownBox
from router.core.errors import BadRequest, ConfigError
from router.core.types import BoxKind
from router.store import engines
from router.store.pg import conn as pg
from router.boxes.pg_registry import PgRegistry
from router.store.route_log import Row, row_values, usage_by_day

from conftest import wait_for


def _migrate(url: str) -> int:
    return pg.migrate(url)


def test_migrations_racing_at_start_apply_each_step_once(pg_url):
    """conn.py rule 2: six processes migrating one new database at once."""
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        versions = pool.map(_migrate, [pg_url] * 6)
    latest = pg.migrations()[-1][0]
    assert versions == [latest] * 6
    with psycopg.connect(pg_url) as conn:
        applied = conn.execute("SELECT version, count(*) FROM schema_migrations GROUP BY version ORDER BY version").fetchall()
    assert applied == [(v, 1) for v in range(1, latest + 1)]


def test_a_database_newer_than_the_code_is_refused(pg_url):
    pg.migrate(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("INSERT INTO schema_migrations (version, name) VALUES (999, 'future')")
    with pytest.raises(ConfigError, match="newer than this router"):
        pg.migrate(pg_url)


def test_a_url_is_shown_without_its_password():
    assert pg.shown("postgresql://u:secret@db:5432/x") == "postgresql://u:***@db:5432/x"
    with pytest.raises(ConfigError):
        pg.check_url("mysql://db/x")


@pytest.fixture
def pg_keys(pg_url, tmp_path):
    engines.open_database(pg_url)
    store = engines.keys(tmp_path / "router.sqlite3", pg_url)
    yield store
    store.close()


def test_keys_live_in_the_database(pg_keys, pg_url, tmp_path):
    """keys.py rules 1-7 on the PostgreSQL engine; a second store (another router) sees them."""
    key_id, key = pg_keys.create("ci", "use", limits={"rpm": 5, "models": ["m1"]})
    assert pg_keys.scope_of(key, time.time(), None) == "use"
    assert pg_keys.limits_of(key_id).rpm == 5
    with pytest.raises(BadRequest):
        pg_keys.create("bad", "root")
    other = engines.keys(tmp_path / "other.sqlite3", pg_url)
    try:
        assert other.scope_of(key, time.time(), None) == "use"
        assert other.set_limits(key_id, {"rpm": 9}).rpm == 9
        assert other.set_priority(key_id, "high")
        assert other.revoke(key_id) and not other.revoke("nope")
    finally:
        other.close()
    pg_keys._checked_mono = float("-inf")
    assert pg_keys.refresh_if_changed()  # the `keys` version moved (rule 3)
    assert pg_keys.scope_of(key, time.time(), None) is None
    assert pg_keys.limits_of(key_id).rpm == 9
    assert [row["id"] for row in pg_keys.list(include_revoked=True)] == [key_id]
    # A key's last use is not a change other routers reload for (schema 0001).
    with psycopg.connect(pg_url, autocommit=True) as conn:
        before = conn.execute("SELECT version FROM store_versions WHERE topic = 'keys'").fetchone()[0]
        conn.execute("UPDATE api_keys SET last_used_at = 1")
        after = conn.execute("SELECT version FROM store_versions WHERE topic = 'keys'").fetchone()[0]
    assert before == after


def test_every_limit_the_rules_allow_fits_the_database(pg_keys):
    """A limit is any count up to router.core.limits.MAX_COUNT (10**12), as in the SQLite store."""
    from router.core.limits import MAX_COUNT

    every = {"rpm": MAX_COUNT, "tpm": MAX_COUNT, "max_parallel": MAX_COUNT, "budget_tokens": MAX_COUNT}
    key_id, _ = pg_keys.create("big", "use", limits=every)
    limits = pg_keys.limits_of(key_id)
    assert (limits.rpm, limits.tpm, limits.max_parallel, limits.budget_tokens) == (MAX_COUNT,) * 4


def test_keys_are_served_from_the_last_copy_while_the_database_is_down(pg_keys, pg_url):
    """keys.py rule 4 / pg/keys.py rule 4: an unreadable database keeps the map."""
    key_id, key = pg_keys.create("ci", "use")
    pg_keys._db.session.url = "postgresql://postgres@127.0.0.1:1/none"  # unreachable from now on
    pg_keys._db.session._conn.close()
    pg_keys._checked_mono = float("-inf")
    pg_keys.refresh_if_changed()
    pg_keys.reload()
    assert pg_keys.scope_of(key, time.time(), None) == "use"


def _row(i: int, **extra) -> Row:
    fields = dict(request_id=f"c{i}", state="done", facade="openai", model="m", box="a",
                  decision={"ranked": [["a", "serving"]]}, attempts=[{"box": "a", "status": 200}],
                  received_at=1000.0 + i, responded_at=1000.5 + i, http_status=200)
    return Row(**{**fields, **extra})


def test_the_route_log_is_written_in_batches_with_the_router_column(pg_url, tmp_path):
    """route_log.py rules 1, 13, 14 on PostgreSQL (pg/route_log.py rule 1)."""
    engines.open_database(pg_url)
    writer = engines.route_log(tmp_path / "router.sqlite3", pg_url, instance="r1")
    writer.start()
    for i in range(600):
        writer.record(_row(i, key_id="k1" if i % 2 else None, prompt_tokens=3, completion_tokens=4))
    writer.record(_row(1))  # a duplicate: dropped alone
    writer.record(Row("bad-state", "exploded", received_at=1.0))  # the table's CHECK: dropped alone
    writer.record(_row(600, model="a\x00b"))  # a NUL PostgreSQL's text cannot hold: kept (rule 1)
    writer.stop()
    assert (writer.written, writer.dropped) == (601, 2)
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*), min(router), max(router) FROM route_log").fetchone() == (601, "r1", "r1")
        assert conn.execute("SELECT model FROM route_log WHERE request_id = 'c600'").fetchone() == ("a\ufffdb",)
        assert conn.execute("SELECT sum(requests), sum(prompt_tokens) FROM key_usage").fetchone() == (300, 900)
    page = writer.read(tail=2)
    assert [r["request_id"] for r in page["rows"]] == ["c599", "c600"]
    assert page["rows"][0]["decision"] == {"ranked": [["a", "serving"]]}
    assert writer.read(since=page["rows"][0]["id"], limit=5)["rows"][0]["request_id"] == "c600"


def test_retention_prunes_on_exactly_one_router(pg_url, tmp_path, monkeypatch):
    """pg/route_log.py rule 5: two writers, one lease."""
    engines.open_database(pg_url)
    writers = [engines.route_log(tmp_path / f"r{n}.sqlite3", pg_url, 3600.0, f"r{n}") for n in (1, 2)]
    for writer in writers:
        writer._open()
    try:
        writers[1]._commit([row_values(_row(i), "r2") for i in range(3)])  # received long ago
        firsts = [writer._prune(time.time()) for writer in writers]
        assert [w._prune_lease for w in writers] == [True, False]
        assert [w.pruned for w in writers] == [3, 0]  # only the holder pruned
        writers[0]._conn.close()  # the holder's session ends: its lease with it (soon after, server side)
        assert wait_for(lambda: writers[1]._prune(time.time()) is False and writers[1]._prune_lease)
        assert firsts == [False, False]
    finally:
        for writer in writers:
            writer._close()


def test_the_registry_holds_boxes_and_aliases_validated_as_the_file(pg_url):
    """pg/registry.py rules 1-3."""
    engines.open_database(pg_url)
    registry = PgRegistry(pg_url)
    assert registry.stamp() == 0 and registry.load().boxes == []
    box = BoxConfig("a", "http://127.0.0.1:9", BoxKind.OLLAMA, key="k")
    assert registry.edit(lambda boxes: boxes.put(box)) is True
    registry.edit(lambda boxes: box_aliases.set_alias(boxes, "fast", ["llama3"]))
    registry.edit(lambda boxes: boxes.update("a", blocked=True))
    loaded = registry.load()
    assert loaded.boxes == [BoxConfig("a", "http://127.0.0.1:9", BoxKind.OLLAMA, key="k", blocked=True)]
    assert list(loaded.aliases) == ["fast"]
    stamp = registry.stamp()
    assert stamp > 0
    with pytest.raises(ConfigError):  # the file's validator: a bad url writes nothing
        registry.edit(lambda boxes: boxes.put(BoxConfig("b", "ftp://x")))
    with pytest.raises(UnknownBox):
        registry.edit(lambda boxes: boxes.remove("zz"))
    assert [b.name for b in registry.load().boxes] == ["a"]
    assert registry.stamp() == stamp  # a failed edit wrote nothing
    registry.session.url = "postgresql://postgres@127.0.0.1:1/none"
    registry.session._conn.close()
    assert registry.stamp() == stamp  # down: the last stamp, so the fleet keeps its copy


def _table(conn, sql: str) -> list[tuple]:
    return [tuple(row) for row in conn.execute(sql)]


def test_export_and_import_round_trip_through_the_cli(pg_url, tmp_path, monkeypatch, capsys):
    """pg/transfer.py rules 1-3 and cli/store.py rules 1-2: a single router's store into
    PostgreSQL, the commands on it, and back into fresh files, equal to the first."""
    from router.boxes import config as boxes_config
    from router.cli.main import main
    from router.store import db
    from router.store.batches import BatchStore
    from router.store.pg.transfer import ORDER, TABLES
    from router.store.route_log import RouteLogWriter

    monkeypatch.delenv(engines.ENV, raising=False)
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    store = engines.keys(first / "router.sqlite3", None)
    key_id, key = store.create("team", "use", limits={"rpm": 7, "budget_tokens": 900})
    store.close()
    writer = RouteLogWriter(first / "router.sqlite3", instance="solo")
    writer.start()
    for i in range(30):
        writer.record(_row(i, key_id=key_id, prompt_tokens=2, completion_tokens=3))
    writer.stop()
    batches = BatchStore(first / "router.sqlite3")  # a batch, its input file and its line move too
    upload = batches.put_file(key_id, "batch", "in.jsonl", b'{"custom_id": "q-1"}\n', 1.0)
    made = batches.create(key_id, "/v1/chat/completions", upload.id, "24h", 86400.0, None, 1.0)
    batches.validated(made.id, [(1, "q-1", b'{"model": "m"}')], None, 1.0)
    batches.close()
    boxes_config.edit(first / "boxes.json", lambda f: (
        f.put(BoxConfig("a", "http://127.0.0.1:9", BoxKind.OLLAMA, key="box-key", max_inflight=2)),
        box_aliases.set_alias(f, "fast", ["tiny", "llama3"])))

    assert main(["store", "export", "--to", pg_url, "--store", str(first / "router.sqlite3"),
                 "--boxes-file", str(first / "boxes.json")]) == 0
    assert capsys.readouterr().out.split() == ["api_keys=1", "key_usage=1", "route_log=30", "batch_files=1", "batches=1",
                                               "batch_lines=1", "boxes=1", "aliases=1"]
    assert main(["store", "export", "--to", pg_url, "--store", str(first / "router.sqlite3"),
                 "--boxes-file", str(first / "boxes.json")]) == 2  # never merges
    assert "is not empty" in capsys.readouterr().err

    # The commands work on the database (cli/store.py rule 1).
    assert main(["keys", "--database-url", pg_url, "list", "--json"]) == 0
    assert key_id in capsys.readouterr().out
    assert main(["log", "--database-url", pg_url, "--tail", "3", "--json"]) == 0
    assert [json.loads(line)["router"] for line in capsys.readouterr().out.splitlines()] == ["solo"] * 3
    assert main(["boxes", "--database-url", pg_url, "block", "a"]) == 0
    assert main(["boxes", "--database-url", pg_url, "unblock", "a"]) == 0
    assert main(["aliases", "--database-url", pg_url, "list"]) == 0
    assert "fast\ttiny -> llama3" in capsys.readouterr().out
    with psycopg.connect(pg_url, autocommit=True) as conn:  # the identity moved past the copied ids
        conn.execute("INSERT INTO route_log (request_id, received_at) VALUES ('new', 1)")
        assert conn.execute("SELECT id FROM route_log WHERE request_id = 'new'").fetchone()[0] > 30
        conn.execute("DELETE FROM route_log WHERE request_id = 'new'")

    assert main(["store", "import", "--from", pg_url, "--store", str(second / "router.sqlite3"),
                 "--boxes-file", str(second / "boxes.json")]) == 0
    a, b = db.open_store(first / "router.sqlite3"), db.open_store(second / "router.sqlite3")
    for table, columns in TABLES.items():
        sql = f"SELECT {', '.join(columns)} FROM {table} ORDER BY {ORDER[table]}"
        assert _table(a, sql) == _table(b, sql), table
    a.close(), b.close()
    assert boxes_config.load(second / "boxes.json").boxes == boxes_config.load(first / "boxes.json").boxes
    assert boxes_config.load(second / "boxes.json").aliases == boxes_config.load(first / "boxes.json").aliases
    back = engines.keys(second / "router.sqlite3", None)
    assert back.scope_of(key, time.time(), None) == "use" and back.limits_of(key_id).rpm == 7
    back.close()


def test_key_usage_increments_go_in_one_order_whatever_the_batch_order():
    """route_log.py rule 13: by key id then day, so two writers lock key_usage rows alike."""
    rows = [_row(1, key_id="k2", responded_at=3 * 86_400.0), _row(2, key_id="k1", responded_at=5 * 86_400.0),
            _row(3, key_id="k2", responded_at=2 * 86_400.0), _row(4, key_id="k1", responded_at=1 * 86_400.0)]
    assert [(key, day) for key, day, *_ in usage_by_day(rows)] == [("k1", 1), ("k1", 5), ("k2", 2), ("k2", 3)]


def test_a_batch_that_loses_a_deadlock_is_written_again_not_parked(pg_url, tmp_path, caplog):
    """pg/route_log.py rule 2: a deadlock is tried again, never said as the database down."""
    import threading

    engines.open_database(pg_url)
    writer = engines.route_log(tmp_path / "r1.sqlite3", pg_url, instance="r1")
    writer._open()
    other = psycopg.connect(pg_url)  # another writer, in a transaction of its own
    try:
        writer._write([(time.monotonic(), _row(i, key_id=key)) for i, key in enumerate(("k1", "k2"))])
        other.execute("SET deadlock_timeout = '30s'")  # this writer's check (1 s) finds the cycle
        other.execute("UPDATE key_usage SET requests = requests + 10 WHERE key_id = 'k2'")
        batch = [(time.monotonic(), _row(i, key_id=key)) for i, key in ((2, "k1"), (3, "k2"))]
        writing = threading.Thread(target=writer._write, args=(batch,))
        writing.start()  # locks k1, then waits for k2
        assert wait_for(lambda: other.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'").fetchone()[0], 5)
        other.execute("UPDATE key_usage SET requests = requests + 10 WHERE key_id = 'k1'")  # the cycle
        other.commit()
        writing.join(10)
        assert (writer.written, writer.parked) == (4, 0)
        assert "unreachable" not in caplog.text
        with psycopg.connect(pg_url) as conn:
            assert _table(conn, "SELECT key_id, requests FROM key_usage ORDER BY key_id") == [("k1", 12), ("k2", 12)]
    finally:
        other.close()
        writer._close()
