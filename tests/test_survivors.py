"""Five mutations that once survived the suite (issue 37), each killed here by the rule it breaks:
a credit spent on a restarted server, a settle that frees a key's slot riding a later round trip,
a freed key slot not offered to its waiter, affinity learning from an error answer, and an alias
chain's first-byte deadline counted per attempt."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time

import pytest

from router.core.limits import Limits
from router.core.slots import Slot
from router.fleetwide import tallies
from router.fleetwide.tallies import SharedCounters, unpack
from router.fleetwide.wire import PREFIX, SharedDown, SharedServer
from router.serve import clock
from router.sim.hugpy import Behavior, SimBox

from support.calls import bearer, call, new_key, request
from support.several_routers import run

pytestmark = pytest.mark.timeout(60)


async def on_server(server: SharedServer, name: str):
    """The tally `name` as the server holds it."""
    return unpack(await server.call(None, "HGET", PREFIX + "tally:" + name, "d") or b"")


def test_a_credit_is_not_spent_on_a_new_run_of_the_server(redis_server, monkeypatch):
    """fleetwide/tallies.py rule 8: a restarted server lost what a credit drew, so the credit is
    not spent there even while it lives: the call is a compare-and-set again, and the credit's
    rest is counted lost, not given back to a run that never held it."""
    monkeypatch.setattr(tallies, "CREDIT_S", 60.0)  # the credit outlives the restart: only its run stops it
    budget = Limits(budget_tokens=10**9)

    async def scenario(server: SharedServer):
        await server.call(None, "DEL", PREFIX + "tally:key:k")
        server.came_up()
        counters = SharedCounters(server, closed=False)
        for _ in range(2):  # the second comes fast: it asks a credit
            await counters.admit("key:k", budget, "m", 10, time.time())
        await asyncio.sleep(0)  # the grant's answer is read
        assert counters.admit("key:k", budget, "m", 10, time.time()).__class__ is tuple  # from the credit
        epoch, lost = server.epoch, counters.lost_steps
        redis_server.stop()
        redis_server.start()
        for _ in range(50):  # the first connection to the new run is refused what the old one asked
            try:
                await server.call(None, "PING")
                break
            except SharedDown:
                await asyncio.sleep(0.02)
        server.came_up()  # the sync's part
        assert server.epoch == epoch + 1 and counters.credits["key:k"].requests  # a new run; the credit lives
        admitted = counters.admit("key:k", budget, "m", 10, time.time())
        assert admitted.__class__ is not tuple, "a credit drawn on the old run was spent on the new one"
        assert (await admitted).__class__ is tuple and counters.lost_steps == lost + 1

    run(scenario, redis_server)


def test_a_settle_that_frees_a_keys_slot_goes_at_once(redis_server):
    """fleetwide/tallies.py rule 7: a settle that gives back a max_parallel slot is its own round
    trip, sent now (some router's call may wait for the slot), not the next one anyone sends."""
    limits = Limits(max_parallel=1)

    async def scenario(server: SharedServer):
        await server.call(None, "DEL", PREFIX + "tally:key:p")
        server.came_up()
        counters = SharedCounters(server, closed=True)  # no credits: nothing else goes out
        assert await counters.take_parallel("key:p", limits) is Slot.GO
        assert (await on_server(server, "key:p")).parallel == 1
        before = server.round_trips
        counters.settle("key:p", limits, 0, 0, time.time(), True)
        await asyncio.sleep(0.1)  # no sync runs here: only an urgent settle has gone out by now
        assert server.round_trips == before + 1, "the settle that frees a slot waited for another round trip"
        assert (await on_server(server, "key:p")).parallel == 0

    run(scenario, redis_server)


def timed_call(router, key: str, timeout: float) -> tuple[int | None, float]:
    """(status, perf_counter at the end) of one keyed call; status None when it had no answer
    within `timeout`."""
    try:
        status = call(router, headers=bearer(key), timeout=timeout)[0]
    except (TimeoutError, socket.timeout):
        status = None
    return status, time.perf_counter()


def test_a_keys_freed_slot_is_handed_to_its_waiter_by_the_settle_not_the_sweep(start_fleet_in_process,
                                                                               monkeypatch):
    """serve/limits.py rule 3 (admission.py rule 5): the slot a call's key frees is offered to the
    queue as the call settles. The CallClock's sweep would offer it too, 50 ms later at most: it
    is held off here, so only the offer can hand the waiter its slot."""
    monkeypatch.setattr(clock, "CLOCK_TICK_S", 60.0)
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.hang(0.5))  # the first call holds its key's one slot at the box
    router = start_fleet_in_process(box)
    _, key = new_key(router, max_parallel=1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(timed_call, router, key, 10)
        time.sleep(0.2)  # the second comes while the first holds the slot: it waits in the queue
        second = pool.submit(timed_call, router, key, 5)
        (first_status, first_end), (second_status, second_end) = first.result(), second.result()
    assert first_status == 200
    assert second_status == 200, "the waiter was not handed the slot its key freed"
    assert second_end - first_end < 2.0


def test_affinity_learns_nothing_from_an_error_answer(start_fleet_in_process):
    """router.core.affinity rule 4 (serve/proxy.py `try_box`): only an answer that is not an error
    teaches where a key's calls go. A box's 400 goes back to the client and binds nothing: the
    session's next call is a miss, not a hit on the box that failed it."""
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.refuse(400, "invalid_request_error", "max_tokens is too large"))
    router = start_fleet_in_process(box)
    session = {"X-Router-Session": "after-an-error"}
    status, headers, _ = call(router, headers=session)
    assert status == 400 and "x-router-affinity" not in headers
    status, headers, _ = call(router, headers=session)
    assert status == 200 and headers["x-router-affinity"] == "miss:session", "a 400 bound the session"


def test_an_alias_chain_has_one_first_byte_deadline_across_its_attempts(start_fleet_in_process):
    """serve/aliases.py rule 4: the chain's first-byte deadline runs from its first send. The first
    model's box takes 2 s of the 3 and fails (it closes without a byte); the second model's box
    would answer 2 s after it is sent, past the 1 s left: the call fails, where a deadline
    counted afresh for each attempt would have let it be served."""
    a = SimBox("a", residents=["big"])
    b = SimBox("b", residents=["small"])
    router = start_fleet_in_process(a, b, extra_args=("--first-byte-timeout", "3"))
    assert request(router, "PUT", "/v1/aliases/coder", {"chain": ["big", "small"]})[0] == 201
    a.script("big", Behavior.drop(after_s=2.0))
    b.script("small", Behavior.hang(2.0))
    status, headers, _ = call(router, model="coder")
    assert status != 200, "the second model's attempt had a first-byte deadline of its own"
    assert status in (502, 504) and [r.model for r in b.calls if r.path.endswith("/chat/completions")] == ["small"]
