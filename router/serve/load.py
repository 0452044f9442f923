"""The load one call puts on a box, held in one record.

Rules:
1. A call counts on at most one box at a time, and every change goes through its `Load`: the
   box's in-flight count (exact at every instant: what the next decision reads, DESIGN.md's
   pending load), the reservation token (what the scheduler's snapshot has not seen yet), the
   scheduler's poke (the inventory is worth a fresh look), and the wait queue's offer of the slot
   the call left.
2. The in-flight count moves first and alone when the queue hands a call a slot (`count_on`):
   no arrival can take that slot before the call wakes. The token follows at dispatch
   (`reserve`), with the scheduler's generation of that moment, and moves with the call on
   failover.
3. `release` is safe to call at any time and more than once: an ended call, and a call that goes
   back to the queue, hold nothing.
4. Several routers (fleetwide/leases.py): the call's lease on its box's fleet-wide slots (`lease`,
   taken by its `slots`' `take`; `asked` while its answer is on its way) goes back (or is parked
   for this router's next call: fleetwide/leases.py rule 9) with the rest, before the queue is
   offered the slot, so the server sees the slot free before a waiter's take. One router:
   `lease` and `asked` stay None (fleetwide/seam.py's ONE_ROUTER_SLOTS holds none).
"""

from __future__ import annotations

from typing import Protocol

from router._fastpath import Reservations
from router.boxes.state import BoxState
from router.fleetwide.seam import ONE_ROUTER_SLOTS, Lease, Slots
from router.telemetry.scheduler import Scheduler


class SlotFreed(Protocol):
    """Told when a call leaves a box, to offer the slot it left (admission.py's `Admission`: a
    protocol, so that the wait queue and the load need not import each other)."""

    def freed(self, box: BoxState) -> None: ...


class Load:
    __slots__ = ("reservations", "scheduler", "admission", "slots", "box", "token", "lease", "asked")

    def __init__(self, reservations: Reservations, scheduler: Scheduler, admission: SlotFreed,
                 slots: Slots = ONE_ROUTER_SLOTS) -> None:
        self.reservations = reservations
        self.scheduler = scheduler
        self.admission = admission
        self.slots = slots
        self.box: BoxState | None = None  # the box whose in-flight count holds the call
        self.token = 0  # its reservation; 0 = none held
        self.lease: Lease | None = None  # its lease on the box it counts on: rule 4
        self.asked: Lease | None = None  # a lease asked, its answer to come: rule 4

    def count_on(self, box: BoxState | None) -> None:
        """Moves the call's in-flight count to `box` (None: off every box)."""
        left = self.box
        if box is left:
            return
        if left is not None:
            left.in_flight -= 1
        if box is not None:
            box.in_flight += 1
        self.box = box
        self.scheduler.poke()
        if left is not None:
            self.admission.freed(left)

    def reserve(self, box: BoxState) -> None:
        """The call is about to be sent to `box`: its reservation and count move there."""
        generation = self.scheduler.generation  # now: a snapshot may have come since the decision
        reservations = self.reservations
        self.token = (
            reservations.move(self.token, box.index, generation)
            if self.token
            else reservations.reserve(box.index, generation)
        )
        self.count_on(box)

    def release(self) -> None:
        if self.asked is not None:
            self.slots.unask(self.asked)
            self.asked = None
        if self.lease is not None:
            self.slots.give(self.lease)
            self.lease = None
        if self.token:
            self.reservations.release(self.token)
            self.token = 0
        self.count_on(None)
