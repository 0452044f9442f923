"""The live view of one box: what its link last saw, plus what this router sent it.

Invariants:
1. Only the box's link writes the inventory fields (online, catalog, residents, free GPU) and
   clears `contracts` when the box restarted; only the proxy records `contracts` and
   `last_picked_s`. Each write that changes a field the
   decision reads bumps `version`, so `facts()` rebuilds the immutable BoxFacts only then.
   What the facts derive from the box's settled state (its contracts, cooling, refusals, busy
   seats, limit) is worked out again only after a `changed()`: a call taken (`took`) that moves
   nothing but `last_picked_s` and the calls in flight (`picked`) rebuilds the facts around the
   derived parts it had.
2. `contracts[key]` is the settings string the router last sent with a call that the box
   accepted for that model (None = default); a box restart clears them. On a hugpy box,
   `loaded[key]` is the load contract that seat runs under (router.core.pairs rule 4): the
   call's contract (its body knobs and options over the pair settings) when the box took it,
   or, for a seat the router first sees already loaded, the contract a call without options
   or knobs had at that moment. The decision compares these, so a pair-settings write after
   the load turns the seat into a load. `fits` is what the box's
   verdicts said per catalog key when last read (boxes/verdicts.py).
3. Refusal memory (router.core.admission rule 7): `refusals[key]` counts placement refusals in a
   row and `cooling[key] = (until_s, ceiling)` is when the back-off they set ends and the calls
   the box had in flight besides the refused one (its ceiling for the model). The back-off's end
   (`expire_cooling`, run by the CallClock's sweep) lifts the cooling and keeps the count, so a
   box that refuses again backs off longer; a success for the key, or more free GPU memory in
   the inventory, clears both. A connect failure
   marks the box `unreachable` (offline for the decision) until its health probe succeeds.
4. `in_flight` counts this router's calls on the box from every facade, at every instant. The
   facts' `pending` is the work the box carries now beside the reservations: the router's calls
   from before the current snapshot (`in_flight - reservations`) or the box's own busy seats
   when more. A call that ended is not pending a moment longer, so calls that follow each other
   follow the ranking exactly; a burst, still running, spreads. The scheduler's snapshot
   `pending` (shown in the state) is that figure at snapshot time.
   With several routers (fleetwide/leases.py), `others` is what the other routers hold on the box
   as last read from the shared server (0 for one router); it adds to `in_flight` wherever the
   box's fullness and load are read, and a change of it bumps `version`.
5. Prefix cache epochs (router.core.affinity rule 3c): `cache_epoch(key)` changes whenever what
   the box computed for that model is gone: the model left the residents or is loading again,
   the router sent it other settings than before (a reload), or the box went offline, became
   unreachable or restarted (every model). Epochs come from one process-wide counter, so an
   old epoch never comes back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from router.boxes.config import BoxConfig
from router.core.admission import backoff_s, is_full
from router.core.kinds import CALL_KEYS, Capability, call_key, can, kinds_that
from router.core.pairs import EMPTY, Fit, PairView, contract
from router.core.refusal import PLACEMENT_REFUSALS, RefusalCode
from router.core.types import BoxFacts, Call, Resident, new_tuple
from router.upstream.pool import Origin

PAIR_SETTINGS = Capability.PAIR_SETTINGS
PAIR_SETTINGS_KINDS = kinds_that(PAIR_SETTINGS)  # asked per call: a set, no frame (`can` costs one)


_epochs = itertools.count(1)  # rule 5
_UNSET = object()  # `took`: a model without a load contract yet


@dataclass(frozen=True)
class Inventory:
    """What a link read: catalog (key -> the name as the box writes it), residents by key,
    the most free GPU memory on one card, and the raw listing for the facades' fleet answers."""

    catalog: dict[str, str] = field(default_factory=dict)
    residents: dict[str, Resident] = field(default_factory=dict)
    free_gpu_bytes: int | None = None
    listing: dict[str, Any] = field(default_factory=dict)
    capacity: int | None = None  # calls at once, as the box itself reports it (llama.cpp's slots)
    pairs: PairView = EMPTY  # a hugpy box's own pair settings (router.core.pairs rule 1)


