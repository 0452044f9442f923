"""A key's credit on one router (fleetwide/tallies.py rule 8): what it holds and whether the
next one is asked, as one table. Pure.

    NONE --ask--> ASKED --grant--> GRANTED --ask--> RENEWING --grant--> GRANTED
    ASKED --deny | fail--> NONE                        (nothing granted: near a limit; or the write failed)
    RENEWING --deny--> NONE                            (the server grants no next one: the held one goes back)
    RENEWING --fail--> GRANTED                         (the next one's write failed: the held one goes on)
    GRANTED | RENEWING --spend--> itself               (a call the credit covers)
    GRANTED --expire | give_back--> NONE               (its rest goes back)
    RENEWING --expire | give_back--> ASKED
    NONE | ASKED --give_back--> itself                 (nothing held: nothing goes back)

Rules:
1. `TRANSITIONS` is the whole machine; `CreditLife.fire` raises IllegalTransition (naming the
   state and the event) for anything else: that is a bug in the router (a grant nobody asked
   for, a credit spent or expired that holds nothing, a second ask while one is on its way).
2. Two facts in one state: whether a credit is held (GRANTED, RENEWING: `HOLDING`) and whether a
   grant is on its way (ASKED, RENEWING: `ASKING`). At most one grant is on its way at a time.
3. Each move out of a held credit (expire, give_back, a grant or a denial that replaces it) is
   where its unspent rest goes back; a grant that fails leaves the held one as it was.

Outside the table (fleetwide/tallies.py, read per call): a held credit is spent only while it
has a request left and room for the call's tokens, for the limits it was granted for, on the
server's run it was drawn on (`SharedServer.epoch`: a restarted server lost the draw) and while
that server is up; a call it does not cover gives it back (with the server up) and asks again.
Where a rest goes back (written, parked while the server is down, lost with a restarted server's
run) is the server's fact, not the credit's.
"""

from __future__ import annotations

from enum import Enum

from router.core.lifecycle import Machine


class CreditState(Enum):
    # identity, as the members are compared (Enum's own hashes the name in Python: ~55 ns a
    # look-up in the table, on a call's path)
    __hash__ = object.__hash__

    NONE = "none"  # nothing held, nothing asked
    ASKED = "asked"  # nothing held; a grant is on its way
    GRANTED = "granted"  # a credit held: spendable (rule 2)
    RENEWING = "renewing"  # a credit held, and the next one asked


class CreditEvent(Enum):
    __hash__ = object.__hash__

    ASK = "ask"  # a grant asked with the key's next compare-and-set
    GRANT = "grant"  # the server drew a credit
    DENY = "deny"  # the server drew none (near a limit, or no room)
    FAIL = "fail"  # the ask's write failed (the server down, or contended)
    SPEND = "spend"  # a call admitted from the credit
    EXPIRE = "expire"  # CREDIT_S passed and nobody renewed it
    GIVE_BACK = "give_back"  # a call it does not cover, or the router stops


_HELD_GOES_BACK = {CreditEvent.EXPIRE: CreditState.NONE, CreditEvent.GIVE_BACK: CreditState.NONE}

TRANSITIONS: dict[CreditState, dict[CreditEvent, CreditState]] = {
    CreditState.NONE: {CreditEvent.ASK: CreditState.ASKED, CreditEvent.GIVE_BACK: CreditState.NONE},
    CreditState.ASKED: {
        CreditEvent.GRANT: CreditState.GRANTED,
        CreditEvent.DENY: CreditState.NONE,
        CreditEvent.FAIL: CreditState.NONE,
        CreditEvent.GIVE_BACK: CreditState.ASKED,
    },
    CreditState.GRANTED: {
        CreditEvent.ASK: CreditState.RENEWING,
        CreditEvent.SPEND: CreditState.GRANTED,
        **_HELD_GOES_BACK,
    },
    CreditState.RENEWING: {
        CreditEvent.GRANT: CreditState.GRANTED,
        CreditEvent.DENY: CreditState.NONE,
        CreditEvent.FAIL: CreditState.GRANTED,
        CreditEvent.SPEND: CreditState.RENEWING,
        CreditEvent.EXPIRE: CreditState.ASKED,
        CreditEvent.GIVE_BACK: CreditState.ASKED,
    },
}

HOLDING = frozenset({CreditState.GRANTED, CreditState.RENEWING})  # rule 2
ASKING = frozenset({CreditState.ASKED, CreditState.RENEWING})


class CreditLife(Machine):
    """A credit's state, moved only through TRANSITIONS (fleetwide/tallies.py's `Credit` adds
    what it holds)."""

    __slots__ = ()
    TRANSITIONS = TRANSITIONS

    def __init__(self) -> None:
        self.state = CreditState.NONE
