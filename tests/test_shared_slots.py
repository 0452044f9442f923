"""Several routers on one redis-server (fleetwide/leases.py): a box's `max_inflight` holds across
routers, a router killed with SIGKILL gives its slots back within the lease bound, a server
that goes down is a stated mode (`--shared-down open|closed`), never a hang, and a lease parked
for the next call (rule 9) costs that call no round trip and comes back when it could matter.

Real processes throughout: `router serve` processes (tests/conftest.py RouterProcess), simulated
boxes on loopback (router.sim), a redis-server of the test's own (tests/engines.py)."""

from __future__ import annotations

import concurrent.futures
import signal
import time
import urllib.request

import pytest
import redis

from router.fleetwide.leases import LEASE_TTL_S, SYNC_S, slots_key
from router.sim.hugpy import Behavior, SimBox

from conftest import wait_for, write_boxes
from support.boxes import chat_calls, max_concurrency
from support.calls import call, get_json
from support.several_routers import fleet, routers, shared_state  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(90)

DEAD_ROUTER_BOUND_S = LEASE_TTL_S + SYNC_S  # fleetwide/leases.py rule 3: 6 s, under the 10 s
IDLE_PARKED_BOUND_S = 2 * SYNC_S  # rule 9: idle through a whole SYNC_S, given back at the next sync


def metrics_text(router) -> str:
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def parked(router, box: str = "a") -> int:
    return shared_state(router)["slots"].get(box, {}).get("parked", 0)


def leases_on_server(redis_server, box: str = "a") -> list[bytes]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        return client.zrange(slots_key(box), 0, -1)
    finally:
        client.close()


@pytest.mark.parametrize("limit", [2, 4])
def test_max_inflight_holds_across_routers_under_a_burst_split_between_them(fleet, routers, redis_server, limit):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(0.2)] * 27)
    fleet(box)
    first, second, third = routers([box], 3, ("--shared-url", redis_server.url), {"a": {"max_inflight": limit}})
    for router in (first, second, third):  # one call each first: leases parked when the burst comes (rule 9)
        assert call(router)[0] == 200
    assert sum(parked(router) for router in (first, second, third)) >= 1
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda i: call((first, second, third)[i % 3]), range(24)))
    assert [status for status, _, _ in results] == [200] * 24
    assert chat_calls(box) == 27
    assert max_concurrency(box) == limit  # never more, fleet-wide; and the limit was reached
    state = shared_state(first)
    assert state["up"] and state["counting"] == "fleet-wide"
    assert sorted(r["instance"] for r in state["routers"]) == ["r0", "r1", "r2"]
    # every slot given back: the parked ones once idle, read by the second router's next sync
    assert wait_for(lambda: shared_state(second)["slots"]["a"]["fleet"] == 0, IDLE_PARKED_BOUND_S + SYNC_S + 1)


def test_a_lease_parked_is_taken_by_the_next_call_with_no_round_trip(fleet, routers, redis_server):
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    (router,) = routers([box], 1, ("--shared-url", redis_server.url), {"a": {"max_inflight": 4}})
    assert call(router)[0] == 200
    kept = leases_on_server(redis_server)
    assert len(kept) == 1 and parked(router) == 1  # the call's lease stayed, parked on the router
    assert "router_shared_parked_leases 1.0" in metrics_text(router)
    before, started = shared_state(router)["round_trips"], time.monotonic()
    for _ in range(10):
        assert call(router)[0] == 200
    syncs = (time.monotonic() - started) / SYNC_S + 1  # the sync's own round trips, once a second
    assert shared_state(router)["round_trips"] - before <= syncs  # none for the ten calls
    assert leases_on_server(redis_server) == kept  # the same lease each time: no take, no give
    assert parked(router) == 1


