"""The call lifecycle table and the failover step (router/core/lifecycle.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.lifecycle import (
    AT_A_BOX,
    TICK_DUTIES,
    TRANSITIONS,
    Duty,
    Event,
    IllegalTransition,
    Lifecycle,
    Phase,
    Stop,
    next_attempt,
)
from router._fastpath import Reservations
from router.boxes.config import BoxConfig
from router.boxes.state import BoxState
from router.core.types import Decision, Path, Reason, ReasonCode, Tier, Why
from router.serve.load import Load

events = st.lists(st.sampled_from(list(Event)), max_size=40)


def walk(sequence: list[Event]) -> list[tuple[Phase, Event, Phase]]:
    """The steps the table accepts, stopping at the first illegal event or at the end (after it,
    events are late news that move nothing: rule 2)."""
    life, steps = Lifecycle(), []
    for event in sequence:
        before = life.phase
        if before is Phase.ENDED:
            break
        try:
            after = life.fire(event)
        except IllegalTransition as exc:
            assert (exc.phase, exc.event) == (before, event) and event not in TRANSITIONS[before]
            assert life.phase is before  # an illegal event changes nothing
            break
        steps.append((before, event, after))
    return steps


@settings(max_examples=500, deadline=None)
@given(events)
def test_nothing_reaches_the_client_before_the_judge(sequence):
    """COMMITTED only after HEAD then JUDGED, since the last box was chosen."""
    seen: list[Event] = []
    for _, event, _ in walk(sequence):
        if event is Event.DECIDED:
            seen = []
        seen.append(event)
        if event is Event.COMMITTED:
            assert seen[:4] == [Event.DECIDED, Event.SENT, Event.HEAD, Event.JUDGED]


class Queue:
    """The scheduler and the wait queue, as a call's Load sees them."""

    generation = 0

    def poke(self) -> None:
        pass

    def freed(self, box) -> None:
        pass


@settings(max_examples=500, deadline=None)
@given(events)
def test_no_path_leaves_a_slot_held(sequence):
    """Rule 4 played on every accepted path, with the serve layer's own Load on a real box and
    reservation table: the slot is taken on DECIDED (or the queue's ADMITTED), released on
    QUEUED and ENDED; at a box the call holds exactly one slot; at the end, none."""
    steps = walk(sequence)
    last = steps[-1][2] if steps else Phase.RECEIVING
    if last is not Phase.ENDED:  # whatever the phase, the client can still leave
        steps.append((last, Event.CLIENT_LEFT, TRANSITIONS[last][Event.CLIENT_LEFT]))
    reservations, queue = Reservations(), Queue()
    box = BoxState(BoxConfig("b", "http://127.0.0.1:9"), 0, 0)
    load = Load(reservations, queue, queue)  # type: ignore[arg-type]
    for before, event, after in steps:
        if event is Event.DECIDED:
            load.reserve(box)  # taken, or moved to the next box
        elif event is Event.ADMITTED:
            load.count_on(box)  # the queue's hand-out counts it before it wakes
        if after in (Phase.QUEUED, Phase.ENDED):
            load.release()
        if after is Phase.QUEUED:
            assert before is Phase.DECIDING  # a call waits only from a decision, never from a box
        if after in (Phase.SENT, Phase.HELD, Phase.JUDGED, Phase.RELAYING):
            assert box.in_flight == 1 and reservations.count(box.index) == 1
        assert box.in_flight in (0, 1)
    assert steps[-1][2] is Phase.ENDED
    assert box.in_flight == 0 and reservations.count(box.index) == 0 and load.token == 0


def test_every_phase_can_end_and_deadline_is_the_calls_own():
    for phase in Phase:
        assert TRANSITIONS[phase][Event.CLIENT_LEFT] is Phase.ENDED
    # rule 5: the body's deadline while it is read, the queue's (a tick duty) while it waits
    assert {p for p in Phase if p is not Phase.ENDED and Event.DEADLINE in TRANSITIONS[p]} == {
        Phase.RECEIVING, Phase.QUEUED}
    assert [p for p in Phase if Duty.QUEUE_DEADLINE in TICK_DUTIES[p]] == [Phase.QUEUED]


