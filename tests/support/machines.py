"""What the property tests of core's table machines (router.core.lifecycle's `Machine`: the
credit's, the lease's) share: one event on the table and on its plain model, and the states a
table reaches."""

from __future__ import annotations

import pytest

from router.core.lifecycle import IllegalTransition


def fire_both(machine, model, event) -> None:
    """`event` on the table machine and on its model: they agree on whether it is legal and on
    the state after it; an illegal event raises IllegalTransition naming the state and the event,
    and changes nothing."""
    before = machine.state
    if model.fire(event):
        assert machine.fire(event) is machine.state is model.state
    else:
        with pytest.raises(IllegalTransition) as raised:
            machine.fire(event)
        assert (raised.value.phase, raised.value.event) == (before, event)
        assert machine.state is before is model.state  # an illegal event changes nothing


def reached(transitions: dict, born) -> set:
    """Every state the table reaches from the states in `born`."""
    found, frontier = set(born), list(born)
    while frontier:
        for after in transitions[frontier.pop()].values():
            if after not in found:
                found.add(after)
                frontier.append(after)
    return found
