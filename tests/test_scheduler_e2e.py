"""The scheduler in the running router: a burst spreads by reservations before any telemetry,
and GPU pressure from a `router agent` steers calls away from a hot box."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import urllib.request

from router.sim.hugpy import Behavior, SimBox
from router.telemetry.agent import AgentServer
from router.telemetry.nvml import CardReading, Scanner

from conftest import wait_for

BURST = 64


def post_chat(url: str, model: str, headers: dict | None = None) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}]}).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
        return response.headers["X-Hugpy-Box"]


def test_a_burst_spreads_evenly_over_equal_boxes_without_telemetry(start_fleet_in_process):
    boxes = [SimBox(f"b{i}", catalog=["tiny"]) for i in range(4)]
    for box in boxes:
        box.script("tiny", *[Behavior.hang(1.5)] * BURST)  # every call stays in flight
    router = start_fleet_in_process(*boxes)
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        landed = list(pool.map(lambda _: post_chat(router.url, "tiny"), range(BURST)))
    counts = {box.name: landed.count(box.name) for box in boxes}
    assert all(abs(n - BURST // 4) <= 2 for n in counts.values()), counts


def test_gpu_pressure_from_an_agent_steers_calls_to_the_cooler_box(start_fleet_in_process):
    # Both serve tiny: inside the serving tier, pressure decides (the file order favours hot).
    hot = SimBox("hot", catalog=["tiny"], residents=["tiny"])
    cool = SimBox("cool", catalog=["tiny"], residents=["tiny"])
    cool.residents["tiny"]["last_used"] -= 1000  # hot is the most recently used seat
    router = start_fleet_in_process(hot, cool)
    assert post_chat(router.url, "tiny") == "hot"
    card = [CardReading(index=0, uuid="GPU-test", util_pct=97.0, mem_free_bytes=1 << 30,
                        mem_total_bytes=80 << 30)]
    agent = AgentServer(Scanner(backend=lambda: card), interval_s=0.2)
    loop = router.fleet._loop  # the agent runs beside the sim boxes
    port = asyncio.run_coroutine_threadsafe(agent.start("127.0.0.1", 0), loop).result(5)
    try:
        # Attach the agent to hot in the running router's boxes file.
        doc = json.loads(router.boxes_path.read_text())
        doc["boxes"][0]["agent"] = f"http://127.0.0.1:{port}"
        router.boxes_path.write_text(json.dumps(doc))
        assert wait_for(lambda: post_chat(router.url, "tiny") == "cool", 8, 0.3)
        assert all(post_chat(router.url, "tiny") == "cool" for _ in range(5))
    finally:
        asyncio.run_coroutine_threadsafe(agent.stop(), loop).result(5)
