"""One call's lifecycle: its phases, the events that move it, what the CallClock does in each
phase, how the row's state follows from the end, and the failover step. Pure.

    RECEIVING --body_in--> DECIDING --decided--> DISPATCHING --sent--> SENT --head--> HELD
        HELD --judged--> JUDGED --committed--> RELAYING --done--> ENDED
    DECIDING --queued--> QUEUED --admitted--> DECIDING            (the queue handed it a slot)
    DISPATCHING | SENT | HELD --box_failed--> DECIDING          (a refusal before the first byte)
    RELAYING --box_failed--> ENDED                               (after it, nothing is rerouted)
    every phase but ENDED --client_left--> ENDED
    RECEIVING | QUEUED --deadline--> ENDED                       (the call's own deadlines)
    RECEIVING | DECIDING | QUEUED --done--> ENDED                (the router answered by itself)
    SENT --sent--> SENT                                          (a resend after a stale-connection race)
    ENDED --any event--> ENDED                                   (late news: see rule 2)

Rules:
1. `TRANSITIONS` is the whole machine; `Lifecycle.fire` raises IllegalTransition (naming the
   phase and the event) for anything else: that is a bug in the router.
2. An event after the end is expected, not an error: a box's head that lands as its client
   leaves, a write that finds the client gone after its answer was whole. ENDED takes every
   event and stays ENDED; `ended_by` keeps the event that ended the call.
3. Nothing of a box's answer reaches the client before it is judged: COMMITTED is only taken
   from JUDGED, and JUDGED only from HELD (the head is in, the first frame held).
4. A box slot (the reservation and the in-flight count) is taken on DECIDED, or by the queue's
   hand-out (ADMITTED: the slot is counted before the call wakes), moved to the next box by the
   next DECIDED after a failover, and released on QUEUED and on ENDED: a waiting call holds
   none, an ended call holds none (the serve layer does each at its event).
5. DEADLINE is the call's own deadlines only: its body's (RECEIVING) and its queue's (QUEUED).
   A box's deadlines (its first byte, its silence after it) are that box failing: BOX_FAILED.
6. Each CallClock tick does the `TICK_DUTIES` of the call's phase, and nothing else (the body's
   deadline is kept for its read by the same clock: serve/body.py).
7. `next_attempt` is the failover step: the next box to try, or why none (`Stop`). A pinned
   call is never rerouted; at most `max_boxes` boxes are tried; a decision that ranked nothing
   but left full or cooling boxes waits for room.

Who fires what (router/serve): the call's task fires its own steps through the piece that takes
them (proxy.py: body_in, decided, box_failed before the first byte, done, and the body's deadline
as its read runs out; admission.py's Seat: queued, admitted; attempt.py: sent, head, judged;
deliver.py: committed, box_failed after it). Events from outside the call (client_left, however
it is seen, and the queue's deadline) have one entry, `ProxyCall.outside`. The one exception: the queue's hand-out (`Seat.admit`) runs in the task of
the call that freed the slot, and fires ADMITTED there, so that no arrival takes the slot first.
"""

from __future__ import annotations

from enum import Enum
from typing import Sequence

from router.core.types import Decision


class Phase(str, Enum):
    RECEIVING = "receiving"  # the body is being read
    DECIDING = "deciding"  # inspect and decide (again, after a refusal or a hand-out)
    QUEUED = "queued"  # every owner full or cooling: waiting for a slot
    DISPATCHING = "dispatching"  # a box is chosen and holds the call's slot; connecting
    SENT = "sent"  # the request is out; waiting for the box's head
    HELD = "held"  # the head is in; the answer (or a stream's first frame) is held to be judged
    JUDGED = "judged"  # judged not a refusal: it may go to the client
    RELAYING = "relaying"  # committed: the box's bytes flow to the client
    ENDED = "ended"


class Event(str, Enum):
    BODY_IN = "body_in"
    DECIDED = "decided"
    QUEUED = "queued"
    ADMITTED = "admitted"
    SENT = "sent"
    HEAD = "head"
    JUDGED = "judged"
    COMMITTED = "committed"  # then the chunks move without an event each: none would cost less
    BOX_FAILED = "box_failed"
    CLIENT_LEFT = "client_left"
    DEADLINE = "deadline"
    DONE = "done"


class IllegalTransition(Exception):
    """A step no table allows: this one's, or router.core.credits' and router.core.leases' (its
    `phase` is then their state)."""

    def __init__(self, phase: Enum, event: Enum) -> None:
        super().__init__(f"event {event.value} in phase {phase.value}")
        self.phase = phase
        self.event = event


class Machine:
    """A state moved only through its class's TRANSITIONS table (state -> event -> state): the
    credit's and the lease's (router.core.credits, router.core.leases)."""

    __slots__ = ("state",)
    TRANSITIONS: dict

    def fire(self, event: Enum) -> Enum:
        """Moves the state by `event`; returns the new one. Raises IllegalTransition when the table
        has no such step (a bug), leaving the state as it was."""
        state = self.TRANSITIONS[self.state].get(event)
        if state is None:
            raise IllegalTransition(self.state, event)
        self.state = state
        return state


# Read per event (`fire`, `row_state`): a module name, since on Python 3.11 a member read off
# its Enum class (`Phase.ENDED`) goes through EnumType.__getattr__'s slow hook (~0.1 µs each).
_ENDED = Phase.ENDED
# The row states of the ends that are not the answer's own (row_state).
_END_STATES = {Event.CLIENT_LEFT: "cancelled", Event.DEADLINE: "failed", Event.BOX_FAILED: "failed"}

