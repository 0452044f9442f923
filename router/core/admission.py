"""Admission: box capacity, the wait queue's order, and the refusal back-off. Pure.

Rules (tests/test_core_admission.py pins each against the plain model in tests/models.py):
1. Capacity. A box with a limit is full while its calls in flight (every facade's, process-wide)
   reach the limit (`is_full`); the decision's gate does not dispatch to a full box
   (ReasonCode.FULL). No limit: never full.
2. Classes are strict: `next_for` never hands out a NORMAL waiter while a HIGH one the box may
   serve waits, nor a LOW one while a NORMAL one does.
3. Inside a class, callers take turns: the caller just served goes to the back of its class's
   rotation, so between two turns of a waiting caller every other caller of its class gets at
   most one turn on the boxes it waits for.
4. Inside one caller, first in, first out among the calls the freed box may serve.
5. A waiter leaves the queue exactly once: handed out (`next_for`), or removed (`remove`: its
   client left or its wait timed out). A removed waiter is never handed out.
6. The queue holds at most `capacity` waiters; `push` past that is refused (429 queue_full).
   One caller holds at most `per_caller` of them, whatever their class; its `push` past that is
   refused (429 queue_share_full) while the queue still has room for everyone else. The
   default share is `fair_share(capacity)`: a quarter of the places, at least 1, so one burst
   leaves three quarters to the others and at least four callers can each hold a full share.
   A caller is whoever the serve layer says (a key, else an address: docs/queue.md).
7. Back-off. A box that refused a model with a placement refusal while it had n other calls in
   flight counts as full for that model at n calls (n = 0: full for it) for
   `backoff_s(consecutive refusals)`: doubling from BACKOFF_BASE_S, capped at BACKOFF_CAP_S. So
   a box that is busy, not broken, keeps the load it proved it takes and no more, and one that
   cannot place the model at all is left alone. A success resets the count (the box's state
   keeps the counts and ceilings: router/boxes/state.py rule 3; this is the formula).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from enum import IntEnum
from typing import Callable, Iterator

from router.core.backoff import doubling_s

# A refused placement is retried soon (a box frees memory in seconds when a call ends) but not
# in a tight loop; past 30 s a box that keeps refusing is better served by the queue's timeout.
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
# Rule 6: the default share of one caller is capacity / SHARE_DIVISOR places (rounded up).
SHARE_DIVISOR = 4
QUEUE_FULL = "queue_full"
QUEUE_SHARE_FULL = "queue_share_full"


def fair_share(capacity: int) -> int:
    """The default places one caller may hold: ceil(capacity / SHARE_DIVISOR), at least 1."""
    return max(1, -(-capacity // SHARE_DIVISOR))


class Priority(IntEnum):
    """Lower value goes first. The names are the API's (`--priority`, `X-Router-Priority`)."""

    HIGH = 0
    NORMAL = 1
    LOW = 2


def parse_priority(text: str | None) -> Priority | None:
    """`high` | `normal` | `low` (any case, surrounding space ignored); None for anything else."""
    if text is None:
        return None
    try:
        return Priority[text.strip().upper()]
    except KeyError:
        return None


def effective_priority(granted: Priority, asked: Priority | None) -> Priority:
    """A call may lower its class below its key's, never raise it above."""
    return granted if asked is None else max(granted, asked)


def is_full(in_flight: int, limit: int | None) -> bool:
    return limit is not None and in_flight >= limit


def backoff_s(consecutive: int) -> float:
    """Seconds a box stays full for a model after `consecutive` placement refusals (>= 1): the
    links' doubling, without their jitter (a cooling ends when the state says it does)."""
    return doubling_s(consecutive, BACKOFF_BASE_S, BACKOFF_CAP_S)


class Waiter:
    """One call waiting for a box. `boxes` are the boxes it may be sent to: the owners the
    gate left it, all full (a pinned call: its pin only). `seq` is its arrival order."""

    __slots__ = ("caller", "priority", "boxes", "seq", "ticket")

    def __init__(self, caller: str, priority: Priority, boxes: frozenset[str], ticket=None) -> None:
        self.caller = caller
        self.priority = priority
        self.boxes = boxes
        self.seq = -1  # set by push
        self.ticket = ticket  # the waiting call as the serve layer knows it (a Seat); never read here

    def __repr__(self) -> str:
        return f"Waiter({self.caller!r}, {self.priority.name}, {sorted(self.boxes)}, #{self.seq})"


class WaitQueue:
    """Waiting calls by class, then caller (a rotation), then arrival."""

    def __init__(self, capacity: int, per_caller: int | None = None) -> None:
        self.capacity = capacity
        self.per_caller = fair_share(capacity) if per_caller is None else per_caller
        self._held: dict[str, int] = {}  # caller -> its waiters, every class (rule 6)
        # per class: caller -> that caller's waiters in arrival order; dict order = rotation
        self._classes: list[OrderedDict[str, deque[Waiter]]] = [OrderedDict() for _ in Priority]
        self.size = 0  # waiters now: read on every call's release (an attribute, not __len__'s frame)
        self._seq = 0

    def __len__(self) -> int:
        return self.size

    def refusal_for(self, caller: str) -> str | None:
        """Why a new waiter of `caller` would be refused now (rule 6): QUEUE_FULL when the queue
        is full, else QUEUE_SHARE_FULL when the caller holds its share; None when it fits."""
        if self.size >= self.capacity:
            return QUEUE_FULL
        if self._held.get(caller, 0) >= self.per_caller:
            return QUEUE_SHARE_FULL
        return None

    def push(self, waiter: Waiter) -> bool:
        """Queues `waiter` behind its caller's earlier calls; False when the queue is full or its
        caller holds its share (`refusal_for` says which)."""
        if self.refusal_for(waiter.caller) is not None:
            return False
        self._held[waiter.caller] = self._held.get(waiter.caller, 0) + 1
        waiter.seq = self._seq
        self._seq += 1
        rotation = self._classes[waiter.priority]
        line = rotation.get(waiter.caller)
        if line is None:  # a caller with nothing waiting joins at the back of the rotation
            line = rotation[waiter.caller] = deque()
        line.append(waiter)
        self.size += 1
        return True

    def remove(self, waiter: Waiter) -> bool:
        """Takes `waiter` out (its client left, or it waited too long); False if not queued."""
        rotation = self._classes[waiter.priority]
        line = rotation.get(waiter.caller)
        if line is None or waiter not in line:
            return False
        line.remove(waiter)
        if not line:
            del rotation[waiter.caller]
        self._left(waiter.caller)
        return True

    def next_for(self, box: str, fits: Callable[[Waiter], bool] = lambda w: True) -> Waiter | None:
        """Hands out the next waiter that `box` may serve and that `fits` accepts (the serve
        layer's check that the usual decision now dispatches it), or None."""
        for rotation in self._classes:
            for caller, line in rotation.items():
                for waiter in line:
                    if box in waiter.boxes and fits(waiter):
                        line.remove(waiter)
                        if line:
                            rotation.move_to_end(caller)
                        else:
                            del rotation[caller]
                        self._left(caller)
                        return waiter
        return None

    def _left(self, caller: str) -> None:
        self.size -= 1
        held = self._held[caller] - 1
        if held:
            self._held[caller] = held
        else:
            del self._held[caller]

    def waiting(self) -> Iterator[Waiter]:
        """Every waiter, in the order `next_for` would consider them."""
        for rotation in self._classes:
            for line in rotation.values():
                yield from line

    def depth(self) -> dict[Priority, int]:
        return {p: sum(len(line) for line in self._classes[p].values()) for p in Priority}
