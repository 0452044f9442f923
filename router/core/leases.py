"""One lease of a box's fleet-wide slots, as this router holds it (fleetwide/leases.py): asked,
held by a call, parked for the next one, given back, gone, as one table. Pure.

    ASKED --taken--> HELD --park--> PARKED --reuse--> HELD      (the next call here takes it)
    ASKED --refused | lost--> GONE                              (the box full fleet-wide; no answer)
    HELD | PARKED --give--> GIVING --given--> GONE              (one GIVE, answered or failed)
    HELD | PARKED --forget--> GONE                              (the server down: nothing to send)

Rules:
1. `TRANSITIONS` is the whole machine; `LeaseLife.fire` raises IllegalTransition (naming the
   state and the event) for anything else: that is a bug in the router (a lease given back
   twice, a parked lease handed to two calls, an answer for a lease not asked).
2. A lease is born ASKED (its take is on its way) or HELD (taken alone while the server is down,
   `--shared-down open`): `BORN`. GONE is the end: nothing leaves it.
3. This router counts a lease as its own on the server (`SlotLeases.held`, renewed by each sync)
   exactly while it is HELD or PARKED (`HELD_HERE`), and as given back and not yet answered while
   it is GIVING: the count that read before a GIVE landed is not another router's.
4. A lost take (its round trip failed) is GONE: what the call does next (count alone, or
   answer 503 shared_store_down) is a new lease or none.

Outside the table (fleetwide/leases.py): whether an ended call's lease parks or goes back (the
box's share of its limit, the mode, the server up), and whether a GIVE goes at once or rides the
next round trip (the box near its limit).
"""

from __future__ import annotations

from enum import Enum

from router.core.errors import UsageError
from router.core.lifecycle import Machine


class LeaseState(Enum):
    # identity, as the members are compared (Enum's own hashes the name in Python: ~55 ns a
    # look-up in the table, on a call's path)
    __hash__ = object.__hash__

    ASKED = "asked"  # its take is on its way to the server
    HELD = "held"  # a call's (or, answered for a call that went elsewhere, to be given back)
    PARKED = "parked"  # kept on the server for this router's next call to the box
    GIVING = "giving"  # its GIVE is out, not answered yet
    GONE = "gone"  # not on the server as this router's


class LeaseEvent(Enum):
    __hash__ = object.__hash__

    TAKEN = "taken"  # the take's answer: a slot
    REFUSED = "refused"  # the take's answer: the box is full fleet-wide
    LOST = "lost"  # the take's round trip failed
    PARK = "park"  # its call ended and keeps it for the next
    REUSE = "reuse"  # a call takes it from the parked ones
    GIVE = "give"  # its GIVE is sent
    GIVEN = "given"  # its GIVE is answered (or failed: the lease expires on the server)
    FORGET = "forget"  # let go while the server is down (fleetwide/leases.py rule 6)


_LET_GO = {LeaseEvent.GIVE: LeaseState.GIVING, LeaseEvent.FORGET: LeaseState.GONE}

TRANSITIONS: dict[LeaseState, dict[LeaseEvent, LeaseState]] = {
    LeaseState.ASKED: {
        LeaseEvent.TAKEN: LeaseState.HELD,
        LeaseEvent.REFUSED: LeaseState.GONE,
        LeaseEvent.LOST: LeaseState.GONE,
    },
    LeaseState.HELD: {LeaseEvent.PARK: LeaseState.PARKED, **_LET_GO},
    LeaseState.PARKED: {LeaseEvent.REUSE: LeaseState.HELD, **_LET_GO},
    LeaseState.GIVING: {LeaseEvent.GIVEN: LeaseState.GONE},
    LeaseState.GONE: {},  # rule 2
}

BORN = frozenset({LeaseState.ASKED, LeaseState.HELD})  # rule 2
HELD_HERE = frozenset({LeaseState.HELD, LeaseState.PARKED})  # rule 3


class LeaseLife(Machine):
    """A lease's state, moved only through TRANSITIONS (fleetwide/seam.py's `Lease` adds its box
    and its name on the server)."""

    __slots__ = ()
    TRANSITIONS = TRANSITIONS

    def __init__(self, state: LeaseState) -> None:
        if state not in BORN:
            raise UsageError(f"a lease is born asked or held, not {state.value} (rule 2)")
        self.state = state
