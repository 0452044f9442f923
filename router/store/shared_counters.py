"""Per-key tallies on the shared server (several routers): router.core.limits' steps, exact
across routers (store/counters.py rule 2).

Rules:
1. A tally is one hash on the server, `hugpy-router:tally:<name>`: a version `v` and the Tally's
   fields `t`, packed. A step reads the tally this router last saw and its version, applies the
   rule of router.core.limits to a copy, and writes it back with a compare-and-set script (CAS):
   written only while the server's version is the one read. A version another router moved
   answers the record as it is instead, and the step is applied again to that (at most
   CAS_TRIES times). So a step is one round trip when this router saw the latest write, two when
   another router wrote since; the rules stay router.core.limits', unchanged, and every step is
   atomic across routers: the counts, and the overshoot bound of a token limit (one call's
   reservation), are the same as one router's. A router writes one tally once at a time: the
   steps that arrive meanwhile are applied in order to one copy and go out in its next write
   (a burst on one key costs one round trip per write, not one per call, and its CASes do not
   race each other).
2. A refusal is written too (the buckets caught up to now): a refusal read from a stale copy
   would be wrong, and the write is what proves the copy current.
3. The server down (store/shared.py rule 3): `open` steps on `local`, a LocalCounters of this
   router alone; `closed` raises SharedDown to the caller (503 `shared_store_down`). A settle
   (or a seed) that finds the server down is dropped and counted (`lost_steps`): its admission
   was made on the server, the local tally never held its reservation.
4. `has_room` and `left` read the copy last seen (no round trip): `has_room` is the queue's
   advice only, and says yes for a copy older than STALE_S, so a waiter whose key's slot was
   given back on another router is tried within STALE_S; `take_parallel` then decides, atomically.
5. A key's tally lives KEY_TALLY_TTL_S after its last write (a month's budget and then some); an
   address's (`addr:`) ADDRESS_TALLY_TTL_S: its minute is all it has.
6. The budget period rolls over inside the rules (limits rule 6) at the first step after the
   boundary, on whichever router takes it; the CAS makes that one step, so no lease is needed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

from router.core import limits as rules
from router.core.limits import Ask, Left, Limits, Refused, Tally, Windows
from router.store.counters import LocalCounters
from router.store.shared import PREFIX, SharedDown, SharedServer

CAS_TRIES = 16
STALE_S = 1.0
KEY_TALLY_TTL_S = 40 * 86400
ADDRESS_TALLY_TTL_S = 120
MAX_SEEN = 65_536  # tallies whose copy is kept; past it the copies are dropped (read again)

# KEYS[1] the tally; ARGV: version read, packed tally, ttl (ms) -> {1, version} | {0, version, packed}
CAS = """
local v = redis.call('HGET', KEYS[1], 'v') or '0'
if v ~= ARGV[1] then return {0, v, redis.call('HGET', KEYS[1], 't') or ''} end
local next = tostring(tonumber(v) + 1)
redis.call('HSET', KEYS[1], 'v', next, 't', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, next}
"""

Result = TypeVar("Result")


def pack(tally: Tally) -> bytes:
    """The fields in Tally's order, as repr writes them (-inf too, which float() reads back)."""
    return ",".join(repr(getattr(tally, field)) for field in Tally.__slots__).encode()


def unpack(packed: bytes) -> Tally:
    tally = Tally()
    if packed:
        for field, text in zip(Tally.__slots__, packed.decode().split(",")):
            value = float(text)
            setattr(tally, field, int(value) if field in ("used", "reserved", "parallel") else value)
    return tally


def copy(tally: Tally) -> Tally:
    twin = Tally()
    for field in Tally.__slots__:
        setattr(twin, field, getattr(tally, field))
    return twin


