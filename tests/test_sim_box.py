"""The simulated hugpy box speaks contracts/hugpy-wrapper.md, quirks included.

Each test starts its own fleet (a loop thread, loopback ports) and talks plain HTTP to it.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from router.sim import Behavior, SimBox, SimFleet

pytestmark = pytest.mark.timeout(10)

KEY = "hpk_box_testsecret0123456789"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "secret prompt"}]}


@pytest.fixture
def box() -> Iterator[SimBox]:
    b = SimBox("box-a", key=KEY, catalog=["m", "cold"], residents=["m"], chunks=3)
    with SimFleet([b]):
        yield b


def request(box: SimBox, method: str, path: str, body: bytes | dict | None = None,
            headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", box.port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def frames(body: bytes) -> list[str]:
    return [f[len("data: "):] for f in body.decode().split("\n\n") if f]


def wait_for(cond, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_health_and_the_query_string_quirk(box: SimBox) -> None:
    for path in ("/health", "/v1/health/"):
        status, headers, body = request(box, "GET", path)
        assert status == 200 and headers["content-type"] == "application/json"
        doc = json.loads(body)
        assert doc["service"] == "hugpy-wrapper" and doc["worker"] == "box-a" and doc["version"] == "0.1.182"
    status, _, body = request(box, "GET", "/health?x=1")
    assert status == 404 and json.loads(body) == {"error": {"message": "not found", "code": 404}}
    assert box.health_hits == 3


def test_silent_health_holds_the_connection(box: SimBox) -> None:
    box.healthy_answer = False
    with pytest.raises(TimeoutError):
        request(box, "GET", "/health", timeout=0.3)
    wait_for(lambda: box.open_connections == 0)


def test_long_poll_answers_early_on_a_change_and_at_the_deadline_otherwise(box: SimBox) -> None:
    since = json.loads(request(box, "GET", "/v1/telemetry/state")[2])["changes"]

    # real time: the box's own long-poll timer across a socket; a lower bound (the loop clock may
    # wake a hair early)
    t0 = time.monotonic()
    status, _, body = request(box, "GET", f"/v1/telemetry/state?wait=0.3&since={since}")
    assert status == 200 and time.monotonic() - t0 >= 0.28
    assert json.loads(body)["changes"] == since  # the timeout answer: the unchanged counter

    threading.Timer(0.1, box.changed).start()
    t0 = time.monotonic()
    doc = json.loads(request(box, "GET", f"/v1/telemetry/state?wait=60&since={since}", timeout=8)[2])
    assert time.monotonic() - t0 < 5 and doc["changes"] > since  # real time, as above: early, not at 60 s

    assert request(box, "GET", "/v1/telemetry/state?wait=abc")[0] == 400


def test_restart_answers_pending_long_polls_with_a_low_counter(box: SimBox) -> None:
    for _ in range(3):
        request(box, "POST", "/v1/chat/completions", CHAT)
    since = json.loads(request(box, "GET", "/v1/telemetry/state")[2])["changes"]
    threading.Timer(0.1, box.restart).start()
    doc = json.loads(request(box, "GET", f"/v1/telemetry/state?wait=5&since={since}")[2])
    assert doc["changes"] < since and doc["residents"] == []


def test_state_snapshot_shape_and_admin_auth(box: SimBox) -> None:
    box.free_gpu_bytes = 10_000
    doc = json.loads(request(box, "GET", "/v1/telemetry/state")[2])
    assert doc["gpu_state"][0]["free"] == 10_000
    (seat,) = doc["residents"]
    assert (seat["key"], seat["state"], seat["healthy"], seat["busy"]) == ("m", "idle", 1, 0)
    assert [m["key"] for m in doc["models"]] == ["cold", "m"]
    assert len(doc["store_id"]) == 32
    for table in ("gpu_state", "host_state", "residents", "models", "cpu_state"):
        assert all(row["worker"] == "box-a" for row in doc[table])

    assert request(box, "GET", "/v1/telemetry/state", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    status, _, body = request(box, "GET", "/v1/telemetry/state", headers={"Authorization": "Bearer nope"})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    # A proxy header makes a loopback caller "outside" (§6).
    assert request(box, "GET", "/v1/telemetry/state", headers={"X-Forwarded-For": "203.0.113.5"})[0] == 401


def test_non_stream_chat_records_the_call(box: SimBox) -> None:
    status, headers, body = request(box, "POST", "/v1/chat/completions", CHAT,
                                    {"X-Hugpy-Parent-Request-Id": "rt-1", "Authorization": "Bearer whatever"})
    doc = json.loads(body)
    assert status == 200 and headers["x-hugpy-execution-request-id"] == doc["hugpy"]["request_id"]
    assert doc["object"] == "chat.completion" and "secret" not in body.decode()
    (call,) = box.calls
    assert (call.model, call.stream, call.parent_id, call.status) == ("m", False, "rt-1", 200)
    assert call.headers["authorization"] == "Bearer whatever" and "x-forwarded-for" not in call.headers
    assert call.body_len == len(json.dumps(CHAT)) and call.finished_at is not None


def test_stream_frames_then_done_then_close(box: SimBox) -> None:
    sock = socket.create_connection(("127.0.0.1", box.port), timeout=2)
    body = json.dumps({**CHAT, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    raw = b""
    while chunk := sock.recv(65536):  # ends only because the box closes (close-delimited body)
        raw += chunk
    sock.close()
    head, _, stream = raw.partition(b"\r\n\r\n")
    head_lines = head.decode().split("\r\n")
    assert head_lines[0] == "HTTP/1.1 200 OK"
    assert "Connection: close" in head_lines and "Content-Type: text/event-stream" in head_lines
    assert not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in head_lines)
    got = frames(stream)
    assert got[-1] == "[DONE]"
    first, *content, final = (json.loads(f) for f in got[:-1])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["model"] == "m"
    assert len(content) == 3
    assert final["choices"][0]["finish_reason"] == "stop" and final["hugpy"]["request_id"] == first["id"]


def test_in_band_refusal_frame(box: SimBox) -> None:
    box.script("m", Behavior.in_band("insufficient_resources", "won't fit"))
    status, headers, body = request(box, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and headers["connection"] == "close"
    error_frame, done = frames(body)
    doc = json.loads(error_frame)
    assert done == "[DONE]"
    assert doc["choices"][0]["finish_reason"] == "error"
    assert doc["error"] == {"message": "won't fit", "type": "insufficient_resources", "code": 503}
    assert doc["hugpy"]["request_id"] == headers["x-hugpy-execution-request-id"]
    # The same behaviour on a plain call is a real 503 before any byte.
    box.script("m", Behavior.in_band("insufficient_resources"))
    assert request(box, "POST", "/v1/chat/completions", CHAT)[0] == 503


def test_model_names_and_options(box: SimBox) -> None:
    status, headers, body = request(box, "POST", "/v1/chat/completions", {**CHAT, "model": "x@ctx-low"})
    assert status == 404 and "x-hugpy-execution-request-id" in headers
    assert json.loads(body) == {"error": {"message": "model not found on this box: x", "code": 404}}
    status, _, body = request(box, "POST", "/v1/chat/completions", {**CHAT, "model": "x"})
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    status, _, body = request(box, "POST", "/v1/chat/completions", {**CHAT, "model": "m@bogus"})
    assert status == 400 and json.loads(body)["error"]["message"] == "unknown or infeasible option(s) bogus for m on this box"
    assert request(box, "POST", "/v1/chat/completions", {**CHAT, "model": "m@RAM-only+ctx-low"})[0] == 200
    assert box.residents["m"]["settings"] == "ctx-low+ram-only"
    assert request(box, "POST", "/v1/chat/completions", b"{bad")[0] == 400
    assert request(box, "POST", "/v1/completions", CHAT)[0] == 404


def test_a_calls_knobs_are_part_of_the_seats_contract(box: SimBox) -> None:
    """§5, §11.2.6: the body's `knobs`, `model@options` over them, merged over the pair settings;
    any difference reloads the seat (a new `since`), an equal contract reuses it."""
    box.set_pair("m", kv_cache_type="q8_0")
    wait_for(lambda: box.pair_settings.get("m") == {"kv_cache_type": "q8_0"})

    def since_after(model: str = "m", knobs: dict | None = None) -> float:
        time.sleep(0.01)  # a reload's `since` is later than the last one's
        body = {**CHAT, "model": model, **({"knobs": knobs} if knobs is not None else {})}
        assert request(box, "POST", "/v1/chat/completions", body)[0] == 200
        return box.residents["m"]["since"]

    loaded = since_after()
    assert since_after(knobs={"kv_cache_type": "q8_0"}) == loaded  # the pair's own value: the same contract
    assert since_after(knobs={"blocked": True}) == loaded  # not a knob a call can set
    with_wait = since_after(knobs={"max_wait_s": 5})  # a preference knob reloads
    assert with_wait > loaded
    assert since_after(knobs={"max_wait_s": 5.0}) == with_wait  # compared as Python compares
    assert since_after("m@kv-f16", knobs={"max_wait_s": 5, "kv_cache_type": "q4_0"}) > with_wait  # options win
    assert box.residents["m"]["contract"] == {"kv_cache_type": "f16", "max_wait_s": 5}


def test_binary_speech_body(box: SimBox) -> None:
    status, headers, body = request(box, "POST", "/v1/audio/speech", {"model": "m", "input": "hello"})
    assert status == 200 and headers["content-type"] == "audio/wav"
    assert set(body) == set(range(256)) and int(headers["content-length"]) == len(body)


def test_multipart_transcription_reads_the_model_part(box: SimBox) -> None:
    boundary = "simboundary"
    payload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n"
               f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
               f"Content-Type: audio/wav\r\n\r\n").encode() + bytes(range(256)) + f"\r\n--{boundary}--\r\n".encode()
    ctype = f"multipart/form-data; boundary={boundary}"
    status, _, body = request(box, "POST", "/v1/audio/transcriptions", payload, {"Content-Type": ctype})
    assert status == 200 and "text" in json.loads(body)
    (call,) = box.calls
    assert (call.model, call.content_type, call.body_len) == ("m", ctype, len(payload))


def test_hang_then_client_leaves_is_recorded(box: SimBox) -> None:
    box.script("m", Behavior.hang(5))
    with pytest.raises(TimeoutError):
        request(box, "POST", "/v1/chat/completions", CHAT, timeout=0.3)
    wait_for(lambda: box.calls[0].client_closed_at is not None)
    assert box.calls[0].status is None and box.residents["m"]["busy"] == 0


def test_cold_load_is_silence_after_the_stream_head(box: SimBox) -> None:
    box.load_s = 2.0
    conn = http.client.HTTPConnection("127.0.0.1", box.port, timeout=5)
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**CHAT, "model": "cold", "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200 and box.residents["cold"]["state"] == "loading"  # the head came before the load
    # real time: the box's load is a sleep on its loop; a lower bound
    assert frames(resp.read())[-1] == "[DONE]" and time.monotonic() - t0 >= 2.0
    wait_for(lambda: box.residents["cold"]["state"] == "idle")


def test_cancel_by_parent_id_ends_the_call(box: SimBox) -> None:
    box.script("m", Behavior.hang(5))
    result: list[int] = []
    caller = threading.Thread(target=lambda: result.append(
        request(box, "POST", "/v1/chat/completions", CHAT, {"X-Hugpy-Parent-Request-Id": "rt-9"})[0]))
    caller.start()
    wait_for(lambda: box.calls)
    status, _, body = request(box, "POST", "/v1/requests/rt-9/cancel")
    assert status == 202 and json.loads(body) == {"request_id": "rt-9", "state": "cancelling"}
    caller.join(2)
    assert result == [499] and box.cancels == ["rt-9"]


def test_reset_die_after_and_raw(box: SimBox) -> None:
    box.script("m", Behavior.reset(), Behavior.die_after(1), Behavior.raw(418, [("X-Odd", "1")], b"teapot"))
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        request(box, "POST", "/v1/chat/completions", CHAT)
    status, _, body = request(box, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and len(frames(body)) == 2  # role frame + 1 content frame, no [DONE]
    status, headers, body = request(box, "POST", "/v1/chat/completions", CHAT)
    assert (status, headers["x-odd"], body) == (418, "1", b"teapot")


def test_pipelined_requests_are_answered_in_order(box: SimBox) -> None:
    sock = socket.create_connection(("127.0.0.1", box.port), timeout=2)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\nGET /health?q HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    sock.close()
    assert re.findall(rb"HTTP/1\.1 (\d+) ", raw) == [b"200", b"404", b"200"]
