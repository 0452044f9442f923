"""Per-key tallies on the shared server (several routers): router.core.limits' steps, exact
across routers (store/counters.py rule 2).

Rules:
1. A tally is one hash on the server, `hugpy-router:tally:<name>`: a version `v` and the Tally's
   fields `d`, packed as eight doubles (`pack`). A step reads the tally this router last saw and
   its version, applies the rule of router.core.limits to a copy, and writes it back with a
   compare-and-set script (CAS): written only while the server's version is the one read. A
   version another router moved answers the record as it is instead, and the step is applied
   again to that (at most CAS_TRIES times). So a step is one round trip when this router saw the
   latest write, two when another router wrote since; the rules stay router.core.limits',
   unchanged, and every step is atomic across routers: the counts, and the overshoot bound of a
   token limit (one call's reservation), are the same as one router's. A router writes one tally
   once at a time: the steps that arrive meanwhile are applied in order to one copy and go out in
   its next write (a burst on one key costs one round trip per write, not one per call, and its
   CASes do not race each other). A step is asked at once and its CAS is packed with the next
   round trip (`SharedServer.prepare`), so whatever else the call asks before it waits (its box's
   lease: serve/proxy.py) shares that round trip.
2. A refusal is written too (the buckets caught up to now): a refusal read from a stale copy
   would be wrong, and the write is what proves the copy current.
3. The server down (fleetwide/wire.py rule 3): `open` steps on `local`, a LocalCounters of this
   router alone, each tally starting (at its first step of the outage) from the copy this router
   last saw on the server and from this router's own holds; what it admits alone joins its holds
   and, once the server is back, is drawn from the server's buckets too (`upkeep`). So no router
   ever holds more than `max_parallel` of a key's calls, and N routers admit at most N times a
   limit in any window, what the server admitted before and after the outage included; `closed`
   answers fleetwide/seam.py's SHARED_DOWN (503 `shared_store_down`). A settle, a credit's give-back or a seed that cannot be written (the
   server down, or its round trip lost) is parked and written again once the server answers
   (`upkeep`), in order, never dropped; a settle while the server is down frees its call's count
   on `local` too (each side never below 0: where the call was admitted is not known). A step
   whose round trip failed after the server had run it (a stall past the deadline) is so
   written twice: its `used` and bucket changes count twice; holds are written whole, so they
   do not (docs/several-routers.md). A step
   parked for an earlier run of the server is not written to a new one (that run holds nothing
   of it: counted in `lost_steps`). Past MAX_PARKED parked steps the oldest is dropped and
   counted too. Either way what it would have freed is freed from this router's holds (rule 5),
   so a step not written never keeps a hold alive.
4. `has_room` and `left` read the copy last seen (no round trip): `has_room` is the queue's
   advice only, and says yes for a copy older than STALE_S, so a waiter whose key's slot was
   given back on another router is tried within STALE_S; `take_parallel` then decides, atomically.
5. A key's tally lives KEY_TALLY_TTL_S after its last write (a month's budget and then some); an
   address's (`addr:`) ADDRESS_TALLY_TTL_S: its minute is all it has. What is held for calls in
   flight (their `max_parallel` slots and their reserved tokens, a credit's draw among them) is not
   a count in the tally but a hold per router (`h`: tag -> [calls, tokens, expiry]) that expires
   HOLD_S after that router last wrote it, on the server's clock, as a box's lease does
   (fleetwide/leases.py rule 3). Each router keeps its own holds in `holding` and writes them with
   every compare-and-set of the tally; the sync renews those it has not written for RENEW_AFTER_S
   (one round trip for all, an expiry moved without a new version when nothing else changed). The
   CAS drops expired holds and answers the tally again, so a router that dies (`kill -9`) or
   pauses past HOLD_S stops holding its key's slots and tokens within HOLD_S, and a settle lost
   with it never locks the key: the tally's `parallel` and `reserved` are the sum of the live
   holds, recomputed at every write. A router that comes back writes its holds again with its
   next write (its calls still run).
6. The budget period rolls over inside the rules (limits rule 6) at the first step after the
   boundary, on whichever router takes it; the CAS makes that one step, so no lease is needed.
   A tally the server no longer holds where this router saw one (a restarted server) goes on
   from the copy this router saw (`_carry_over`) until the store's seed.
7. A settle that gives back no `max_parallel` slot is in no hurry: it rides the next round trip
   anyone sends (the key's next call, the sync within a second), where it is one write with the
   steps asked meanwhile. Until then the tally holds the call's reservation rather than its
   tokens, which errs on the side of the limit. A settle that frees a slot goes at once: some
   router's call may wait for it.
8. Credits (router.core.limits rule 9): a key whose calls come to this router faster than one
   per CREDIT_S gets a credit with its next compare-and-set: requests and tokens drawn on the
   server ahead of its calls, for twice as many calls as the last credit served (CREDIT_FIRST_CALLS
   at first, CREDIT_MAX_CALLS at most), each the size of the call that asked, and never more than
   1/17 of what is left of any limit. A call the credit covers is admitted on this router with no
   round trip; one it does not cover (spent, or a larger call) is admitted by the compare-and-set
   as before, which gives back what was left and asks the next credit in the same write. Half a
   credit spent, or half its CREDIT_S gone, the next one is asked (not waited for: the calls go on
   spending this one), for twice the calls the key's rate makes in CREDIT_S; when it comes, what
   the old one did not spend goes back with the next round trip. A credit nobody renews lives
   CREDIT_S, then its rest goes back at once, and a router that stops gives back what its credits
   hold (and writes its settles) before it closes. So nothing a credit admits is uncounted on the
   server, a limit is never passed by more than one router's bound (a credit's tokens are
   reserved like a call's), and what credits hold unspent (at most 1/17 of what was left, twice
   that while one is renewed) counts as spent for at most CREDIT_S plus a round trip: near a
   limit, where that would matter, no credit is given and every call is a compare-and-set. A
   credit is not spent while the server is down, nor on a new run of it (`SharedServer.epoch`: a
   restarted server lost what it drew); its rest, not given back then, is counted in
   `lost_steps`. The served call's rate headers are the tally's when its credit was granted, the
   credit counted as spent. `--shared-down closed` gives no credit: it promises that a call runs
   only on a count a live server answered for that call (as it parks no lease: fleetwide/leases.py
   rule 9). A credit moves (asked, granted, renewed, spent, expired, given back) only through
   router.core.credits' table: a move it lacks raises.
"""

