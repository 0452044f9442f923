"""Box answers are bounded, and a box's silence is timed only while the router waits for it
(issue 11, items 8 and 9): the upstream pool against raw asyncio servers on loopback that
break HTTP in the ways a broken or hostile box would, and the router in front of them."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import uvloop

from router.serve.attempt import ERROR_BODY_LIMIT
from router.sim import SimBox
from router.upstream.fetch import fetch
from router.upstream.pool import MAX_HEAD_BYTES, MAX_HEADERS, BadResponse, Deadline, Exchange, Origin, StreamIdle

from support.boxes import JSON_HEAD, RawBox, answer_with
from support.calls import MESSAGES
from support.raw_calls import assert_openai_error, client, error_lines, post_chat, row_of

pytestmark = pytest.mark.timeout(60)


# -- the stream idle deadline (item 9) ----------------------------------------------------------


def test_the_idle_deadline_runs_only_while_the_reader_waits_for_the_box():
    """A reader busy writing to a slow client (no waiter) is not a silent box; new bytes push
    the deadline on; silence while the reader waits fails the exchange."""

    async def main():
        loop = asyncio.get_running_loop()
        exchange = Exchange(None, loop, reused=False)  # type: ignore[arg-type]  # no socket: fed by hand
        exchange.keep(Deadline(1.0, StreamIdle("silent"), silence=True))
        now = loop.time()
        exchange.expire(now + 5.0)  # the reader is elsewhere (writing): the clock restarts
        assert exchange.error is None
        exchange.waiter = loop.create_future()  # now it waits for the box
        exchange.expire(now + 5.9)
        assert exchange.error is None
        exchange._feed(b"data: 1\n\n")  # the box spoke
        exchange.expire(now + 6.5)
        exchange.expire(now + 7.4)
        assert exchange.error is None
        exchange.expire(now + 7.6)
        assert isinstance(exchange.error, StreamIdle)

    uvloop.run(main())


# -- a box that lies in its head (item 8) ---------------------------------------------------------


def headers_then_body(count: int) -> bytes:
    """A whole answer with `count` header lines in all (Content-Type and Content-Length included)."""
    lines = b"".join(b"X-Filler-%d: v\r\n" % n for n in range(count - 2))
    return JSON_HEAD + lines + b"Content-Length: 2\r\n\r\n{}"


async def endless_header(writer: asyncio.StreamWriter) -> None:
    """A header value that never ends, written as fast as the peer reads it."""
    writer.write(JSON_HEAD + b"X-Endless: ")
    piece = b"a" * 65536
    while True:
        writer.write(piece)
        await writer.drain()


def fetch_from(answer) -> tuple[int, bytes]:
    """(status, body) of one pool request (what every link does) to a RawBox answering `answer`."""

    async def main():
        box = RawBox("raw", answer)
        await box.start()
        origin = Origin("127.0.0.1", box.port)
        try:
            status, _, body = await fetch(origin, "POST", "/v1/chat/completions", body=b"{}", timeout_s=5.0)
            return status, body
        finally:
            origin.close()
            await box.stop()

    return uvloop.run(main())


def test_a_link_read_of_a_head_that_never_ends_fails_fast():
    with pytest.raises(BadResponse, match="head over 65536 bytes"):
        fetch_from(endless_header)


@pytest.mark.parametrize(("lines", "ok"), [(MAX_HEADERS, True), (MAX_HEADERS + 1, False)])
def test_at_most_100_header_lines(lines, ok):
    if ok:
        assert fetch_from(answer_with(headers_then_body(lines))) == (200, b"{}")
    else:
        with pytest.raises(BadResponse, match="over 100 headers"):
            fetch_from(answer_with(headers_then_body(lines)))


def test_a_head_over_the_limit_in_one_read_is_refused_too():
    big = JSON_HEAD + b"X-Big: " + b"b" * MAX_HEAD_BYTES + b"\r\nContent-Length: 2\r\n\r\n{}"
    with pytest.raises(BadResponse, match="head over 65536 bytes"):
        fetch_from(answer_with(big))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_a_box_whose_head_never_ends_gets_a_502_and_router_memory_stays_flat(start_fleet):
    raw = RawBox("raw", endless_header)
    router = start_fleet(raw)
    answers = []
    for n in range(40):
        if n == 10:
            warm_kib = rss_kib(router.pid)
        answers.append(post_chat(router))
    grown_kib = rss_kib(router.pid) - warm_kib
    for status, headers, data in answers:
        assert status == 502 and assert_openai_error(status, data)["code"] == "bad_response"
        assert headers["x-hugpy-router-request-id"].startswith("rt-")
    assert raw.calls == 40
    # 30 more calls, each reading 64 KiB and more of head before giving up: nothing kept.
    assert grown_kib < 2048, f"router RSS grew {grown_kib} KiB over 30 endless heads"
    assert not error_lines(router)


@pytest.mark.parametrize("answer", [
    pytest.param(endless_header, id="endless-header"),
    pytest.param(answer_with(headers_then_body(200)), id="200-headers"),
    pytest.param(answer_with(JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"), id="bad-chunk-size"),
    pytest.param(answer_with(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                             b"\r\n-5\r\ndata: {}\r\n"), id="bad-chunk-size-stream"),
])
def test_a_box_that_breaks_http_before_the_first_byte_is_refused_and_the_next_owner_serves(start_fleet_in_process, answer):
    raw = RawBox("raw", answer)
    good = SimBox("good", catalog=["tiny"])
    router = start_fleet_in_process(raw, good)
    status, headers, data = post_chat(router)
    assert (status, headers["x-hugpy-box"]) == (200, "good"), data
    row = row_of(router, headers["x-hugpy-router-request-id"])
    assert [(att["box"], att.get("refusal")) for att in row["attempts"]] == [("raw", "bad_response"), ("good", None)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_bad_chunk_framing_from_the_only_owner_is_a_502_in_the_facades_shape(start_fleet_in_process, stream):
    content_type = b"text/event-stream" if stream else b"application/json"
    raw = RawBox("raw", answer_with(b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type +
                                    b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"))
    router = start_fleet_in_process(raw)
    with pytest.raises(openai.APIStatusError) as info:
        client(router).chat.completions.create(model="tiny", messages=MESSAGES, stream=stream)
    assert info.value.status_code == 502 and info.value.code == "bad_response"
    call_id = info.value.response.headers["x-hugpy-router-request-id"]
    row = row_of(router, call_id)
    assert (row["state"], row["http_status"], row["error"]) == ("failed", 502, "bad_response")


def test_the_boxes_server_cookie_via_and_cors_headers_are_not_passed_on(start_fleet_in_process):
    body = b'{"id": "x", "object": "chat.completion", "choices": []}'
    raw = RawBox("raw", answer_with(
        JSON_HEAD + b"Server: BoxServer/9.9\r\nSet-Cookie: session=box-secret\r\nVia: 1.1 box-proxy\r\n"
        b"Access-Control-Allow-Origin: *\r\nAccess-Control-Allow-Credentials: true\r\n"
        b"X-Powered-By: Express\r\nX-Internal-Host: gpu-7.corp\r\nx-internal-trace: 42\r\n"
        b"X-Box-Own: kept\r\nContent-Length: %d\r\n\r\n" % len(body) + body))
    router = start_fleet_in_process(raw)
    status, headers, data = post_chat(router)
    assert status == 200 and data == body
    assert headers["x-box-own"] == "kept"  # the box's other headers still go through
    assert "set-cookie" not in headers and "via" not in headers
    assert not [name for name in headers if name.startswith("access-control-")]
    assert "x-powered-by" not in headers  # issue 20 item 13: the box's stack and internals
    assert not [name for name in headers if name.startswith("x-internal-")]
    assert "BoxServer" not in headers.get("server", "")


# -- a box's error body reaches the client only as an API's error (issue 36 item 13) -------------

TRACEBACK = (b"Traceback (most recent call last):\n  File \"serve.py\", line 9, in chat\n"
             b"    connect(DB_PASSWORD=hunter2)\nRuntimeError: the database is down\n")


def error_answer(status: bytes, body: bytes, content_type: bytes = b"text/plain"):
    return answer_with(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type +
                       b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize("status", [b"500 Internal Server Error", b"503 Service Unavailable"], ids=["500", "503-last"])
def test_a_box_error_body_that_is_no_api_error_becomes_the_routers_own(start_fleet_in_process, status):
    router = start_fleet_in_process(RawBox("raw", error_answer(status, TRACEBACK)))
    code, headers, data = post_chat(router)
    assert code == int(status[:3]) and b"hunter2" not in data and b"Traceback" not in data
    error = json.loads(data)["error"]
    assert error["code"] == "box_error" and "raw" in error["message"] and status[:3].decode() in error["message"]
    assert headers["x-hugpy-box"] == "raw" and headers["content-type"] == "application/json"
    logged = [line for line in router.log_text().splitlines() if "no API's error" in line]
    assert len(logged) == 1 and "Traceback (most recent call last): File" in logged[0]  # one line


@pytest.mark.parametrize("body", [
    b'{"error": {"message": "context too long", "type": "invalid_request_error", "code": 400}}',
    b'{"error": "model is required"}',
    b'{"object": "error", "message": "context too long", "type": "BadRequestError", "code": 400}',
], ids=["openai", "ollama", "vllm-flat"])
def test_a_box_error_in_an_apis_shape_goes_back_as_sent(start_fleet_in_process, body):
    router = start_fleet_in_process(RawBox("raw", error_answer(b"400 Bad Request", body, b"application/json")))
    code, headers, data = post_chat(router)
    assert (code, data, headers["x-hugpy-box"]) == (400, body, "raw")


def test_an_error_body_over_the_limit_is_not_relayed(start_fleet_in_process):
    big = b"DB_PASSWORD=hunter2 " * (ERROR_BODY_LIMIT // 10)
    router = start_fleet_in_process(RawBox("raw", error_answer(b"500 Internal Server Error", big)))
    code, _, data = post_chat(router)
    assert code == 500 and len(data) < 1000 and json.loads(data)["error"]["code"] == "box_error"


def test_a_router_behind_the_router_names_one_box_and_one_call_id(start_fleet_in_process):
    """reply.py rule 3 (issue 36 item 13): a box that is itself a router sets X-Hugpy-Box and the
    call id too; the answer carries the outer router's, once each."""
    import http.client

    body = b'{"choices": []}'
    inner = RawBox("inner", answer_with(JSON_HEAD + b"X-Hugpy-Box: gpu7\r\nX-Hugpy-Router-Request-Id: inner-1\r\n"
                                        b"Content-Length: %d\r\n\r\n" % len(body) + body))
    router = start_fleet_in_process(inner)
    host, port = router.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": "tiny", "messages": MESSAGES}),
                     {"Content-Type": "application/json"})
        answer = conn.getresponse()
        answer.read()
        names = [name.lower() for name, _ in answer.getheaders()]
        assert answer.status == 200
        assert names.count("x-hugpy-box") == 1 and answer.getheader("x-hugpy-box") == "inner"
        assert names.count("x-hugpy-router-request-id") == 1 and answer.getheader("x-hugpy-router-request-id") != "inner-1"
    finally:
        conn.close()