def test_a_parked_lease_idle_for_a_whole_sync_goes_back(fleet, routers, redis_server):
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    (router,) = routers([box], 1, ("--shared-url", redis_server.url), {"a": {"max_inflight": 4}})
    assert call(router)[0] == 200
    parked_at = time.monotonic()
    assert len(leases_on_server(redis_server)) == 1
    assert wait_for(lambda: not leases_on_server(redis_server), IDLE_PARKED_BOUND_S + 1)
    assert time.monotonic() - parked_at >= SYNC_S  # idle through a whole SYNC_S first
    assert parked(router) == 0
    assert "router_shared_parked_leases 0.0" in metrics_text(router)


def park_two(router, redis_server) -> float:
    """Two calls at once on `router`, both ended: their leases parked there (limit 4: each park
    leaves the fleet-wide count at 2, half). Returns when."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert [f.result()[0] for f in [pool.submit(call, router) for _ in range(2)]] == [200, 200]
    parked_at = time.monotonic()
    assert parked(router) == 2 and len(leases_on_server(redis_server)) == 2
    return parked_at


def test_parked_leases_go_back_once_the_box_passes_half_its_limit(fleet, routers, redis_server):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.hang(0.3), Behavior.hang(0.3), Behavior.hang(3.0), Behavior.hang(0.3))
    fleet(box)
    first, second = routers([box], 2, ("--shared-url", redis_server.url), {"a": {"max_inflight": 4}})
    parked_at = park_two(first, redis_server)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(call, second) for _ in range(2)]  # 4 of 4 held: past half
        assert wait_for(lambda: parked(first) == 0, SYNC_S)
        back_s = time.monotonic() - parked_at
        assert [f.result()[0] for f in busy] == [200, 200]
    assert back_s < SYNC_S * 0.8, back_s  # at the count read (the second's give published it), not idle


def test_a_call_waiting_on_a_box_full_with_leases_parked_elsewhere_gets_one_within_a_hop(
        fleet, routers, redis_server):
    box = SimBox("a", residents=["tiny"])
    # the two parked calls hang 0.2 s so that they overlap even on a loaded machine (two calls one
    # after the other park one lease, not two); the waiter is still served well before the sync
    box.script("tiny", Behavior.hang(0.2), Behavior.hang(0.2), *[Behavior.hang(2.0)] * 3)
    fleet(box)
    first, second = routers([box], 2, ("--shared-url", redis_server.url), {"a": {"max_inflight": 4}})
    # the first's next count read (which would give its parked leases back too) is SYNC_S away
    synced = just_synced(first)
    park_two(first, redis_server)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        holders = [pool.submit(call, second) for _ in range(2)]  # 2 + the first's 2 parked: full
        assert wait_for(lambda: chat_calls(box) == 4, 5)
        waiter = pool.submit(call, second)  # full fleet-wide: it waits, and asks for the parked ones
        assert wait_for(lambda: chat_calls(box) == 5, 2 * SYNC_S)
        served_s = time.monotonic() - synced
        assert [f.result()[0] for f in (*holders, waiter)] == [200] * 3
    assert served_s < SYNC_S * 0.8, served_s  # a pub/sub hop, not the first's next sync
    assert max_concurrency(box) == 3  # the holders and the waiter: the parked two were no calls


def just_synced(router) -> float:
    """When `router`'s sync has just run (an idle router sends no other round trip)."""
    before = shared_state(router)["round_trips"]
    assert wait_for(lambda: shared_state(router)["round_trips"] != before, 2 * SYNC_S, interval=0.005)
    return time.monotonic()


def test_parked_leases_go_back_when_the_box_limit_changes_live(fleet, routers, redis_server):
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    (router,) = routers([box], 1, ("--shared-url", redis_server.url), {"a": {"max_inflight": 4}})
    assert call(router)[0] == 200
    assert parked(router) == 1
    write_boxes(router.boxes_path, [box], a={"max_inflight": 1})
    changed = time.monotonic()
    router.proc.send_signal(signal.SIGHUP)  # re-read the boxes file now
    assert wait_for(lambda: not leases_on_server(redis_server), SYNC_S)
    assert time.monotonic() - changed < SYNC_S * 0.8  # as the fleet changed, not at an idle sync
    assert parked(router) == 0
    assert call(router)[0] == 200  # a limit of 1 parks nothing: past half at once
    assert parked(router) == 0 and wait_for(lambda: not leases_on_server(redis_server), 1)


