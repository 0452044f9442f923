"""The scheduler's snapshot: what it publishes, and the order it publishes.

Rules (seed 000, DESIGN.md "Scheduler, pressure and reservations"):
1. A snapshot is immutable: generation, the priority order, pending and pressure per box.
2. Pending is the work the box already carries when the snapshot is taken: the router's own
   calls in flight on it, or the box's own count of busy seats when that is larger (other
   clients use the box too).
3. Order: `pending + pressure` ascending, then pressure, then the stable id (position in the
   boxes file, then name).
4. A facade ranks with `pending + pressure + reservations` (router.core.decide), where the
   reservations are the dispatches since this snapshot: a burst spreads before the next one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from router.core.pressure import NEUTRAL_PRESSURE


@dataclass(frozen=True, slots=True)
class BoxLoad:
    """One box's load facts at snapshot time."""

    id: str
    order: int
    in_flight: int  # the router's own calls on the box
    busy_seats: int  # what the box says is busy (0 when it does not say)
    pressure: int = NEUTRAL_PRESSURE


@dataclass(frozen=True, slots=True)
class Snapshot:
    generation: int
    order: tuple[str, ...]
    pending: Mapping[str, int]
    pressure: Mapping[str, int]
    taken_at_s: float

    def to_event(self) -> dict:
        return {
            "generation": self.generation,
            "order": list(self.order),
            "pending": dict(self.pending),
            "pressure": dict(self.pressure),
        }


def pending_of(load: BoxLoad) -> int:
    return max(load.in_flight, load.busy_seats)


def take(generation: int, loads: Sequence[BoxLoad], now_s: float) -> Snapshot:
    """The snapshot of `loads` as generation `generation`."""
    pending = {load.id: pending_of(load) for load in loads}
    ranked = sorted(
        loads, key=lambda l: (pending[l.id] + l.pressure, l.pressure, l.order, l.id)
    )
    return Snapshot(
        generation=generation,
        order=tuple(load.id for load in ranked),
        pending=pending,
        pressure={load.id: load.pressure for load in loads},
        taken_at_s=now_s,
    )


EMPTY = Snapshot(generation=0, order=(), pending={}, pressure={}, taken_at_s=0.0)