class BoxState:
    def __init__(self, config: BoxConfig, index: int, order: int) -> None:
        self.config = config
        self.name = config.name  # read several times a call: an attribute, not a property
        self.index = index  # slot in the reservation table, fixed for the process lifetime
        self.order = order
        self.origin = Origin(config.host, config.port, tls=config.url.startswith("https:"))
        self.auth_header = (
            f"Authorization: Bearer {config.key}\r\n".encode("latin-1") if config.key else b""
        )
        self.online = False
        self.last_ok_s = 0.0
        self.inventory = Inventory()
        self.limit: int | None = None
        self._set_limit()
        self.catalog: frozenset[str] = frozenset()
        self.contracts: dict[str, str | None] = {}
        self.loaded: dict[str, str | None] = {}
        self.fits: dict[str, Fit] = {}
        self.last_picked_s = 0.0
        # load: the router's own calls on the box now; pending and pressure as of the last
        # scheduler snapshot (until one exists: nothing pending, neutral pressure)
        self.in_flight = 0
        self.others = 0  # rule 4: other routers' calls on the box
        self.pending = 0
        self.pressure = 1
        self.refusals: dict[str, int] = {}
        self.cooling: dict[str, tuple[float, int]] = {}
        self.unreachable = False
        self.cache_epochs: dict[str, int] = {}  # rule 5: per model key, over cache_base
        self.cache_base = 0
        self.down = ""  # why the link's last probe failed ("" after a good one)
        self.version = 0
        self._facts: BoxFacts | None = None
        # the facts' parts derived from settled state, and the version they were derived at
        # (invariant 1): (online, contracts, busy seats, limit, cooling, recent refusals)
        self._derived: tuple = ()
        self._derived_version = -1
        # what `_facts` was built from: (version, reservations, in_flight), kept apart so that the
        # check on every decision allocates nothing
        self._facts_version = self._facts_reservations = self._facts_in_flight = -1

    def changed(self) -> None:
        self.version += 1

    def reconfigure(self, config: BoxConfig, order: int) -> None:
        """The boxes file moved what it says of the box beside its link (pool, blocked, agent,
        max_inflight) or its place: its limit follows."""
        self.config, self.order = config, order
        self._set_limit()
        self.changed()

    def _set_limit(self) -> None:
        """Calls at once: the boxes file's `max_inflight`, else what the box reports (its
        inventory's `capacity`). An attribute, set when either moves: several routers read it
        several times a call."""
        self.limit = self.config.max_inflight if self.config.max_inflight is not None else self.inventory.capacity

    def picked(self) -> None:
        """Only `last_picked_s` moved: the facts are rebuilt, their derived parts kept (invariant 1)."""
        derived_current = self._derived_version == self.version
        self.version += 1
        if derived_current:
            self._derived_version = self.version

    def set_online(self, online: bool) -> None:
        if online != self.online:
            self.online = online
            if not online:
                self.drop_caches()
            self.changed()

    def cache_epoch(self, key: str) -> int:
        """The epoch of what the box has computed for model `key` (rule 5)."""
        epoch = self.cache_epochs.get(key, 0)
        return epoch if epoch > self.cache_base else self.cache_base

    def drop_caches(self, key: str | None = None) -> None:
        """What the box computed for `key` (None: every model) is gone (rule 5)."""
        if key is None:
            self.cache_base = next(_epochs)
        else:
            self.cache_epochs[key] = next(_epochs)

    def set_down(self, why: str) -> None:
        if why != self.down:
            self.down = why
            self.changed()

    @property
    def residents(self) -> dict[str, Resident]:
        return self.inventory.residents

    def set_inventory(self, inventory: Inventory) -> None:
        old = self.inventory
        self.inventory = inventory
        self._set_limit()
        if old.residents is not inventory.residents:
            for key, was in old.residents.items():
                now = inventory.residents.get(key)
                if now is None or (now.loading and not was.loading):
                    self.drop_caches(key)  # unloaded, or loading again
        if self.refusals and (inventory.free_gpu_bytes or 0) > (old.free_gpu_bytes or 0):
            self.refusals, self.cooling = {}, {}  # room freed: a refused placement may fit now
            self.changed()
        if can(self.config.kind, PAIR_SETTINGS):
            for key in inventory.residents.keys() - self.loaded.keys():  # a seat first seen (rule 2)
                self.loaded[key] = contract(inventory.pairs, key, None)
        if (inventory.catalog, inventory.residents, inventory.free_gpu_bytes, inventory.capacity,
                inventory.pairs) != (old.catalog, old.residents, old.free_gpu_bytes, old.capacity, old.pairs):
            self.catalog = frozenset(inventory.catalog)
            self.changed()

    def set_load(self, pending: int, pressure: int) -> None:
        if (pending, pressure) != (self.pending, self.pressure):
            self.pending, self.pressure = pending, pressure
            self.changed()

    def forget_contracts(self) -> None:
        """The box restarted: what it was sent, and what it computed, are gone."""
        self.drop_caches()
        if self.contracts or self.loaded:
            self.contracts, self.loaded = {}, {}
            self.changed()

    def set_fits(self, fits: dict[str, Fit]) -> None:
        if fits != self.fits:
            self.fits = fits
            self.changed()

    def took(self, call: Call, now_s: float) -> None:
        """The box took `call` (its answer is going to the client): it now runs the model with
        the call's settings, and it had room for it."""
        named = CALL_KEYS[(self.config.kind, call.model, call.settings)]  # call_key, remembered
        if named is not None:
            if self.config.kind in PAIR_SETTINGS_KINDS:
                loaded = contract(self.inventory.pairs, named[0], named[1], call.knobs)
                if self.loaded.get(named[0], _UNSET) != loaded:
                    self.loaded[named[0]] = loaded
                    self.changed()
            self.record_dispatch(named[0], named[1], now_s)
            self.placement_ok(named[0])

    def refused(self, call: Call, code: RefusalCode, now_s: float) -> None:
        """The box refused `call` before its first byte: a placement refusal makes it full for the
        model for a back-off; a box that cannot be reached is out of every decision until its
        health probe sees it again."""
        if code is RefusalCode.UNREACHABLE:
            self.mark_unreachable()
        elif code in PLACEMENT_REFUSALS:
            named = call_key(self.config.kind, call.model, call.settings)
            if named is not None:
                self.placement_refused(named[0], now_s)

    def record_dispatch(self, key: str, settings: str | None, now_s: float) -> None:
        """The box accepted a call for `key` under `settings`: remember both for the tiers."""
        self.last_picked_s = now_s
        if key not in self.contracts or self.contracts[key] != settings:
            if key in self.contracts:
                self.drop_caches(key)  # other settings: the box reloads the model
            self.contracts[key] = settings
            self.changed()
        else:
            self.picked()

    def placement_refused(self, key: str, now_s: float) -> None:
        """The box refused to place `key` (the refused call still counted in `in_flight`): full
        for it at the load it had besides, for the next back-off step."""
        consecutive = self.refusals[key] = self.refusals.get(key, 0) + 1
        self.cooling[key] = (now_s + backoff_s(consecutive), max(self.in_flight - 1, 0))
        self.changed()

    def placement_ok(self, key: str) -> None:
        if self.refusals.pop(key, None) is not None:
            self.cooling.pop(key, None)
            self.changed()

    def expire_cooling(self, now_s: float) -> None:
        """Lifts the back-offs that are over (their refusal counts stay until a success)."""
        if any(until <= now_s for until, _ in self.cooling.values()):
            self.cooling = {k: v for k, v in self.cooling.items() if v[0] > now_s}
            self.changed()

    def mark_unreachable(self) -> None:
        if not self.unreachable:
            self.unreachable = True
            self.drop_caches()
            self.changed()

    def reachable(self) -> None:
        if self.unreachable:
            self.unreachable = False
            self.changed()

    @property
    def busy_seats(self) -> int:
        """What the box itself says is busy (its residents serving a call, anyone's)."""
        busy = 0
        for resident in self.inventory.residents.values():  # a loop: no generator per decision
            busy += resident.busy
        return busy

    @property
    def limit_source(self) -> str | None:
        if self.config.max_inflight is not None:
            return "boxes file"
        return "box (llama.cpp total_slots)" if self.inventory.capacity is not None else None

    @property
    def full(self) -> bool:
        return is_full(self.in_flight + self.others, self.limit)

    def facts(self, reservations: int) -> BoxFacts:
        """Immutable facts for one decision; rebuilt only when something changed."""
        # pending, fullness and a cooling model's ceiling depend on the calls in flight (rule 4)
        if (self.version != self._facts_version or reservations != self._facts_reservations
                or self.in_flight != self._facts_in_flight):
            self._facts = self._new_facts(reservations)
            self._facts_version, self._facts_reservations = self.version, reservations
            self._facts_in_flight = self.in_flight
        return self._facts  # type: ignore[return-value]

    def _new_facts(self, reservations: int) -> BoxFacts:
        """`facts` rebuilt around the derived parts, themselves worked out again only after a
        `changed()` (invariant 1)."""
        if self._derived_version != self.version:
            self._derived = self._derive()
            self._derived_version = self.version
        online, contracts, busy_seats, limit, cooling, recent_refusals = self._derived
        config, inventory, in_flight = self.config, self.inventory, self.in_flight + self.others
        # Positional, in BoxFacts' order, each line naming its field (tests/test_exact_load.py
        # checks each).
        return new_tuple(BoxFacts, (
            config.name,  # id
            config.kind,  # kind
            self.order,  # order
            online,  # online
            config.pool,  # pool
            config.blocked,  # blocked
            self.catalog,  # catalog
            inventory.residents,  # residents
            contracts,  # contracts
            inventory.free_gpu_bytes,  # free_gpu_bytes
            max(in_flight - reservations, busy_seats),  # pending
            self.pressure,  # pressure
            reservations,  # reservations
            self.last_picked_s,  # last_picked_s
            in_flight,  # in_flight
            limit,  # max_inflight
            cooling,  # cooling
            recent_refusals,  # recent_refusals
            self.down,  # down
            inventory.pairs,  # pairs
            self.fits,  # fits
        ))

    def _derive(self) -> tuple:
        """The facts' parts that follow from settled state alone (`_derived`'s order). (A method
        of its own: its comprehensions would make `self` a cell in `_new_facts`.)"""
        config = self.config
        return (
            self.online and not self.unreachable,
            {k: v for k, v in (self.loaded if can(config.kind, PAIR_SETTINGS)
                               else self.contracts).items() if v is not None},
            self.busy_seats,
            self.limit,
            {k: ceiling for k, (_, ceiling) in self.cooling.items()},
            sum(self.refusals[k] for k in self.cooling),
        )
