"""Affinity bindings shared across routers (fleetwide/bindings.py): a session that reached one
router goes to the same box when its next call reaches another, through the redis-server; the
server down, each router keeps its own."""

from __future__ import annotations

import pytest

from router.sim.hugpy import SimBox

from support.conversations import chat, client, first_message
from support.several_routers import fleet, routers, shared_state  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(90)


def test_a_session_bound_on_one_router_holds_on_the_other(fleet, routers, redis_server):
    boxes = [SimBox(name, residents=["tiny"]) for name in "abcd"]
    fleet(*boxes)
    first, second = routers(boxes, 2, ("--shared-url", redis_server.url))
    here, there = client(first), client(second)
    sessions = {f"s{n}": chat(here, [first_message(n)], {"X-Router-Session": f"s{n}"}) for n in range(8)}
    assert all(affinity == "miss:session" for _, affinity in sessions.values())
    assert len({box for box, _ in sessions.values()}) >= 2  # misses spread: a match below is no accident
    for session, (box, _) in sessions.items():
        assert chat(there, [first_message(99)], {"X-Router-Session": session}) == (box, "hit:session")


def test_with_the_server_down_each_router_keeps_its_own_bindings(fleet, routers, redis_server):
    boxes = [SimBox(name, residents=["tiny"]) for name in "ab"]
    fleet(*boxes)
    (router,) = routers(boxes, 1, ("--shared-url", redis_server.url))
    api = client(router)
    redis_server.stop()
    box, affinity = chat(api, [first_message(1)], {"X-Router-Session": "alone"})
    assert affinity == "miss:session"
    assert chat(api, [first_message(2)], {"X-Router-Session": "alone"}) == (box, "hit:session")
    assert not shared_state(router)["up"]
