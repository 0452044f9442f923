"""The one way a telemetry object owns its background task."""

from __future__ import annotations

import asyncio


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
