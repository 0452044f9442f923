"""This router's engines on the shared server, made before the process state (serve/app.py),
which hands each to the piece of the call that meets it (fleetwide/seam.py): the keys' tallies
to tenancy, the boxes' slots to the call's load, the bindings to affinity."""

from __future__ import annotations

import logging
from collections.abc import Callable

from router.boxes.fleet import Fleet
from router.boxes.state import BoxState
from router.fleetwide.bindings import SharedBindings
from router.fleetwide.leases import CLOSED, OPEN, SlotLeases
from router.fleetwide.tallies import SharedCounters
from router.fleetwide.wire import SharedServer

log = logging.getLogger("router.shared")


class SeveralRouters:
    def __init__(self, server: SharedServer, instance: str, fleet: Fleet, down_mode: str = OPEN) -> None:
        self.server = server
        self.instance = instance
        self.fleet = fleet
        self.down_mode = down_mode
        server.meanwhile = ("counting in this router alone" if down_mode == OPEN
                            else "refusing calls that need a shared count (503 shared_store_down)")
        self.tallies = SharedCounters(server, down_mode == CLOSED)
        self.bindings = SharedBindings(server)
        self.leases: SlotLeases | None = None  # `slots`: they offer a slot freed elsewhere to the wait queue

    def slots(self, freed: Callable[[BoxState], None], stats: Callable[[], dict],
              on_back: Callable[[], None]) -> SlotLeases:
        """The boxes' slots, for the process state that holds the wait queue (`freed`), this
        router's figures (`stats`, its heartbeat's) and its budgets' seed (`on_back`)."""
        self.leases = SlotLeases(self.server, self.instance, self.fleet, self.down_mode,
                                 upkeep=self.tallies.upkeep, freed=freed, stats=stats, on_back=on_back)
        return self.leases

    async def start(self) -> None:
        """The first round trip, before the first call; then the sync and the pub/sub."""
        leases = self.leases
        await leases.sync()  # type: ignore[union-attr]
        if self.server.up:
            log.info("shared server %s: up, as router %s (--shared-down %s)", self.server.url, self.instance,
                     self.down_mode)
        else:  # fleetwide/wire.py rule 4: why, and what this router does meanwhile
            self.server.say_down()
        leases.start()  # type: ignore[union-attr]

    async def stop(self) -> None:
        """Credits back and settles written while the server is up, then the leases given back."""
        await self.tallies.give_back()
        await self.leases.stop()  # type: ignore[union-attr]

    def view(self) -> dict:
        """The state's `shared` (fleetwide/leases.py rules 6-7, and the tallies)."""
        return {**self.leases.view(), "tallies": self.tallies.view()}  # type: ignore[union-attr]
