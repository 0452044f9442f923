"""The source-aware telemetry cache: the latest reading per box and source, aged on read.

Rules (DESIGN.md "Scheduler, pressure and reservations"; the maths is router/core/pressure.py):
1. Times are the event loop's clock (`loop.time()`), passed in; the cache reads no clock.
2. Per box it keeps one latest `Reading` per source (`scan`, `box`). A reading older than the
   one already held for that source (a late answer) is dropped.
3. `get` picks with `pick_reading`: the scan while usable, else the box's own, else None.
4. Each reading that is the box's pick at the moment it was read is folded into that box's
   moving average once, at `put`; so the average does not depend on how often pressure is
   asked, and `pressure` only looks.
5. NVML being unavailable is a normal state: it is logged once per process, at info, never per
   scan or per call.
6. Single-threaded: used from the event loop only (scans come back through the executor).
"""

from __future__ import annotations

import logging

from router.core.pressure import (
    SOURCE_BOX,
    SOURCE_SCAN,
    Reading,
    Smoothed,
    pick_reading,
    pressure,
    smooth,
)

log = logging.getLogger("router.telemetry")


class TelemetryCache:
    def __init__(self) -> None:
        self._readings: dict[str, dict[str, Reading]] = {}  # box -> source -> latest
        self._smoothed: dict[str, Smoothed] = {}  # box -> moving average
        self._nvml_logged = False

    def put(self, box: str, reading: Reading) -> None:
        """Stores `reading` as the box's latest for its source (rule 2) and folds it (rule 4)."""
        by_source = self._readings.setdefault(box, {})
        held = by_source.get(reading.source)
        if held is not None and reading.read_at_s < held.read_at_s:
            return
        by_source[reading.source] = reading
        at = reading.read_at_s
        if pick_reading(by_source.get(SOURCE_SCAN), by_source.get(SOURCE_BOX), at) is reading:
            folded = smooth(self._smoothed.get(box), reading)
            if folded is not None:
                self._smoothed[box] = folded

    def get(self, box: str, now: float) -> Reading | None:
        """The box's usable reading at `now` (rule 3), or None."""
        by_source = self._readings.get(box)
        if by_source is None:
            return None
        return pick_reading(by_source.get(SOURCE_SCAN), by_source.get(SOURCE_BOX), now)

    def age_s(self, box: str, source: str, now: float) -> float | None:
        """How old the box's latest reading from `source` is at `now`; None when there is none."""
        reading = self._readings.get(box, {}).get(source)
        return None if reading is None else now - reading.read_at_s

    def pressure(self, box: str, now: float) -> int:
        """The box's pressure 0–3 at `now`: neutral without a usable reading."""
        return pressure(self._smoothed.get(box), self.get(box, now), now)

    def scan_unavailable(self, reason: str) -> None:
        """A local scan found no NVML (rule 5): logged the first time only."""
        if not self._nvml_logged:
            self._nvml_logged = True
            log.info("NVML unavailable (%s): local boxes use their own GPU reports", reason)
