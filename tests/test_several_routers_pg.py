"""Several routers on one PostgreSQL store, end to end (docs/several-routers.md): real router
processes, a real throw-away cluster (tests/engines.py), simulated boxes. A change made on one
router is live on the other within a second; one route log holds both routers' rows; a
PostgreSQL outage stops no call and loses no row below the bound."""

from __future__ import annotations

import json
import time

import psycopg
import pytest

from router.sim import SimFleet, SimOllama

from conftest import RouterProcess, wait_for
from support.calls import admin, call, get_json, request

pytestmark = pytest.mark.timeout(120)

LIVE_S = 1.0  # issue 23: a change is live on every router within a second


def start_routers(tmp_path, url: str, count: int = 2, env: dict | None = None) -> list[RouterProcess]:
    routers = []
    for n in range(count):
        folder = tmp_path / f"r{n}"
        folder.mkdir()
        boxes = folder / "boxes.json"
        boxes.write_text('{"boxes": []}')  # not read: the boxes live in the database
        routers.append(RouterProcess(boxes, "--database-url", url, "--instance", f"r{n}", env=env))
    return routers


@pytest.fixture
def fleet():
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    sims = SimFleet([box])
    sims.start()
    yield box
    sims.stop()


@pytest.fixture
def routers(tmp_path, pg_url):
    started = start_routers(tmp_path, pg_url, env={"HUGPY_ROUTER_REQUIRE_KEY": "1"})
    yield started
    for router in started:
        router.stop()


def live_within(predicate, limit_s: float = LIVE_S) -> float:
    """How long until `predicate` held (fails past the limit, with a margin for a loaded machine)."""
    start = time.monotonic()
    assert wait_for(predicate, timeout=limit_s + 2.0, interval=0.02), "never became live"
    return time.monotonic() - start


def box_names(router) -> dict:
    return {box["name"]: box for box in get_json(router, "/v1/boxes")["boxes"]}


def test_a_box_added_blocked_and_removed_on_one_router_is_live_on_the_other(routers, fleet):
    a, b = routers
    status, doc = admin(a, "POST", "/v1/boxes", {"name": "o", "url": fleet.url, "kind": "ollama"})
    assert status == 201, doc
    took = [live_within(lambda: "o" in box_names(b))]
    assert admin(a, "POST", "/v1/boxes/o/block")[0] == 200
    took.append(live_within(lambda: box_names(b)["o"].get("blocked")))
    assert admin(b, "PUT", "/v1/aliases/fast", {"chain": ["tiny"]})[0] == 201  # the other way round
    took.append(live_within(lambda: [x["name"] for x in get_json(a, "/v1/aliases")["aliases"]] == ["fast"]))
    assert admin(a, "DELETE", "/v1/boxes/o")[0] == 200
    took.append(live_within(lambda: "o" not in box_names(b)))
    assert max(took) < LIVE_S + 1.0, took


def test_a_key_made_limited_and_revoked_on_one_router_holds_on_the_other(routers, fleet):
    a, b = routers
    assert admin(a, "POST", "/v1/boxes", {"name": "o", "url": fleet.url, "kind": "ollama"})[0] == 201
    wait_for(lambda: "o" in box_names(b))
    status, _, body = request(a, "POST", "/v1/keys", {"name": "team"})
    key_id, key = json.loads(body)["id"], json.loads(body)["key"]
    auth = {"Authorization": f"Bearer {key}"}
    took = [live_within(lambda: call(b, headers=auth)[0] == 200)]
    assert admin(a, "PUT", f"/v1/keys/{key_id}/limits", {"rpm": 50})[0] == 200
    took.append(live_within(lambda: call(b, headers=auth)[1].get("x-ratelimit-limit-requests") == "50"))
    assert admin(a, "POST", f"/v1/keys/{key_id}/revoke")[0] == 200
    took.append(live_within(lambda: call(b, headers=auth)[0] == 401))
    assert max(took) < LIVE_S + 1.0, took


