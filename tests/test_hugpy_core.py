"""hugpy-core through the router (issue 26), end to end with simulated hugpy boxes: each box's own
pair settings, blocks and verdicts (contracts/hugpy-wrapper.md §11), the relay's management
paths and the fleet views."""

from __future__ import annotations

import http.client
import json

import pytest

from router.boxes import verdicts as verdict_reader
from router.serve import admin
from router.sim import SimBox

from conftest import wait_for

KEY = "hpk_box_corekey0000000000000000"


@pytest.fixture(autouse=True)
def quick_verdicts(monkeypatch):
    """The box coalesces settings writes for 1 s before pricing; the sim prices at once."""
    monkeypatch.setattr(verdict_reader, "SETTLE_S", 0.05)
    monkeypatch.setattr(verdict_reader, "NO_ROW_GRACE_S", 1.0)


def request(router, method: str, path: str, doc=None, headers: dict | None = None):
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=None if doc is None else json.dumps(doc),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


LAST_CALL: dict = {}


def chat(router, model: str = "tiny", headers: dict | None = None, knobs: dict | None = None):
    doc = {"model": model, "messages": [{"role": "user", "content": "x"}], **({} if knobs is None else {"knobs": knobs})}
    status, head, body = request(router, "POST", "/v1/chat/completions", doc, headers)
    LAST_CALL[router] = head.get("x-hugpy-router-request-id")
    return status, head, body


def served_by(router, model: str = "tiny", headers: dict | None = None, knobs: dict | None = None) -> str:
    status, head, body = chat(router, model, headers, knobs)
    assert status == 200, body
    return head["x-hugpy-box"]


def state(router) -> dict:
    return {b["name"]: b for b in json.loads(request(router, "GET", "/v1/router/state")[2])["boxes"]}


def resident(router, box: str, key: str = "tiny") -> bool:
    return any(r["key"] == key and r["state"] == "idle" for r in state(router)[box]["residents"])


def last_decision(router) -> dict:
    """The route log's decision for the router's last call (rows are written in batches)."""
    def row():
        rows = json.loads(request(router, "GET", "/v1/telemetry?since=0&limit=5000")[2])["rows"]
        return next((r for r in rows if r["request_id"] == LAST_CALL[router]), None)
    return wait_for(row)["decision"]


