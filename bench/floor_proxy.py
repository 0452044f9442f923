"""The floor: a bare proxy on the router's own stack, measured beside the router in every run.

Granian (embedded, on uvloop, the router's server settings) in front of one box through
router.upstream.pool: the body read, one keep-alive request to the box, the answer passed back
(whole when sized, else chunk by chunk), and nothing else: no access check, decision,
reservation, first-frame hold, route-log row or metrics. The router's CPU above this floor is
what the router itself costs; the floor above a direct call is the stack's own price
(the project's stack notes §2, not in this repository, measured the same on an httptools proxy).

    PYTHONPATH=. .venv/bin/python bench/floor_proxy.py --interface asgi|rsgi --box http://127.0.0.1:PORT

(bench/run.py runs it with PYTHONPATH on the run's router snapshot) prints `floor listening on http://127.0.0.1:PORT` once it serves; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

import uvloop

from router.serve import server  # the router's own Granian settings
from router.upstream.pool import Origin, request_head

HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length"})


class FloorApp:
    def __init__(self, origin: Origin) -> None:
        self.origin = origin

    async def _exchange(self, method: str, target: str, content_type: str | None, body: bytes):
        extra = f"content-type: {content_type}\r\n".encode("latin-1") if content_type else b""
        exchange = await self.origin.send(request_head(method, target, self.origin, extra, len(body)), body)
        await exchange.head
        headers = [(k.lower(), v) for k, v in exchange.headers if k.lower() not in HOP]
        return exchange, headers, exchange.header(b"content-length")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        declared = int(declared) if declared is not None and declared.isdigit() else None
        parts = []
        size = 0
        while True:  # a declared body ends at its length, as the router reads it (serve/edge.py invariant 8)
            message = await receive()
            body = message.get("body", b"")
            parts.append(body)
            size += len(body)
            if size == declared or not message.get("more_body"):
                break
        content_type = headers.get(b"content-type")
        exchange, headers, length = await self._exchange(
            scope["method"], scope["path"], content_type.decode("latin-1") if content_type else None, b"".join(parts))
        try:
            if length is not None:
                data = await exchange.read_all(1 << 20)
                headers.append((b"content-length", length))
                await send({"type": "http.response.start", "status": exchange.status, "headers": headers})
                await send({"type": "http.response.body", "body": data})
                return
            await send({"type": "http.response.start", "status": exchange.status, "headers": headers})
            while chunks := await exchange.next_chunks():
                await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            exchange.done()

    async def __rsgi__(self, scope, proto) -> None:
        if scope.proto != "http":
            return
        body = await proto()
        exchange, headers, length = await self._exchange(
            scope.method, scope.path, scope.headers.get("content-type"), body)
        try:
            text_headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
            if length is not None:
                proto.response_bytes(exchange.status, text_headers, await exchange.read_all(1 << 20))
                return
            stream = proto.response_stream(exchange.status, text_headers)
            while chunks := await exchange.next_chunks():
                await stream.send_bytes(b"".join(chunks))
        finally:
            exchange.done()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--interface", choices=("asgi", "rsgi"), default="asgi")
    parser.add_argument("--box", required=True, help="the box's base URL")
    args = parser.parse_args()
    box = urlsplit(args.box)
    host = "127.0.0.1"
    port = server.free_port(host)
    config = server.ServeConfig(host=host, port=port, boxes_path=Path("/dev/null"), interface=args.interface)
    max_conns = server.conns_per_listener(server.raise_fd_limit(), 1)
    granian = server.granian_server(FloorApp(Origin(box.hostname, box.port)), config, port, max_conns=max_conns)
    serving = asyncio.get_running_loop().create_task(granian.serve())
    await server.wait_listening(host, port, serving)
    print(f"floor listening on http://{host}:{port}", flush=True)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    await stopping.wait()
    granian.stop()
    await asyncio.wait({serving}, timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(uvloop.run(main()))