def test_a_router_killed_mid_burst_gives_its_slots_back_within_the_bound(fleet, routers, redis_server):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(30)] * 2, *[Behavior.hang(0.2)] * 6)
    fleet(box)
    doomed, survivor = routers([box], 2, ("--shared-url", redis_server.url), {"a": {"max_inflight": 2}})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        hung = [pool.submit(call, doomed, timeout=60) for _ in range(2)]
        assert wait_for(lambda: chat_calls(box) == 2, 10)  # the doomed router holds both slots
        assert wait_for(lambda: shared_state(survivor)["slots"].get("a", {}).get("fleet") == 2, 3)
        served = [pool.submit(call, survivor, timeout=60) for _ in range(6)]
        time.sleep(0.5)
        assert chat_calls(box) == 2  # full fleet-wide: the survivor's calls wait
        doomed.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert wait_for(lambda: chat_calls(box) > 2, DEAD_ROUTER_BOUND_S + 2)
        back_s = time.monotonic() - killed
        results = [f.result() for f in served]
        for f in hung:
            with pytest.raises(Exception):
                f.result()
    assert [status for status, _, _ in results] == [200] * 6
    assert back_s <= DEAD_ROUTER_BOUND_S + 0.5, back_s
    assert [r["instance"] for r in shared_state(survivor)["routers"]] == ["r1"] or wait_for(
        lambda: [r["instance"] for r in shared_state(survivor)["routers"]] == ["r1"], 8)


def test_open_mode_counts_alone_while_the_server_is_down_and_says_so(fleet, routers, redis_server):
    box = SimBox("a", residents=["tiny"])
    fleet(box)
    (router,) = routers([box], 1, ("--shared-url", redis_server.url), {"a": {"max_inflight": 2}})
    assert call(router)[0] == 200
    redis_server.stop()
    started = time.monotonic()
    statuses = [call(router, timeout=10)[0] for _ in range(5)]
    assert statuses == [200] * 5 and time.monotonic() - started < 5  # nothing hung
    assert wait_for(lambda: not shared_state(router)["up"], 3)
    state = shared_state(router)
    assert state["counting"] == "this router alone" and state["down_mode"] == "open"
    assert "router_shared_store_up 0.0" in metrics_text(router)
    assert router.log_text().count("is DOWN") == 1  # one loud line, not one per call
    redis_server.start()
    assert wait_for(lambda: shared_state(router)["up"], 3 * SYNC_S)
    assert "router_shared_store_up 1.0" in metrics_text(router)
    assert call(router)[0] == 200
    assert shared_state(router)["counting"] == "fleet-wide"


def test_closed_mode_refuses_calls_that_need_a_shared_count_until_the_server_is_back(fleet, routers, redis_server):
    limited, free = SimBox("a", residents=["tiny"]), SimBox("b", residents=["other"])
    fleet(limited, free)
    (router,) = routers([limited, free], 1, ("--shared-url", redis_server.url, "--shared-down", "closed"),
                        {"a": {"max_inflight": 2}})
    assert call(router)[0] == 200
    redis_server.stop()
    started = time.monotonic()
    status, _, body = call(router, timeout=10)
    assert status == 503 and body["error"]["code"] == "shared_store_down", body
    assert time.monotonic() - started < 2
    assert call(router, model="other")[0] == 200  # a box without a limit needs no shared count
    assert wait_for(lambda: shared_state(router)["counting"] == "refusing calls that need a count", 3)
    assert "router_shared_store_down_refusals_total 1.0" in metrics_text(router)
    redis_server.start()
    assert wait_for(lambda: call(router, timeout=10)[0] == 200, 3 * SYNC_S + 1)
    assert shared_state(router)["up"]