def test_a_blocked_pair_is_skipped_while_the_box_serves_other_models(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny", "other"])
    b = SimBox("b", key=KEY, catalog=["tiny"])
    a.set_pair("tiny", blocked="operator")
    router = start_fleet_in_process(a, b)
    assert {served_by(router) for _ in range(4)} == {"b"}
    assert served_by(router, "other") == "a"  # the box still serves its other models
    assert last_decision(router)["refused"] == {"b": "no_model: other"}
    assert state(router)["a"]["blocked_models"] == {"tiny": "tiny"}
    # both blocked: a no_box answer that says why, in the body and the route log
    b.set_pair("tiny", blocked=True)
    wait_for(lambda: state(router)["b"]["blocked_models"] == {"tiny": "tiny"})
    status, _, body = chat(router)
    assert status == 503
    reasons = json.loads(body)["error"]["reasons"]
    assert reasons == {"a": "blocked_pair: tiny", "b": "blocked_pair: tiny"}
    assert last_decision(router)["refused"] == reasons
    assert not [c for c in a.calls + b.calls if c.model == "tiny"][4:]  # the 503 reached no box
    # a call cannot clear a block: its options are knobs, and `blocked` is not one it can set
    assert chat(router, "tiny@ram-only")[0] == 503


def test_a_blanket_block_leaves_the_box_out_for_every_model(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny", "other"])
    b = SimBox("b", key=KEY, catalog=["tiny"])
    router = start_fleet_in_process(a, b)
    a.set_pair("*", blocked="maintenance")
    wait_for(lambda: state(router)["a"]["blanket_blocked"])
    assert {served_by(router) for _ in range(3)} == {"b"}
    status, _, body = chat(router, "other")
    assert status == 503 and json.loads(body)["error"]["reasons"]["a"] == "blocked_pair: *"
    a.set_pair("*", blocked=None)  # a null removes the key (§11.2.3)
    wait_for(lambda: not state(router)["a"]["blanket_blocked"])
    assert served_by(router, "other") == "a"


def test_a_pin_to_a_blocked_pair_is_refused(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny"])
    b = SimBox("b", key=KEY, catalog=["tiny"])
    a.set_pair("tiny", blocked=True)
    router = start_fleet_in_process(a, b)
    status, _, body = chat(router, headers={"X-Router-Box": "a"})
    error = json.loads(body)["error"]
    assert status == 503 and error["reasons"] == {"a": "blocked_pair: tiny", "b": "not_pinned: a"}
    assert not a.calls and not b.calls  # refused, never rerouted


def test_a_pair_settings_write_after_the_load_moves_calls_off_serving(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny"])
    b = SimBox("b", key=KEY, catalog=["tiny"])
    router = start_fleet_in_process(a, b)
    first = served_by(router)
    wait_for(lambda: resident(router, first))
    assert served_by(router) == first  # now resident there: the serving tier
    assert last_decision(router)["why"][first] == "serving"
    box = a if first == "a" else b
    box.set_pair("tiny", max_wait_s=5)  # a preference knob: the box reloads on the next call
    wait_for(lambda: state(router)[first]["pair_settings"]["tiny"] == {"max_wait_s": 5})
    served_by(router)
    assert last_decision(router)["why"][first] == "load"
    assert state(router)[first]["loaded_under"]["tiny"] is None  # loaded before the write


def test_options_over_pair_settings_match_as_the_box_merges_them(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny"])
    a.set_pair("tiny", kv_cache_type="q8_0")
    router = start_fleet_in_process(a)
    served_by(router)  # loads under {kv_cache_type: q8_0}
    wait_for(lambda: resident(router, "a"))
    since = a.residents["tiny"]["since"]
    served_by(router, "tiny@kv-q8_0")  # the same contract once merged: the same seat
    assert last_decision(router)["why"]["a"] == "serving"
    assert a.residents["tiny"]["since"] == since  # the box did not reload either
    served_by(router, "tiny@ram-only")  # pair keys the call does not name still apply
    assert last_decision(router)["why"]["a"] == "load"
    served_by(router, "tiny@ram-only+kv-q8_0")
    assert last_decision(router)["why"]["a"] == "serving"
    served_by(router, "tiny@kv-f16+ram-only")  # the call wins key by key
    assert last_decision(router)["why"]["a"] == "load"


def test_a_calls_knobs_go_to_the_seat_loaded_under_them_and_reload_it_elsewhere(start_fleet_in_process):
    """The body's `knobs` are part of the contract (blanket ⊕ pair ⊕ knobs ⊕ options): a call
    goes to the box whose seat runs its contract, and reloads a seat only where none does."""
    a = SimBox("a", key=KEY, catalog=["tiny"])
    b = SimBox("b", key=KEY, catalog=["tiny"])
    b.set_pair("tiny", max_wait_s=5)
    router = start_fleet_in_process(a, b)
    wait_for(lambda: state(router)["b"]["pair_settings"].get("tiny") == {"max_wait_s": 5})
    assert served_by(router, headers={"X-Router-Box": "a"}) == "a"  # a's seat: {}
    assert served_by(router, headers={"X-Router-Box": "b"}) == "b"  # b's seat: {max_wait_s: 5}
    wait_for(lambda: resident(router, "a") and resident(router, "b"))
    since = {box.name: box.residents["tiny"]["since"] for box in (a, b)}
    for _ in range(3):
        assert served_by(router, knobs={"max_wait_s": 5}) == "b"
        assert last_decision(router)["why"] == {"a": "load", "b": "serving"}
    served_by(router)  # no knobs: each seat runs what a call without knobs gets there
    assert last_decision(router)["why"] == {"a": "serving", "b": "serving"}
    assert served_by(router, knobs={"max_wait_s": None}) == "a"  # a call's null clears b's pair knob
    assert last_decision(router)["why"] == {"a": "serving", "b": "load"}
    assert served_by(router, knobs={"max_wait_s": 5.0, "blocked": True}) == "b"  # 5.0 == 5; no `blocked`
    assert request(router, "PUT", "/v1/aliases/fast", {"chain": ["tiny"]})[0] == 201
    for knobs, box_name in (({"max_wait_s": 5}, "b"), ({"max_wait_s": None}, "a")):  # an alias keeps them
        assert served_by(router, "fast", knobs=knobs) == box_name
    assert {box.name: box.residents["tiny"]["since"] for box in (a, b)} == since  # neither box reloaded
    # knobs no seat runs: a load, and that box's seat reloads under them, then serves them
    new = {"tolerance": "slowest"}
    took = served_by(router, knobs=new)
    assert last_decision(router)["why"] == {"a": "load", "b": "load"}
    box = a if took == "a" else b
    assert box.residents["tiny"]["since"] > since[took]
    assert json.loads(state(router)[took]["loaded_under"]["tiny"]) == box.residents["tiny"]["contract"]
    wait_for(lambda: resident(router, took))
    assert served_by(router, knobs=new) == took
    assert last_decision(router)["why"][took] == "serving"
    assert box.residents["tiny"]["since"] > since[took]


def test_a_box_where_the_model_does_not_fit_is_never_tried_cold(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny"], free_gpu_bytes=80 << 30)
    b = SimBox("b", key=KEY, catalog=["tiny"], free_gpu_bytes=1 << 30)  # fits: null (not priced yet)
    c = SimBox("c", key=KEY, catalog=["tiny"], free_gpu_bytes=90 << 30)
    a.verdicts["tiny"] = "impossible"
    c.verdicts["tiny"] = "none"  # no verdict row at all
    router = start_fleet_in_process(a, b, c)
    wait_for(lambda: state(router)["c"]["verdicts"]["fits"] == {"tiny": "none"})
    assert {served_by(router) for _ in range(4)} == {"b"}
    assert last_decision(router)["refused"] == {"a": "does_not_fit: tiny", "c": "does_not_fit: tiny"}
    assert state(router)["a"]["verdicts"]["read_s_ago"] is not None
    assert served_by(router, headers={"X-Router-Box": "a"}) == "a"  # verdicts never override a pin
    # once resident it fits by definition: the serving tier never reads verdicts
    wait_for(lambda: resident(router, "a"))
    served_by(router)
    assert last_decision(router)["why"]["a"] == "serving" and "a" not in last_decision(router)["refused"]


def test_a_gpu_fit_is_preferred_over_a_ram_only_one(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny"], free_gpu_bytes=80 << 30)
    b = SimBox("b", key=KEY, catalog=["tiny"], free_gpu_bytes=1 << 30)
    a.verdicts["tiny"] = "ram"
    b.verdicts["tiny"] = "gpu"
    router = start_fleet_in_process(a, b)
    wait_for(lambda: state(router)["a"]["verdicts"]["fits"] == {"tiny": "ram"})
    assert served_by(router) == "b"  # before "most free GPU", which would pick a


def test_verdicts_are_read_again_when_the_catalog_or_settings_move(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny"])
    router = start_fleet_in_process(a)
    wait_for(lambda: state(router)["a"]["verdicts"]["fits"] == {"tiny": "unknown"})
    a.verdicts["new"] = "gpu"
    a.catalog.add("new")
    a.changed()
    wait_for(lambda: state(router)["a"]["verdicts"]["fits"] == {"new": "gpu", "tiny": "unknown"})
    # a model the box has not priced yet is unknown for a grace, then fits nowhere
    a.catalog.add("late")
    a.verdicts["late"] = "none"
    a.changed()
    assert wait_for(lambda: state(router)["a"]["verdicts"]["fits"].get("late") == "unknown")
    wait_for(lambda: state(router)["a"]["verdicts"]["fits"].get("late") == "none")
    assert state(router)["a"]["verdicts"]["fits"]["late"] == "none"
    reads = a.verdict_reads
    assert reads >= 2
    for _ in range(5):  # calls never read verdicts, though each moves the box's counter
        served_by(router)
    assert a.verdict_reads == reads


# -- one address for hugpy-core ----------------------------------------------------------------

NEW_PATHS = ["v1/verdicts", "v1/queue", "v1/next-call", "v1/requests/fe-1", "v1/facts/export", "v1/station",
             "v1/hashes", "v1/drives", "limits", "profiles", "residents"]


@pytest.mark.parametrize("path", NEW_PATHS)
def test_the_relay_reaches_the_wrappers_management_paths(path):
    assert admin.relay_target(path, "") == "/" + path


@pytest.mark.parametrize("path", ["v1/keys", "v1/keys/1/revoke", "v1/verdictsX", "limitsX", "v1/fleet"])
def test_the_relay_never_reaches_keys_or_lookalikes(path):
    assert admin.relay_target(path, "") is None


def test_the_relay_and_the_fleet_views_are_admin_only(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    status, head, body = request(router, "GET", "/v1/boxes/a/v1/verdicts?model_key=tiny")
    assert status == 200 and head["x-hugpy-box"] == "a" and json.loads(body)["verdicts"][0]["model_key"] == "tiny"
    assert json.loads(request(router, "GET", "/v1/boxes/a/residents")[2])["residents"][0]["key"] == "tiny"
    # a settings write through the relay keeps the box's write-then-read: POST, then GET
    status, _, body = request(router, "POST", "/v1/boxes/a/v1/settings/pair",
                              {"model_key": "tiny", "settings": {"max_wait_s": 30}})
    assert status == 200 and json.loads(body) == {"model_key": "tiny", "settings": {"max_wait_s": 30}}
    read = json.loads(request(router, "GET", "/v1/boxes/a/v1/settings/pair?model_key=tiny")[2])
    assert read["effective"] == {"max_wait_s": 30}
    # the box has no PUT: the relay passes the method on and the box's own 501 comes back
    status, head, body = request(router, "PUT", "/v1/boxes/a/v1/settings/pair",
                                 {"model_key": "tiny", "settings": {"max_wait_s": 1}})
    assert status == 501 and head["content-type"].startswith("text/html") and b"Unsupported method ('PUT')" in body
    assert json.loads(request(router, "GET", "/v1/boxes/a/v1/settings/pair?model_key=tiny")[2])["settings"] == {
        "max_wait_s": 30}
    assert request(router, "GET", "/v1/boxes/a/v1/keys")[0] == 403
    outside = {"X-Forwarded-For": "203.0.113.5"}
    for path in ("/v1/boxes/a/v1/verdicts", "/v1/boxes/a/residents", "/v1/fleet/verdicts",
                 "/v1/fleet/settings", "/v1/fleet/residents"):
        assert request(router, "GET", path, headers=outside)[0] == 401, path


def test_fleet_views_merge_every_box_and_list_one_down_with_why(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny", "other"], residents=["tiny"])
    b = SimBox("b", key=KEY, catalog=["tiny"])
    a.verdicts["other"] = "ram"
    a.set_pair("*", tolerance="slowest", model_paths=["/m"])
    a.set_pair("tiny", max_wait_s=30, blocked="operator")
    router = start_fleet_in_process(a, b)
    wait_for(lambda: state(router)["b"]["verdicts"]["read_s_ago"] is not None
             and state(router)["a"]["verdicts"]["read_s_ago"] is not None)
    doc = json.loads(request(router, "GET", "/v1/fleet/verdicts?model=tiny")[2])
    assert sorted(r["box"] for r in doc["verdicts"]) == ["a", "b"] and doc["unanswered"] == []
    assert {r["model_key"] for r in doc["verdicts"]} == {"tiny"}
    doc = json.loads(request(router, "GET", "/v1/fleet/settings?model=tiny")[2])
    rows = {(r["box"], r["model_key"]): r for r in doc["settings"]}
    assert rows[("a", "tiny")] == {"box": "a", "model_key": "tiny", "blocked": True,
                                   "effective": {"tolerance": "slowest", "max_wait_s": 30, "blocked": "operator"}}
    assert rows[("a", "*")]["effective"] == {"tolerance": "slowest"}  # box-only knobs are not inherited
    assert rows[("b", "tiny")]["effective"] == {}
    doc = json.loads(request(router, "GET", "/v1/fleet/residents")[2])
    assert [(r["box"], r["key"], r["healthy"]) for r in doc["residents"]] == [("a", "tiny", True)]

    router.fleet.stop_box(b)
    wait_for(lambda: not state(router)["b"]["online"], timeout=15)
    for view, rows_key in (("verdicts", "verdicts"), ("settings", "settings"), ("residents", "residents")):
        doc = json.loads(request(router, "GET", f"/v1/fleet/{view}")[2])
        assert {r["box"] for r in doc[rows_key]} == {"a"}, view
        assert [u["box"] for u in doc["unanswered"]] == ["b"] and doc["unanswered"][0]["why"].startswith("offline")
