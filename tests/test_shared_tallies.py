"""Per-key limits on one redis-server across routers (fleetwide/tallies.py): `rpm` exact
(±1), `max_parallel` never exceeded at the box, and the shared server's outage in both modes.

The two routers share one SQLite store (one HUGPY_ROUTER_HOME) so that they know the same keys;
the tallies themselves are on the redis-server only."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import pytest
from hypothesis import given, strategies as st

from router.core.limits import Limits, Tally
from router.sim.hugpy import Behavior, SimBox
from router.fleetwide.wire import PREFIX, SharedDown, SharedServer
from router.fleetwide.tallies import CREDIT_FIRST_CALLS, CREDIT_S, SharedCounters, copy, pack, unpack

from conftest import wait_for
from support.boxes import chat_calls, max_concurrency
from support.calls import bearer, call, new_key, request
from support.several_routers import fleet, knows, routers, run, shared_state  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(90)


def test_rpm_is_exact_across_two_routers(fleet, routers, redis_server, tmp_path):
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    first, second = routers([box], 2, ("--shared-url", redis_server.url), home=tmp_path / "home")
    key_id, key = new_key(first, rpm=10)
    assert wait_for(lambda: knows(second, key_id, {"rpm": 10}), 5)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: call((first, second)[i % 2], headers=bearer(key)), range(32)))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}
    served = statuses.count(200)
    assert 10 <= served <= 11, statuses  # the minute drains 10/60 a second: ±1 over the burst


def test_rpm_is_exact_across_two_routers_where_credits_are_given(fleet, routers, redis_server, tmp_path):
    """shared_counters rule 8: with room for credits (rpm 340: 20 a credit at first), a burst split
    between two routers is served exactly to the limit, plus what drained meanwhile: a credit
    draws ahead, so none passes it, and none is left unspent while calls are turned away."""
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    first, second = routers([box], 2, ("--shared-url", redis_server.url), home=tmp_path / "home")
    rpm = 340
    key_id, key = new_key(first, rpm=rpm)
    assert wait_for(lambda: knows(second, key_id, {"rpm": rpm}), 5)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: call((first, second)[i % 2], headers=bearer(key)), range(rpm + 160)))
    drained = (time.monotonic() - started) * rpm / 60
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}
    credited = sum(shared_state(router)["tallies"]["credited_calls"] for router in (first, second))
    assert credited > 0
    assert rpm - 1 <= statuses.count(200) <= rpm + drained + 1, (statuses.count(200), drained, credited)


def test_max_parallel_holds_across_two_routers(fleet, routers, redis_server, tmp_path):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(0.2)] * 12)
    fleet(box)
    first, second = routers([box], 2, ("--shared-url", redis_server.url), home=tmp_path / "home")
    key_id, key = new_key(first, max_parallel=2)
    assert wait_for(lambda: knows(second, key_id, {"max_parallel": 2}), 5)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: call((first, second)[i % 2], headers=bearer(key)), range(12)))
    assert [status for status, _, _ in results] == [200] * 12
    assert chat_calls(box) == 12
    assert max_concurrency(box) == 2


def test_a_keyed_call_meets_the_mode_while_the_server_is_down(fleet, routers, redis_server, tmp_path):
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    opened, closed = routers([box], 2, ("--shared-url", redis_server.url), home=tmp_path / "home")
    closed.stop()
    (closed,) = routers([box], 1, ("--shared-url", redis_server.url, "--shared-down", "closed"),
                        first=2, home=tmp_path / "home")
    key_id, key = new_key(opened, rpm=100)
    assert wait_for(lambda: knows(closed, key_id, {"rpm": 100}), 5)
    redis_server.stop()
    started = time.monotonic()
    assert call(opened, headers=bearer(key), timeout=10)[0] == 200
    status, _, body = call(closed, headers=bearer(key), timeout=10)
    assert status == 503 and body["error"]["code"] == "shared_store_down"
    assert time.monotonic() - started < 3  # nothing hung
    assert wait_for(lambda: shared_state(opened)["counting"] == "this router alone", 3)
    redis_server.start()
    assert wait_for(lambda: call(closed, headers=bearer(key), timeout=10)[0] == 200, 4)


def test_a_restarted_server_gets_the_budgets_back_from_the_store(fleet, routers, redis_server, tmp_path):
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    (router,) = routers([box], 1, ("--shared-url", redis_server.url), home=tmp_path / "home")
    key_id, key = new_key(router, budget_tokens=10_000)
    for _ in range(3):
        assert call(router, headers=bearer(key))[0] == 200

    def spent() -> tuple[int, int]:
        """(the tally's spend, the store's tokens this period)"""
        doc = json.loads(request(router, "GET", "/v1/keys/usage", timeout=10)[2])
        key_doc = next(k for k in doc["keys"] if k["id"] == key_id)
        return 10_000 - key_doc["left"]["budget_tokens"], key_doc["current"]["prompt_tokens"] + key_doc[
            "current"]["completion_tokens"]

    # the last call's settle rides the next round trip (shared_counters rule 7), within a second
    assert wait_for(lambda: spent()[0] == spent()[1] > 0, 5)
    before = spent()[0]
    redis_server.stop()
    assert wait_for(lambda: not shared_state(router)["up"], 5)
    redis_server.start()  # empty: no persistence
    assert wait_for(lambda: shared_state(router)["up"], 5)
    assert call(router, headers=bearer(key))[0] == 200  # a step reads the emptied tally
    # the key upkeep (once a second) seeds the budget from the store again: not from 0
    assert wait_for(lambda: spent()[0] >= before, 5)


def test_a_keyed_call_to_a_box_with_a_limit_waits_for_one_round_trip(fleet, routers, redis_server, tmp_path):
    """The admission's compare-and-set and the box's lease go out together, the gives and settles
    ride the next call's round trip (fleetwide/leases.py rule 1, shared_counters rule 7)."""
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    (router,) = routers([box], 1, ("--shared-url", redis_server.url), {"a": {"max_inflight": 4}},
                        home=tmp_path / "home")
    _, key = new_key(router, rpm=1000, tpm=10**9, budget_tokens=10**9)
    assert call(router, headers=bearer(key))[0] == 200
    calls = 20
    before, started = shared_state(router)["round_trips"], time.monotonic()
    for _ in range(calls):
        assert call(router, headers=bearer(key))[0] == 200
    sent = shared_state(router)["round_trips"] - before
    syncs = int(time.monotonic() - started) + 2  # the once-a-second renewal, and the state read's moment
    assert sent <= calls + syncs, (sent, calls, syncs)  # two a call (admission, then lease) would be 40