from __future__ import annotations

import asyncio
import functools
import math
import operator
import os
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import orjson

from router.core import limits as rules
from router.core.credits import ASKING, CreditEvent, CreditLife, CreditState
from router.core.limits import Left, Limits, Refused, Tally, Windows
from router.core.slots import Slot
from router.store.counters import LocalCounters
from router.fleetwide.seam import SHARED_DOWN
from router.fleetwide.wire import PREFIX, ROUND_TRIP_TIMEOUT_S, SharedDown, SharedServer

CAS_TRIES = 16
CREDIT_S = 0.1  # rule 8
CREDIT_FIRST_CALLS = 4
CREDIT_MAX_CALLS = 1024  # a key at ~10k calls a second on one router: a round trip per credit, not per call
STALE_S = 1.0
HOLD_S = 5.0  # rule 5: as a box's lease lives (fleetwide/leases.py LEASE_TTL_S)
HOLD_MS = int(HOLD_S * 1000)
RENEW_AFTER_S = 1.0  # rule 5: a hold not written for this long is renewed at the next sync (once a second)
MAX_PARKED = 65_536  # rule 3
KEY_TALLY_TTL_S = 40 * 86400
ADDRESS_TALLY_TTL_S = 120
MAX_SEEN = 65_536  # tallies whose copy is kept; past it the copies are dropped (read again)

# KEYS[1] the tally; ARGV: version read, packed tally, ttl (ms), this router's tag, its calls and
# tokens held, a hold's life (ms) -> {1, version} | {0, version, packed, holds}. Expired holds go
# first (rule 5), as a new version: a router's copy that still counts them is answered afresh. A
# write that changes nothing but this router's hold's expiry keeps the version (a renewal costs
# the other routers no second try).
CAS = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local v = redis.call('HGET', KEYS[1], 'v') or '0'
local raw = redis.call('HGET', KEYS[1], 'h')
local holds = {}
if raw then holds = cjson.decode(raw) end
local expired = false
for tag, hold in pairs(holds) do
  if hold[3] <= now then holds[tag] = nil expired = true end
