"""Whatever way a call ends, the load it put on its boxes is gone (router/serve/proxy.py rule 3,
router/serve/load.py): the real router, real simulated boxes, and the box's in-flight count as
`/v1/router/state` shows it, which is what the next decision reads. Each case fails if the call
path stops releasing its load (`self.load.release()` in `ProxyCall.run`)."""

from __future__ import annotations

import json

import pytest

from router.sim.hugpy import Behavior, SimBox

from conftest import wait_for
from support.boxes import box_calls
from support.raw_calls import chat_body, hang_up, open_raw, post_chat, read_until, request

pytestmark = pytest.mark.timeout(30)


def in_flight(router) -> dict[str, int]:
    status, _, data = request(router, "GET", "/v1/router/state")
    assert status == 200, data
    return {box["name"]: box["in_flight"] for box in json.loads(data)["boxes"]}


def settled(router) -> dict[str, int]:
    """The in-flight counts once they are all 0, or as they stand after 2 s."""
    counts = wait_for(lambda: (c := in_flight(router)) and not any(c.values()) and c, 2)
    return counts or in_flight(router)


def test_a_call_answered_whole_leaves_no_load(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    assert post_chat(router)[0] == 200
    assert settled(router) == {"a": 0}


def test_a_stream_leaves_no_load(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    status, _, data = post_chat(router, stream=True)
    assert status == 200 and b"[DONE]" in data
    assert settled(router) == {"a": 0}


def test_a_failover_leaves_no_load_on_either_box(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])  # serving: tried first
    b = SimBox("b", catalog=["tiny"])
    a.script("tiny", Behavior.refuse(503, "insufficient_resources"))
    router = start_fleet_in_process(a, b)
    assert post_chat(router)[0] == 200
    assert len(box_calls(a)) == len(box_calls(b)) == 1  # a refused, b answered
    assert settled(router) == {"a": 0, "b": 0}


def test_a_call_every_box_refuses_leaves_no_load(start_fleet_in_process):
    boxes = [SimBox(f"b{i}", catalog=["tiny"]) for i in range(3)]
    for box in boxes:
        box.script("tiny", Behavior.refuse(503, "load_error"))
    router = start_fleet_in_process(*boxes)
    assert post_chat(router)[0] == 503
    assert settled(router) == {"b0": 0, "b1": 0, "b2": 0}


def test_a_client_leaving_mid_stream_leaves_no_load(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=100, cadence_s=0.05)
    router = start_fleet_in_process(a)
    sock = open_raw(router, chat_body(stream=True))
    assert b'"tok "' in read_until(sock, b'"tok "')
    (call,) = box_calls(a)
    hang_up(sock, call)
    assert settled(router) == {"a": 0}


def test_a_box_failing_mid_stream_leaves_no_load(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=6, cadence_s=0.02)
    a.script("tiny", Behavior.die_after(2))
    router = start_fleet_in_process(a)
    status, _, data = post_chat(router, stream=True)
    assert status == 200 and b"box_failed" in data
    assert settled(router) == {"a": 0}
