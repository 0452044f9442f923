"""Admission control end to end: box limits, the wait queue, its order and answers, refusal memory.

The real router (in this process, tests/inproc.py) in front of simulated hugpy boxes whose calls take a set time (a scripted
`hang`); callers are told apart by their source address on loopback (127.0.0.x), as keyless
callers are in production.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import threading
import time

import ollama
import openai
import pytest

from router.sim import SimLlamaCpp, SimOllama
from router.sim.hugpy import Behavior, SimBox

from conftest import wait_for
from support.boxes import chat_calls, max_concurrency
from support.calls import MESSAGES, admin, call, get_json, request

pytestmark = pytest.mark.timeout(60)


def in_queue(router) -> int:
    return get_json(router, "/v1/router/state")["queue"]["size"]


def test_a_limited_box_never_takes_more_than_its_limit_and_every_call_is_served(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(0.15)] * 12)
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 2}})
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: call(router), range(12)))
    assert [status for status, _, _ in results] == [200] * 12
    assert chat_calls(box) == 12
    assert max_concurrency(box) == 2
    state = get_json(router, "/v1/router/state")
    assert state["boxes"][0]["max_inflight"] == 2 and state["queue"]["outcomes"]["admitted"] >= 1
    metrics = get_json_text(router, "/metrics")
    assert 'router_queue_outcomes_total{outcome="admitted"}' in metrics
    assert "router_queue_wait_seconds_count" in metrics


def get_json_text(router, path: str) -> str:
    return request(router, "GET", path, timeout=10)[2].decode()


def test_a_light_caller_is_not_stuck_behind_a_heavy_callers_backlog(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(0.2)] * 9)
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 1}})
    done: list[tuple[str, float]] = []
    lock = threading.Lock()

    def send(source: str) -> None:
        status, _, _ = call(router, source=source)
        assert status == 200
        with lock:
            done.append((source, time.monotonic()))

    threads = [threading.Thread(target=send, args=("127.0.0.2",)) for _ in range(8)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: in_queue(router) == 7, 5)
    light = threading.Thread(target=send, args=("127.0.0.3",))
    light.start()
    for thread in [*threads, light]:
        thread.join(30)
    order = [source for source, _ in sorted(done, key=lambda d: d[1])]
    # the heavy call on the box, then at most one more heavy turn, then the light call
    assert order.index("127.0.0.3") <= 2, order


def test_classes_are_strict_and_a_call_can_only_lower_its_own(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(0.25)] * 4)
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 1}})
    done: list[str] = []
    lock = threading.Lock()

    def send(name: str, priority: str | None) -> None:
        headers = {"X-Router-Priority": priority} if priority else {}
        status, _, _ = call(router, headers=headers, source="127.0.0.%d" % (10 + len(name)))
        assert status == 200
        with lock:
            done.append(name)

    first = threading.Thread(target=send, args=("first", None))
    first.start()
    assert wait_for(lambda: get_json(router, "/v1/router/state")["boxes"][0]["full"], 5)
    low = threading.Thread(target=send, args=("low", "low"))
    low.start()
    assert wait_for(lambda: in_queue(router) == 1, 5)
    # "high" from a caller whose class is normal stays normal: it cannot jump the other normal one
    normal = threading.Thread(target=send, args=("normal", None))
    normal.start()
    assert wait_for(lambda: in_queue(router) == 2, 5)
    raised = threading.Thread(target=send, args=("raised", "high"))
    raised.start()
    assert wait_for(lambda: in_queue(router) == 3, 5)
    classes = [w["class"] for w in get_json(router, "/v1/router/state")["queue"]["waiting"]]
    assert classes == ["normal", "normal", "low"]
    for thread in (first, low, normal, raised):
        thread.join(30)
    assert done == ["first", "normal", "raised", "low"]


def test_a_full_queue_answers_429_with_retry_after_in_each_facades_shape(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(1.0)] * 3)
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 1}}, extra_args=("--queue-size", "1"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(call, router) for _ in range(2)]
        assert wait_for(lambda: in_queue(router) == 1, 5)
        status, headers, body = call(router)
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert body["error"]["code"] == "queue_full"
        assert headers["x-hugpy-router-request-id"]
        with pytest.raises(openai.RateLimitError) as raised:
            openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                model="tiny", messages=MESSAGES)
        assert raised.value.code == "queue_full"
        assert [f.result()[0] for f in busy] == [200, 200]
    assert chat_calls(box) == 2  # the refused calls never reached the box


def test_one_callers_burst_takes_its_share_of_the_queue_and_leaves_the_rest(start_fleet_in_process):
    """Issue 20 item 4: `--queue-size 4` (a share of 1 place per caller). A burst from one address
    fills the box and its one place; the rest of the burst gets 429 queue_share_full, and a second
    caller still waits and is served instead of a 429."""
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(0.6)] * 3)
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 1}}, extra_args=("--queue-size", "4"))
    assert get_json(router, "/v1/router/state")["queue"]["per_caller"] == 1
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = [pool.submit(call, router, source="127.0.0.2") for _ in range(2)]
        assert wait_for(lambda: in_queue(router) == 1, 5)
        burst = [call(router, source="127.0.0.2") for _ in range(3)]
        assert [(status, body["error"]["code"]) for status, _, body in burst] == [(429, "queue_share_full")] * 3
        assert "share of the queue (1 of 4 places)" in burst[0][2]["error"]["message"]
        other = pool.submit(call, router, source="127.0.0.3")
        assert wait_for(lambda: in_queue(router) == 2, 5)
        assert [f.result()[0] for f in first] == [200, 200]
        assert other.result()[0] == 200
    outcomes = get_json(router, "/v1/router/state")["queue"]["outcomes"]
    assert outcomes["queue_share_full"] == 3 and "queue_full" not in outcomes


def test_ollama_callers_get_429_in_ollamas_shape(start_fleet_in_process):
    box = SimOllama("o", tags=["llama3"], loaded=["llama3"])
    box.script("llama3:latest", *[Behavior.hang(1.0)] * 2)
    router = start_fleet_in_process(box, boxes_extra={"o": {"max_inflight": 1}}, extra_args=("--queue-size", "1"))
    client = ollama.Client(host=router.url)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(client.chat, model="llama3", messages=MESSAGES, stream=False) for _ in range(2)]
        assert wait_for(lambda: in_queue(router) == 1, 5)
        with pytest.raises(ollama.ResponseError) as raised:
            client.chat(model="llama3", messages=MESSAGES, stream=False)
        assert raised.value.status_code == 429 and "full" in raised.value.error
        for f in busy:
            f.result()


def test_a_wait_past_the_queue_timeout_is_503_with_retry_after(start_fleet_in_process):
    """The queue's deadline on the router's call clock, stepped ahead (tests/inproc.py
    advance_clock): a minute's timeout, not yet due a second before it, due a second after."""
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.hang(5.0))  # holds the slot while the test steps the clock
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 1}},
                                    extra_args=("--queue-timeout", "60", "--first-byte-timeout", "600"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(call, router)
        assert wait_for(lambda: get_json(router, "/v1/router/state")["boxes"][0]["full"], 5)
        waiting = pool.submit(call, router)
        assert wait_for(lambda: in_queue(router) == 1, 5)
        router.advance_clock(59)
        assert in_queue(router) == 1 and not waiting.done()
        router.advance_clock(61)
        status, headers, body = waiting.result(5)
        assert status == 503 and body["error"]["code"] == "queue_timeout"
        assert int(headers["retry-after"]) >= 1
        assert not first.done()  # the 503 came at the queue's deadline, not when the slot freed
        assert first.result()[0] == 200
    assert chat_calls(box) == 1


def test_a_client_that_leaves_the_queue_never_reaches_a_box(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.hang(1.0))
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 1}})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(call, router)
        assert wait_for(lambda: get_json(router, "/v1/router/state")["boxes"][0]["full"], 5)
        host, port = router.url.removeprefix("http://").split(":")
        quitter = socket.create_connection((host, int(port)))
        body = json.dumps({"model": "tiny", "messages": MESSAGES}).encode()
        quitter.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: in_queue(router) == 1, 5)
        quitter.close()
        assert wait_for(lambda: in_queue(router) == 0, 2)  # removed at once, not at the timeout
        assert first.result()[0] == 200
    time.sleep(0.3)
    assert chat_calls(box) == 1
    assert get_json(router, "/v1/router/state")["queue"]["outcomes"]["left"] == 1