@settings(max_examples=300, deadline=None)
@given(events, st.lists(st.sampled_from(list(Event)), min_size=1, max_size=12))
def test_an_event_after_the_end_is_expected(sequence, late):
    """Rule 2 (issue 20 item 6): once ENDED, any event is late news. It raises nothing, and the
    call stays ended by the event that ended it."""
    life = Lifecycle()
    for event in sequence:
        if event in TRANSITIONS[life.phase]:
            life.fire(event)
    life.fire(Event.CLIENT_LEFT)
    ended_by = life.ended_by
    for event in late:
        assert life.fire(event) is Phase.ENDED
    assert (life.phase, life.ended_by, life.ended) == (Phase.ENDED, ended_by, True)


def test_the_tick_duties_cover_every_phase():
    assert set(TICK_DUTIES) == set(Phase)
    assert TICK_DUTIES[Phase.ENDED] == ()
    for phase in AT_A_BOX:  # at a box: the client is watched and the box's deadline kept
        assert {Duty.WATCH_CLIENT, Duty.BOX_DEADLINE} <= set(TICK_DUTIES[phase])
    for phase in set(Phase) - AT_A_BOX:  # never before the body is in, nor in the queue (it watches)
        assert Duty.WATCH_CLIENT not in TICK_DUTIES[phase]


def test_an_illegal_event_names_the_phase_and_the_event():
    life = Lifecycle()
    with pytest.raises(IllegalTransition, match="event committed in phase receiving"):
        life.fire(Event.COMMITTED)
    for event in (Event.BODY_IN, Event.DECIDED, Event.SENT, Event.HEAD, Event.JUDGED, Event.COMMITTED,
                  Event.DONE):
        life.fire(event)
    assert (life.phase, life.ended_by) == (Phase.ENDED, Event.DONE)
    life.fire(Event.CLIENT_LEFT)  # late: the call stays as it ended (rule 2)
    assert (life.phase, life.ended_by) == (Phase.ENDED, Event.DONE)


def test_a_refusal_before_the_first_byte_decides_again_after_it_ends_the_call():
    life = Lifecycle()
    for event in (Event.BODY_IN, Event.DECIDED, Event.SENT, Event.HEAD):
        life.fire(event)
    assert life.fire(Event.BOX_FAILED) is Phase.DECIDING
    for event in (Event.DECIDED, Event.SENT, Event.HEAD, Event.JUDGED, Event.COMMITTED):
        life.fire(event)
    assert life.fire(Event.BOX_FAILED) is Phase.ENDED


# -- next_attempt --------------------------------------------------------------------------------

BOXES = ("a", "b", "c", "d")


def decision(ranked: tuple[str, ...], waiting: tuple[str, ...] = ()) -> Decision:
    why = {box: Why(Tier.LOAD, (i,)) for i, box in enumerate(ranked)}
    refused = {box: Reason(ReasonCode.FULL, "1/1") for box in waiting}
    return Decision(Path.RANKED if ranked else Path.REFUSED, ranked, why, refused)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.sampled_from(BOXES), unique=True),
    st.lists(st.sampled_from(BOXES), unique=True),
    st.lists(st.sampled_from(BOXES), unique=True),
    st.one_of(st.none(), st.sampled_from(BOXES)),
    st.integers(1, 4),
)
def test_next_attempt(ranked, waiting, tried, pin, max_boxes):
    got = next_attempt(decision(tuple(ranked), tuple(waiting)), tried, pin, max_boxes)
    if isinstance(got, Stop):
        if got is Stop.PINNED:
            assert pin is not None and tried
        elif got is Stop.MAX_BOXES:
            assert len(tried) >= max_boxes
        else:
            assert not [b for b in ranked if b not in tried and (pin is None or b == pin)]
            assert (got is Stop.WAIT) == bool(waiting)
        return
    assert got not in tried  # never back to a box that refused the call
    assert pin is None or (got == pin and not tried)  # a pinned call is never rerouted
    assert len(tried) < max_boxes
    assert got == next(b for b in ranked if b not in tried and (pin is None or b == pin))  # in order
