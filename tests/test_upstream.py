"""The upstream pool against a real loopback server: keep-alive reuse after flow control."""

from __future__ import annotations

import asyncio

import uvloop

from router.upstream.pool import HIGH_WATER_BYTES, Deadline, FirstByteTimeout, Origin, request_head

BODY = b"y" * (HIGH_WATER_BYTES * 9 // 8)  # its last read crosses the pause mark and ends the answer


async def _box(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = await reader.read(65536)
            if not chunk:
                return
            head += chunk
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
        await writer.drain()


def test_a_connection_paused_for_a_slow_reader_goes_back_to_the_pool_readable():
    async def main() -> tuple[int, int]:
        server = await asyncio.start_server(_box, "127.0.0.1", 0)
        origin = Origin("127.0.0.1", server.sockets[0].getsockname()[1])
        head = request_head("GET", "/", origin, b"", 0)
        try:
            first = await origin.send(head, b"")
            await first.head
            await asyncio.sleep(0.3)  # a slow reader: the whole answer arrives while paused
            assert len(await first.read_all(1 << 30)) == len(BODY)
            first.done()
            second = await origin.send(head, b"")
            assert second.reused
            second.keep(Deadline(3, FirstByteTimeout("the reused connection is not being read")), timer=True)
            await second.head
            data = await second.read_all(1 << 30)
            second.done()
            return second.status, len(data)
        finally:
            origin.close()
            server.close()

    assert uvloop.run(main()) == (200, len(BODY))
