"""Where per-key tallies live: the seam between the limit rules and the engine that counts.

The rules are router.core.limits' pure steps over one key's `Tally` (admit, settle, take and give
a parallel slot, read what is left). An engine only holds tallies and applies a step to one of
them atomically; it never decides anything itself:
1. `LocalCounters` (the default) holds them in this process's memory: each step runs on the
   event loop, so it is atomic by construction and costs a dict lookup beyond the rule.
2. The shared engine (several routers: fleetwide/tallies.py's `SharedCounters`, on a
   Redis-protocol server) holds the same `Tally` fields under the key's id and applies the same
   step as one atomic read-modify-write (a compare-and-set of a versioned record), so the counts
   are exact across routers and the rules are still router.core.limits', unchanged. Its `admit`
   and `take_parallel` may answer with a round trip's future (fleetwide/seam.py: the call
   awaits it); losing the server falls back to a `LocalCounters` (`--shared-down open`).
3. Tallies of callers without a key (by address) are bounded: past MAX_ADDRESS_TALLIES the ones
   with nothing reserved and nothing in flight are dropped; a dropped address starts afresh.
4. `seed(key, used, period)` installs what the store says a key's budget period has used so
   far, so a restart or a changed period counts from the store, not from zero (never less than
   what this process already counted in that period: the store is a flush behind).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from router.core import limits as rules
from router.core.limits import Left, Limits, Refused, Tally, Windows
from router.core.slots import GO, WAIT, Slot

# Distinct addresses counted at once for `--default-rpm/--default-tpm` (~200 B each: ~13 MB); past
# it the idle ones are forgotten (rule 3): an address spray could then reset another address's
# minute, but one that sprays addresses has a minute per address anyway.
MAX_ADDRESS_TALLIES = 65_536


class Counters(Protocol):
    """One atomic step of router.core.limits on one key's tally (rules 1-2)."""

    def admit(self, key: str, limits: Limits, model: str, tokens: int,
              now: float) -> Refused | Windows | Awaitable[Refused | Windows]:
        """`rules.admit`; admitted: `rules.windows_after` (the served call's headers). Several
        routers: a round trip (unless a credit covers it), and the server down and closed is
        the Refused fleetwide/seam.py's SHARED_DOWN."""

    def settle(self, key: str, limits: Limits, reserved: int, used: int, now: float, slot: bool) -> None:
        """`rules.settle` (giving back the call's max_parallel slot when it held one)."""

    def take_parallel(self, key: str, limits: Limits) -> Slot | Awaitable[Slot]:
        """`rules.take_parallel`: GO, WAIT; several routers also DOWN (fleetwide/seam.py)."""

    def has_room(self, key: str, limits: Limits) -> bool: ...

    def left(self, key: str, limits: Limits, now: float) -> Left: ...

    def seed(self, key: str, used: int, period: tuple[float, float]) -> None: ...


class LocalCounters:
    """The tallies of this process (rule 1)."""

    def __init__(self) -> None:
        self.tallies: dict[str, Tally] = {}

    def _tally(self, key: str) -> Tally:
        tally = self.tallies.get(key)
        if tally is None:
            if len(self.tallies) >= MAX_ADDRESS_TALLIES:
                self.forget_idle()
            tally = self.tallies[key] = Tally()
        return tally

    def admit(self, key: str, limits: Limits, model: str, tokens: int, now: float) -> Refused | Windows:
        tally = self.tallies.get(key) or self._tally(key)
        refused = rules.admit(tally, limits, model, tokens, now)
        return refused if refused is not None else rules.windows_after(tally, limits)

    def settle(self, key: str, limits: Limits, reserved: int, used: int, now: float, slot: bool) -> None:
        rules.settle(self.tallies.get(key) or self._tally(key), limits, reserved, used, now, slot)

    def take_parallel(self, key: str, limits: Limits) -> Slot:
        return GO if rules.take_parallel(self.tallies.get(key) or self._tally(key), limits) else WAIT

    def has_room(self, key: str, limits: Limits) -> bool:
        tally = self.tallies.get(key)
        return tally is None or rules.has_room(tally, limits)

    def left(self, key: str, limits: Limits, now: float) -> Left:
        tally = self.tallies.get(key)
        return rules.left(tally if tally is not None else Tally(), limits, now)

    def seed(self, key: str, used: int, period: tuple[float, float]) -> None:
        tally = self._tally(key)
        if tally.period_start == period[0]:  # the store is up to a flush behind what settled here
            used = max(used, tally.used)
        tally.used = used
        tally.period_start, tally.period_end = period

    def forget_idle(self) -> int:
        """Drops the address tallies that hold nothing (rule 3); keys' tallies stay (their
        budget's `used` is worth keeping). Returns how many it dropped."""
        idle = [key for key, t in self.tallies.items()
                if key.startswith("addr:") and not t.parallel and not t.reserved]
        for key in idle:
            del self.tallies[key]
        return len(idle)
