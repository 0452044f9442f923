"""A fleet of simulated boxes (any mix of kinds) on one uvloop loop in a daemon thread: how the
tests and the benchmark run boxes beside a router in the same process.

Rules:
1. `start` returns once every box listens, or raises and leaves nothing half-started.
2. Everything a box does runs on the fleet's loop; the test thread reaches it through
   `call_soon` (and the boxes' own thread-safe methods).
3. `stop_box` then `start_box` is a process restart as a client sees it: refused connections,
   then the same address answers again.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

import uvloop

from router.sim.server import SimServer

START_TIMEOUT_S = 10.0  # binding loopback sockets takes milliseconds



class SimFleet:
    """Runs several simulated boxes (any mix of kinds) on one uvloop loop in a daemon thread."""

    def __init__(self, boxes: list[SimServer]) -> None:
        self.boxes = boxes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the loop thread and every box; returns once all are listening."""
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sim-fleet", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start_boxes(), self._loop).result(START_TIMEOUT_S)
        except BaseException:
            self.stop()  # no half-started fleet left behind
            raise

    def stop(self) -> None:
        """Stops every box, then the loop and its thread."""
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._stop_boxes(), self._loop).result(START_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_S)
        self._loop.close()
        self._loop = None

    def stop_box(self, box: SimServer) -> None:
        """Stops one box (its port refuses connections afterwards); the others keep serving."""
        asyncio.run_coroutine_threadsafe(box.stop(), self._loop).result(START_TIMEOUT_S)

    def start_box(self, box: SimServer) -> None:
        """Starts a box stopped with `stop_box` again, on the port it had (a process restart
        as a client sees it: refused connections, then the same address answers again)."""
        asyncio.run_coroutine_threadsafe(box.start(port=box.port), self._loop).result(START_TIMEOUT_S)

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Runs `fn(*args)` on the fleet loop, thread-safely."""
        self._loop.call_soon_threadsafe(fn, *args)

    def __enter__(self) -> SimFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _start_boxes(self) -> None:
        for box in self.boxes:
            await box.start()

    async def _stop_boxes(self) -> None:
        for box in self.boxes:
            await box.stop()
