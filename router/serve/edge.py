"""The client side of a call, over Granian's ASGI or RSGI interface, behind one small API.

Why two: RSGI is Granian's fastest interface, but its response stream has no write
backpressure (contracts/stack-notes.md §1.4: a stalled reader let 512 MiB queue in 1.25 s),
while its ASGI `send` waits for the client since 2.8. The proxy bounds what it buffers per
stream (upstream.pool HIGH_WATER_BYTES) only if a write waits for the client, so ASGI is the
default and RSGI is kept for trusted, fast clients and for measuring the bound's cost.

Invariants:
1. `read_body` never holds more than `limit` bytes: a declared larger body is refused before
   it is read, an undeclared one as soon as it passes the limit. A large body's pieces are
   joined off the loop (JOIN_ON_LOOP_BYTES).
2. Header names given to `respond`/`start` are lower-case bytes; values bytes.
3. `watch_disconnect(callback)` calls `callback()` at most once, when the client goes away; the
   returned task is cancelled by the caller when the call ends.
4. `finish()` ends a streamed answer; after it, the edge holds nothing that keeps the answer open.
5. Every answer carries ANSWER_HEADERS (nosniff and a CSP that runs no script and allows no
   framing), except the dashboard's own files, which `respond_page` sends under their own CSP.
6. `client` is the TCP peer's address in one form on both interfaces (`::1`, never `[::1]`),
   `port` its port as the interface gives it (Granian's ASGI: text; "" when unknown); `caller`
   is who the access gate found calling (None: unknown, or not judged).
7. `headers` is the request's headers by name, which `header` reads (`get`, `in`, iteration
   over the names): for a caller that asks about several names on every call (affinity's session
   headers) without a Python call per name.
8. A body with a Content-Length is read until that many bytes are in, not until the interface
   says it ended: Granian's ASGI hands a small body over in a message saying more may come, and
   then an empty one saying none does, a second receive (a hop to its Rust side and a
   suspension, ~9 µs of CPU a call: bench/floor_proxy.py measured 130 -> 121 µs a call). HTTP/1.1
   framing ends such a body at its length, and Granian keeps the connection alive without the
   last message being read (a later receive, the disconnect watcher's, returns it and reads on).
"""

from __future__ import annotations

import asyncio
from typing import Callable, Mapping, Protocol

from router._fastpath import header_map
from router.core.access import peer_address


# Every answer names the router: Granian adds `server: granian` to an answer without one (issue
# 11 item 8: the front door does not advertise its stack). The proxy drops the box's own.
SERVER = (b"server", b"router")
# Every answer but the dashboard's own files (`respond_page`) is data, never a page of the
# router's origin: a box's `text/html` (hostile, or a relayed management page) opened in a
# browser, or posted to by a cross-site form, would run script that passes the admin Origin
# check (issue 20 item 1). `sandbox` gives the document an opaque origin, `default-src 'none'`
# loads nothing, `frame-ancestors 'none'` keeps it out of frames; `nosniff` stops a browser from
# reading JSON or text as HTML or script. Built once: each answer extends its list with them.
ANSWER_HEADERS = (
    SERVER,
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"sandbox; default-src 'none'; frame-ancestors 'none'"),
)
ANSWER_HEADERS_STR = tuple((k.decode(), v.decode()) for k, v in ANSWER_HEADERS)
PAGE_HEADERS_STR = (("server", "router"),)


class BodyTooLarge(Exception):
    pass


class ClientLeft(Exception):
    """The client disconnected, as a read of its body found (both interfaces) or a write (RSGI
    only: on ASGI, Granian drops a write to a gone client silently, granian#650, so there the
    disconnect watcher is what notices a client that left mid-answer)."""


# A body up to this size is joined on the loop (~0.1 ms). A larger one on a worker thread:
# bytes.join drops the GIL while it copies a large result (CPython >= 3.9), and a 60 MB join,
# faulting in fresh pages, took 40-330 ms here (bench/body_stall.py), all of it a loop stall.
JOIN_ON_LOOP_BYTES = 256 << 10


async def _joined(parts: list[bytes], size: int) -> bytes:
    if size <= JOIN_ON_LOOP_BYTES:
        return b"".join(parts)
    return await asyncio.get_running_loop().run_in_executor(None, b"".join, parts)


def _content_length(value: str | None) -> int | None:
    if value is None or not value.isdigit():
        return None
    return int(value)