def test_a_placement_refusal_cools_the_box_for_the_model_then_success_resets_it(start_fleet_in_process):
    refusing = SimBox("a", residents=["tiny"])
    steady = SimBox("b", catalog=["tiny"])
    refusing.script("tiny", Behavior.refuse(503, "insufficient_resources"))
    router = start_fleet_in_process(refusing, steady)
    status, headers, _ = call(router)
    assert status == 200 and headers["x-hugpy-box"] == "b"
    state = get_json(router, "/v1/router/state")
    assert "tiny" in state["boxes"][0]["cooling"]
    # while it cools, a fast-failing box does not draw the next calls, though it serves the model
    for _ in range(3):
        assert call(router)[1]["x-hugpy-box"] == "b"
    assert chat_calls(refusing) == 1


def test_the_back_off_grows_with_refusals_in_a_row_and_a_success_resets_it(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.refuse(503, "insufficient_resources")] * 2)
    router = start_fleet_in_process(box)

    def box_state() -> dict:
        return get_json(router, "/v1/router/state")["boxes"][0]

    assert call(router)[0] == 503  # the only owner refused: its refusal goes back
    assert box_state()["placement_refusals"] == {"tiny": 1}
    assert box_state()["cooling"]["tiny"]["ceiling"] == 0 and 0.3 < box_state()["cooling"]["tiny"]["seconds_left"] <= 0.5
    started = time.monotonic()
    assert call(router, alloc={"worker": "a"})[0] == 503  # waits out 0.5 s, then refused again
    # real time: the back-off is the router's own, waited out on its loop; a lower bound, which load cannot break
    assert time.monotonic() - started > 0.3  # it waited instead of hammering the box
    assert box_state()["placement_refusals"] == {"tiny": 2} and 0.7 < box_state()["cooling"]["tiny"]["seconds_left"] <= 1.0
    started = time.monotonic()
    status, headers, _ = call(router, alloc={"worker": "a"})
    assert status == 200 and headers["x-hugpy-box"] == "a"
    assert time.monotonic() - started > 0.7  # real time, a lower bound: as above
    assert box_state()["placement_refusals"] == {} and box_state()["cooling"] == {}
    assert chat_calls(box) == 3


