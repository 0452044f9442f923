"""The client side of a call, over Granian's ASGI or RSGI interface, behind one small API.

Why two: RSGI is Granian's fastest interface, but its response stream has no write
backpressure (contracts/stack-notes.md §1.4: a stalled reader let 512 MiB queue in 1.25 s),
while its ASGI `send` waits for the client since 2.8. The proxy bounds what it buffers per
stream (upstream.pool HIGH_WATER_BYTES) only if a write waits for the client, so ASGI is the
default and RSGI is kept for trusted, fast clients and for measuring the bound's cost.

Invariants:
1. `read_body` never holds more than `limit` bytes: a declared larger body is refused before
   it is read, an undeclared one as soon as it passes the limit.
2. Header names given to `respond`/`start` are lower-case bytes; values bytes.
3. `watch_disconnect(callback)` calls `callback()` at most once, when the client goes away; the
   returned task is cancelled by the caller when the call ends.
4. `finish()` ends a streamed answer; after it, the edge holds nothing that keeps the answer open.
"""

from __future__ import annotations

import asyncio
from typing import Callable


# Every answer names the router: Granian adds `server: granian` to an answer without one (issue
# 11 item 8: the front door does not advertise its stack). The proxy drops the box's own.
SERVER = (b"server", b"router")
SERVER_STR = ("server", "router")


class BodyTooLarge(Exception):
    pass


class ClientLeft(Exception):
    pass


def _content_length(value: str | None) -> int | None:
    if value is None or not value.isdigit():
        return None
    return int(value)


class AsgiEdge:
    __slots__ = ("scope", "receive", "send", "method", "path", "query", "client", "_headers")

    def __init__(self, scope: dict, receive, send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: str = scope["query_string"].decode("latin-1")
        client = scope.get("client")
        self.client: str = client[0] if client else ""
        self._headers: dict[str, str] | None = None

    def header(self, name: str) -> str | None:
        if self._headers is None:
            self._headers = {
                k.decode("latin-1"): v.decode("latin-1") for k, v in self.scope["headers"]
            }
        return self._headers.get(name)

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
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        headers.append((b"content-length", b"%d" % len(body)))
        headers.append(SERVER)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        headers.append(SERVER)
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


def _str_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
    out.append(SERVER_STR)
    return out


class RsgiEdge:
    __slots__ = ("scope", "proto", "method", "path", "query", "client", "stream")

    def __init__(self, scope, proto) -> None:
        self.scope = scope
        self.proto = proto
        self.method: str = scope.method
        self.path: str = scope.path
        self.query: str = scope.query_string
        self.client: str = scope.client.rsplit(":", 1)[0] if scope.client else ""
        self.stream = None

    def header(self, name: str) -> str | None:
        return self.scope.headers.get(name)

    async def read_body(self, limit: int) -> bytes:
        declared = _content_length(self.header("content-length"))
        if declared is not None and declared > limit:
            raise BodyTooLarge()
        try:
            if declared is not None:
                return await self.proto()
            parts: list[bytes] = []
            size = 0
            async for chunk in self.proto:
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge()
                parts.append(chunk)
            return b"".join(parts)
        except RuntimeError:  # granian.rsgi.ProtocolClosed: the client left mid-upload
            raise ClientLeft() from None

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.proto.response_bytes(status, _str_headers(headers), body)

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
