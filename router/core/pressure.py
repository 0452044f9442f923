"""GPU pressure 0–3 from telemetry readings. Pure: every time is passed in as `now`.

Rules (DESIGN.md "Scheduler, pressure and reservations"; seeds/000):
1. A reading is one compact number per source and box: the maximum GPU utilisation over the
   box's cards, with memory free/total summed over them, stamped `read_at_s`. Sources:
   `scan` (the local NVML scan, or a `router agent` on the box's host) and `box` (what the box
   itself reports).
2. Fresh means `now - read_at_s <= STALE_AFTER_S`: a reading exactly 10.0 s old is still
   fresh, one older than that is stale. A reading whose stamp is not a number is stale.
3. Usable means fresh with a valid utilisation: a real number in [0, 100] (None, NaN, ±inf,
   a bool, below 0 or above 100 are invalid).
4. `pick_reading`: the scan wins while it is usable; otherwise the box's own reading if it is
   usable; otherwise there is none.
5. `smooth`: an exponential moving average of utilisation over time, half-life `HALF_LIFE_S`.
   A reading that is not newer than the state, or not valid, leaves the state as it is.
6. `pressure`: no usable reading → `NEUTRAL_PRESSURE`; otherwise the smoothed utilisation's
   level in `LEVELS`.
7. Pressure is never derived from VRAM capacity, free memory, GPU model or device affinity:
   memory fields travel with the reading for the load tie-break and for display only.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE_SCAN = "scan"
SOURCE_BOX = "box"

# The seed's rule: telemetry older than 10 s says nothing about the box now.
STALE_AFTER_S = 10.0
# Unknown load counts as moderate: it neither attracts traffic (0) nor repels it (2, 3), so a
# box without telemetry is ranked beside its peers rather than first or last.
NEUTRAL_PRESSURE = 1
# NVML utilisation is the share of the driver's last sample period (1/6 s to 1 s) in which a
# kernel ran, so one reading jumps between prefill bursts and decode gaps. A 3 s half-life
# (three 1 Hz scans) irons that out, yet a box that turns busy crosses a level within a few
# seconds: from 0 % to a constant 100 % the average passes 25 % after 1.25 s and 85 % after
# 8.2 s.
HALF_LIFE_S = 3.0
# (upper bound, level): the first bound above the smoothed utilisation names its level.
LEVELS: tuple[tuple[float, int], ...] = (
    # Below 25 %: idle or light decode between calls; the card has room for another call.
    (25.0, 0),
    # Below 60 %: steady work on some streams; a new call shares the card without queueing.
    (60.0, 1),
    # Below 85 %: busy; a new call slows the running ones noticeably.
    (85.0, 2),
)
# 85 % and above: saturated; a new call waits behind running kernels.
SATURATED = 3


@dataclass(frozen=True, slots=True)
class Reading:
    """One source's view of one box at `read_at_s` (the caller's clock, seconds)."""

    util_pct: float | None
    mem_free_bytes: int | None
    mem_total_bytes: int | None
    read_at_s: float
    source: str


@dataclass(frozen=True, slots=True)
class Smoothed:
    """The moving average of utilisation `value` (percent) as of `at_s`."""

    value: float
    at_s: float


def valid_util(util_pct: object) -> bool:
    """Whether `util_pct` is a real percentage in [0, 100] (rule 3). NaN fails both bounds."""
    if isinstance(util_pct, bool) or not isinstance(util_pct, (int, float)):
        return False
    return 0.0 <= util_pct <= 100.0


def is_fresh(reading: Reading, now: float) -> bool:
    """Rule 2: exactly `STALE_AFTER_S` old is fresh; a NaN stamp compares False, so stale."""
    return now - reading.read_at_s <= STALE_AFTER_S


def usable(reading: Reading | None, now: float) -> bool:
    """Rule 3: present, fresh and carrying a valid utilisation."""
    return reading is not None and is_fresh(reading, now) and valid_util(reading.util_pct)


def pick_reading(scan: Reading | None, box: Reading | None, now: float) -> Reading | None:
    """Rule 4: the scan while usable, else the box's own while usable, else None."""
    if usable(scan, now):
        return scan
    if usable(box, now):
        return box
    return None


def smooth(prev: Smoothed | None, reading: Reading) -> Smoothed | None:
    """Rule 5: folds `reading` into the moving average.

    alpha = 1 - 2**(-dt / HALF_LIFE_S), dt = reading.read_at_s - prev.at_s: after one
    half-life of constant input, half of the gap to it is closed, whatever the sampling rate.
    The first valid reading starts the average at its own value.

    Returns the new state; `prev` unchanged when the reading is invalid or not newer than it
    (so folding the same reading twice is harmless); None only when `prev` is None and the
    reading is invalid.
    """
    if not valid_util(reading.util_pct):
        return prev
    util = float(reading.util_pct)  # type: ignore[arg-type]  # valid_util checked it
    if prev is None:
        return Smoothed(util, reading.read_at_s)
    dt = reading.read_at_s - prev.at_s
    if not dt > 0.0:  # also catches a NaN stamp
        return prev
    alpha = 1.0 - 2.0 ** (-dt / HALF_LIFE_S)
    return Smoothed(prev.value + alpha * (util - prev.value), reading.read_at_s)


def level(util_pct: float) -> int:
    """The pressure level of a valid utilisation, from `LEVELS`."""
    for bound, value in LEVELS:
        if util_pct < bound:
            return value
    return SATURATED


def pressure(smoothed: Smoothed | None, reading: Reading | None, now: float) -> int:
    """Rule 6: the box's pressure 0–3 at `now`.

    `reading` is the picked reading (`pick_reading`) and decides whether there is fresh, valid
    telemetry at all; `smoothed` is the average it was folded into. Without an average yet,
    the reading's own utilisation is used.

    Returns `NEUTRAL_PRESSURE` when the reading is missing, stale or invalid.
    """
    if not usable(reading, now):
        return NEUTRAL_PRESSURE
    return level(smoothed.value if smoothed is not None else reading.util_pct)  # type: ignore[union-attr,arg-type]
