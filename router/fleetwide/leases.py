"""Several routers on one Redis-protocol server: each box's in-flight slots as leases, the
routers seen recently, and the mode a router is in when the server is down.

What is shared and what is not (docs/several-routers.md, "Redis-protocol server"):
1. A box with a limit (`max_inflight`, or the slots it reports) has one sorted set of leases on
   the server, scored by when each lease expires (the server's clock). A call takes a lease
   before it is sent to the box: one script, one round trip, that drops the expired leases and
   adds this one only while fewer than the limit are held (TAKE). So `max_inflight` holds across
   every router. A box without a limit takes no lease and costs no round trip. A call whose
   admission is on its way to the server (a key counted there) asks its first box's lease in
   that same round trip (`ask`); a call that then goes elsewhere or ends gives it back (`unask`).
   A box with a lease parked here (rule 9) asks nothing: the call takes that one.
2. The local count goes on the box before the round trip (`Load.count_on`), so no call of this
   router takes the slot meanwhile; a lease refused takes it off again, and the call decides
   again over what the server said the box holds (the box is then full: the call waits).
3. A lease lives LEASE_TTL_S. Once a second (`sync`) this router renews every lease it holds and
   reads every limited box's count, in one round trip; so a router that dies (`kill -9`) leaves
   its leases for at most LEASE_TTL_S, and every other router sees them gone within SYNC_S more:
   at most LEASE_TTL_S + SYNC_S (6 s).
4. A call that ends gives its lease back unless it parks it (rule 9) (GIVE: one script, sent
   with the next round trip: at once when the box is at or one short of its limit, where calls
   may be waiting for it; else with the next call's take or the sync, within SYNC_S, which halves
   the round trips of calls that follow each other) and, when that took the box from full to not
   full (the only case where any router's calls wait for it), the script publishes the box's new
   count on FREED_CHANNEL. Every router's waiters see a slot freed anywhere within a pub/sub hop
   (milliseconds); a lease that expired, or a message lost while a router reconnected, within
   SYNC_S (the poll of rule 3).
5. A box's `others` (what the other routers hold on it, as last read: the count less this
   router's own leases) is added to its local in-flight count for fullness and ranking: the
   decision sees the fleet's load, the take in rule 1 is what makes it exact.
6. The server down (fleetwide/wire.py rule 3): `--shared-down open` (the default) counts in this
   router alone (`others` 0, no lease asked), with one loud log line, `router_shared_store_up 0`
   and the state's `shared.counting: "this router alone"`; the leases held then (less the parked
   ones, forgotten: rule 9) are added to the server by the first sync after it is back, and
   `on_back` runs (the budgets are seeded from the store again: a restarted server lost its
   tallies). `--shared-down closed` answers a call that needs a lease 503 `shared_store_down`
   (the facade's shape) instead. Either way no call waits on the server past
   ROUND_TRIP_TIMEOUT_S.
7. Heartbeat: each sync writes this router's name and a small doc (calls it ended, calls in
   flight, when it started) to the routers' set, and reads back every router seen within
   ROUTER_SEEN_S: the state's `shared.routers`, the dashboard's routers.
8. Affinity bindings: fleetwide/bindings.py.
9. Parked leases: a call that ends keeps its lease on the server, parked on this router, while the
   box is far from its limit, and this router's next call to the box takes it with no round trip
   (rules 1 and 4 cost a call no wait then). A parked lease is a lease like any other (held,
   renewed by the sync, counted by every router), so `max_inflight` holds exactly; what it costs
   is that the other routers see it as load, so it is bounded: a call takes a new lease only when
   none is parked on its box, so what this router holds there (its calls and its parked leases) is
   never more than the most calls it had there at once, and one parked idle goes back (below); and
   parking stops while the box's fleet-wide count (this router's calls, the others', its parked
   leases) is past PARK_SHARE of the limit: checked as a lease parks, as one is reused, on every
   count read (`counted`: past it, the box's parked leases go back at once) and when the fleet
   changes (a box gone, or its limit moved). One idle through a whole SYNC_S goes back at the next
   sync (so within 2 x SYNC_S). A call of any router that must wait for a full box that
   others hold leases on asks for them (`want`: WANTED_CHANNEL, at most once per box per
   WANTED_EVERY_S), and every router gives its parked leases on the box back at once, within a
   pub/sub hop (their GIVE publishes the freed count, which wakes the waiter: rule 4). The server
   down (rule 6): parked leases are forgotten, never handed to a call (on a server that only
   blinked, they expire there within LEASE_TTL_S). `--shared-down closed` parks nothing: it
   promises that a call is sent only on a slot a live server granted it, and a reused lease is
   one no round trip has checked since its call ended.
10. A lease (fleetwide/seam.py's `Lease`) moves (asked, held, parked, given back, gone) only
   through router.core.leases' table: a move it lacks raises.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.boxes.fleet import Fleet
from router.boxes.state import BoxState
from router.core.leases import LeaseEvent, LeaseState
from router.core.slots import Slot
from router.fleetwide.seam import Holder, Lease
from router.fleetwide.wire import PREFIX, SharedDown, SharedServer, read_out

log = logging.getLogger("router.shared")

LEASE_TTL_S = 5.0  # rule 3
LEASE_TTL_MS = int(LEASE_TTL_S * 1000)
SYNC_S = 1.0  # rule 3: renew, poll, heartbeat
ROUTER_SEEN_S = 5.0  # rule 7: a router not heard from for this long is no longer listed
FREED_CHANNEL = PREFIX + "freed"
WANTED_CHANNEL = PREFIX + "wanted"  # rule 9: a box's name, when a router's call waits for it
PARK_SHARE = 0.5  # rule 9: parking stops, and parked leases go back, past this share of the limit
WANTED_EVERY_S = 0.1  # rule 9: a router asks for a box's parked leases at most this often
ROUTERS_KEY = PREFIX + "routers"
ROUTER_DOCS_KEY = PREFIX + "router-docs"
OPEN, CLOSED = "open", "closed"

_NOW_MS = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) "
# KEYS[1] the box's leases; ARGV: member, limit, ttl (ms) -> {taken 0|1, count}
TAKE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  return {1, held + 1}
end
return {0, held}
"""
# KEYS[1] the box's leases; ARGV: member, channel, box name, limit -> count. Published only when
# the box was full: a router waits on a box only while it looks full (rule 4).
GIVE = _NOW_MS + """
local before = redis.call('ZCARD', KEYS[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if before >= tonumber(ARGV[4]) and held < tonumber(ARGV[4]) then
  redis.call('PUBLISH', ARGV[2], ARGV[3] .. '\\n' .. held)
end
return held
"""
# KEYS[1] the box's leases; ARGV: ttl (ms), then this router's members -> count
RENEW = _NOW_MS + """
local expiry = now + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], expiry, ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
# KEYS: the routers' set, their docs; ARGV: name, doc, seen window (ms) -> {now, name, seen, doc, ...}
HEARTBEAT = _NOW_MS + """
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
for _, name in ipairs(gone) do redis.call('ZREM', KEYS[1], name) redis.call('HDEL', KEYS[2], name) end
local out = {now}
local seen = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #seen, 2 do
  table.insert(out, seen[i]) table.insert(out, seen[i + 1])
  table.insert(out, redis.call('HGET', KEYS[2], seen[i]) or '{}')