def test_a_box_that_cannot_be_reached_is_out_until_its_probe_sees_it(start_fleet_in_process):
    alive = SimBox("b", residents=["tiny"])
    time.sleep(0.01)
    dead = SimBox("a", residents=["tiny"])  # used more recently: ranked first
    router = start_fleet_in_process(dead, alive)
    router.fleet.stop_box(dead)
    assert call(router)[1]["x-hugpy-box"] == "b"
    state = get_json(router, "/v1/router/state")
    assert state["boxes"][0]["unreachable"] is True
    before = chat_calls(dead)
    for _ in range(3):
        assert call(router)[1]["x-hugpy-box"] == "b"
    assert chat_calls(dead) == before


def test_a_keys_class_orders_the_queue_and_is_changeable_through_the_keys_api(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(0.3)] * 4)
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 1}}, env={"HUGPY_ROUTER_REQUIRE_KEY": "always"})

    status, low = admin(router, "POST", "/v1/keys", {"name": "batch", "priority": "low"})
    assert status == 201 and low["priority"] == "low"
    status, vip = admin(router, "POST", "/v1/keys", {"name": "vip"})
    assert status == 201 and vip["priority"] == "normal"
    assert admin(router, "POST", f"/v1/keys/{vip['id']}/priority", {"priority": "high"}) == (
        200, {"id": vip["id"], "priority": "high"})
    assert admin(router, "POST", f"/v1/keys/{vip['id']}/priority", {"priority": "urgent"})[0] == 400
    assert admin(router, "POST", "/v1/keys/nope/priority", {"priority": "low"})[0] == 404
    listed = {k["id"]: k["priority"] for k in admin(router, "GET", "/v1/keys")[1]["keys"]}
    assert listed == {low["id"]: "low", vip["id"]: "high"}

    done: list[str] = []
    lock = threading.Lock()

    def send(name: str, key: str) -> None:
        status, _, _ = call(router, headers={"Authorization": f"Bearer {key}"})
        assert status == 200
        with lock:
            done.append(name)

    first = threading.Thread(target=send, args=("first", low["key"]))
    first.start()
    assert wait_for(lambda: get_json(router, "/v1/router/state")["boxes"][0]["full"], 5)
    batch = threading.Thread(target=send, args=("batch", low["key"]))
    batch.start()
    assert wait_for(lambda: in_queue(router) == 1, 5)
    urgent = threading.Thread(target=send, args=("vip", vip["key"]))
    urgent.start()
    assert wait_for(lambda: in_queue(router) == 2, 5)
    waiting = get_json(router, "/v1/router/state")["queue"]["waiting"]
    assert [(w["class"], w["caller"]) for w in waiting] == [("high", f"key:{vip['id']}"), ("low", f"key:{low['id']}")]
    for thread in (first, batch, urgent):
        thread.join(30)
    assert done == ["first", "vip", "batch"]


def test_a_llama_cpp_box_reports_its_own_capacity_and_the_router_keeps_to_it(start_fleet_in_process):
    box = SimLlamaCpp("lc", alias="qwen", total_slots=2)
    box.script("qwen", *[Behavior.hang(0.15)] * 6)
    router = start_fleet_in_process(box)
    assert wait_for(lambda: get_json(router, "/v1/router/state")["boxes"][0]["max_inflight"] == 2, 5)
    assert get_json(router, "/v1/router/state")["boxes"][0]["limit_source"] == "box (llama.cpp total_slots)"
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: call(router, model="qwen"), range(6)))
    assert [status for status, _, _ in results] == [200] * 6
    assert max_concurrency(box) == 2


