"""The one way a telemetry object owns its background task, and the one scan schedule."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("router.telemetry")

# A driver installed or loaded after the router started is picked up within this.
UNAVAILABLE_RETRY_S = 30.0


class BackgroundTask:
    """`start()` runs the subclass's `_run()` as a named task; `stop()` cancels it and waits."""

    task_name = "telemetry"
    _task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        raise NotImplementedError


async def scan_on_schedule(scan: Callable[[], Awaitable[bool]], interval_s: float, what: str) -> None:
    """Runs `scan` every `interval_s` (start to start), or every `UNAVAILABLE_RETRY_S` while it
    returns False (no NVML here). It never dies: a failure is logged once per streak."""
    loop = asyncio.get_running_loop()
    failing = False
    while True:
        started_s = loop.time()
        delay_s = interval_s
        try:
            if not await scan():
                delay_s = UNAVAILABLE_RETRY_S
            failing = False
        except Exception:
            if not failing:
                log.warning("%s failing", what, exc_info=True)
            failing = True
        await asyncio.sleep(max(0.0, started_s + delay_s - loop.time()))