end
return out
"""


# router.core.leases' states and events, read per move as module names (an Enum member read off
# its class goes through EnumType.__getattr__ on Python 3.11: router/core/lifecycle.py)
_ASKED, _HELD = LeaseState.ASKED, LeaseState.HELD
_TAKEN, _REFUSED, _LOST = LeaseEvent.TAKEN, LeaseEvent.REFUSED, LeaseEvent.LOST
_PARK, _REUSE, _GIVE, _GIVEN, _FORGET = (LeaseEvent.PARK, LeaseEvent.REUSE, LeaseEvent.GIVE, LeaseEvent.GIVEN,
                                         LeaseEvent.FORGET)


def slots_key(box: str) -> str:
    return PREFIX + "slots:" + box


class SlotLeases:
    """This router's side of the shared slots (rules 1-6, 9) and its heartbeat (rule 7)."""

    gates = True  # a call takes a lease before it is sent (fleetwide/seam.py)

    def __init__(self, server: SharedServer, instance: str, fleet: Fleet, down_mode: str, *,
                 upkeep: Callable[[], None], freed: Callable[[BoxState], None], stats: Callable[[], dict],
                 on_back: Callable[[], None]) -> None:
        self.server = server
        self.upkeep = upkeep  # run by each sync before its round trip: the keys' holds renewed there
        self.instance = instance
        self.fleet = fleet
        self.down_mode = down_mode
        self.parks = down_mode == OPEN  # rule 9
        self.take_script = server.script(TAKE)
        self.give_script = server.script(GIVE)
        self.renew_script = server.script(RENEW)
        self.heartbeat_script = server.script(HEARTBEAT)
        self.freed = freed  # the wait queue's: a box with a slot freed elsewhere is offered to its waiters
        self.stats = stats  # this router's figures for its heartbeat doc
        self.on_back = on_back  # the server answers again after an outage
        self.held: dict[str, set[str]] = {}  # box name -> this router's leases on it
        self.giving: dict[str, int] = {}  # box name -> its leases given back, not answered yet
        self.counts: dict[str, int] = {}  # box name -> leases on it fleet-wide, as last read
        # rule 9: box name -> its leases parked here (each still in `held`), oldest first; a call
        # takes the newest, so the oldest go idle
        self.parked: dict[str, list[Lease]] = {}
        self.wanted_at: dict[str, float] = {}  # rule 9: box name -> when this router last asked
        self.routers: list[dict] = []  # rule 7, as last read
        self.refused = 0  # calls answered 503 shared_store_down
        self.lease_refusals = 0  # takes refused: the box was full fleet-wide
        # members are unique across routers and restarts: the name, a random part, a counter
        self._prefix = f"{instance}/{os.urandom(4).hex()}/"
        self._numbers = itertools.count(1)
        self.started = time.time()
        self.tasks: list[asyncio.Task] = []
        fleet.on_change.append(self.fleet_changed)

    # -- the call path (rules 1, 2, 4, 6, 9) ---------------------------------------------------
    def ask(self, load: Holder, box: BoxState) -> None:
        """Rule 1, asked early: `box`'s lease goes out with the round trip the call is about to
        wait for anyway (its admission's: serve/proxy.py), and `take` waits for its answer. A
        call that goes elsewhere, or ends, gives it back (`unask`). A lease parked on `box` is
        the call's at once instead (rule 9)."""
        if box.limit is None or load.lease is not None or load.asked is not None or not self.server.up:
            return
        if not self._reuse(load, box):
            load.asked = self._ask(load, box)

    def _ask(self, load: Holder, box: BoxState) -> Lease:
        load.count_on(box)  # rule 2
        lease = Lease(box, self._member(), asyncio.get_running_loop().create_future(), _ASKED)
        self.server.send(functools.partial(self._took, lease), self.take_script, 1,
                         slots_key(box.name), lease.member, box.limit, LEASE_TTL_MS)
        return lease

    def _member(self) -> str:
        """A lease's name on the server: unique across routers and restarts."""
        return self._prefix + str(next(self._numbers))

    def _took(self, lease: Lease, answer: list | SharedDown) -> None:
        """A take's answer, read as it comes (in the order the server ran them, with the gives'):
        so this router's leases and the count always describe the same moment (rule 5). Then
        into the lease's `reply`, which the call awaits."""
        reply = lease.reply
        if answer.__class__ is SharedDown:
            lease.fire(_LOST)
            if not reply.done():  # type: ignore[union-attr]
                reply.set_exception(answer)  # type: ignore[union-attr, arg-type]
            return
        taken, count = answer  # type: ignore[misc]
        box = lease.box
        if taken:
            lease.fire(_TAKEN)
            self.held.setdefault(box.name, set()).add(lease.member)
        else:
            lease.fire(_REFUSED)
            self.lease_refusals += 1
        self.counted(box, count)
        if not reply.done():  # type: ignore[union-attr]
            reply.set_result(answer)
        elif taken and reply.cancelled():  # type: ignore[union-attr]
            self._give_back(lease, True)  # the call's task ended while its take was out: nobody holds it

    def take(self, load: Holder, box: BoxState) -> Slot | Awaitable[Slot]:
        """Before `box` is sent the call (fleetwide/seam.py): GO when the call holds a lease there
        (or needs none, or the server is down in open mode), WAIT when every slot is taken
        fleet-wide, DOWN when the server is down in closed mode; a coroutine of that answer when
        it is a round trip away."""
        if box.limit is None:
            return Slot.GO
        lease = load.lease
        if lease is not None:
            if lease.box is box:
                return Slot.GO
            self.give(lease)  # failover to another box: the first box's slot goes back
            load.lease = None
        asked, load.asked = load.asked, None
        if asked is not None and asked.box is not box:
            self.unask(asked)
            asked = None
        if asked is not None:
            return self._answered(load, asked)
        if not self.server.up:
            load.count_on(box)
            return self._alone(load, box, self._member())
        if self._reuse(load, box):
            return Slot.GO
        return self._answered(load, self._ask(load, box))

    async def _answered(self, load: Holder, lease: Lease) -> Slot:
        try:
            taken, _ = await lease.reply  # type: ignore[misc]  # `_took` has read it
        except SharedDown:
            self.alone()  # the server went down: rule 6, below
            return self._alone(load, lease.box, lease.member)
        except asyncio.CancelledError:  # the call's task ended: the lease is nobody's (`_took` if not answered yet)
            if lease.state is _HELD:
                self._give_back(lease, True)
            raise
        if not taken:
            load.count_on(None)
            return Slot.WAIT
        load.lease = lease
        return Slot.GO

    def _alone(self, load: Holder, box: BoxState, member: str) -> Slot:
        """Rule 6: the server is down. Closed: DOWN; open: a lease of this router's alone
        (router.core.leases rule 4: born HELD), added to the server once it is back."""
        if self.down_mode == CLOSED:
            load.count_on(None)
            self.refused += 1
            return Slot.DOWN
        self.held.setdefault(box.name, set()).add(member)
        load.lease = Lease(box, member, None, _HELD)
        return Slot.GO

    def unask(self, asked: Lease) -> None:
        """A lease asked early for a box the call did not go to: given back once it is answered."""
        asked.reply.add_done_callback(functools.partial(self._unasked, asked))  # type: ignore[union-attr]

    def _unasked(self, lease: Lease, done: asyncio.Future) -> None:
        if lease.state is _HELD:  # taken (else refused or lost: GONE)
            self._give_back(lease, False)

    def _reuse(self, load: Holder, box: BoxState) -> bool:
        """Rule 9: a lease parked on `box` becomes the call's, with no round trip (the server is
        up: the caller has looked)."""
        parked = self.parked.get(box.name)
        if parked is None:
            return False
        if parked[-1].box is not box or self._past_share(box, len(parked)):
            self.unpark(box.name)  # the box was replaced, or its limit moved
            return False
        lease = parked.pop()
        if not parked:
            del self.parked[box.name]
        lease.fire(_REUSE)
        load.count_on(box)
        load.lease = lease
        return True

    @staticmethod
    def _past_share(box: BoxState, parked: int) -> bool:
        """Rule 9: the box's fleet-wide count, with this router's `parked` leases on it, is past
        what parking may hold (or it has no limit now)."""
        return box.limit is None or box.in_flight + box.others + parked > box.limit * PARK_SHARE

    def give(self, lease: Lease) -> None:
        """The call left the box (its count still on it): its lease is parked for this router's
        next call there (rule 9), or goes back in the next round trip (rule 4)."""
        box = lease.box
        if self.parks and self.server.up and box.limit is not None:
            parked = self.parked.get(box.name)
            count = 0 if parked is None else len(parked)
            # the count moves from the call to the parked lease: the fleet-wide sum stays as it is
            if not self._past_share(box, count) and self.fleet.get(box.name) is box:
                if parked is None:
                    parked = self.parked[box.name] = []
                lease.fire(_PARK)
                lease.parked_mono = time.monotonic()
                parked.append(lease)
                return
        self._give_back(lease, False)

    def _give_back(self, lease: Lease, urgent: bool) -> None:
        """One GIVE (rule 4): sent at once when `urgent` or near the limit; none while the
        server is down (the lease is forgotten: it expires there, rule 3)."""
        box = lease.box
        name = box.name
        held = self.held.get(name)
        if held is not None:
            held.discard(lease.member)
        if not self.server.up:
            lease.fire(_FORGET)
        else:
            lease.fire(_GIVE)
            limit = box.limit or 0
            # urgent near the limit, where some router's calls may wait for this slot; else it
            # rides the next round trip (the next call's take, or the sync within SYNC_S)
            send = self.server.send if urgent or box.in_flight + box.others >= limit - 1 else self.server.send_later
            self.giving[name] = self.giving.get(name, 0) + 1
            send(functools.partial(self._given, lease), self.give_script, 1, slots_key(name), lease.member,
                 FREED_CHANNEL, name, limit)

    def _given(self, lease: Lease, answer: int | SharedDown) -> None:
        lease.fire(_GIVEN)
        box = lease.box
        self.giving[box.name] -= 1
        if answer.__class__ is not SharedDown:
            self.counted(box, answer)  # type: ignore[arg-type]

    def counted(self, box: BoxState, count: int) -> None:
        """The server says `box` holds `count` leases (rule 5): the others' share moves, and a
        share that shrank offers the box to this router's waiters. This router's own leases are
        those it holds and those it gave back that the server has not answered yet: a count read
        before a give reached the server still holds it, and is not another router's."""
        name = box.name
        self.counts[name] = count
        others = max(0, count - len(self.held.get(name, ())) - self.giving.get(name, 0))
        if others != box.others:
            shrank = others < box.others
            box.others = others
            box.changed()
            if shrank:
                self.freed(box)
        parked = self.parked.get(name)
        if parked is not None and self._past_share(box, len(parked)):
            self.unpark(name)

    def unpark(self, name: str) -> None:
        """Rule 9: the box's parked leases go back, at once."""
        for lease in self.parked.pop(name, ()):
            self._give_back(lease, True)

    def want(self, names: frozenset[str]) -> None:
        """Rule 9: a call is about to wait for these boxes. Those full with other routers' leases
        on them are asked for: every router gives back what it parks there."""
        if not self.server.up:
            return
        now = time.monotonic()
        for name in names:
            box = self.fleet.get(name)
            if (box is not None and box.others and box.full
                    and now - self.wanted_at.get(name, -WANTED_EVERY_S) >= WANTED_EVERY_S):
                self.wanted_at[name] = now
                self.server.call(None, "PUBLISH", WANTED_CHANNEL, name).add_done_callback(read_out)

    def fleet_changed(self) -> None:
        """Rule 9: a box gone, replaced, or whose limit moved gives its parked leases back."""
        for name, parked in list(self.parked.items()):
            box = self.fleet.get(name)
            if box is not parked[0].box or self._past_share(box, len(parked)):
                self.unpark(name)

    def give_idle(self) -> None:
        """Rule 9: leases parked through a whole SYNC_S without a call taking them go back."""
        idle_before = time.monotonic() - SYNC_S
        for name, parked in list(self.parked.items()):
            idle = 0
            while idle < len(parked) and parked[idle].parked_mono <= idle_before:
                self._give_back(parked[idle], True)
                idle += 1
            if idle == len(parked):
                del self.parked[name]
            else:
                del parked[:idle]

    # -- in the background (rules 3, 4, 6, 7) --------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self.keep_synced(), name="shared-sync"),
                      loop.create_task(self.listen(), name="shared-freed")]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.server.up:  # a clean stop gives its leases back at once, not after their TTL
            gone = [self.server.call(None, "ZREM", slots_key(name), *members)
                    for name, members in self.held.items() if members]
            gone.append(self.server.call(None, "ZREM", ROUTERS_KEY, self.instance))
            gone.append(self.server.call(None, "HDEL", ROUTER_DOCS_KEY, self.instance))
            await asyncio.gather(*gone, return_exceptions=True)  # behind what is queued (rule 2)
        await self.server.close()

    async def keep_synced(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:  # a bug: said, and the renewals go on (their stopping would free every slot)
                log.exception("shared server sync failed")
            await asyncio.sleep(SYNC_S)

    async def sync(self) -> None:
        """One round trip: the idle parked leases given back (rule 9), every limited box's leases
        renewed and counted, the heartbeat."""
        self.give_idle()  # first: their GIVEs go out ahead of the renewals, in the same round trip
        self.upkeep()  # the keys' holds renewed, their parked settles written (fleetwide/tallies.py)
        server = self.server
        boxes = [box for box in self.fleet.ordered() if box.limit is not None]
        futures = [server.call(self.renew_script, 1, slots_key(box.name), LEASE_TTL_MS, *self.held.get(box.name, ()))
                   for box in boxes]
        doc = orjson.dumps({"started": self.started, **self.stats()})
        futures.append(server.call(self.heartbeat_script, 2, ROUTERS_KEY, ROUTER_DOCS_KEY, self.instance, doc,
                                   int(ROUTER_SEEN_S * 1000)))
        results = await asyncio.gather(*futures, return_exceptions=True)
        if any(isinstance(result, BaseException) for result in results):
            self.alone()
            return
        if not server.up:
            back = server.reached
            server.came_up()
            # before any call of this router asks the server again: what it counted alone is
            # drawn there first, so N routers pass a key's limits at most N times
            # (fleetwide/tallies.py rule 3)
            self.upkeep()
            if back:
                self.on_back()
        for box, count in zip(boxes, results):
            self.counted(box, count)
        self.routers = self._routers(results[-1])

    def alone(self) -> None:
        """Rule 6: the server is down; this router counts its own calls only. Its parked leases
        are forgotten (rule 9): no call holds them, so the come-back must not write them again."""
        for name, parked in self.parked.items():
            held = self.held.get(name, set())
            for lease in parked:
                held.discard(lease.member)
                lease.fire(_FORGET)
        self.parked.clear()
        for box in self.fleet.ordered():
            if box.others:
                box.others = 0
                box.changed()
                self.freed(box)
        self.counts.clear()

    @staticmethod
    def _routers(reply: list) -> list[dict]:
        now_ms = int(reply[0])
        routers = []
        for i in range(1, len(reply), 3):
            doc = orjson.loads(reply[i + 2])
            doc = doc if isinstance(doc, dict) else {}
            routers.append({"instance": reply[i].decode(errors="replace"),
                            "seen_s_ago": round(max(0, now_ms - int(float(reply[i + 1]))) / 1000, 3), **doc})
        return routers

    async def listen(self) -> None:
        """Rule 4: the counts other routers publish as they give slots back; rule 9: the boxes
        whose parked leases a router's calls wait for."""
        wanted = WANTED_CHANNEL.encode()
        while True:
            pubsub = self.server.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(FREED_CHANNEL, WANTED_CHANNEL)
                while True:
                    message = await pubsub.get_message(timeout=SYNC_S)
                    if message is None:
                        continue
                    if message["channel"] == wanted:
                        self.unpark(message["data"].decode(errors="replace"))
                    else:
                        self.freed_elsewhere(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception:  # the server went away: the sync says so; try again in a while
                await asyncio.sleep(SYNC_S)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    def freed_elsewhere(self, data: bytes) -> None:
        name, _, count = data.decode(errors="replace").rpartition("\n")
        box = self.fleet.get(name)
        if box is not None and count.isdigit() and self.server.up:
            self.counted(box, int(count))

    # -- what the operator sees ----------------------------------------------------------------
    def counting(self) -> str:
        if self.server.up:
            return "fleet-wide"
        return "this router alone" if self.down_mode == OPEN else "refusing calls that need a count"

    def view(self) -> dict:
        """The state's `shared` (rules 6-7)."""
        server = self.server
        return {
            "instance": self.instance,
            "url": server.url,
            "up": server.up,
            "down_mode": self.down_mode,
            "counting": self.counting(),
            "down_since": None if server.up else server.down_since,
            "why_down": server.why_down or None,
            "lease_ttl_s": LEASE_TTL_S,
            "routers": self.routers,
            "slots": {name: {"fleet": count, "this_router": len(self.held.get(name, ())),
                             "parked": len(self.parked.get(name, ()))}
                      for name, count in sorted(self.counts.items())},
            "refused": self.refused,
            "lease_refusals": self.lease_refusals,
            "round_trips": server.round_trips,
        }

    def collect(self):
        up = GaugeMetricFamily("router_shared_store_up", "1 while the shared server answers, 0 while it is down.")
        up.add_metric([], 1 if self.server.up else 0)
        yield up
        parked = GaugeMetricFamily("router_shared_parked_leases", "Leases this router keeps on the shared server "
                                   "for its next calls (no round trip for those): counted as load by every router.")
        parked.add_metric([], sum(len(leases) for leases in self.parked.values()))
        yield parked
        routers = GaugeMetricFamily("router_shared_routers", "Routers seen on the shared server recently.")
        routers.add_metric([], len(self.routers))
        yield routers
        yield CounterMetricFamily("router_shared_store_down_refusals", "Calls answered 503 shared_store_down "
                                  "(--shared-down closed, the server down).", value=self.refused)
        yield CounterMetricFamily("router_shared_lease_refusals", "Slots refused by the shared server: the box "
                                  "was full across routers (the call decided again, and may have waited).",
                                  value=self.lease_refusals)
        yield CounterMetricFamily("router_shared_round_trips", "Round trips to the shared server (each carries "
                                  "every command asked meanwhile: a keyed call's admission and its box's "
                                  "lease share one).", value=self.server.round_trips)