end
if expired then
  v = tostring(tonumber(v) + 1)
  redis.call('HSET', KEYS[1], 'v', v, 'h', cjson.encode(holds))
end
local d = redis.call('HGET', KEYS[1], 'd') or ''
if v ~= ARGV[1] then return {0, v, d, cjson.encode(holds)} end
local calls, tokens = tonumber(ARGV[5]), tonumber(ARGV[6])
local mine = holds[ARGV[4]]
local same = mine and mine[1] == calls and mine[2] == tokens and d == ARGV[2]
if calls > 0 or tokens > 0 then
  holds[ARGV[4]] = {calls, tokens, now + tonumber(ARGV[7])}
else
  holds[ARGV[4]] = nil
end
if same then
  redis.call('HSET', KEYS[1], 'h', cjson.encode(holds))
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, v}
end
local next = tostring(tonumber(v) + 1)
redis.call('HSET', KEYS[1], 'v', next, 'd', ARGV[2], 'h', cjson.encode(holds))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, next}
"""
NO_HOLDS = (0, 0)  # (calls, tokens) the other routers hold on a tally


def held_by_others(holds: bytes, tag: str) -> tuple[int, int]:
    """The calls and tokens the routers other than `tag` hold on a tally (rule 5), from the CAS's
    answer (`h`, live holds only)."""
    calls = tokens = 0
    for holder, hold in orjson.loads(holds or b"{}").items():
        if holder != tag:
            calls += int(hold[0])
            tokens += int(hold[1])
    return calls, tokens


def _renewal(tally: Tally) -> None:
    """The step of a renewal (rule 5): the write carries this router's holds, and nothing else."""


Result = TypeVar("Result")


FIELDS = operator.attrgetter(*Tally.__slots__)  # a tally's fields as one tuple, in C
# The fields in Tally's order as little-endian doubles (its counts are exact below 2**53; -inf
# too): one C call each way, where text cost a float repr a field. Under its own hash field `d`:
# a router that wrote text under `t` reads no tally here, never a misread one.
PACKED = struct.Struct("<8d")


def pack(tally: Tally) -> bytes:
    return PACKED.pack(*FIELDS(tally))


def unpack(packed: bytes) -> Tally:
    """A tally as `pack` wrote it; a new one for none (or for what is not one)."""
    if len(packed) != PACKED.size:
        return Tally()
    tally = Tally.__new__(Tally)
    (tally.req_drawn, tally.tok_drawn, tally.stamp, tally.period_start, tally.period_end, used, reserved,
     parallel) = PACKED.unpack(packed)
    tally.used, tally.reserved, tally.parallel = int(used), int(reserved), int(parallel)
    return tally


def copy(tally: Tally) -> Tally:
    twin = Tally.__new__(Tally)
    twin.req_drawn, twin.tok_drawn, twin.stamp = tally.req_drawn, tally.tok_drawn, tally.stamp
    twin.period_start, twin.period_end = tally.period_start, tally.period_end
    twin.used, twin.reserved, twin.parallel = tally.used, tally.reserved, tally.parallel
    return twin


# router.core.credits' states and events, read per call as module names (an Enum member read off
# its class goes through EnumType.__getattr__ on Python 3.11: router/core/lifecycle.py)
_GRANTED = CreditState.GRANTED
_ASK, _GRANT, _DENY, _FAIL = CreditEvent.ASK, CreditEvent.GRANT, CreditEvent.DENY, CreditEvent.FAIL
_SPEND, _EXPIRE, _GIVE_BACK = CreditEvent.SPEND, CreditEvent.EXPIRE, CreditEvent.GIVE_BACK


class Credit(CreditLife):
    """One key's credit on this router (rule 8), moved through router.core.credits' table: what is
    left of it, the limits and the rate headers it was granted with, and what its calls spent (the
    next one's size)."""

    __slots__ = ("requests", "tokens", "limits", "windows", "spent", "renew_at", "granted_at", "epoch",
                 "slow_at", "expiry")

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0
        self.tokens = 0
        self.limits: Limits | None = None
        self.windows: Windows | None = None
        self.spent = 0  # calls the live (or the last) credit admitted
        self.renew_at = 0  # the next credit is asked when this many calls spent this one
        self.granted_at = 0.0  # monotonic
        self.epoch = -1  # the server's run it was drawn on (SharedServer.epoch)
        self.slow_at = -math.inf  # monotonic: the last call a compare-and-set admitted
        self.expiry: asyncio.TimerHandle | None = None


