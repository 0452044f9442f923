"""Several `router serve` processes over the same simulated boxes, and the shared server they
meet on. A test file takes the fixtures by importing them by name:
`from support.several_routers import fleet, routers  # noqa: F401 (fixtures)`."""

from __future__ import annotations

import json
import signal
import time

import pytest
import uvloop

from router.fleetwide.wire import SharedServer
from router.sim import SimFleet

from conftest import RouterProcess, write_boxes
from support.calls import get_json, request


@pytest.fixture
def fleet():
    fleets: list[SimFleet] = []

    def start(*boxes):
        sim = SimFleet(list(boxes))
        sim.start()
        fleets.append(sim)
        return sim

    yield start
    for sim in fleets:
        sim.stop()


@pytest.fixture
def routers(tmp_path):
    """routers(boxes, n, extra=(), limits={}, home=None) -> [RouterProcess]: n routers over the same
    boxes, each with its own folder (boxes file, and home unless `home` names one for all)."""
    started: list[RouterProcess] = []

    def start(boxes, n, extra=(), limits=None, first=0, home=None):
        made = []
        for i in range(first, first + n):
            folder = tmp_path / f"router{i}"
            folder.mkdir()
            path = write_boxes(folder / "boxes.json", list(boxes), **(limits or {}))
            env = {"HUGPY_ROUTER_HOME": str(home)} if home is not None else None
            router = RouterProcess(path, "--instance", f"r{i}", *extra, env=env)
            started.append(router)
            made.append(router)
        return made

    yield start
    for router in started:
        router.stop()


def shared_state(router) -> dict:
    return get_json(router, "/v1/router/state")["shared"]


def knows(router, key_id: str, limits: dict) -> bool:
    """The router has read the key's limits from the store (a SIGHUP reloads the keys: the usage
    report shows the limits the router counts against)."""
    router.proc.send_signal(signal.SIGHUP)
    time.sleep(0.2)
    doc = json.loads(request(router, "GET", "/v1/keys/usage", timeout=10)[2])
    return any(k["id"] == key_id and all(k["limits"][f] == v for f, v in limits.items()) for k in doc["keys"])


def run(coroutine_function, redis_server):
    """`coroutine_function(server)` on a fresh loop, with a SharedServer on `redis_server`."""
    async def main():
        server = SharedServer(redis_server.url)
        try:
            return await coroutine_function(server)
        finally:
            await server.close()

    return uvloop.run(main())