def test_a_call_its_key_refuses_gives_back_the_lease_asked_with_its_admission(fleet, routers, redis_server,
                                                                            tmp_path):
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    (router,) = routers([box], 1, ("--shared-url", redis_server.url), {"a": {"max_inflight": 1}},
                        home=tmp_path / "home")
    _, key = new_key(router, rpm=1)
    assert call(router, headers=bearer(key))[0] == 200
    assert call(router, headers=bearer(key))[0] == 429
    assert wait_for(lambda: shared_state(router)["slots"]["a"] == {"fleet": 0, "this_router": 0, "parked": 0}, 3)
    assert call(router)[0] == 200  # the box's one slot is free


def test_a_busy_key_is_admitted_from_its_credit_and_gives_back_what_it_did_not_spend(fleet, routers, redis_server,
                                                                                  tmp_path):
    """shared_counters rule 8: calls of a key that come fast are admitted from a credit with no
    round trip; the credit's unspent share goes back, so the budget left is the tokens counted
    exactly (nothing reserved stays behind), and its calls still carry the rate headers."""
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    (router,) = routers([box], 1, ("--shared-url", redis_server.url), home=tmp_path / "home")
    key_id, key = new_key(router, rpm=100_000, tpm=10**9, budget_tokens=10**9)
    before, started = shared_state(router), time.monotonic()
    calls = 60
    for _ in range(calls):
        status, headers, _ = call(router, headers=bearer(key))
        assert status == 200 and int(headers["x-ratelimit-remaining-requests"]) < 100_000
    after, elapsed = shared_state(router), time.monotonic() - started
    credited = after["tallies"]["credited_calls"] - before["tallies"]["credited_calls"]
    assert credited >= calls // 2, after["tallies"]
    # what goes out is the calls not credited, the renewals and give-backs (waited for by no call:
    # about one each half CREDIT_S, a few more while the credit grows) and the syncs: far from one a call
    sent = after["round_trips"] - before["round_trips"]
    assert sent <= calls // 3, (sent, elapsed)

    def spent() -> tuple[int, int]:
        """(the tally's spend, reserved included; the store's tokens this period)"""
        doc = json.loads(request(router, "GET", "/v1/keys/usage", timeout=10)[2])
        key_doc = next(k for k in doc["keys"] if k["id"] == key_id)
        return 10**9 - key_doc["left"]["budget_tokens"], key_doc["current"]["prompt_tokens"] + key_doc[
            "current"]["completion_tokens"]

    assert wait_for(lambda: spent()[0] == spent()[1] > 0, 5), spent()


