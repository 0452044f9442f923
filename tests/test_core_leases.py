"""A box's lease as a table (router/core/leases.py), against the flags it was written as before
(an answer awaited, held in `SlotLeases.held`, parked, counted in `giving`): random event
sequences move both alike, and both refuse the same events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.errors import UsageError
from router.core.leases import BORN, HELD_HERE, TRANSITIONS, LeaseEvent, LeaseLife, LeaseState
from support.machines import fire_both, reached

E = LeaseEvent


class FlagLease:
    """The plain model: the flags fleetwide/leases.py kept before the table, and the rules read
    literally. `fire` says whether the event was legal; an illegal one changes nothing."""

    def __init__(self, taken_alone: bool) -> None:
        self.asked = not taken_alone  # a take is on its way
        self.held = taken_alone  # in this router's `held`: renewed by each sync
        self.parked = False  # kept for the next call (while held)
        self.giving = False  # its GIVE out, not answered

    def fire(self, event: LeaseEvent) -> bool:
        if event in (E.TAKEN, E.REFUSED, E.LOST):  # the take's answer, once
            if not self.asked:
                return False
            self.asked = False
            self.held = event is E.TAKEN
        elif event is E.PARK:  # a call's lease, its call ended
            if not self.held or self.parked:
                return False
            self.parked = True
        elif event is E.REUSE:  # a parked one, to the next call
            if not self.parked:
                return False
            self.parked = False
        elif event in (E.GIVE, E.FORGET):  # held (a call's or parked): let go, once
            if not self.held:
                return False
            self.held = self.parked = False
            self.giving = event is E.GIVE
        elif event is E.GIVEN:  # its GIVE's answer
            if not self.giving:
                return False
            self.giving = False
        return True

    @property
    def state(self) -> LeaseState:
        if self.asked:
            return LeaseState.ASKED
        if self.parked:
            return LeaseState.PARKED
        if self.held:
            return LeaseState.HELD
        return LeaseState.GIVING if self.giving else LeaseState.GONE


@settings(max_examples=500, deadline=None)
@given(st.booleans(), st.lists(st.sampled_from(list(LeaseEvent)), max_size=40))
def test_the_table_and_the_flags_agree_on_every_step(taken_alone, sequence):
    lease = LeaseLife(LeaseState.HELD if taken_alone else LeaseState.ASKED)
    model = FlagLease(taken_alone)
    for event in sequence:
        fire_both(lease, model, event)
        assert (lease.state in HELD_HERE) == model.held  # rule 3: renewed exactly while held here


def test_a_lease_is_born_asked_or_held_and_gone_is_the_end():
    for state in LeaseState:
        if state in BORN:
            assert LeaseLife(state).state is state
        else:
            with pytest.raises(UsageError):
                LeaseLife(state)
    assert TRANSITIONS[LeaseState.GONE] == {}
    assert reached(TRANSITIONS, BORN) == set(LeaseState)
    # every lease this router holds can be let go, with the server up or down
    assert all({E.GIVE, E.FORGET} <= TRANSITIONS[state].keys() for state in HELD_HERE)
