"""What a router holds on the shared server for a key's calls expires unless that router renews it
(fleetwide/tallies.py rules 3 and 5): a router killed mid-call, a server that stalls while
calls end, a budget reservation lost across a period's reset, and a queued call's wait, each
bounded. Real time: the holds expire on redis-server's own clock (HOLD_S), and the routers are
other processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import time

import pytest

from router.core.limits import Limits, Refused
from router.core.slots import Slot
from router.sim.hugpy import Behavior, SimBox
from router.fleetwide.wire import PREFIX, SharedServer
from router.fleetwide.tallies import HOLD_S, SharedCounters, unpack

from conftest import wait_for
from support.boxes import chat_calls
from support.calls import bearer, call, new_key
from support.several_routers import fleet, knows, routers, run  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(120)

SYNC_S = 1.0  # fleetwide/leases.py: the sync that renews holds and writes parked settles


def two_routers_with_a_key(fleet, routers, redis_server, tmp_path, box, extra=(), **limits):
    fleet(box)
    first, second = routers([box], 2, ("--shared-url", redis_server.url, *extra), home=tmp_path / "home")
    key_id, key = new_key(first, **limits)
    assert wait_for(lambda: knows(second, key_id, limits), 5)
    return first, second, key


def test_a_router_killed_mid_call_frees_its_keys_slots_within_the_holds_life(fleet, routers, redis_server,
                                                                             tmp_path):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.hang(60), Behavior.hang(60))
    first, second, key = two_routers_with_a_key(fleet, routers, redis_server, tmp_path, box, max_parallel=2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(2):
            pool.submit(call, first, headers=bearer(key), timeout=90)
        assert wait_for(lambda: chat_calls(box) == 2, 10)
        first.proc.kill()  # kill -9: nothing settled, nothing given back
        first.proc.wait()
        started = time.monotonic()
        status, _, _ = call(second, headers=bearer(key), timeout=60)
        waited = time.monotonic() - started
    assert status == 200
    # real time: the dead router's holds expire HOLD_S after its last renewal (a sync, within
    # SYNC_S before the kill), and the waiting call is offered the slot within STALE_S after
    assert waited < HOLD_S + 2 * SYNC_S + 2, waited


def test_a_server_stall_while_calls_end_loses_no_settle(fleet, routers, redis_server, tmp_path):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.hang(1.0), Behavior.hang(1.0))
    first, second, key = two_routers_with_a_key(fleet, routers, redis_server, tmp_path, box, max_parallel=2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ended = [pool.submit(call, first, headers=bearer(key), timeout=30) for _ in range(2)]
        assert wait_for(lambda: chat_calls(box) == 2, 10)
        redis_server.proc.send_signal(signal.SIGSTOP)  # both calls end during the stall
        try:
            assert [future.result()[0] for future in ended] == [200, 200]
            time.sleep(3.0)
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
    # the first router still lives and renews: only its parked settles, written once the server
    # answers again, free the key's two slots (a settle dropped would hold them as long as it lives)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        statuses = [status for status, _, _ in pool.map(lambda _: call(second, headers=bearer(key), timeout=60),
                                                         range(2))]
    assert statuses == [200, 200]
    assert time.monotonic() - started < HOLD_S + 2 * SYNC_S + 2  # real time: as above


def test_a_lost_reservation_expires_and_never_refuses_once_the_period_resets(redis_server):
    """A router that admitted a call and died (`dead`, never settling nor renewing): its budget
    reservation and its max_parallel slot refuse the key on another router only for the hold's
    life, in the same period and after the period's reset alike."""
    limits = Limits(budget_tokens=1000, max_parallel=1)

    async def scenario(server: SharedServer):
        await server.call(None, "DEL", PREFIX + "tally:key:lost")
        server.came_up()
        dead, live = SharedCounters(server, closed=False), SharedCounters(server, closed=False)
        today = time.time()
        assert (await dead.admit("key:lost", limits, "m", 1000, today)).__class__ is tuple
        assert await dead.take_parallel("key:lost", limits) is Slot.GO
        refused = await live.admit("key:lost", limits, "m", 10, today)
        assert refused.__class__ is Refused and refused.reason == "budget_exceeded"
        assert await live.take_parallel("key:lost", limits) is Slot.WAIT
        await asyncio.sleep(HOLD_S + 0.5)  # real time: the hold expires on the server's clock
        tomorrow = today + 86400
        assert (await live.admit("key:lost", limits, "m", 10, tomorrow)).__class__ is tuple
        assert (await live.admit("key:lost", limits, "m", 10, today)).__class__ is tuple
        assert await live.take_parallel("key:lost", limits) is Slot.GO
        tally = unpack(await server.call(None, "HGET", PREFIX + "tally:key:lost", "d"))
        return tally.reserved, tally.parallel

    reserved, parallel = run(scenario, redis_server)
    assert reserved < 1000 and parallel == 1  # the live router's own (its calls, its credit), none of the dead one's


