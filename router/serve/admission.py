"""The wait queue at work: calls whose owners are all full wait here for a slot.

The rules (capacity, order, back-off) are router.core.admission's. This room feeds the queue
its events and carries out its hand-outs:
1. A call joins (`join`) when its decision ranked nothing but left boxes that are only full or
   cooling (`Decision.waits_for`). A full queue refuses it (429 queue_full).
2. A slot frees (`freed`: a call left the box) or a back-off ends (`sweep`): the box hands its
   free slots, one by one, to the next waiters that the usual decision now dispatches. The
   hand-out counts the call on its box before anything else runs (`Seat.admit`), so no
   arrival can take the slot in between and no box goes over its limit.
3. A waiter leaves without a box when its client goes (`leave`) or its wait passes the timeout
   (the CallClock's sweep: 503 queue_timeout); it is never handed out after that.
4. Retry-After is the queue's length over the recent drain rate, within [1 s, the timeout].
5. A call whose key is at its `max_parallel` waits too, full for its caller (serve/limits.py
   rule 3), for any box its decision ranked: it is handed out only while its key has room, and
   the hand-out takes its key's slot with its box's (several routers: asks it of the shared
   server, and the call reads the answer before it is sent). A slot its key frees is offered at
   once (`offer`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from typing import Callable, Protocol

from router.boxes.fleet import Fleet
from router.boxes.state import BoxState
from router.core.admission import QUEUE_FULL, QUEUE_SHARE_FULL, Priority, Waiter, WaitQueue
from router.core.lifecycle import Event, Lifecycle
from router.core.types import BoxFacts, Call, Decision
from router.serve.load import Load
from router.serve.reply import Reply

# The drain rate is measured over the last hand-outs, at most this many seconds back and at
# most this many of them.
DRAIN_WINDOW_S = 30.0
DRAIN_SAMPLES = 4096
REFUSAL_TEXT = {
    QUEUE_FULL: "every box for this model is full and the queue is full",
    QUEUE_SHARE_FULL: "every box for this model is full and this caller already holds its share "
    "of the queue ({share} of {capacity} places)",
}


class CallerSlot(Protocol):
    """A call's slot with its caller's `max_parallel` (serve/limits.py's `Charge`; a protocol,
    since tenancy offers freed slots back to the queue: rule 5)."""

    def has_room(self) -> bool: ...

    def take_slot(self) -> object:
        """router.core.slots' Slot, or the future of one (several routers: the call reads it)."""


class Waiting(Protocol):
    """What a waiting call offers the queue (a `Seat`)."""

    call: Call | None
    call_id: str
    queued_s: float

    def decide_now(self, facts: list[BoxFacts]) -> Decision: ...

    def has_room(self) -> bool: ...

    def admit(self, decision: Decision) -> None: ...


class Admission:
    def __init__(self, fleet: Fleet, capacity: int, timeout_s: float, per_caller: int | None = None) -> None:
        self.fleet = fleet
        self.queue = WaitQueue(capacity, per_caller)
        self.timeout_s = timeout_s
        # perf_counter stamps of the latest hand-outs, for the drain rate: bounded, since a
        # router that never answers 429 or 503 never trims them by the window
        self.handed_out: deque[float] = deque(maxlen=DRAIN_SAMPLES)
        # admitted | queue_full | queue_share_full | queue_timeout | left
        self.outcomes: Counter[str] = Counter()

    def join(self, waiting: Waiting, caller: str, priority: Priority, boxes: frozenset[str]) -> Waiter | str:
        """The waiter now queued, or the refusal's code (QUEUE_FULL, QUEUE_SHARE_FULL)."""
        refusal = self.queue.refusal_for(caller)
        if refusal is not None:
            self.outcomes[refusal] += 1
            return refusal
        waiter = Waiter(caller, priority, boxes, ticket=waiting)
        self.queue.push(waiter)
        return waiter

    def leave(self, waiter: Waiter, outcome: str) -> bool:
        """Takes a waiter out without a box; False when it was already handed out."""
        if self.queue.remove(waiter):
            self.outcomes[outcome] += 1
            return True
        return False

    def freed(self, box: BoxState) -> None:
        """`box` may have room: hand it to the waiters in turn while it has."""
        if self.queue.size and not box.full:
            self._hand_out(box)

    def _hand_out(self, box: BoxState) -> None:
        """`freed`'s work when calls wait (a method of its own: `fits` makes `self` and
        `offered` cells, allocated on every call of the function that holds it)."""
        offered: list[Decision] = []

        def fits(waiter: Waiter) -> bool:
            """Its caller has room (rule 5) and the usual decision, over the facts as they are
            now, ranks a box for it."""
            if not waiter.ticket.has_room():
                return False
            decision = waiter.ticket.decide_now(self.fleet.facts())
            if decision.boxes:
                offered.append(decision)
            return bool(decision.boxes)

        while not box.full:
            waiter = self.queue.next_for(box.name, fits)
            if waiter is None:
                return
            self.outcomes["admitted"] += 1
            self.handed_out.append(time.perf_counter())
            waiter.ticket.admit(offered.pop())

    def sweep(self, now_s: float) -> None:
        """The CallClock's tick: end the back-offs that are over, then offer every box."""
        for box in self.fleet.ordered():
            box.expire_cooling(now_s)
        self.offer()

    def offer(self) -> None:
        """Every box offered to the waiters (a back-off ended, a caller's slot freed: rule 5)."""
        if self.queue:
            for box in self.fleet.ordered():
                self.freed(box)

    def depth(self) -> dict[tuple[str, str], int]:
        """Waiting calls by (model, class)."""
        counts: Counter[tuple[str, str]] = Counter()
        for waiter in self.queue.waiting():
            counts[(waiter.ticket.call.model, waiter.priority.name.lower())] += 1
        return dict(counts)

    def snapshot(self) -> dict:
        """The queue for /v1/router/state: its limits, who waits (in turn order), outcomes."""
        loop_now = asyncio.get_running_loop().time()
        return {
            "size": len(self.queue),
            "capacity": self.queue.capacity,
            "per_caller": self.queue.per_caller,
            "timeout_s": self.timeout_s,
            "retry_after_s": self.retry_after_s(),
            "waiting": [
                {
                    "call_id": w.ticket.call_id,
                    "model": w.ticket.call.model,
                    "class": w.priority.name.lower(),
                    "caller": w.caller,
                    "boxes": sorted(w.boxes),
                    "waited_s": round(loop_now - w.ticket.queued_s, 3),
                }
                for w in self.queue.waiting()
            ],
            "outcomes": dict(self.outcomes),
        }

    def retry_after_s(self) -> int:
        now = time.perf_counter()
        handed = self.handed_out
        while handed and now - handed[0] > DRAIN_WINDOW_S:
            handed.popleft()
        if not handed:
            return max(1, math.ceil(self.timeout_s))
        rate = len(handed) / max(now - handed[0], 1.0)
        return int(min(max(1, math.ceil(len(self.queue) / rate)), max(1, math.ceil(self.timeout_s))))


