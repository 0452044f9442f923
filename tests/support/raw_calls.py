"""Requests as bytes (a body sent as given, a raw socket for what a client library will not
send), and the router's own record of its calls: the route_log rows through the admin cursor,
the ERROR lines of its log."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time

import openai

from conftest import wait_for
from support.calls import MESSAGES

ERROR_LINE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) ", re.MULTILINE)


def client(router, timeout: float = 15) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def address(router) -> tuple[str, int]:
    host, port = router.url.removeprefix("http://").split(":")
    return host, int(port)


def chat_body(model: str = "tiny", **extra) -> bytes:
    return json.dumps({"model": model, "messages": MESSAGES, **extra}).encode()


def request(router, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 15) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(*address(router), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def post_chat(router, model: str = "tiny", headers: dict | None = None, **extra) -> tuple[int, dict, bytes]:
    return request(router, "POST", "/v1/chat/completions", chat_body(model, **extra), headers)


def rows(router) -> list[dict]:
    """Every route_log row, through the admin cursor."""
    out, since = [], 0
    while True:
        status, _, data = request(router, "GET", f"/v1/telemetry?since={since}&limit=5000")
        assert status == 200, data
        doc = json.loads(data)
        out += doc["rows"]
        since = doc["next"]
        if not doc["more"]:
            return out


def row_of(router, call_id: str, timeout: float = 3.0) -> dict:
    """The route_log row of `call_id`, once the batched writer has it."""
    found = wait_for(lambda: next((r for r in rows(router) if r["request_id"] == call_id), None), timeout, 0.05)
    assert found is not None, f"no route_log row for {call_id}"
    return found


def error_lines(router) -> list[str]:
    return [line for line in router.log_text().splitlines() if ERROR_LINE.match(line)]


def assert_openai_error(status: int, data: bytes) -> dict:
    """A router-made or box-made error in OpenAI's shape, never a 500."""
    assert status != 500 and status >= 400, (status, data)
    doc = json.loads(data)
    assert isinstance(doc.get("error"), dict) and isinstance(doc["error"].get("message"), str), doc
    return doc["error"]


def raw_request(body: bytes, path: str = "/v1/chat/completions", length: int | None = None) -> bytes:
    """A POST's bytes on the wire: its head and `body` (Content-Length `length`, default the body's own)."""
    return (f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def open_raw(router, body: bytes, path: str = "/v1/chat/completions", length: int | None = None) -> socket.socket:
    """A raw client connection that has sent `raw_request(body, path, length)`."""
    sock = socket.create_connection(address(router))
    sock.sendall(raw_request(body, path, length))
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    seen = b""
    while marker not in seen:
        data = sock.recv(65536)
        if not data:
            break
        seen += data
    return seen


def hang_up(sock: socket.socket, call) -> None:
    """The client closes its connection: the box's call must end long before it would have
    (each caller's box call lasts 5 s or more). Real time: the router closes its box connection
    (or posts the cancel) on its loop, the box sees it on another thread."""
    left = time.monotonic()
    sock.close()
    assert wait_for(lambda: call.finished_at is not None, 3)
    assert call.finished_at - left < 2.5