def test_a_slot_freed_on_one_router_reaches_the_others_waiters_at_once(fleet, routers, redis_server):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.hang(0.6), *[Behavior.hang(0.05)] * 3)
    fleet(box)
    first, second = routers([box], 2, ("--shared-url", redis_server.url), {"a": {"max_inflight": 1}})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        holder = pool.submit(call, first)
        assert wait_for(lambda: chat_calls(box) == 1, 5)
        waiter_started = time.monotonic()
        waiter = pool.submit(call, second)
        assert holder.result()[0] == 200
        freed = time.monotonic()
        assert waiter.result()[0] == 200
    waited = [r for r in box.calls if r.path == "/v1/chat/completions"][1]
    # pub/sub, not the once-a-second poll: the waiter is on the box well within SYNC_S
    first_end = [r for r in box.calls if r.path == "/v1/chat/completions"][0].finished_at
    assert waited.started_at - first_end < SYNC_S / 2, waited.started_at - first_end
    assert freed - waiter_started > 0.3


def test_one_router_without_a_shared_url_has_no_shared_state(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    router = start_fleet_in_process(box, boxes_extra={"a": {"max_inflight": 1}})
    assert call(router)[0] == 200
    assert "shared" not in get_json(router, "/v1/router/state")
    assert "router_shared_store_up" not in metrics_text(router)


def test_a_server_that_stops_answering_costs_a_call_at_most_the_round_trip_timeout(fleet, routers, redis_server):
    from router.fleetwide.wire import ROUND_TRIP_TIMEOUT_S

    box = SimBox("a", residents=["tiny"])
    fleet(box)
    (router,) = routers([box], 1, ("--shared-url", redis_server.url), {"a": {"max_inflight": 2}})
    assert call(router)[0] == 200
    redis_server.proc.send_signal(signal.SIGSTOP)  # up, connected, silent: the worst case
    try:
        took = []
        for _ in range(4):
            started = time.monotonic()
            assert call(router, timeout=10)[0] == 200
            took.append(time.monotonic() - started)
        assert max(took) < ROUND_TRIP_TIMEOUT_S + 1.0, took  # the first pays the timeout, no more
        assert wait_for(lambda: not shared_state(router)["up"], 3)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert wait_for(lambda: shared_state(router)["up"], 3 * SYNC_S)
    assert call(router)[0] == 200


def test_a_call_that_fails_over_gives_the_first_boxs_slot_back(fleet, routers, redis_server):
    refusing, serving = SimBox("a", residents=["tiny"]), SimBox("b", residents=["tiny"])
    refusing.script("tiny", *[Behavior.refuse(503, "maintenance")] * 2)
    serving.script("tiny", Behavior.hang(2.0), Behavior.hang(1.0))
    fleet(refusing, serving)
    (router,) = routers([refusing, serving], 1, ("--shared-url", redis_server.url),
                        {"a": {"max_inflight": 1}, "b": {"max_inflight": 2}})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        holder = pool.submit(call, router)
        assert wait_for(lambda: chat_calls(serving) == 1, 5)  # b is busier than a now
        moved = pool.submit(call, router)  # to a first, which refuses: then to b
        assert wait_for(lambda: chat_calls(serving) == 2, 5)
        assert chat_calls(refusing) >= 1
        slots = shared_state(router)["slots"]
        assert slots["a"]["fleet"] == 0 and slots["b"]["fleet"] == 2  # a's slot went back as it failed over
        assert holder.result()[0] == 200 and moved.result()[0] == 200
    assert wait_for(lambda: shared_state(router)["slots"]["b"]["fleet"] == 0, 2 * SYNC_S)
