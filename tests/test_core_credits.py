"""A key's credit as a table (router/core/credits.py), against the flags it was written as before:
random event sequences move both alike, and both refuse the same events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.credits import ASKING, HOLDING, TRANSITIONS, CreditEvent, CreditLife, CreditState
from support.machines import fire_both, reached

E = CreditEvent


class FlagCredit:
    """The plain model: the two flags of the docstring's rule 2 (a credit held, a grant on its way)
    and the rules read literally. `fire` says whether the event was legal; an illegal one changes
    nothing."""

    def __init__(self) -> None:
        self.held = False
        self.asking = False

    def fire(self, event: CreditEvent) -> bool:
        if event is E.ASK:  # one grant on its way at a time
            if self.asking:
                return False
            self.asking = True
        elif event in (E.GRANT, E.DENY, E.FAIL):  # the answer to an ask
            if not self.asking:
                return False
            self.asking = False
            if event is E.GRANT:
                self.held = True  # the new credit (the one it replaces went back)
            elif event is E.DENY:
                self.held = False  # none granted: the one held went back too
            # FAIL: the held one, if any, goes on
        elif event in (E.SPEND, E.EXPIRE):  # only a held credit is spent, or lapses
            if not self.held:
                return False
            if event is E.EXPIRE:
                self.held = False
        elif event is E.GIVE_BACK:  # whatever is held goes back; nothing held, nothing to do
            self.held = False
        return True

    @property
    def state(self) -> CreditState:
        return {(False, False): CreditState.NONE, (False, True): CreditState.ASKED,
                (True, False): CreditState.GRANTED, (True, True): CreditState.RENEWING}[(self.held, self.asking)]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(list(CreditEvent)), max_size=60))
def test_the_table_and_the_flags_agree_on_every_step(sequence):
    credit, model = CreditLife(), FlagCredit()
    for event in sequence:
        fire_both(credit, model, event)
        assert (credit.state in HOLDING, credit.state in ASKING) == (model.held, model.asking)


def test_every_step_of_the_table_is_reached_and_every_state_can_end_holding_nothing():
    assert reached(TRANSITIONS, {CreditState.NONE}) == set(CreditState)
    for state in CreditState:  # a held credit always has a way to give its rest back (rule 3)
        ends = {TRANSITIONS[state].get(E.GIVE_BACK), TRANSITIONS[state].get(E.EXPIRE)}
        assert state in HOLDING or TRANSITIONS[state][E.GIVE_BACK] is state
        assert state not in HOLDING or ends & {CreditState.NONE, CreditState.ASKED}