def test_a_credit_admits_with_no_round_trip_gives_back_the_rest_and_is_not_spent_after_an_outage(redis_server):
    """shared_counters rule 8, in this process: the second of two quick calls asks a credit; the
    calls it covers are answered at once (no round trip waited for); a call it does not cover is a
    compare-and-set; what was not spent goes back once the credit lapses, unasked; a credit
    outlives a blip of the same server, and is not spent on a new run of it (restarted)."""
    budget = Limits(budget_tokens=10**9)

    async def reserved_on_server(server: SharedServer) -> int:
        return unpack(await server.call(None, "HGET", PREFIX + "tally:key:k", "d") or b"").reserved

    async def scenario(server: SharedServer):
        await server.call(None, "DEL", PREFIX + "tally:key:k")
        server.came_up()
        counters = SharedCounters(server, closed=False)
        for _ in range(2):
            assert (await counters.admit("key:k", budget, "m", 10, time.time())).__class__ is tuple
        await asyncio.sleep(0)  # the grant's answer is read
        before = server.round_trips
        credited = [counters.admit("key:k", budget, "m", 10, time.time()) for _ in range(CREDIT_FIRST_CALLS)]
        await asyncio.sleep(0.01)  # a round trip asked would have gone out by now
        assert all(answer.__class__ is tuple for answer in credited)
        assert server.round_trips - before <= 1  # the renewal, asked half spent, waited for by none
        larger = counters.admit("key:k", budget, "m", 10**6, time.time())  # more than any credit holds
        assert larger.__class__ is not tuple and (await larger).__class__ is tuple
        await asyncio.sleep(CREDIT_S * 2.5)  # every credit's rest back, unasked, once it lapsed
        assert (await reserved_on_server(server)) == 10 * (2 + CREDIT_FIRST_CALLS) + 10**6
        for _ in range(2):  # a new credit, once quick again
            await counters.admit("key:k", budget, "m", 10, time.time())
        await asyncio.sleep(0)
        assert counters.credits["key:k"].requests
        server.went_down(OSError("the test's blip"))  # the same run of the server: it still holds the draw
        server.came_up()
        assert counters.admit("key:k", budget, "m", 10, time.time()).__class__ is tuple
        lost = counters.lost_steps
        redis_server.stop()
        redis_server.start()  # a new run: what the credit drew is gone
        await asyncio.sleep(0.1)
        assert not server.up  # the idle connection's close said so (fleetwide/wire.py rule 3)
        for _ in range(2):  # what the first connection to the new run carries is failed, not sent
            try:
                await server.call(None, "PING")
                break
            except SharedDown:
                pass
        server.came_up()  # the sync's part
        counters.upkeep()  # the sync's part too: a step parked for the old run is not written to the new
        assert counters.admit("key:k", budget, "m", 10, time.time()).__class__ is not tuple
        assert counters.lost_steps == lost + 1  # its rest was not given back to the new run

    run(scenario, redis_server)


def test_a_router_that_stops_gives_back_its_credits_and_writes_its_settles(redis_server):
    """shared_counters rule 8: `give_back` (run as the router stops) leaves the tally holding
    exactly the calls admitted and settled, nothing of a credit's rest."""
    budget = Limits(budget_tokens=10**9)

    async def scenario(server: SharedServer):
        await server.call(None, "DEL", PREFIX + "tally:key:s")
        server.came_up()
        counters = SharedCounters(server, closed=False)
        for _ in range(2):
            await counters.admit("key:s", budget, "m", 100, time.time())
        await asyncio.sleep(0)  # the credit is granted
        assert counters.admit("key:s", budget, "m", 100, time.time()).__class__ is tuple
        counters.settle("key:s", budget, 100, 40, time.time(), False)  # rides a later round trip
        await counters.give_back()
        tally = unpack(await server.call(None, "HGET", PREFIX + "tally:key:s", "d") or b"")
        return tally.reserved, tally.used

    assert run(scenario, redis_server) == (200, 40)  # two calls unsettled, one settled at 40 tokens


@given(st.lists(st.floats(allow_nan=False), min_size=5, max_size=5),
       st.lists(st.integers(min_value=-(2 ** 53), max_value=2 ** 53), min_size=3, max_size=3))
def test_a_tally_packs_copies_and_unpacks_whole(floats, ints):
    """store/shared_counters rule 1: every field of a Tally, in its order, survives `pack` and
    `unpack` (counts as ints), and `copy` copies every field."""
    tally = Tally()
    for field, value in zip(Tally.__slots__, floats + ints):
        setattr(tally, field, value)
    for twin in (unpack(pack(tally)), copy(tally)):
        assert [getattr(twin, field) for field in Tally.__slots__] == floats + ints
        assert all(type(getattr(twin, field)) is int for field in ("used", "reserved", "parallel"))
    assert [getattr(unpack(b""), field) for field in Tally.__slots__] == \
        [getattr(Tally(), field) for field in Tally.__slots__]
