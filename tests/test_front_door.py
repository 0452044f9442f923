"""The OpenAI front door end to end: the official `openai` client → router → sim boxes.
The router runs in the test process (tests/inproc.py), as a `router serve` process where the
case is about the process (its memory, SIGTERM).

Each test names the rule of the box-choice contract (DESIGN.md) or the issue item it pins.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import openai
import psutil
import pytest

from router.sim.hugpy import Behavior, SimBox

from conftest import wait_for

KEY_A = "hpk_box_secret-key-of-box-a-000000000000"


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="client-key", max_retries=0, timeout=30)


def chat(router, model: str, **extra):
    return client(router).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hello"}], **extra
    )


def post(router, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def calls(box: SimBox) -> list:
    return [c for c in box.calls if c.path.startswith("/v1/")]


def test_non_stream_call_is_proxied_with_ids_and_the_box_key(start_fleet_in_process):
    a = SimBox("a", key=KEY_A, catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    raw = chat(router, "tiny")
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert raw.headers["x-hugpy-box"] == "a"
    call_id = raw.headers["x-hugpy-router-request-id"]
    (record,) = calls(a)
    assert record.parent_id == call_id
    assert record.headers["authorization"] == f"Bearer {KEY_A}"
    assert record.headers["host"] == a.url.removeprefix("http://")
    assert KEY_A not in json.dumps(dict(raw.headers))


def test_client_authorization_and_forwarding_headers_never_reach_the_box(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    # A forwarded call from an untrusted peer is outside: open the use routes for this test.
    router = start_fleet_in_process(a, env={"HUGPY_ROUTER_REQUIRE_KEY": "never"})
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()
    status, _, _ = post(
        router, "/v1/chat/completions", body,
        {"Authorization": "Bearer client-secret", "X-Forwarded-For": "203.0.113.5",
         "Forwarded": "for=203.0.113.5", "X-Real-IP": "203.0.113.5"},
    )
    assert status == 200
    (record,) = calls(a)
    assert "authorization" not in record.headers
    for name in ("x-forwarded-for", "forwarded", "x-real-ip"):
        assert name not in record.headers


def test_stream_call_relays_every_frame(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=7)
    router = start_fleet_in_process(a)
    stream = client(router).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) == 7
    assert calls(a)[0].stream is True


def test_serving_first_beats_load_even_against_file_order(start_fleet_in_process):
    loader = SimBox("loader", catalog=["tiny"])
    server = SimBox("server", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(loader, server)
    raw = chat(router, "tiny")
    assert raw.headers["x-hugpy-box"] == "server"
    assert not calls(loader)


def test_load_tier_prefers_more_free_gpu_memory(start_fleet_in_process):
    small = SimBox("small", catalog=["tiny"], free_gpu_bytes=1 << 30)
    big = SimBox("big", catalog=["tiny"], free_gpu_bytes=8 << 30)
    router = start_fleet_in_process(small, big)
    assert chat(router, "tiny").headers["x-hugpy-box"] == "big"


def test_a_resident_with_other_settings_is_a_load(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a, b)
    # Both serve tiny with default settings: file order picks a for the ram-only load.
    assert chat(router, "tiny@ram-only").headers["x-hugpy-box"] == "a"
    # a now runs tiny@ram-only (the router sent it); the same settings are served by a,
    assert chat(router, "tiny@RAM-only").headers["x-hugpy-box"] == "a"
    # and a default call is served by b, whose seat still runs the default settings.
    assert chat(router, "tiny").headers["x-hugpy-box"] == "b"


def test_pin_is_honoured_over_a_better_box(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    router = start_fleet_in_process(a, b)
    raw = chat(router, "tiny", extra_body={"alloc": {"worker": "b"}})
    assert raw.headers["x-hugpy-box"] == "b"
    assert not calls(a)


def test_pin_by_header(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    router = start_fleet_in_process(a, b)
    raw = chat(router, "tiny", extra_headers={"X-Router-Box": "b"})
    assert raw.headers["x-hugpy-box"] == "b"


def test_a_pinned_box_that_refuses_is_never_rerouted(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    b.script("tiny", Behavior.refuse(503, "insufficient_resources", "won't fit: test"))
    router = start_fleet_in_process(a, b)
    with pytest.raises(openai.APIStatusError) as info:
        chat(router, "tiny", extra_body={"alloc": {"worker": "b"}})
    assert info.value.status_code == 503
    assert info.value.body["type"] == "insufficient_resources"
    assert not calls(a)


def test_a_pin_cannot_override_the_gate(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["other"])
    router = start_fleet_in_process(a, b)
    with pytest.raises(openai.APIStatusError) as info:
        chat(router, "tiny", extra_body={"alloc": {"worker": "b"}})
    assert info.value.status_code == 503
    error = info.value.body
    assert error["code"] == "no_box"
    assert error["reasons"]["b"].startswith("no_model")
    assert not calls(a) and not calls(b)


def test_refusal_503_fails_over_to_the_next_box(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    a.script("tiny", Behavior.refuse(503, "insufficient_resources", "won't fit"))
    router = start_fleet_in_process(a, b)
    assert chat(router, "tiny").headers["x-hugpy-box"] == "b"
    assert len(calls(a)) == 1 and len(calls(b)) == 1


def test_in_band_load_error_on_a_stream_fails_over(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"], chunks=3)
    a.script("tiny", Behavior.in_band("load_error", "load failed: child exited rc=1"))
    router = start_fleet_in_process(a, b)
    raw = client(router).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert raw.headers["x-hugpy-box"] == "b"
    chunks = [c for c in raw.parse() if c.choices and c.choices[0].delta.content]
    assert len(chunks) == 3


def test_connect_refused_fails_over(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    router = start_fleet_in_process(a, b)
    port = a.port
    router.fleet.stop_box(a)  # the box dies while the router still holds it online
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert chat(router, "tiny").headers["x-hugpy-box"] == "b"


def test_a_400_passes_through_exactly(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    body = b'{"error": {"message": "bad thing", "code": 400}}'
    a.script("tiny", Behavior.raw(400, [("Content-Type", "application/json; charset=x-test")], body))
    router = start_fleet_in_process(a, b)
    payload = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()
    status, headers, data = post(router, "/v1/chat/completions", payload)
    assert (status, data) == (400, body)
    assert headers["content-type"] == "application/json; charset=x-test"
    assert headers["x-hugpy-box"] == "a"
    assert not calls(b)


def test_unknown_model_is_503_no_box_with_every_reason_and_no_box_contacted(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    router = start_fleet_in_process(a, b, boxes_extra={"b": {"blocked": True}})
    with pytest.raises(openai.APIStatusError) as info:
        chat(router, "nope")
    assert info.value.status_code == 503
    error = info.value.body
    assert error["code"] == "no_box"
    assert error["reasons"]["a"].startswith("no_model")
    assert error["reasons"]["b"] == "blocked"
    assert not calls(a) and not calls(b)


def test_never_more_than_three_boxes_per_call(start_fleet_in_process):
    boxes = [SimBox(f"b{i}", catalog=["tiny"]) for i in range(4)]
    for box in boxes:
        box.script("tiny", Behavior.refuse(503, "load_error", f"load failed on {box.name}"))
    router = start_fleet_in_process(*boxes)
    with pytest.raises(openai.APIStatusError) as info:
        chat(router, "tiny")
    assert info.value.status_code == 503
    assert info.value.body["type"] == "load_error"
    assert sum(len(calls(box)) for box in boxes) == 3


def test_client_disconnect_while_waiting_closes_the_box_call(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    a.script("tiny", Behavior.hang(10))
    router = start_fleet_in_process(a)
    host, port = router.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    assert wait_for(lambda: calls(a), 5)
    sock.close()
    record = calls(a)[0]
    # The box stops working on it: its socket closed (no status), or the router's cancel arrived
    # first (499, §7); either way before its own answer (10 s away), which would have been a 200.
    assert wait_for(lambda: record.finished_at is not None, 5)
    assert record.status in (None, 499)
    assert wait_for(lambda: record.parent_id in a.cancels, 3)


def test_a_stalled_reader_keeps_router_memory_bounded(start_fleet):
    big = bytes(range(256)) * (4 * 65536)  # 64 MiB answer
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    a.script("tiny", Behavior.raw(200, [("Content-Type", "application/octet-stream")], big))
    router = start_fleet(a)
    proc = psutil.Process(router.pid)
    host, port = router.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "input": "x"})
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    before = proc.memory_info().rss
    sock.sendall(
        f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    sock.recv(1024)  # the head arrived: the router committed and is relaying
    time.sleep(3)  # the client stops reading
    grown = proc.memory_info().rss - before
    sock.close()
    assert grown < 16 * (1 << 20), f"router grew {grown / (1 << 20):.1f} MiB for a stalled reader"


def test_multipart_upload_is_routed_by_its_model_field(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"])
    w = SimBox("w", catalog=["whisper"])
    router = start_fleet_in_process(a, w)
    result = client(router).audio.transcriptions.with_raw_response.create(
        model="whisper", file=("clip.wav", b"RIFF" + bytes(5000), "audio/wav")
    )
    assert result.headers["x-hugpy-box"] == "w"
    (record,) = calls(w)
    assert record.content_type.startswith("multipart/form-data")
    assert record.body_len > 5000
    assert not calls(a)


def test_binary_answer_passes_through_byte_for_byte(start_fleet_in_process):
    a = SimBox("a", catalog=["kokoro"], residents=["kokoro"])
    router = start_fleet_in_process(a)
    audio = client(router).audio.speech.create(model="kokoro", voice="af", input="hello")
    assert audio.content == bytes(range(256)) * 16


def test_models_lists_the_union_with_boxes_and_residents(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny", "big"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    router = start_fleet_in_process(a, b)
    models = {m.id: m for m in client(router).models.list()}
    assert set(models) == {"tiny", "big"}
    assert models["tiny"].model_extra["boxes"] == ["a", "b"]
    assert models["tiny"].model_extra["resident_on"] == ["a"]


@pytest.mark.parametrize(
    "body, code",
    [
        (b'{"model": "tiny", ', "invalid_request"),
        (b'[{"model": "tiny"}]', "invalid_request"),
        (b'{"messages": []}', "model_required"),
        (b'{"model": 42}', "model_required"),
        (b'{"model": "tiny", "alloc": "a"}', "invalid_request"),
        (b"", "invalid_request"),
    ],
)
def test_bad_bodies_get_a_clear_400_and_no_box_is_contacted(start_fleet_in_process, body, code):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    status, headers, data = post(router, "/v1/chat/completions", body)
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert json.loads(data)["error"]["code"] == code
    assert not calls(a)


def test_a_body_over_the_limit_is_413(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a, extra_args=("--max-body", "1k"))
    body = json.dumps({"model": "tiny", "input": "x" * 4000}).encode()
    status, _, data = post(router, "/v1/embeddings", body)
    assert status == 413
    assert json.loads(data)["error"]["code"] == "body_too_large"
    assert not calls(a)


def test_unknown_route_and_wrong_method(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    status, _, data = post(router, "/v1/nowhere", b"{}")
    assert status == 404 and json.loads(data)["error"]["code"] == "unknown_route"
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/v1/chat/completions")
    resp = conn.getresponse()
    assert resp.status == 405
    assert json.loads(resp.read())["error"]["code"] == "method_not_allowed"
    assert not calls(a)


def test_sigterm_stops_cleanly(start_fleet):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a)
    assert router.stop() == 0


def test_the_rsgi_interface_serves_the_same_calls(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    # 4 chunks 40 ms apart: a stream that lives through CallClock ticks
    b = SimBox("b", catalog=["tiny"], chunks=4, cadence_s=0.04)
    a.script("tiny", Behavior.in_band("load_error", "load failed"))
    router = start_fleet_in_process(a, b, extra_args=("--interface", "rsgi"))
    raw = client(router).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert raw.headers["x-hugpy-box"] == "b"
    assert len([c for c in raw.parse() if c.choices and c.choices[0].delta.content]) == 4
    assert chat(router, "tiny").parse().choices[0].message.content
    # The openai client stops at `data: [DONE]`; a plain HTTP client reads to the end of the
    # chunked body, which Granian sends only once the router lets go of the stream.
    host, port = router.url.removeprefix("http://").split(":")
    for _ in range(2):
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
            headers={"Content-Type": "application/json", "X-Router-Box": "b"})
        answer = conn.getresponse()
        assert answer.read().endswith(b"data: [DONE]\n\n")  # times out if the stream never ends
        conn.close()


def test_the_pool_gate_routes_by_alloc_pool_or_header(start_fleet_in_process):
    gpu = SimBox("gpu", catalog=["tiny"], residents=["tiny"])
    cpu = SimBox("cpu", catalog=["tiny"])
    router = start_fleet_in_process(gpu, cpu, boxes_extra={"gpu": {"pool": "gpu"}, "cpu": {"pool": "cpu"}})
    assert chat(router, "tiny", extra_body={"alloc": {"pool": "cpu"}}).headers["x-hugpy-box"] == "cpu"
    assert chat(router, "tiny", extra_headers={"X-Router-Pool": "cpu"}).headers["x-hugpy-box"] == "cpu"
    with pytest.raises(openai.APIStatusError) as info:
        chat(router, "tiny", extra_body={"alloc": {"pool": "tpu"}})
    assert info.value.body["reasons"] == {"gpu": "other_pool: gpu", "cpu": "other_pool: cpu"}
