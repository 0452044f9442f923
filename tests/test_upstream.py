"""The upstream pool against a real loopback server: keep-alive reuse after flow control, spares."""

from __future__ import annotations

import asyncio

import uvloop

from router.upstream.pool import HIGH_WATER_BYTES, MAX_SPARES, FirstByteTimeout, Origin, request_head

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
            second.arm_timeout(3, FirstByteTimeout("the reused connection is not being read"))
            await second.head
            data = await second.read_all(1 << 30)
            second.done()
            return second.status, len(data)
        finally:
            origin.close()
            server.close()

    assert uvloop.run(main()) == (200, len(BODY))


async def _streaming_box(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """hugpy's stream shape: a head with neither length nor chunking, one frame, then close."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await reader.read(65536)
        if not chunk:
            writer.close()
            return
        head += chunk
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                 b"data: [DONE]\n\n")
    await writer.drain()
    writer.close()


async def _idle_within(origin: Origin, seconds: float) -> None:
    for _ in range(int(seconds / 0.01)):
        if origin.idle:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no spare connection within {seconds} s")


def test_a_close_delimited_answer_leaves_a_spare_connection_for_the_next_call():
    accepted = 0

    async def box(reader, writer) -> None:
        nonlocal accepted
        accepted += 1
        await _streaming_box(reader, writer)

    async def main() -> None:
        server = await asyncio.start_server(box, "127.0.0.1", 0)
        origin = Origin("127.0.0.1", server.sockets[0].getsockname()[1])
        head = request_head("POST", "/v1/chat/completions", origin, b"", 0)
        try:
            first = await origin.send(head, b"")
            assert not first.reused  # the first call connects itself
            assert await first.read_all(1 << 20) == b"data: [DONE]\n\n"
            first.done()
            await _idle_within(origin, 2.0)
            assert accepted == 2  # the spare was opened before the second call
            second = await origin.send(head, b"")
            assert second.reused  # taken from the idle list: rule 6 applies to it
            assert await second.read_all(1 << 20) == b"data: [DONE]\n\n"
            second.done()
            await _idle_within(origin, 2.0)
            assert accepted == 3
        finally:
            origin.close()
            server.close()
        assert not origin.idle

    uvloop.run(main())


def test_streams_that_end_together_leave_at_most_max_spares():
    async def main() -> int:
        server = await asyncio.start_server(_streaming_box, "127.0.0.1", 0)
        origin = Origin("127.0.0.1", server.sockets[0].getsockname()[1])
        head = request_head("POST", "/v1/chat/completions", origin, b"", 0)
        try:
            exchanges = [await origin.send(head, b"", fresh=True) for _ in range(MAX_SPARES + 8)]
            for exchange in exchanges:
                await exchange.read_all(1 << 20)
                exchange.done()
            for _ in range(200):
                if not origin.opening:
                    break
                await asyncio.sleep(0.01)
            return len(origin.idle)
        finally:
            origin.close()
            server.close()

    assert uvloop.run(main()) == MAX_SPARES
