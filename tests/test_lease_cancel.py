"""A call whose task ends while its box's lease is a round trip away (its body's deadline, the
server stopping) leaves no lease behind: the lease, once the server has granted it, goes back
instead of being renewed by every sync for as long as the router runs (fleetwide/leases.py)."""

from __future__ import annotations

import asyncio
import types

import pytest

from router.boxes.config import BoxConfig
from router.boxes.state import BoxState
from router.fleetwide.leases import SlotLeases, slots_key
from router.fleetwide.wire import SharedServer

from support.several_routers import run

pytestmark = pytest.mark.timeout(60)


class Holder:
    """A call's load, as the leases see it (serve/load.py's `Load`)."""

    def __init__(self) -> None:
        self.lease = self.asked = self.box = None

    def count_on(self, box) -> None:
        self.box = box


def leases_on(server: SharedServer, box: BoxState) -> SlotLeases:
    fleet = types.SimpleNamespace(on_change=[], ordered=lambda: [box], get=lambda name: box)
    return SlotLeases(server, "r-test", fleet, "open", upkeep=lambda: None, freed=lambda box: None,  # type: ignore[arg-type]
                      stats=dict, on_back=lambda: None)


@pytest.mark.parametrize("cancelled", ["before the answer", "after the answer, before the call resumed"])
def test_a_call_cancelled_while_its_take_is_out_leaves_no_lease(redis_server, cancelled):
    box = BoxState(BoxConfig(name="cancel-me", url="http://127.0.0.1:9", max_inflight=2), 0, 0)
    assert box.limit == 2

    async def scenario(server: SharedServer):
        await server.call(None, "DEL", slots_key(box.name))
        server.came_up()
        leases = leases_on(server, box)
        holder = Holder()

        async def call() -> None:
            answer = leases.take(holder, box)
            await answer  # a round trip: the server is up and nothing is parked

        task = asyncio.get_running_loop().create_task(call())
        if cancelled == "before the answer":
            await asyncio.sleep(0)  # the take is asked; its round trip is out
        else:
            while not any(leases.held.values()):  # the answer came: the lease is held, the call not resumed
                await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.2)  # the answer, and the give it sets off
        return {name: set(members) for name, members in leases.held.items() if members}, \
            await server.call(None, "ZCARD", slots_key(box.name))

    held, on_server = run(scenario, redis_server)
    assert held == {} and on_server == 0, (held, on_server)