class Edge(Protocol):
    """What the app, the proxy and the admin API use of a request and its answer; AsgiEdge and
    RsgiEdge are the two implementations (tests/test_edge_protocol.py checks both)."""

    method: str
    path: str
    query: str
    client: str  # the TCP peer's address (invariant 6)
    port: str | int  # the TCP peer's port, as the interface gives it (invariant 6)
    caller: str | None  # who the access gate found calling
    key_id: str | None  # the valid key it presented, by id (`admin`: HUGPY_ROUTER_KEY); tenancy
    batch_id: str | None  # the batch a line of it belongs to (serve/batches.py); None: a client's call
    custom_id: str | None  # that line's id in its batch

    headers: Mapping[str, str]  # the request's headers by name (invariant 7)
    # header(name): the value of header `name` (lower-case), or None. The mapping's own `get`,
    # bound once: a call reads ~25 headers, and a method would cost a Python frame each.
    header: Callable[[str], str | None]

    def header_lines(self, name: str) -> str | None: ...

    async def read_body(self, limit: int) -> bytes: ...

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...

    async def respond_page(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def finish(self) -> None: ...

    def watch_disconnect(self, callback: Callable[[], None]) -> asyncio.Task: ...


class AsgiEdge:
    __slots__ = ("scope", "receive", "send", "method", "path", "query", "client", "port", "caller", "key_id",
                 "headers", "header", "batch_id", "custom_id")

    def __init__(self, scope: dict, receive, send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: str = scope["query_string"].decode("latin-1")
        client = scope.get("client")
        self.client: str = client[0] if client else ""
        self.port: str | int = client[1] if client else ""
        self.caller: str | None = None
        self.key_id: str | None = None  # the valid key it presented (the access gate's)
        self.batch_id = self.custom_id = None  # a client's call is no batch's line
        self.headers = header_map(scope["headers"])
        self.header = self.headers.get

    def header_lines(self, name: str) -> str | None:
        """Every line of header `name`, joined with `,` in order (RFC 9110 §5.3), or None."""
        key = name.encode("latin-1")
        lines = [v.decode("latin-1") for k, v in self.scope["headers"] if k == key]
        return ",".join(lines) if lines else None

    async def read_body(self, limit: int) -> bytes:
        declared = _content_length(self.header("content-length"))
        if declared is not None and declared > limit:
            raise BodyTooLarge()
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft()
            body = message.get("body", b"")
            if body:
                size += len(body)
                if size > limit:
                    raise BodyTooLarge()
                parts.append(body)
            # A declared body is whole once its bytes are in (invariant 8): Granian's closing
            # empty message is not waited for.
            if size == declared or not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else await _joined(parts, size)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        headers.append((b"content-length", b"%d" % len(body)))
        headers += ANSWER_HEADERS
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def respond_page(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A dashboard file: `headers` carry its own CSP (invariant 5)."""
        headers.append((b"content-length", b"%d" % len(body)))
        headers.append(SERVER)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        headers += ANSWER_HEADERS
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self) -> None:
        await self.send({"type": "http.response.body", "body": b""})

    def watch_disconnect(self, callback: Callable[[], None]) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._watch(callback))

    async def _watch(self, callback: Callable[[], None]) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                callback()
                return


def _str_headers(
    headers: list[tuple[bytes, bytes]], tail: tuple[tuple[str, str], ...] = ANSWER_HEADERS_STR
) -> list[tuple[str, str]]:
    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
    out += tail
    return out


class RsgiEdge:
    __slots__ = ("scope", "proto", "method", "path", "query", "client", "port", "caller", "key_id", "headers",
                 "header", "batch_id", "custom_id", "stream")

    def __init__(self, scope, proto) -> None:
        self.scope = scope
        self.proto = proto
        self.method: str = scope.method
        self.path: str = scope.path
        self.query: str = scope.query_string
        self.client: str = peer_address(scope.client) if scope.client else ""
        self.port: str | int = scope.client.rpartition(":")[2] if scope.client else ""  # "ip:port", "[v6]:port"
        self.caller: str | None = None
        self.key_id: str | None = None  # the valid key it presented (the access gate's)
        self.batch_id = self.custom_id = None  # a client's call is no batch's line
        self.headers = scope.headers
        self.header = scope.headers.get
        self.stream = None

    def header_lines(self, name: str) -> str | None:
        """Every line of header `name`, joined with `,` in order (RFC 9110 §5.3), or None."""
        lines = self.scope.headers.get_all(name)
        return ",".join(lines) if lines else None

    async def read_body(self, limit: int) -> bytes:
        declared = _content_length(self.header("content-length"))
        if declared is not None and declared > limit:
            raise BodyTooLarge()
        try:
            # A small declared body in one piece; a large one piece by piece, since Granian
            # builds the one piece holding the GIL (a 60 MB body stalled the loop ~90 ms).
            if declared is not None and declared <= JOIN_ON_LOOP_BYTES:
                return await self.proto()
            parts: list[bytes] = []
            size = 0
            async for chunk in self.proto:
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge()
                parts.append(chunk)
            return await _joined(parts, size)
        except RuntimeError:  # granian.rsgi.ProtocolClosed: the client left mid-upload
            raise ClientLeft() from None

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.proto.response_bytes(status, _str_headers(headers), body)

    async def respond_page(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A dashboard file: `headers` carry its own CSP (invariant 5)."""
        self.proto.response_bytes(status, _str_headers(headers, PAGE_HEADERS_STR), body)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.stream = self.proto.response_stream(status, _str_headers(headers))

    async def write(self, data: bytes) -> None:
        try:
            await self.stream.send_bytes(data)
        except RuntimeError:  # granian.rsgi.ProtocolClosed: the client left
            raise ClientLeft() from None

    async def finish(self) -> None:
        # Granian ends an RSGI stream when its transport object is released, not when the app
        # returns: drop ours now, so that nothing which outlives the answer can hold it open.
        self.stream = None

    def watch_disconnect(self, callback: Callable[[], None]) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._watch(callback))

    async def _watch(self, callback: Callable[[], None]) -> None:
        await self.proto.client_disconnect()
        callback()
