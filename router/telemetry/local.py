"""The local scan: this host's GPUs, read every second, become the `scan` reading of every box
on this host.

Rules:
1. The scan runs in the loop's default executor; the loop only awaits it, so a slow or hung
   NVML call delays the next scan, never a call. One scan is in flight at a time.
2. The cards reduce to one reading (`reduce_cards`: max utilisation, summed memory), stamped
   with the loop clock when the scan returned, and put as source `scan` for each box
   `boxes_on_this_host()` names at that moment (boxes whose URL is loopback:
   `is_loopback_url`). Boxes elsewhere get their `scan` reading from a `router agent`.
3. Without NVML the cache logs it once and the task retries every `task.UNAVAILABLE_RETRY_S`
   instead of every interval: a host without a driver is not probed each second.
4. The task never dies: an unexpected error is logged once per streak and the next scan runs
   on schedule.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from router.core.pressure import SOURCE_SCAN, Reading
from router.telemetry.cache import TelemetryCache
from router.telemetry.task import BackgroundTask, scan_on_schedule
from router.telemetry.nvml import NvmlUnavailable, Scanner, reduce_cards



def is_loopback_url(url: str) -> bool:
    """Whether the box at `url` runs on this host: `localhost` or a loopback address."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a DNS name other than localhost: resolving it here would block
        return False


class LocalScanTask(BackgroundTask):
    task_name = "telemetry:local-scan"

    def __init__(
        self,
        cache: TelemetryCache,
        boxes_on_this_host: Callable[[], list[str]],
        interval_s: float = 1.0,
        scanner: Scanner | None = None,
    ) -> None:
        self._cache = cache
        self._boxes_on_this_host = boxes_on_this_host
        self._interval_s = interval_s
        self._scanner = scanner if scanner is not None else Scanner()

    async def scan_once(self) -> Reading | None:
        """One scan put into the cache (rule 2). Returns the reading, or None without NVML."""
        loop = asyncio.get_running_loop()
        try:
            cards = await loop.run_in_executor(None, self._scanner.scan)
        except NvmlUnavailable as exc:
            self._cache.scan_unavailable(str(exc))
            return None
        reading = reduce_cards(cards, loop.time(), SOURCE_SCAN)
        for box in self._boxes_on_this_host():
            self._cache.put(box, reading)
        return reading

    async def _run(self) -> None:
        await scan_on_schedule(self._scan_available, self._interval_s, "local GPU scan")

    async def _scan_available(self) -> bool:
        return await self.scan_once() is not None
