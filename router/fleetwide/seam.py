"""What a call asks of the state routers share, in one shape whichever router count is behind it.

Three concerns, each with a one-router implementation and a several-routers one of the same
shape, chosen when the process state is built (serve/app.py), never asked about by the call:
1. A key's tallies: store/counters.py's `Counters` (`LocalCounters`; fleetwide/tallies.py's
   `SharedCounters`), read by serve/limits.py: its `admit` answers a Charge or a Refused.
2. A box's slots: `Slots` (`ONE_ROUTER_SLOTS`: the box's in-flight count on this router is the
   whole of it; fleetwide/leases.py's `SlotLeases`: a lease per call on the shared server).
3. Affinity bindings: `Bindings` (`ONE_ROUTER_BINDINGS`: this router's own index only;
   fleetwide/bindings.py's `SharedBindings`).

Each step answers at once, or with a `pending` answer (a round trip to the shared server: a
Future or a coroutine) that the call awaits; the answer awaited has the same type as the one
given at once. A shared server that is down and `--shared-down closed` is an answer, never an
exception: `Slot.DOWN` for a slot, SHARED_DOWN (a Refused of reason SHARED_STORE_DOWN) for an admission, each
answered 503 `shared_store_down` at one site (serve/proxy.py `turned_away`).
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable
from typing import Protocol

from router.boxes.state import BoxState
from router.core.leases import LeaseLife, LeaseState
from router.core.limits import Refused
from router.core.slots import GO, Slot

SHARED_STORE_DOWN = "shared_store_down"  # the 503's code
SHARED_DOWN_TEXT = "the shared server that counts this call across routers is down"
SHARED_DOWN = Refused(SHARED_STORE_DOWN, 0, SHARED_DOWN_TEXT)  # an admission's answer, as a key's refusal

# what a step answers when the answer is a round trip away (a Future, or an `async def`'s coroutine)
PENDING = (asyncio.Future, types.CoroutineType)


class Lease(LeaseLife):
    """One lease of a box's slots (fleetwide/leases.py), moved through router.core.leases' table:
    the box, the lease's name on the server (unique across routers and restarts), the take's
    answer while it is ASKED, and when it was parked while it is PARKED."""

    __slots__ = ("box", "member", "reply", "parked_mono")

    def __init__(self, box: BoxState, member: str, reply: asyncio.Future | None, state: LeaseState) -> None:
        super().__init__(state)
        self.box = box
        self.member = member
        self.reply = reply  # the take's answer (`SlotLeases._took`); None for a lease taken alone
        self.parked_mono = 0.0


class Holder(Protocol):
    """What a box's slot moves of a call's load (serve/load.py's `Load`): its count on a box, its
    lease, and the lease asked and not answered yet (fleetwide/leases.py rules 1-2)."""

    lease: Lease | None
    asked: Lease | None

    def count_on(self, box: BoxState | None) -> None: ...


class Slots(Protocol):
    """A box's `max_inflight` slots, as one call meets them."""

    gates: bool  # whether `take` can answer anything but GO (the call asks only then)

    def ask(self, load: Holder, box: BoxState) -> None:
        """The slot of `box`, asked early: with the round trip the call waits for anyway."""

    def take(self, load: Holder, box: BoxState) -> Slot | Awaitable[Slot]:
        """Before `box` is sent the call."""

    def want(self, names: frozenset[str]) -> None:
        """The call is about to wait for these boxes."""

    def give(self, lease: Lease) -> None:
        """The call left the box its lease is on."""

    def unask(self, asked: Lease) -> None:
        """A slot asked early for a box the call did not go to."""


class OneRouterSlots:
    """One router: a box's in-flight count here is all there is (serve/load.py); no lease is
    ever held, so `give` and `unask` are never called."""

    gates = False

    def ask(self, load: Holder, box: BoxState) -> None:
        pass

    def take(self, load: Holder, box: BoxState) -> Slot:
        return GO

    def want(self, names: frozenset[str]) -> None:
        pass

    def give(self, lease: Lease) -> None:
        raise AssertionError("one router holds no lease")

    unask = give


class Bindings(Protocol):
    """Affinity bindings other routers made (router.core.affinity rule 9)."""

    def find(self, scoped: tuple) -> str | None | Awaitable[str | None]:
        """The box another router bound a key to (its scoped parts: router.core.affinity's
        `Key.scoped`), or None."""

    def keep(self, scoped: tuple, box: str) -> None:
        """A binding made or moved here."""


class OneRouterBindings:
    """One router: its own index is every binding there is."""

    def find(self, scoped: tuple) -> None:
        return None

    def keep(self, scoped: tuple, box: str) -> None:
        pass


ONE_ROUTER_SLOTS = OneRouterSlots()
ONE_ROUTER_BINDINGS = OneRouterBindings()
