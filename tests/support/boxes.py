"""Boxes as tests see them: a box that answers raw bytes (HTTP broken on purpose), faked GPU
cards for the telemetry scanner, and what a simulated box recorded of the calls it took."""

from __future__ import annotations

import asyncio
import time

from router.sim.hugpy import SimBox
from router.telemetry.nvml import CardReading

GIB = 1 << 30
MODELS = b'{"object": "list", "data": [{"id": "tiny", "object": "model"}]}'
JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


def answer_with(data: bytes):
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
    return answer


class RawBox:
    """An `openai`-kind box on loopback that lists `tiny` at `GET /v1/models` (its health and its
    inventory, kept alive) and answers any other request with `answer(writer)`, then closes.
    It has the SimServer's start/stop, so it runs in a SimFleet beside the simulated boxes."""

    kind = "openai"

    def __init__(self, name: str, answer) -> None:
        self.name = name
        self.answer = answer
        self.port = 0
        self.calls = 0
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if head.startswith(b"GET /v1/models "):
                    writer.write(JSON_HEAD + b"Content-Length: %d\r\n\r\n" % len(MODELS) + MODELS)
                    continue
                self.calls += 1
                await self.answer(writer)
                return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


class FakeCards:
    """An injected backend: the cards it returns are set by the test (read from a thread)."""

    def __init__(self, *utils: float | None) -> None:
        self.calls = 0
        self.set(*utils)

    def set(self, *utils: float | None) -> None:
        self.cards = [CardReading(i, f"GPU-{i}", u, 10 * GIB, 80 * GIB) for i, u in enumerate(utils)]

    def __call__(self) -> list[CardReading]:
        self.calls += 1
        return list(self.cards)


def max_concurrency(box) -> int:
    """The most calls the box worked on at once, from its call records."""
    edges = []
    for record in box.calls:
        if record.path == "/v1/chat/completions":
            edges += [(record.started_at, 1), (record.finished_at or time.monotonic(), -1)]
    level = peak = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        level += step
        peak = max(peak, level)
    return peak


def chat_calls(box) -> int:
    return sum(1 for r in box.calls if r.path == "/v1/chat/completions")


def box_calls(box: SimBox) -> list:
    return [c for c in box.calls if c.path.startswith("/v1/chat")]