def test_a_live_router_keeps_its_holds_past_their_life_by_renewing_them(redis_server):
    """The other side of rule 5: a router whose call runs longer than HOLD_S keeps its slot, as
    long as its sync renews it."""
    limits = Limits(max_parallel=1)

    async def scenario(server: SharedServer):
        await server.call(None, "DEL", PREFIX + "tally:key:long")
        server.came_up()
        holder, other = SharedCounters(server, closed=False), SharedCounters(server, closed=False)
        assert await holder.take_parallel("key:long", limits) is Slot.GO
        for _ in range(int(HOLD_S / SYNC_S) + 2):  # the sync's part, once a second
            holder.upkeep()
            await asyncio.sleep(SYNC_S)
        assert await other.take_parallel("key:long", limits) is Slot.WAIT
        holder.settle("key:long", limits, 0, 0, time.time(), True)
        await asyncio.sleep(0.05)  # a settle that frees a slot goes at once
        return await other.take_parallel("key:long", limits)

    assert run(scenario, redis_server) is Slot.GO


def test_a_queued_call_ends_by_its_timeout_while_its_keys_slot_is_held_elsewhere(fleet, routers, redis_server,
                                                                                tmp_path):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.hang(20))
    first, second, key = two_routers_with_a_key(fleet, routers, redis_server, tmp_path, box,
                                                 ("--queue-timeout", "2"), max_parallel=1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(call, first, headers=bearer(key), timeout=60)
        assert wait_for(lambda: chat_calls(box) == 1, 10)
        started = time.monotonic()
        status, _, body = call(second, headers=bearer(key), timeout=30)
        waited = time.monotonic() - started
    assert status == 503 and body["error"]["code"] == "queue_timeout", (status, body)
    # real time: its slot is tried again about every STALE_S; each try must not restart the wait
    assert waited < 2 + 2.5, waited


def test_routers_counting_alone_in_a_stall_admit_at_most_n_times_a_limit(fleet, routers, redis_server, tmp_path):
    """fleetwide/tallies.py rule 3: each router alone starts from the tally it last saw, so
    two routers pass an rpm at most twice over a window that holds a stall, the calls the server
    admitted before it included (each alone from its own count would make it three times)."""
    rpm = 30
    box = SimBox("a", residents=["tiny"])
    first, second, key = two_routers_with_a_key(fleet, routers, redis_server, tmp_path, box, rpm=rpm)
    started = time.monotonic()

    def burst(calls: int) -> list[int]:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return [status for status, _, _ in pool.map(
                lambda i: call((first, second)[i % 2], headers=bearer(key), timeout=30), range(calls))]

    before = burst(rpm)
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        during = burst(2 * rpm)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    drained = (time.monotonic() - started) * rpm / 60
    served = (before + during).count(200)
    assert set(before + during) <= {200, 429}
    assert before.count(200) >= rpm - 1
    assert served <= 2 * rpm + drained + 2, (before.count(200), during.count(200), drained)


def test_a_call_that_ends_in_an_outage_frees_its_slot_for_the_calls_counted_alone(redis_server):
    """Rule 3: counting alone starts from this router's holds less the settles parked (their calls
    have ended), and a settle parked once the key counts alone frees its slot there at once: a
    key with one slot is not locked on this router for the outage's length by a call it ended."""
    limits = Limits(max_parallel=1, budget_tokens=1000)

    async def scenario(server: SharedServer):
        await server.call(None, "DEL", PREFIX + "tally:key:ended")
        server.came_up()
        counters = SharedCounters(server, closed=False)
        assert (await counters.admit("key:ended", limits, "m", 100, time.time())).__class__ is tuple
        assert await counters.take_parallel("key:ended", limits) is Slot.GO
        server.went_down(ConnectionError("the test's outage"))
        counters.settle("key:ended", limits, 100, 50, time.time(), True)  # ends before any step alone
        first = await counters.take_parallel("key:ended", limits)  # the outage's first step: its seed
        counters.settle("key:ended", limits, 100, 50, time.time(), True)  # ends while counted alone
        second = await counters.take_parallel("key:ended", limits)
        return first, second

    assert run(scenario, redis_server) == (Slot.GO, Slot.GO)


def test_what_a_router_admitted_alone_is_drawn_whole_once_the_server_is_back(redis_server):
    """Rule 3: the calls a router admitted alone are drawn on the server as they were counted, not
    as a bucket drained meanwhile: the server's bucket drains through the outage by itself, so a
    second drain would let a saturated key past its rpm by the outage's drain on every outage
    (the 30-minute fault run: 35 calls a 3 s stall, never paid back)."""
    rpm = 600  # 10 a second
    limits = Limits(rpm=rpm)

    async def scenario(server: SharedServer):
        await server.call(None, "DEL", PREFIX + "tally:key:alone")
        server.came_up()
        counters = SharedCounters(server, closed=True)  # no credits: each admission asks the server
        start = time.time() - 3.0
        full = [await counters.admit("key:alone", limits, "m", 0, start) for _ in range(rpm + 2)]
        assert [a.__class__ for a in full].count(Refused) == 2
        counters.closed = False  # open for the outage: it counts alone
        server.went_down(ConnectionError("the test's outage"))
        alone = [await counters.admit("key:alone", limits, "m", 0, start + second)
                 for second in (1, 2, 3) for _ in range(10)]
        assert Refused not in [a.__class__ for a in alone]  # each second's drain, admitted alone
        server.came_up()
        counters.upkeep()
        counters.closed = True
        after = [await counters.admit("key:alone", limits, "m", 0, time.time()) for _ in range(10)]
        return [a.__class__ for a in after].count(Refused)

    assert run(scenario, redis_server) >= 9  # full again: the 30 alone paid for the 3 s drained