def test_the_boxes_file_limit_wins_over_the_reported_one(start_fleet_in_process):
    box = SimLlamaCpp("lc", alias="qwen", total_slots=4)
    router = start_fleet_in_process(box, boxes_extra={"lc": {"max_inflight": 1}})
    state = get_json(router, "/v1/router/state")["boxes"][0]
    assert (state["max_inflight"], state["limit_source"]) == (1, "boxes file")


def read_stream(router, body: dict, timeout: float = 15) -> tuple[int, dict, list[bytes]]:
    """POSTs a streamed chat call; returns the status, headers and the stream's lines (blank
    lines dropped), read as they come."""
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        lines = [line.rstrip(b"\r\n") for line in resp]
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, [line for line in lines if line]
    finally:
        conn.close()


STREAM_CALL = {"model": "tiny", "messages": MESSAGES, "stream": True}


def test_a_long_wait_for_the_first_byte_is_kept_alive_and_still_fails_over(start_fleet_in_process):
    steady = SimBox("b", residents=["tiny"])
    time.sleep(0.01)
    slow = SimBox("a", residents=["tiny"])  # used more recently: ranked first
    slow.script("tiny", Behavior.drop(after_s=1.0))  # takes the call, then dies without a byte
    router = start_fleet_in_process(slow, steady, extra_args=("--stream-keepalive", "0.3"))
    status, headers, lines = read_stream(router, STREAM_CALL)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    comments = [line for line in lines if line.startswith(b":")]
    assert len(comments) >= 2 and set(comments) == {b": waiting"}
    data = [line for line in lines if line.startswith(b"data: ")]
    first_data = lines.index(data[0])
    assert all(line.startswith(b":") for line in lines[:first_data])  # comments only, then data
    assert data[-1] == b"data: [DONE]" and b'"error"' not in b"".join(data)
    assert chat_calls(slow) == 1 and chat_calls(steady) == 1  # failed over after the comments


def test_a_final_refusal_after_keep_alives_is_an_in_band_error_frame(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.drop(after_s=0.8))
    router = start_fleet_in_process(box, extra_args=("--stream-keepalive", "0.25"))
    status, _, lines = read_stream(router, STREAM_CALL)
    assert status == 200
    assert lines[0] == b": waiting"
    last = json.loads(lines[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "connection_lost"


def test_a_stream_waiting_in_the_queue_is_kept_alive_and_the_openai_client_reads_it(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.hang(1.0))
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 1}}, extra_args=("--stream-keepalive", "0.25"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(call, router)
        assert wait_for(lambda: get_json(router, "/v1/router/state")["boxes"][0]["full"], 5)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=15)
        started = time.monotonic()
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
        # real time: the keep-alive frames are written by the router's own timer; a lower bound
        assert time.monotonic() - started > 0.5  # it waited for the slot, kept alive meanwhile
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert first.result()[0] == 200


def test_ndjson_streams_are_not_kept_alive(start_fleet_in_process):
    box = SimOllama("o", tags=["llama3"], loaded=["llama3"])
    box.script("llama3", Behavior.hang(0.8))
    router = start_fleet_in_process(box, extra_args=("--stream-keepalive", "0.2"))
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/api/chat", body=json.dumps({"model": "llama3", "messages": MESSAGES}))
    lines = [line for line in conn.getresponse().read().split(b"\n") if line]
    conn.close()
    assert all(json.loads(line) for line in lines)  # every line is JSON: no comment was sent


def test_a_boxs_limit_is_set_and_changed_through_the_box_admin_api(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    router = start_fleet_in_process(box)

    status, view = admin(router, "PUT", "/v1/boxes/a", {"max_inflight": 3})
    assert status == 200 and view["max_inflight"] == 3
    assert get_json(router, "/v1/router/state")["boxes"][0]["max_inflight"] == 3
    assert admin(router, "PUT", "/v1/boxes/a", {"max_inflight": 0})[0] == 400
    assert admin(router, "PUT", "/v1/boxes/a", {"max_inflight": "many"})[0] == 400
    status, view = admin(router, "PUT", "/v1/boxes/a", {"max_inflight": None})
    assert status == 200 and view["max_inflight"] is None


def test_the_drain_rate_keeps_a_bounded_history():
    from router.serve.admission import DRAIN_SAMPLES, Admission

    admission = Admission(fleet=None, capacity=8, timeout_s=5.0)  # type: ignore[arg-type]
    for _ in range(DRAIN_SAMPLES * 3):
        admission.handed_out.append(0.0)
    assert len(admission.handed_out) == DRAIN_SAMPLES
