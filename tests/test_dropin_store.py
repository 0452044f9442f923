"""The store both ways, against real hugpy-router 0.0.4 (tests/dropin.py): a 0.0.4 user's
world (boxes file, store with use, admin and revoked keys, route rows) swapped to this router
with nothing else changed keeps its fleet, keys and rows; rolled back to 0.0.4, it serves
again, this router's rows included."""

from __future__ import annotations

import pytest

from conftest import wait_for
from dropin import CHAT, NEW, OLD, Served, cli, require_004, user_env
from router.store import db

BOX_KEY = "hpk_box_simulatedboxkey0123456789"
ADMIN_KEY = "hpk_box_routeradminkey0123456789"


@pytest.fixture
def world(tmp_path):
    """A 0.0.4 user's world: its boxes file and store, made by 0.0.4 itself."""
    from router.sim import SimBox, SimFleet

    require_004()
    box = SimBox("ae", key=BOX_KEY, catalog=["tiny-llama"], residents=["tiny-llama"])
    fleet = SimFleet([box])
    fleet.start()
    env = user_env(tmp_path / "home", HUGPY_ROUTER_KEY=ADMIN_KEY, HUGPY_ROUTER_REQUIRE_KEY="always")
    cli(OLD, env, "boxes", "add", "--name", "ae", "--url", box.url, "--key", BOX_KEY)
    old = Served(OLD, env, tmp_path / "old.log")
    try:
        keys = {}
        for name, scope in (("laptop", "use"), ("ops", "admin"), ("gone", "use")):
            status, made = old.call("POST", "/v1/keys", {"name": name, "scope": scope}, key=ADMIN_KEY)
            assert status == 201
            keys[name] = made
        assert old.call("POST", f"/v1/keys/{keys['gone']['id']}/revoke", {}, key=ADMIN_KEY)[0] == 200
        assert old.chat(keys["laptop"]["key"])[0] == 200
        assert old.call("POST", "/v1/chat/completions", {**CHAT, "model": "nope"},
                        key=keys["laptop"]["key"])[0] == 503
        status, logged = old.call("GET", "/v1/telemetry", key=ADMIN_KEY)
        assert status == 200 and len(logged["rows"]) == 2
    finally:
        assert old.stop() in (0, -15)
    yield {"env": env, "keys": keys, "rows": logged["rows"], "box": box, "tmp": tmp_path}
    fleet.stop()


def test_swap_keeps_fleet_keys_and_rows_then_roll_back_serves_again(world):
    env, keys, tmp = world["env"], world["keys"], world["tmp"]
    store = tmp / "home" / ".local" / "share" / "hugpy" / "router" / "router.sqlite3"
    conn = db.connect(store)
    assert conn.pragma("user_version") == 1  # 0.0.4's store, as 0.0.4 left it
    conn.close()

    new = Served(NEW, env, tmp / "new.log")
    try:
        use, admin, gone = keys["laptop"]["key"], keys["ops"]["key"], keys["gone"]["key"]
        status, answer = new.chat(use)
        assert status == 200, answer
        assert new.call("POST", "/v1/chat/completions", CHAT, key=gone)[0] == 401
        status, listed = new.call("GET", "/v1/keys?all=1", key=admin)
        assert status == 200
        by_id = {k["id"]: k for k in listed["keys"]}
        assert by_id[keys["gone"]["id"]]["revoked_at"] is not None
        assert by_id[keys["laptop"]["id"]]["revoked_at"] is None
        status, box_list = new.call("GET", "/v1/boxes", key=ADMIN_KEY)
        assert [b["name"] for b in box_list["boxes"]] == ["ae"]
        old_rows = {r["request_id"]: r for r in world["rows"]}
        logged = wait_for(lambda: (lambda doc: doc if len(doc["rows"]) > len(old_rows) else None)(
            new.call("GET", "/v1/telemetry", key=admin)[1]), timeout=5)  # the writer's batch window
        assert logged is not None
        got = {r["request_id"]: r for r in logged["rows"]}
        for request_id, row in old_rows.items():  # 0.0.4's rows, every field as 0.0.4 wrote it
            assert {k: got[request_id][k] for k in row} == row
        mine = [r for r in logged["rows"] if r["request_id"] not in old_rows]
        assert [(r["state"], r["box"], r["http_status"]) for r in mine] == [("done", "ae", 200)]
    finally:
        assert new.stop() == 0
    conn = db.connect(store)
    assert conn.pragma("user_version") == len(db.migrations())
    conn.close()

    rolled_back = Served(OLD, env, tmp / "old-again.log")
    try:
        assert rolled_back.chat(keys["laptop"]["key"])[0] == 200
        assert rolled_back.call("POST", "/v1/chat/completions", CHAT, key=keys["gone"]["key"])[0] == 401
        status, logged = rolled_back.call("GET", "/v1/telemetry", key=ADMIN_KEY)
        assert status == 200 and len(logged["rows"]) == 4
        assert [r["state"] for r in logged["rows"]] == ["done", "refused", "done", "done"]
        status, made = rolled_back.call("POST", "/v1/keys", {"name": "after"}, key=ADMIN_KEY)
        assert status == 201
    finally:
        rolled_back.stop()
    again = Served(NEW, env, tmp / "new-again.log")  # and forward once more: nothing to migrate
    try:
        assert again.chat(made["key"])[0] == 200
    finally:
        assert again.stop() == 0


def test_a_0_0_4_store_named_by_state_directory_is_migrated(world, tmp_path):
    """systemd's StateDirectory (what 0.0.4's unit sets) names the same store."""
    store_dir = tmp_path / "home" / ".local" / "share" / "hugpy" / "router"
    env = {**world["env"], "STATE_DIRECTORY": str(store_dir)}
    new = Served(NEW, env, tmp_path / "state-dir.log")
    try:
        assert new.chat(world["keys"]["laptop"]["key"])[0] == 200
    finally:
        assert new.stop() == 0
