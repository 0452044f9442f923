"""A PostgreSQL outage never stops calls (issue 23 item 3; router/store/pg/route_log.py rules
2-4, listen.py rule 3): keys, boxes and aliases are served from the last copy, route-log rows
are held, then spilled, then counted as dropped, and written when the database is back. Each
test has a cluster of its own (it stops it)."""

from __future__ import annotations

import json

import orjson
import psycopg
import pytest

from router.sim import SimFleet, SimOllama
from router.store import engines
from router.store.pg import route_log as pg_route_log
from router.store.route_log import Row

from conftest import RouterProcess, wait_for
from engines import PostgresServer
from support.calls import admin, call, get_json, request

pytestmark = pytest.mark.timeout(150)
ADMIN_KEY = "outage-admin-key"


@pytest.fixture
def own_cluster():
    server = PostgresServer()
    yield server
    server.close()


def logged(url: str) -> int:
    with psycopg.connect(url, connect_timeout=2) as conn:
        return conn.execute("SELECT count(*) FROM route_log").fetchone()[0]


def _row(i: int) -> Row:
    return Row(request_id=f"c{i:05d}", state="done", model="m", box="a", received_at=1000.0,
               responded_at=1000.5, key_id="k", prompt_tokens=1, completion_tokens=1)


def test_rows_are_held_then_spilled_then_counted_and_none_below_the_bound_is_lost(own_cluster, tmp_path, monkeypatch):
    """Rules 2-4, with small bounds: 10 held, 20 spilled, the rest dropped and counted; the held
    and spilled rows are all written once the database is back, the usage with them."""
    url = own_cluster.database("outage")
    engines.open_database(url)
    line = len(orjson.dumps(pg_route_log.base.row_values(_row(0), "r0"))) + 1
    monkeypatch.setattr(pg_route_log, "MAX_HELD_ROWS", 10)
    monkeypatch.setattr(pg_route_log, "SPILL_MAX_BYTES", 20 * line)
    writer = engines.route_log(tmp_path / "router.sqlite3", url, instance="r0")
    writer.start()
    writer.record(_row(0))
    assert wait_for(lambda: writer.written == 1)
    own_cluster.stop()
    for i in range(1, 41):
        writer.record(_row(i))
    assert wait_for(lambda: writer.parked == 30 and writer.outage_dropped == 10, timeout=10)
    assert len(writer.spill_path.read_bytes().splitlines()) == 20
    own_cluster.start()
    assert wait_for(lambda: writer.parked == 0, timeout=15)
    writer.stop()
    assert (writer.written, writer.dropped, writer.outage_dropped) == (31, 10, 10)
    assert not writer.spill_path.exists()
    assert logged(url) == 31
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT requests FROM key_usage").fetchone() == (31,)


def test_a_writer_stopped_during_an_outage_spills_and_the_next_start_flushes(own_cluster, tmp_path):
    url = own_cluster.database("restart")
    engines.open_database(url)
    writer = engines.route_log(tmp_path / "router.sqlite3", url)
    writer.start()
    own_cluster.stop()
    for i in range(5):
        writer.record(_row(i))
    assert wait_for(lambda: writer.parked == 5, timeout=10)
    writer.stop()
    assert len(writer.spill_path.read_bytes().splitlines()) == 5
    own_cluster.start()
    again = engines.route_log(tmp_path / "router.sqlite3", url)
    again.start()  # its thread may flush the spill at once: the outcome is what is checked
    again.record(_row(99))
    assert wait_for(lambda: again.written == 6, timeout=10)
    again.stop()
    assert not again.spill_path.exists()
    assert logged(url) == 6


def test_a_router_serves_every_call_through_a_postgresql_restart_and_loses_no_row(own_cluster, tmp_path):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    sims = SimFleet([box])
    sims.start()
    url = own_cluster.database("routers")
    boxes = tmp_path / "boxes.json"
    boxes.write_text('{"boxes": []}')
    router = RouterProcess(boxes, "--database-url", url, "--instance", "r0",
                           env={"HUGPY_ROUTER_REQUIRE_KEY": "1", "HUGPY_ROUTER_KEY": ADMIN_KEY})
    try:
        assert admin(router, "POST", "/v1/boxes", {"name": "o", "url": box.url, "kind": "ollama"})[0] == 201
        status, _, body = request(router, "POST", "/v1/keys", {"name": "team"})
        auth = {"Authorization": f"Bearer {json.loads(body)['key']}"}
        assert [call(router, headers=auth)[0] for _ in range(5)] == [200] * 5
        assert wait_for(lambda: logged(url) == 5)
        own_cluster.stop()
        assert wait_for(lambda: get_json(router, "/v1/router/state")["database"]["up"] is False, timeout=10)
        assert [call(router, headers=auth, timeout=10)[0] for _ in range(20)] == [200] * 20
        # Edits refuse, loudly and quickly; calls go on (docs/several-routers.md).
        status, doc = admin(router, "POST", "/v1/keys", {"name": "later"})
        assert (status, doc["error"]["code"]) == (503, "store_unavailable")
        status, doc = admin(router, "POST", "/v1/boxes", {"name": "p", "url": box.url, "kind": "ollama"})
        assert status == 503, doc
        metrics = request(router, "GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})[2].decode()
        assert "router_database_up 0.0" in metrics
        own_cluster.start()
        assert wait_for(lambda: get_json(router, "/v1/router/state")["database"]["up"] is True, timeout=15)
        assert wait_for(lambda: logged(url) == 25, timeout=15)
        state = get_json(router, "/v1/router/state")["database"]
        assert (state["route_log_parked"], state["route_log_dropped_while_down"]) == (0, 0)
        assert "unreachable" in router.log_text()
    finally:
        router.stop()
        sims.stop()
