"""The live view of one box: what its link last saw, plus what this router sent it.

Invariants:
1. Only the box's link writes the inventory fields (online, catalog, residents, free GPU) and
   clears `contracts` when the box restarted; only the proxy records `contracts` and
   `last_picked_s`. Each write that changes a field the
   decision reads bumps `version`, so `facts()` rebuilds the immutable BoxFacts only then.
2. `contracts[key]` is the settings string the router last sent with a call that the box
   accepted for that model (None = default); a box restart clears them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.boxes.config import BoxConfig
from router.core.types import BoxFacts, Resident
from router.upstream.pool import Origin


@dataclass(frozen=True)
class Inventory:
    """What a link read: catalog (key -> the name as the box writes it), residents by key,
    the most free GPU memory on one card, and the raw listing for the facades' fleet answers."""

    catalog: dict[str, str] = field(default_factory=dict)
    residents: dict[str, Resident] = field(default_factory=dict)
    free_gpu_bytes: int | None = None
    listing: dict[str, Any] = field(default_factory=dict)


class BoxState:
    def __init__(self, config: BoxConfig, index: int, order: int) -> None:
        self.config = config
        self.index = index  # slot in the reservation table, fixed for the process lifetime
        self.order = order
        self.origin = Origin(config.host, config.port)
        self.auth_header = (
            f"Authorization: Bearer {config.key}\r\n".encode("latin-1") if config.key else b""
        )
        self.online = False
        self.last_ok_s = 0.0
        self.inventory = Inventory()
        self.catalog: frozenset[str] = frozenset()
        self.contracts: dict[str, str | None] = {}
        self.last_picked_s = 0.0
        # load: the router's own calls on the box now; pending and pressure as of the last
        # scheduler snapshot (until one exists: nothing pending, neutral pressure)
        self.in_flight = 0
        self.pending = 0
        self.pressure = 1
        self.version = 0
        self._facts: BoxFacts | None = None
        self._facts_key: tuple[int, int] = (-1, -1)

    @property
    def name(self) -> str:
        return self.config.name

    def changed(self) -> None:
        self.version += 1

    def set_online(self, online: bool) -> None:
        if online != self.online:
            self.online = online
            self.changed()

    @property
    def residents(self) -> dict[str, Resident]:
        return self.inventory.residents

    def set_inventory(self, inventory: Inventory) -> None:
        old = self.inventory
        self.inventory = inventory
        if (inventory.catalog, inventory.residents, inventory.free_gpu_bytes) != (
            old.catalog,
            old.residents,
            old.free_gpu_bytes,
        ):
            self.catalog = frozenset(inventory.catalog)
            self.changed()

    def set_load(self, pending: int, pressure: int) -> None:
        if (pending, pressure) != (self.pending, self.pressure):
            self.pending, self.pressure = pending, pressure
            self.changed()

    def forget_contracts(self) -> None:
        if self.contracts:
            self.contracts = {}
            self.changed()

    def record_dispatch(self, key: str, settings: str | None, now_s: float) -> None:
        """The box accepted a call for `key` under `settings`: remember both for the tiers."""
        self.last_picked_s = now_s
        if key not in self.contracts or self.contracts[key] != settings:
            self.contracts[key] = settings
        self.changed()

    def facts(self, reservations: int) -> BoxFacts:
        """Immutable facts for one decision; rebuilt only when something changed."""
        key = (self.version, reservations)
        if key != self._facts_key:
            config = self.config
            self._facts = BoxFacts(
                id=config.name,
                kind=config.kind,
                order=self.order,
                online=self.online,
                pool=config.pool,
                blocked=config.blocked,
                catalog=self.catalog,
                residents=self.inventory.residents,
                contracts={k: v for k, v in self.contracts.items() if v is not None},
                free_gpu_bytes=self.inventory.free_gpu_bytes,
                pending=self.pending,
                pressure=self.pressure,
                reservations=reservations,
                last_picked_s=self.last_picked_s,
            )
            self._facts_key = key
        return self._facts  # type: ignore[return-value]