class Seat:
    """One call's place in the queue, from join to hand-out or leaving (rules 1-3)."""

    __slots__ = ("admission", "fleet", "reply", "life", "load", "decide_now", "charge", "waiter", "turn", "queued_s")

    def __init__(self, admission: Admission, reply: Reply, life: Lifecycle, load: Load,
                 decide_now: Callable[[list[BoxFacts]], Decision], charge: CallerSlot | None = None,
                 since: float | None = None) -> None:
        self.admission = admission
        self.fleet = admission.fleet
        self.reply = reply
        self.life = life
        self.load = load
        self.decide_now = decide_now  # the call's own decision, never broadened (failover)
        self.charge = charge  # its key's account: max_parallel (rule 5)
        self.waiter: Waiter | None = None
        self.turn: asyncio.Future | None = None  # resolved with its Decision, or None: no box
        # loop time when the call first joined: a call that waits again (its key's slot taken
        # elsewhere as it was handed out) keeps its first arrival, so the timeout bounds its whole wait
        self.queued_s = since

    @property
    def call(self) -> Call | None:
        return self.reply.record.call

    @property
    def call_id(self) -> str:
        return self.reply.record.call_id

    async def join(self, decision: Decision, caller: str, priority: Priority) -> bool:
        """Takes a place waiting for a slot on one of `decision.waits_for`; False when the queue
        is full or the caller holds its share (answered 429)."""
        admission = self.admission
        joined = admission.join(self, caller, priority, decision.waits_for or frozenset(decision.boxes))
        if isinstance(joined, str):
            await self.reply.error(
                429, joined, REFUSAL_TEXT[joined].format(share=admission.queue.per_caller, capacity=admission.queue.capacity),
                {"boxes": decision.reasons_text()}, turned_away=True, retry_after_s=admission.retry_after_s(),
            )
            return False
        self.waiter = joined
        loop = asyncio.get_running_loop()
        self.turn = loop.create_future()
        if self.queued_s is None:
            self.queued_s = loop.time()
        self.life.fire(Event.QUEUED)
        return True

    async def wait(self, decision: Decision) -> Decision | None:
        """The decision that dispatches the call, or None when it was answered instead (503) or
        its client left."""
        admission, turn_future = self.admission, self.turn
        try:
            turn = await turn_future  # type: ignore[misc]
        finally:
            # Not handed out: out of the queue now, never handed out later. A cancel (the server
            # stops) cancels the future too, so `done()` alone would not say it.
            if turn_future.cancelled() or not turn_future.done():  # type: ignore[union-attr]
                admission.leave(self.waiter, "left")  # type: ignore[arg-type]
            self.waiter = None
        self.reply.record.queued(round((asyncio.get_running_loop().time() - self.queued_s) * 1000, 3))
        if turn is None and self.life.ended_by is Event.DEADLINE:
            await self.reply.error(
                503, "queue_timeout", f"no box for this model had room within {admission.timeout_s:g} s",
                {"boxes": decision.reasons_text()}, retry_after_s=admission.retry_after_s(),
            )
        return turn

    def has_room(self) -> bool:
        return self.charge is None or self.charge.has_room()

    def admit(self, decision: Decision) -> None:
        """The queue hands the call a slot: it counts on its box (and its key, rule 5) now,
        before anything else runs (rule 2), then the call wakes."""
        self.reply.record.decided(decision)
        self.life.fire(Event.ADMITTED)
        self.load.count_on(self.fleet.get(decision.boxes[0]))
        if self.charge is not None:
            self.charge.take_slot()
        self.turn.set_result(decision)  # type: ignore[union-attr]

    def leave(self, event: Event) -> bool:
        """The client left (CLIENT_LEFT) or the wait passed the timeout (DEADLINE): out of the
        queue without a box. False when it is not waiting (or was handed out already)."""
        outcome = "queue_timeout" if event is Event.DEADLINE else "left"
        if self.waiter is None or not self.admission.leave(self.waiter, outcome):
            return False
        self.life.fire(event)
        self.turn.set_result(None)  # type: ignore[union-attr]
        return True

    def overdue(self, now_s: float) -> bool:
        """The wait has passed the queue's timeout (rule 3)."""
        return self.queued_s is not None and now_s - self.queued_s > self.admission.timeout_s
