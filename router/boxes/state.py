"""The live view of one box: what its link last saw, plus what this router sent it.

Invariants:
1. Only the box's link writes the inventory fields (online, catalog, residents, free GPU);
   only the proxy writes `contracts` and `last_picked_s`. Each write that changes a field the
   decision reads bumps `version`, so `facts()` rebuilds the immutable BoxFacts only then.
2. `contracts[key]` is the settings string the router last sent with a call that the box
   accepted for that model (None = default); a box restart clears them.
"""

from __future__ import annotations

from router.boxes.config import BoxConfig
from router.core.types import BoxFacts, Resident
from router.upstream.pool import Origin


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
        self.catalog: frozenset[str] = frozenset()
        self.residents: dict[str, Resident] = {}
        self.free_gpu_bytes: int | None = None
        self.contracts: dict[str, str | None] = {}
        self.last_picked_s = 0.0
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

    def set_inventory(
        self, catalog: frozenset[str], residents: dict[str, Resident], free_gpu_bytes: int | None
    ) -> None:
        if (catalog, residents, free_gpu_bytes) != (
            self.catalog,
            self.residents,
            self.free_gpu_bytes,
        ):
            self.catalog, self.residents, self.free_gpu_bytes = catalog, residents, free_gpu_bytes
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
                residents=self.residents,
                contracts={k: v for k, v in self.contracts.items() if v is not None},
                free_gpu_bytes=self.free_gpu_bytes,
                reservations=reservations,
                last_picked_s=self.last_picked_s,
            )
            self._facts_key = key
        return self._facts  # type: ignore[return-value]
