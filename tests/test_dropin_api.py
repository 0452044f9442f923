"""API parity with hugpy-router 0.0.4, as 0.0.4 itself serves it (tests/dropin.py): every route
and field 0.0.4 answers keeps its name and JSON type here; new fields stand beside them. Both
routers serve the same world in turn: one hugpy box with a resident model, one call served,
one refused."""

from __future__ import annotations

import openai
import pytest

from dropin import CHAT, NEW, OLD, Served, cli, require_004, user_env
from conftest import wait_for

BOX_KEY = "hpk_box_apiboxkey0123456789abcdef"


def shape_errors(old, new, where: str = "$") -> list[str]:
    """Where `new` lacks a field of `old` or gives it another JSON type. A null in 0.0.4's
    answer says nothing about the type; numbers are one type (JSON has one)."""
    if old is None:
        return []
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{where}: object in 0.0.4, {type(new).__name__} here"]
        errors = []
        for key, value in old.items():
            if key not in new:
                errors.append(f"{where}.{key}: missing")
            else:
                errors += shape_errors(value, new[key], f"{where}.{key}")
        return errors
    if isinstance(old, list):
        if not isinstance(new, list):
            return [f"{where}: array in 0.0.4, {type(new).__name__} here"]
        if old and not new:
            return [f"{where}: empty here"]
        return shape_errors(old[0], new[0], f"{where}[0]") if old else []
    kinds = {bool: "boolean", int: "number", float: "number", str: "string"}
    if kinds[type(old)] != kinds.get(type(new)):
        return [f"{where}: {kinds[type(old)]} in 0.0.4, {type(new).__name__} here ({new!r})"]
    return []


def answers(router: Served) -> dict:
    """Every 0.0.4 route's answer on `router`, after one served and one refused call."""
    got = {"health": router.call("GET", "/health")}
    got["served"] = router.chat()
    got["no_box"] = router.call("POST", "/v1/chat/completions", {**CHAT, "model": "nope"})
    got["models"] = router.call("GET", "/v1/models")
    got["state"] = router.call("GET", "/v1/router/state")
    got["boxes"] = router.call("GET", "/v1/boxes")
    got["created"] = router.call("POST", "/v1/keys", {"name": "laptop", "scope": "use"})
    got["keys"] = router.call("GET", "/v1/keys?all=1")
    got["revoked"] = router.call("POST", f"/v1/keys/{got['created'][1]['id']}/revoke", {})
    got["unknown_key"] = router.call("POST", "/v1/keys/0123456789/revoke", {})
    got["relay"] = router.call("GET", "/v1/boxes/ae/v1/telemetry/state")
    got["telemetry"] = wait_for(  # the writer's batch window: wait for both rows
        lambda: (lambda a: a if len(a[1]["rows"]) >= 2 else None)(router.call("GET", "/v1/telemetry")), 5)
    return got


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """{route: (0.0.4's answer, this router's answer)}, each a (status, JSON body)."""
    from router.sim import SimBox, SimFleet

    require_004()
    tmp = tmp_path_factory.mktemp("api")
    box = SimBox("ae", key=BOX_KEY, catalog=["tiny-llama", "other"], residents=["tiny-llama"],
                 free_gpu_bytes=8 << 30)
    fleet = SimFleet([box])
    fleet.start()
    got = {}
    try:
        for exe in (OLD, NEW):
            env = user_env(tmp / exe.parent.parent.name)
            cli(exe, env, "boxes", "add", "--name", "ae", "--url", box.url, "--key", BOX_KEY)
            router = Served(exe, env, tmp / f"{exe.parent.parent.name}.log")
            try:
                got[exe] = answers(router)
            finally:
                router.stop()
    finally:
        fleet.stop()
    return {route: (got[OLD][route], got[NEW][route]) for route in got[OLD]}


# Where this router answers otherwise on purpose, and why (docs/operating.md: differences that remain).
KNOWN = {
    # OpenAI's error object has a string `code` (or null): "no_box" here, 0.0.4 put the status
    # (503) there, which the HTTP status already says.
    "no_box": ["$.error.code: number in 0.0.4, str here ('no_box')"],
}
ROUTES = ["health", "served", "no_box", "models", "state", "boxes", "created", "keys", "revoked",
          "unknown_key", "relay", "telemetry"]


@pytest.mark.parametrize("route", ROUTES)
def test_each_answer_keeps_0_0_4s_status_fields_and_types(both, route):
    (old_status, old_doc), (new_status, new_doc) = both[route]
    assert new_status == old_status
    assert shape_errors(old_doc, new_doc) == KNOWN.get(route, [])


def test_no_box_is_0_0_4s_and_a_valid_openai_error(both):
    (_, old), (_, new) = both["no_box"]
    error = new["error"]
    assert error["type"] == "no_box" == old["error"]["type"]
    assert set(error["reasons"]) == set(old["error"]["reasons"]) == {"ae"}
    assert error["request_id"]
    assert isinstance(error["message"], str) and isinstance(error["code"], str)


def test_no_box_through_the_openai_client(start_fleet_in_process):
    from router.sim import SimBox

    router = start_fleet_in_process(SimBox("a", catalog=["tiny"]))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503 and info.value.type == "no_box" and info.value.code == "no_box"
    assert info.value.body["reasons"]["a"].startswith("no_model") and info.value.body["request_id"]


def test_state_residents_are_objects_and_contracts_are_listed(both):
    _, (_, new) = both["state"]
    (box,) = new["boxes"]
    assert box["residents"][0]["key"] == "tiny-llama" and box["residents"][0]["state"] in ("idle", "serving")
    assert box["models"] == 2 and box["room_gpu"] == 8 << 30
    assert {"box": "ae", "model": "tiny-llama", "options": None} in new["contracts"]


def test_telemetry_rows_have_0_0_4s_fields_and_default_limit(both):
    (_, old), (_, new) = both["telemetry"]
    assert [r["state"] for r in new["rows"]] == [r["state"] for r in old["rows"]] == ["done", "refused"]
    for old_row, new_row in zip(old["rows"], new["rows"]):
        assert set(old_row) <= set(new_row)
        assert new_row["path"] == old_row["path"] or old_row["path"] == "serving"