def test_one_route_log_holds_both_routers_rows(routers, fleet, pg_url):
    a, b = routers
    assert admin(a, "POST", "/v1/boxes", {"name": "o", "url": fleet.url, "kind": "ollama"})[0] == 200 + 1
    wait_for(lambda: "o" in box_names(b))
    status, _, body = request(a, "POST", "/v1/keys", {"name": "team"})
    auth = {"Authorization": f"Bearer {json.loads(body)['key']}"}
    wait_for(lambda: call(b, headers=auth)[0] == 200)  # b knows the key
    for router in (a, b, a, b, a):
        assert call(router, headers=auth)[0] == 200
    def counted():
        with psycopg.connect(pg_url) as conn:
            return dict(conn.execute("SELECT router, count(*) FROM route_log GROUP BY router").fetchall())
    assert wait_for(lambda: counted().get("r0") == 3 and counted().get("r1", 0) >= 2)
    tail = get_json(b, "/v1/telemetry?tail=50")["rows"]  # either router reads the one log
    assert {row["router"] for row in tail} == {"r0", "r1"}
    state = get_json(a, "/v1/router/state")["database"]
    assert state["engine"] == "postgresql" and state["up"] is True


def test_routers_starting_together_on_a_new_database_migrate_it_once(tmp_path, pg_url):
    """router/store/pg/conn.py rule 2, with real routers: three start at once on an empty database."""
    import concurrent.futures

    folders = []
    for n in range(3):
        folder = tmp_path / f"r{n}"
        folder.mkdir()
        (folder / "boxes.json").write_text('{"boxes": []}')
        folders.append(folder / "boxes.json")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        started = list(pool.map(lambda path: RouterProcess(path, "--database-url", pg_url), folders))
    try:
        assert wait_for(lambda: all(get_json(r, "/v1/router/state")["database"]["up"] for r in started))
        with psycopg.connect(pg_url) as conn:
            applied = conn.execute("SELECT version, count(*) FROM schema_migrations GROUP BY version").fetchall()
        assert applied and all(count == 1 for _, count in applied)
    finally:
        for router in started:
            router.stop()


def test_a_box_naming_a_peer_router_is_refused_and_never_freezes_the_registry(routers, fleet, pg_url):
    """Issue 36 item 4 (listeners.py rules 4-5, fleet.py rule 4, pg_registry.py rule 5): a box
    that is another router on the database is refused by any router; one written behind their
    backs, or bad on this machine only, is skipped and said, and the rest of the registry applies."""
    a, b = routers
    status, doc = admin(a, "POST", "/v1/boxes", {"name": "loop", "url": b.url, "kind": "ollama"})
    assert (status, doc["error"]["code"]) == (400, "invalid_box"), doc
    assert "router r1's listener" in doc["error"]["message"]
    with psycopg.connect(pg_url, autocommit=True) as conn:  # psql, or a router that did not know r1 yet
        conn.execute("INSERT INTO boxes (name, position, doc) VALUES ('loop', 0, %s), ('bad', 1, %s)",
                     (json.dumps({"name": "loop", "url": b.url, "kind": "ollama"}),
                      json.dumps({"name": "bad", "url": "http://127.0.0.1:99999"})))
    assert admin(a, "POST", "/v1/boxes", {"name": "o", "url": fleet.url, "kind": "ollama"})[0] == 201
    live_within(lambda: "o" in box_names(b))  # the rest applies on r1, where `loop` is its own listener
    assert "loop" not in box_names(b) and set(box_names(a)) == {"loop", "o"}
    skipped = sorted(get_json(b, "/v1/router/state")["registry"]["skipped"], key=lambda line: "box bad" in line)
    assert "box loop: url" in skipped[0] and "box bad: url port must be 1-65535" in skipped[1]
    assert "boxes registry in postgresql://" in skipped[1]  # the URL as it is, never `postgresql:/`
    text = b.log_text()
    assert "box loop: url" in text and "skipped, the rest applies" in text
    assert text.count("box bad: url port") == 1  # said once while it stays