_LEFT = {Event.CLIENT_LEFT: Phase.ENDED}
_DUE = {Event.DEADLINE: Phase.ENDED}

TRANSITIONS: dict[Phase, dict[Event, Phase]] = {
    Phase.RECEIVING: {Event.BODY_IN: Phase.DECIDING, Event.DONE: Phase.ENDED, **_LEFT, **_DUE},
    Phase.DECIDING: {
        Event.DECIDED: Phase.DISPATCHING,
        Event.QUEUED: Phase.QUEUED,
        Event.DONE: Phase.ENDED,
        **_LEFT,
    },
    Phase.QUEUED: {Event.ADMITTED: Phase.DECIDING, Event.DONE: Phase.ENDED, **_LEFT, **_DUE},
    Phase.DISPATCHING: {Event.SENT: Phase.SENT, Event.BOX_FAILED: Phase.DECIDING, **_LEFT},
    Phase.SENT: {Event.SENT: Phase.SENT, Event.HEAD: Phase.HELD, Event.BOX_FAILED: Phase.DECIDING, **_LEFT},
    Phase.HELD: {Event.JUDGED: Phase.JUDGED, Event.BOX_FAILED: Phase.DECIDING, **_LEFT},
    Phase.JUDGED: {Event.COMMITTED: Phase.RELAYING, **_LEFT},
    Phase.RELAYING: {Event.BOX_FAILED: Phase.ENDED, Event.DONE: Phase.ENDED, **_LEFT},
    Phase.ENDED: dict.fromkeys(Event, Phase.ENDED),  # rule 2
}

# The phases in which a call is at a box: its client is watched and the box's deadline kept.
AT_A_BOX = frozenset({Phase.DISPATCHING, Phase.SENT, Phase.HELD, Phase.JUDGED, Phase.RELAYING})


class Duty(str, Enum):
    """What a CallClock tick does for a call (rule 6)."""

    QUEUE_DEADLINE = "queue_deadline"  # it waited longer than the queue's timeout: DEADLINE
    WATCH_CLIENT = "watch_client"  # start the disconnect watcher (never before the body is in:
    # until then the client's receive() belongs to the body)
    BOX_DEADLINE = "box_deadline"  # the box's first byte or its silence is overdue (rule 5)
    KEEPALIVE = "keepalive"  # a streamed call still without an answer gets its comment


_AT_A_BOX_DUTIES = (Duty.WATCH_CLIENT, Duty.BOX_DEADLINE, Duty.KEEPALIVE)

TICK_DUTIES: dict[Phase, tuple[Duty, ...]] = {
    Phase.RECEIVING: (),  # the body's deadline is its read's own (serve/body.py)
    Phase.DECIDING: (Duty.KEEPALIVE,),
    Phase.QUEUED: (Duty.QUEUE_DEADLINE, Duty.KEEPALIVE),
    **dict.fromkeys(AT_A_BOX, _AT_A_BOX_DUTIES),
    Phase.ENDED: (),
}


class Lifecycle:
    """The phase of one call, moved only through TRANSITIONS."""

    __slots__ = ("phase", "ended_by")

    def __init__(self) -> None:
        self.phase = Phase.RECEIVING
        self.ended_by: Event | None = None  # the event that ended the call

    @property
    def ended(self) -> bool:
        return self.ended_by is not None

    def fire(self, event: Event) -> Phase:
        """Moves the call by `event`; returns the new phase. Raises IllegalTransition when the
        table has no such step (a bug); an event after the end changes nothing (rule 2)."""
        phase = TRANSITIONS[self.phase].get(event)
        if phase is None:
            raise IllegalTransition(self.phase, event)
        if phase is _ENDED and self.ended_by is None:
            self.ended_by = event
        self.phase = phase
        return phase


def row_state(ended_by: Event | None, status: int, failure: str | None, turned_away: bool) -> str:
    """The route-log state of a call that ended by `ended_by`, whose answer (if any went out) had
    `status`, its error code `failure`, and came from the router itself when `turned_away`:
    - the client left: `cancelled`;
    - a deadline passed, or the box failed after the first byte: `failed`;
    - otherwise (DONE) the answer says: `refused` when the router turned the call away (no box,
      queue full), `failed` for an error answer or none at all, else `done`."""
    end_state = _END_STATES.get(ended_by)  # type: ignore[arg-type]
    if end_state is not None:
        return end_state
    if turned_away:
        return "refused"
    return "failed" if failure is not None or not status else "done"


class Stop(str, Enum):
    """Why a call tries no further box."""

    PINNED = "pinned"  # its pinned box refused: a pin is never rerouted
    MAX_BOXES = "max_boxes"  # it has tried as many boxes as a call may
    NO_BOX = "no_box"  # the gate leaves no box
    WAIT = "wait"  # the boxes left are full or cooling: wait in the queue for room


def next_attempt(decision: Decision, tried: Sequence[str], pin: str | None, max_boxes: int) -> str | Stop:
    """The next box for a call after `tried` refused it, or why there is none (rule 4).
    `decision` is the call's decision over the current facts with `tried` excluded."""
    if pin is not None and tried:
        return Stop.PINNED
    if len(tried) >= max_boxes:
        return Stop.MAX_BOXES
    for box in decision.boxes:
        if box not in tried and (pin is None or box == pin):
            return box
    return Stop.WAIT if decision.waits_for else Stop.NO_BOX