class SharedCounters:
    """The Counters steps on the shared server (rules 1-6); `admit` and `take_parallel` are
    awaited (a round trip), `settle` and `seed` are sent and not waited for."""

    def __init__(self, server: SharedServer, closed: bool) -> None:
        self.server = server
        self.closed = closed
        self.cas = server.script(CAS)
        self.local = LocalCounters()  # rule 3, open
        self.seen: dict[str, tuple[Tally, bytes, float]] = {}  # name -> (copy, version, monotonic read)
        self.lost_steps = 0
        self.queued: dict[str, list] = {}  # name -> the steps waiting for its next write
        self.tasks: set[asyncio.Task] = set()

    async def _step(self, name: str, apply: Callable[[Tally], Result], alone: Callable[[], Result]) -> Result:
        """`apply` on the tally as the server holds it, atomically (rule 1); `alone` when the
        server is down and the mode is open (rule 3)."""
        if self.server.up:
            try:
                return await self._queue(name, apply)
            except SharedDown:
                if self.server.up:  # contended past CAS_TRIES: said, never counted alone in silence
                    raise
        if self.closed:
            raise SharedDown(self.server.why_down)
        return alone()

    def _queue(self, name: str, apply: Callable[[Tally], Result]) -> asyncio.Future:
        """`apply` joins the next write of `name`'s tally (rule 1): one write at a time per tally
        from this router, carrying every step queued meanwhile."""
        future = asyncio.get_running_loop().create_future()
        queued = self.queued.get(name)
        if queued is None:
            queued = self.queued[name] = []
            task = asyncio.get_running_loop().create_task(self._write_all(name, queued))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        queued.append((apply, future))
        return future

    async def _write_all(self, name: str, queued: list) -> None:
        try:
            while queued:
                batch = queued[:]
                queued.clear()
                await self._write(name, batch)
        finally:
            del self.queued[name]

    async def _write(self, name: str, batch: list) -> None:
        """The steps of `batch`, in order, on one copy, written with one CAS (rule 1)."""
        seen = self.seen.get(name)
        tally, version = (seen[0], seen[1]) if seen is not None else (Tally(), b"0")
        ttl_ms = (ADDRESS_TALLY_TTL_S if name.startswith("addr:") else KEY_TALLY_TTL_S) * 1000
        failure: SharedDown = SharedDown(f"the tally of {name} changed {CAS_TRIES} times in a row")
        for _ in range(CAS_TRIES):
            work = copy(tally)
            results = [apply(work) for apply, _ in batch]
            try:
                reply = await self.server.call(self.cas, 1, PREFIX + "tally:" + name, version, pack(work), ttl_ms)
            except SharedDown as exc:
                failure = exc
                break
            if reply[0] == 1:
                self._saw(name, work, reply[1])
                for (_, future), result in zip(batch, results):
                    future.set_result(result)
                return
            version, tally = reply[1], unpack(reply[2])
            self._saw(name, tally, version)
        for _, future in batch:
            future.set_exception(failure)

    def _saw(self, name: str, tally: Tally, version: bytes) -> None:
        if len(self.seen) >= MAX_SEEN and name not in self.seen:
            self.seen.clear()
        self.seen[name] = (tally, version, time.monotonic())

    def _later(self, name: str, apply: Callable[[Tally], None]) -> None:
        """A step nobody waits for (settle, seed); counted in `lost_steps` when it fails."""
        self._queue(name, apply).add_done_callback(self._done)

    def _done(self, future: asyncio.Future) -> None:
        if future.exception() is not None:
            self.lost_steps += 1

    # -- the Counters steps --------------------------------------------------------------------
    async def admit(self, key: str, limits: Limits, ask: Ask, now: float) -> Refused | Windows:
        def apply(tally: Tally) -> Refused | Windows:
            refused = rules.admit(tally, limits, ask, now)
            return refused if refused is not None else rules.windows_after(tally, limits)

        return await self._step(key, apply, lambda: self.local.admit(key, limits, ask, now))

    def settle(self, key: str, limits: Limits, reserved: int, used: int, now: float, slot: bool) -> None:
        def apply(tally: Tally) -> None:
            rules.settle(tally, limits, reserved, used, now, slot)

        if not self.server.up:
            self.lost_steps += 1  # rule 3
            return
        self._later(key, apply)

    async def take_parallel(self, key: str, limits: Limits) -> bool:
        return await self._step(key, lambda tally: rules.take_parallel(tally, limits),
                                lambda: self.local.take_parallel(key, limits))

    def has_room(self, key: str, limits: Limits) -> bool:
        """Rule 4: the queue's advice, from the copy last seen."""
        seen = self.seen.get(key)
        if not self.server.up:
            return self.local.has_room(key, limits)
        return seen is None or time.monotonic() - seen[2] > STALE_S or rules.has_room(seen[0], limits)

    def left(self, key: str, limits: Limits, now: float) -> Left:
        seen = self.seen.get(key)
        return rules.left(seen[0] if seen is not None else Tally(), limits, now)

    def seed(self, key: str, used: int, period: tuple[float, float]) -> None:
        """The store's count of the period (store/counters.py rule 4), never below the server's."""
        def apply(tally: Tally) -> None:
            if tally.period_start == period[0]:
                tally.used = max(used, tally.used)
            else:
                tally.used = used
            tally.period_start, tally.period_end = period

        self.local.seed(key, used, period)
        if self.server.up:
            self._later(key, apply)

    def view(self) -> dict:
        return {"tallies_seen": len(self.seen), "lost_steps": self.lost_steps, "writing": len(self.queued)}