class SharedCounters:
    """The Counters steps on the shared server (rules 1-6); `admit` and `take_parallel` are
    awaited (a round trip), `settle` and `seed` are sent and not waited for."""

    def __init__(self, server: SharedServer, closed: bool) -> None:
        self.server = server
        self.closed = closed
        self.cas = server.script(CAS)
        self.local = LocalCounters()  # rule 3, open
        # name -> (copy, version, monotonic read, what the other routers hold on it: rule 5)
        self.seen: dict[str, tuple[Tally, bytes, float, tuple[int, int]]] = {}
        self.tag = os.urandom(6).hex()  # this router's holds (rule 5): unique across routers and restarts
        self.holding: dict[str, list] = {}  # name -> [calls, tokens, monotonic written] this router holds
        # rule 3: (name, step, what it frees, the server's run it was asked of)
        self.parked: list[tuple[str, Callable[[Tally], None], tuple[int, int], int]] = []
        self.alone_from_seen: set[str] = set()  # rule 3: the tallies counted alone since the server was last up
        # rule 3: name -> [requests, tokens, limits] admissions alone drew, as counts: not drained
        # here, since the server's bucket drains through the outage itself
        self.drawn_alone: dict[str, list] = {}
        self.lost_steps = 0
        self.queued: dict[str, list] = {}  # name -> the steps waiting for its next write
        self.ready: list[str] = []  # tallies with steps and no write out: written at the next flush
        self.writing: set[str] = set()  # tallies with a write out
        self.credits: dict[str, Credit] = {}  # rule 8
        self.credited = 0  # calls admitted from a credit

    def _step(self, name: str, apply: Callable[[Tally], Result], alone: tuple[Callable[[], Result], Result]
              ) -> Awaitable[Result]:
        """`apply` on the tally as the server holds it, atomically (rule 1), asked now (it goes
        out with the next round trip); `alone`: its count on this router alone, for when the
        server is down and the mode is open (rule 3), and its answer otherwise when the write
        fails (fleetwide/seam.py: DOWN, Slot.DOWN). A future, not a coroutine around one: the
        call awaits it directly."""
        if self.server.up:
            return self._queue(name, apply, alone=alone)
        future = asyncio.get_running_loop().create_future()
        self._failed_step(name, future, alone, SharedDown(self.server.why_down))
        return future

    def _failed_step(self, name: str, future: asyncio.Future, alone: tuple[Callable[[], Result], Result] | None,
                     failure: SharedDown) -> None:
        """A step whose write failed (rule 3): a call's step counts alone when the server is down
        and the mode open; else it answers its down answer (closed, or contended past CAS_TRIES
        while the server is up: said, never counted alone in silence). Any other step fails with
        `failure`."""
        if future.done():
            return
        if alone is None:
            future.set_exception(failure)
            return
        count_alone, down = alone
        if not self.server.up and not self.closed:
            if name not in self.alone_from_seen:
                self._count_alone_from_seen(name)
            future.set_result(count_alone())
        else:
            future.set_result(down)

    def _queue(self, name: str, apply: Callable[[Tally], Result], urgent: bool = True,
               alone: tuple[Callable[[], Result], Result] | None = None, waited: bool = True,
               frees: tuple[int, int] | None = None) -> asyncio.Future | None:
        """`apply` joins the next write of `name`'s tally (rule 1): one write at a time per tally
        from this router, carrying every step asked until its round trip is packed. A step in no
        hurry (rule 7) rides the next round trip anyone sends. A step someone waits for gets a
        future, and `alone`, its count on this router alone (`_failed_step`); one nobody waits
        for is parked when it fails (rule 3), with `frees`, the calls and tokens of this router's
        holds it gives back (None: a renewal, asked again by the next sync instead)."""
        future = asyncio.get_running_loop().create_future() if waited else None
        steps = self.queued.get(name)
        if steps is None:
            steps = self.queued[name] = []
            if name not in self.writing:
                self.ready.append(name)
                if len(self.ready) == 1:
                    self.server.prepare(self._write_ready)
        steps.append((apply, future, alone, frees, self.server.epoch))
        if urgent:
            self.server.soon()
        return future

    def _write_ready(self) -> None:
        """As the round trip is packed: one write for each tally with steps and no write out."""
        ready, self.ready = self.ready, []
        for name in ready:
            self._write(name, self.queued.pop(name), CAS_TRIES)

    def _write(self, name: str, batch: list, tries: int) -> None:
        """The steps of `batch`, in order, on one copy of the tally, written with one CAS (rule 1);
        `_written` takes the answer."""
        seen = self.seen.get(name)
        tally, version, others = (seen[0], seen[1], seen[3]) if seen is not None else (Tally(), b"0", NO_HOLDS)
        ttl_ms = (ADDRESS_TALLY_TTL_S if name.startswith("addr:") else KEY_TALLY_TTL_S) * 1000
        mine = self.holding.get(name)
        calls, tokens = (mine[0], mine[1]) if mine is not None else NO_HOLDS
        work = copy(tally)  # its calls and tokens in flight: the live holds (rule 5)
        work.parallel, work.reserved = others[0] + calls, others[1] + tokens
        results = [step[0](work) for step in batch]
        # what this router holds after the steps: theirs is the others' (a step never frees a hold
        # of another router's, nor makes this router's negative)
        held_calls, held_tokens = max(0, work.parallel - others[0]), max(0, work.reserved - others[1])
        self.writing.add(name)
        self.server.send(functools.partial(self._written, name, batch, work, results, tries, others,
                                           (held_calls - calls, held_tokens - tokens)),
                         self.cas, 1, PREFIX + "tally:" + name, version, pack(work), ttl_ms, self.tag,
                         held_calls, held_tokens, HOLD_MS)

    def _written(self, name: str, batch: list, work: Tally, results: list, tries: int, others: tuple[int, int],
                 moved: tuple[int, int], reply: list | SharedDown) -> None:
        self.writing.discard(name)
        failure = reply if reply.__class__ is SharedDown else None
        if failure is None:
            if reply[0] == 1:  # type: ignore[index]
                self._saw(name, work, reply[1], others)  # type: ignore[index]
                self._hold(name, moved)
                self.alone_from_seen.discard(name)  # a next outage starts from this copy
                for step, result in zip(batch, results):
                    future = step[1]
                    if future is not None and not future.done():
                        future.set_result(result)
            else:  # another router wrote since (or a hold expired): the steps again, on the server's copy
                fresh = unpack(reply[2])  # type: ignore[index]
                if not reply[2]:  # type: ignore[index]
                    self._carry_over(name, fresh)
                self._saw(name, fresh, reply[1], held_by_others(reply[3], self.tag))  # type: ignore[index]
                if tries > 1:
                    self._write(name, batch, tries - 1)
                    return
                failure = SharedDown(f"the tally of {name} changed {CAS_TRIES} times in a row")
        if failure is not None:
            for apply, future, alone, frees, epoch in batch:
                if future is not None:
                    self._failed_step(name, future, alone, failure)
                elif frees is not None:
                    self._park(name, apply, frees, epoch)
        steps = self.queued.pop(name, None)
        if steps is not None:  # asked while this write was out: theirs goes now
            self._write(name, steps, CAS_TRIES)

    def _count_alone_from_seen(self, name: str) -> None:
        """Rule 3: the first step of `name` counted alone in an outage starts from the windows
        and the budget's use this router last saw on the server, not from its own count of an
        earlier outage, and from this router's own calls and tokens in flight (its holds): so
        each router alone admits at most what was left then and holds at most `max_parallel`
        calls, and N routers at most N times a limit (docs/several-routers.md)."""
        self.alone_from_seen.add(name)
        seen = self.seen.get(name)
        base = seen[0] if seen is not None else self.local.tallies.get(name)  # (the store's seed, at least)
        tally = copy(base) if base is not None else Tally()
        held = self.holding.get(name)
        calls, tokens = (held[0], held[1]) if held is not None else NO_HOLDS
        for parked, _, frees, _ in self.parked:  # settled, not yet written: their calls have ended
            if parked == name:
                calls, tokens = calls - frees[0], tokens - frees[1]
        tally.parallel, tally.reserved = max(0, calls), max(0, tokens)
        self.local.tallies[name] = tally

    def _admit_alone(self, key: str, limits: Limits, model: str, tokens: int, now: float) -> Refused | Windows:
        """Rule 3: an admission counted alone. What it drew is drawn on the server once it is
        back (`upkeep`: the minute's buckets there count it too), and its tokens join this
        router's holds (written with the next write, freed by its settle), as on the server."""
        admitted = self.local.admit(key, limits, model, tokens, now)
        if admitted.__class__ is not Refused:
            drawn = self.drawn_alone.get(key)
            if drawn is None:
                drawn = self.drawn_alone[key] = [0, 0, limits]
            drawn[0] += 1
            drawn[1] += tokens
            self._hold_more(key, 0, tokens)
        return admitted

    def _take_alone(self, key: str, limits: Limits) -> Slot:
        """Rule 3: a max_parallel slot taken alone joins this router's holds too."""
        taken = self.local.take_parallel(key, limits)
        if taken is Slot.GO:
            self._hold_more(key, 1, 0)
        return taken

    def _hold_more(self, name: str, calls: int, tokens: int) -> None:
        held = self.holding.get(name)
        if held is None:
            held = self.holding[name] = [0, 0, 0.0]
        held[0] += calls
        held[1] += tokens
        held[2] = 0.0  # written at the next sync

    def _carry_over(self, name: str, fresh: Tally) -> None:
        """Rule 6: the server holds no tally where this router saw one (a restarted server: its
        new run lost them all): the budget's use and the windows as this router last saw them go
        on in the new one, so no call is admitted on an empty tally before the store's seed comes
        (the key upkeep's, within a second). Never below what it saw: the seed raises it."""
        seen = self.seen.get(name)
        if seen is None:
            return
        old = seen[0]
        fresh.req_drawn, fresh.tok_drawn, fresh.stamp = old.req_drawn, old.tok_drawn, old.stamp
        fresh.period_start, fresh.period_end, fresh.used = old.period_start, old.period_end, old.used

    def _saw(self, name: str, tally: Tally, version: bytes, others: tuple[int, int]) -> None:
        if len(self.seen) >= MAX_SEEN and name not in self.seen:
            self.seen.clear()
        self.seen[name] = (tally, version, time.monotonic(), others)

    # -- this router's holds (rules 3, 5) ------------------------------------------------------
    def _hold(self, name: str, moved: tuple[int, int]) -> None:
        """A write of `name` landed: this router's holds there moved by `moved` (calls, tokens), and
        were renewed now."""
        held = self.holding.get(name)
        if held is None:
            if moved == NO_HOLDS:
                return
            held = self.holding[name] = [0, 0, 0.0]
        held[0], held[1], held[2] = max(0, held[0] + moved[0]), max(0, held[1] + moved[1]), time.monotonic()
        if not (held[0] or held[1]):
            del self.holding[name]

    def _free(self, name: str, frees: tuple[int, int]) -> None:
        """What a step that will never be written would have freed, freed from this router's holds
        (rule 3); the server learns it with the next write."""
        held = self.holding.get(name)
        if held is not None:
            held[0], held[1], held[2] = max(0, held[0] - frees[0]), max(0, held[1] - frees[1]), 0.0

    def _park(self, name: str, apply: Callable[[Tally], None], frees: tuple[int, int], epoch: int,
              freed_alone: bool = False) -> None:
        """Rule 3: a step nobody waits for, asked of the server's run `epoch`, written again once
        the server answers. What it frees is freed at once on the tally counted alone, where
        this outage counts `name` there (unless the caller did: `freed_alone`)."""
        if not freed_alone and name in self.alone_from_seen:
            alone = self.local.tallies.get(name)
            if alone is not None:
                alone.parallel, alone.reserved = max(0, alone.parallel - frees[0]), max(0, alone.reserved - frees[1])
        self.parked.append((name, apply, frees, epoch))
        if len(self.parked) > MAX_PARKED:
            self._lost(*self.parked.pop(0)[::2])

    def _lost(self, name: str, frees: tuple[int, int]) -> None:
        self.lost_steps += 1
        self._free(name, frees)

    def upkeep(self) -> None:
        """At each sync, before its round trip is packed (so what it asks shares it): the parked
        steps written again (rule 3; those asked of an earlier run of the server are lost with
        what it held: the store's count seeds the new run), and the holds not written for
        RENEW_AFTER_S renewed (rule 5)."""
        if not self.server.up:
            return
        self.alone_from_seen.clear()
        drawn, self.drawn_alone = self.drawn_alone, {}
        now = time.time()
        for name, (requests, tokens, limits) in drawn.items():
            self._queue(name, functools.partial(rules.draw, limits=limits, requests=requests, tokens=tokens,
                                                now=now), urgent=False, waited=False, frees=NO_HOLDS)
        parked, self.parked = self.parked, []
        for name, apply, frees, epoch in parked:
            if epoch != self.server.epoch:
                self._lost(name, frees)
            else:
                self._queue(name, apply, urgent=False, waited=False, frees=frees)
        stale = time.monotonic() - RENEW_AFTER_S
        for name, held in self.holding.items():
            if held[2] <= stale and name not in self.queued:
                self._queue(name, _renewal, urgent=False, waited=False)

    # -- the Counters steps --------------------------------------------------------------------
    def admit(self, key: str, limits: Limits, model: str, tokens: int,
              now: float) -> Windows | Awaitable[Refused | Windows]:
        """Admitted from the key's credit (rule 8): its rate headers; else an awaitable of the
        compare-and-set's answer."""
        credit = self.credits.get(key)
        if credit is not None:
            if (credit.requests and tokens <= credit.tokens and credit.limits is limits
                    and credit.epoch == self.server.epoch and self.server.up
                    and (limits.models is None or rules.model_allowed(limits.models, model))):
                credit.fire(_SPEND)
                credit.requests -= 1
                credit.tokens -= tokens
                credit.spent += 1
                self.credited += 1
                if credit.state is _GRANTED and (credit.spent >= credit.renew_at
                                                 or time.monotonic() - credit.granted_at >= CREDIT_S / 2):
                    self._renew(key, credit, limits, tokens, now)
                return credit.windows  # type: ignore[return-value]
            if self.server.up:
                self._refund(key, credit)  # ahead of the admission, in the same write

        def apply(tally: Tally) -> Refused | Windows:
            refused = rules.admit(tally, limits, model, tokens, now)
            return refused if refused is not None else rules.windows_after(tally, limits)

        admitted = self._step(key, apply, (lambda: self._admit_alone(key, limits, model, tokens, now), SHARED_DOWN))
        if self.server.up and not self.closed:
            self._ask_credit(key, credit, limits, tokens, now)
        return admitted

    def _ask_credit(self, key: str, credit: Credit | None, limits: Limits, tokens: int, now: float) -> None:
        """Rule 8: with this compare-and-set, the key's next credit, when its calls come fast."""
        moment = time.monotonic()
        if credit is None:
            if len(self.credits) >= MAX_SEEN:
                self.credits = {name: held for name, held in self.credits.items()
                                if held.state in ASKING or held.requests}
                if len(self.credits) >= MAX_SEEN:
                    return
            credit = self.credits[key] = Credit()
        last, credit.slow_at = max(credit.slow_at, credit.granted_at), moment
        if credit.state in ASKING:
            return
        if moment - last >= CREDIT_S:  # not fast enough (yet, or any more)
            credit.spent = 0
            return
        calls = min(CREDIT_MAX_CALLS, 2 * credit.spent) if credit.spent else CREDIT_FIRST_CALLS
        self._grant(key, credit, limits, calls, tokens, now, urgent=False)  # the admission's write carries it

    def _renew(self, key: str, credit: Credit, limits: Limits, tokens: int, now: float) -> None:
        """Rule 8: half the credit spent, or half its life gone, the next one is asked, for twice
        the calls its rate makes in CREDIT_S; the calls go on spending this one until it comes."""
        age = max(time.monotonic() - credit.granted_at, CREDIT_S / 100)
        calls = min(CREDIT_MAX_CALLS, max(CREDIT_FIRST_CALLS, math.ceil(2 * credit.spent * CREDIT_S / age)))
        self._grant(key, credit, limits, calls, tokens, now, urgent=True)

    def _grant(self, key: str, credit: Credit, limits: Limits, calls: int, tokens: int, now: float,
               urgent: bool) -> None:
        credit.fire(_ASK)

        def apply(tally: Tally) -> tuple[int, int, Windows]:
            requests, drawn = rules.grant(tally, limits, calls, tokens, now)
            return requests, drawn, rules.windows_after(tally, limits)

        granting = self._queue(key, apply, urgent=urgent)
        granting.add_done_callback(  # type: ignore[union-attr]
            functools.partial(self._granted, key, credit, limits, self.server.epoch))

    def _granted(self, key: str, credit: Credit, limits: Limits, epoch: int, granting: asyncio.Future) -> None:
        if granting.cancelled() or granting.exception() is not None:
            credit.fire(_FAIL)  # a renewal's: the credit held goes on
            return
        requests, tokens, windows = granting.result()
        # a renewal: what the one it replaces did not spend goes back
        self._refund(key, credit, _GRANT if requests else _DENY)
        credit.spent = 0
        if not requests:
            return
        credit.requests, credit.tokens, credit.limits = requests, tokens, limits
        credit.windows, credit.epoch = windows, epoch
        credit.renew_at, credit.granted_at = max(1, requests // 2), time.monotonic()
        credit.expiry = asyncio.get_running_loop().call_later(CREDIT_S, self._expired, key, credit)

    def _expired(self, key: str, credit: Credit) -> None:
        credit.expiry = None
        self._refund(key, credit, _EXPIRE, urgent=True)  # nobody renewed it: its rest goes back now

    def _refund(self, key: str, credit: Credit, event: CreditEvent = _GIVE_BACK, urgent: bool = False) -> None:
        """The credit moves by `event`, and what it did not spend goes back (rule 8;
        router.core.credits rule 3), with the next round trip, where the server still holds what
        it drew; the credit is done either way. The server down: parked (rule 3). A new run of the
        server holds nothing of the draw: counted in `lost_steps`, and its tokens freed from this
        router's holds (rule 5)."""
        credit.fire(event)
        requests, tokens, limits = credit.requests, credit.tokens, credit.limits
        credit.requests = credit.tokens = 0
        if credit.expiry is not None:
            credit.expiry.cancel()
            credit.expiry = None
        if not (requests or tokens):
            return
        now = time.time()

        def apply(tally: Tally) -> None:
            rules.refund(tally, limits, requests, tokens, now)

        if credit.epoch != self.server.epoch:  # a new run of the server: it holds nothing of the draw
            self._lost(key, (0, tokens))
        elif not self.server.up:
            self._park(key, apply, (0, tokens), credit.epoch)
        else:
            self._queue(key, apply, urgent=urgent, waited=False, frees=(0, tokens))

    async def give_back(self) -> None:
        """The router stops: every credit's rest goes back (rule 8), and what is still to be
        written (settles riding the next round trip) is written, within two round trips' deadline."""
        for key, credit in self.credits.items():
            self._refund(key, credit, _GIVE_BACK, urgent=True)
        self.upkeep()  # the parked steps too
        if self.ready or self.queued:
            self.server.soon()
        deadline = time.monotonic() + 2 * ROUND_TRIP_TIMEOUT_S
        while (self.writing or self.ready or self.queued) and self.server.up and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def settle(self, key: str, limits: Limits, reserved: int, used: int, now: float, slot: bool) -> None:
        def apply(tally: Tally) -> None:
            rules.settle(tally, limits, reserved, used, now, slot)

        frees = (1 if slot else 0, reserved)
        if not self.server.up:
            # rule 3: where it was admitted is not known here, so both sides free what they hold
            # of it (never below 0): the count alone (the calls admitted alone run on it), and
            # the server's, parked
            alone = self.local.tallies.get(key) if key in self.alone_from_seen else None
            if alone is not None:  # (else the outage's first step counts it: its seed leaves it out)
                self.local.settle(key, limits, min(reserved, max(alone.reserved, 0)), used, now, slot)
            self._park(key, apply, frees, self.server.epoch, freed_alone=True)
            return
        self._queue(key, apply, urgent=slot, waited=False, frees=frees)  # rule 7

    def take_parallel(self, key: str, limits: Limits) -> Awaitable[Slot]:
        return self._step(key, lambda tally: Slot.GO if rules.take_parallel(tally, limits) else Slot.WAIT,
                          (lambda: self._take_alone(key, limits), Slot.DOWN))

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
            self._queue(key, apply, waited=False, frees=NO_HOLDS)

    def view(self) -> dict:
        return {"tag": self.tag, "tallies_seen": len(self.seen), "lost_steps": self.lost_steps,
                "writing": len(self.writing),
                "holding": len(self.holding), "parked_steps": len(self.parked),
                "credits": sum(1 for credit in self.credits.values() if credit.requests),
                "credited_calls": self.credited}

