"""GPU telemetry (router/telemetry): NVML absent on this machine, the NVML backend against a faked
`pynvml`, the cache's source rules, the local scan, and a real agent + link on loopback."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import orjson
import pynvml
import pytest
import uvloop

from router.core.pressure import NEUTRAL_PRESSURE, SOURCE_BOX, SOURCE_SCAN, STALE_AFTER_S, Reading
from router.telemetry import agent as agent_mod
from router.telemetry.agent import AgentLink, AgentServer, parse_reading
from router.telemetry.cache import TelemetryCache
from router.telemetry.local import LocalScanTask, is_loopback_url
from router.telemetry.nvml import CardReading, NvmlUnavailable, PynvmlBackend, Scanner, reduce_cards
from router.upstream.fetch import fetch
from router.upstream.pool import Origin

from conftest import wait_until
from support.boxes import GIB, FakeCards


def nvml_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def nvml_logs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "NVML unavailable" in r.getMessage()]


# -- NVML ------------------------------------------------------------------------------------------


@pytest.mark.skipif(nvml_present(), reason="this host has NVML")
def test_nvml_absent_raises_nvml_unavailable():
    scanner = Scanner()
    for _ in range(3):  # init is tried again each time, and fails the same way
        with pytest.raises(NvmlUnavailable, match="LibraryNotFound"):
            scanner.scan()


@pytest.fixture
def fake_pynvml(monkeypatch):
    """Two cards; card 1 does not report utilisation (NotSupported). Counts nvmlInit calls."""
    state = SimpleNamespace(inits=0, init_error=None)

    def init():
        state.inits += 1
        if state.init_error is not None:
            raise pynvml.NVMLError(state.init_error)

    def utilisation(handle):
        if handle == "h1":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=42, memory=7)

    monkeypatch.setattr(pynvml, "nvmlInit", init)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: f"h{i}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: b"GPU-" + h.encode())  # old: bytes
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", utilisation)
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(free=GIB, total=4 * GIB, used=3 * GIB)
    )
    return state


def test_pynvml_backend_reads_cards_and_inits_once(fake_pynvml):
    backend = PynvmlBackend()
    first = backend()
    assert first == [
        CardReading(0, "GPU-h0", 42.0, GIB, 4 * GIB),
        CardReading(1, "GPU-h1", None, GIB, 4 * GIB),  # rule 3: only the failing field is None
    ]
    assert backend() == first
    assert fake_pynvml.inits == 1


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "LibraryNotFound"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "DriverNotLoaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "NoPermission"),
    ],
)
def test_init_errors_are_nvml_unavailable_until_the_driver_appears(fake_pynvml, code, name):
    fake_pynvml.init_error = code
    backend = PynvmlBackend()
    with pytest.raises(NvmlUnavailable, match=name):
        backend()
    fake_pynvml.init_error = None  # the driver loads later: the next scan succeeds
    assert [card.index for card in backend()] == [0, 1]


def test_reduce_cards_takes_the_max_util_and_sums_memory():
    cards = [
        CardReading(0, "a", 30.0, 1, 10),
        CardReading(1, "b", 70.0, 2, 20),
        CardReading(2, "c", None, None, None),
        CardReading(3, "d", float("nan"), 4, 40),  # an invalid util does not win the max
    ]
    assert reduce_cards(cards, 5.0, SOURCE_SCAN) == Reading(70.0, 7, 70, 5.0, SOURCE_SCAN)
    assert reduce_cards([], 5.0, SOURCE_SCAN) == Reading(None, None, None, 5.0, SOURCE_SCAN)


# -- the cache ---------------------------------------------------------------------------------


def test_cache_scan_wins_while_fresh_then_box_reading_takes_over():
    cache = TelemetryCache()
    cache.put("a", Reading(95.0, None, None, 0.0, SOURCE_SCAN))
    cache.put("a", Reading(5.0, None, None, 1.0, SOURCE_BOX))
    assert cache.get("a", now=STALE_AFTER_S).source == SOURCE_SCAN
    assert cache.pressure("a", now=STALE_AFTER_S) == 3
    assert cache.get("a", now=STALE_AFTER_S + 0.5).source == SOURCE_BOX
    assert cache.age_s("a", SOURCE_BOX, now=STALE_AFTER_S + 0.5) == pytest.approx(STALE_AFTER_S - 0.5)
    assert cache.pressure("a", now=STALE_AFTER_S + 20) == NEUTRAL_PRESSURE
    assert cache.pressure("unknown", now=0.0) == NEUTRAL_PRESSURE
    assert cache.age_s("unknown", SOURCE_SCAN, now=0.0) is None


def test_cache_drops_a_late_older_reading():
    cache = TelemetryCache()
    cache.put("a", Reading(90.0, None, None, 5.0, SOURCE_SCAN))
    cache.put("a", Reading(10.0, None, None, 4.0, SOURCE_SCAN))
    assert cache.get("a", now=5.0).util_pct == 90.0


def test_cache_folds_only_the_picked_reading_and_asking_does_not_move_it():
    cache = TelemetryCache()
    for t in range(10):
        cache.put("a", Reading(10.0, None, None, float(t), SOURCE_SCAN))
        cache.put("a", Reading(100.0, None, None, float(t), SOURCE_BOX))  # ignored: the scan wins
    assert [cache.pressure("a", now=9.0) for _ in range(5)] == [0] * 5


# -- the local scan ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://127.8.0.1:8000", True),
        ("http://localhost:11434", True),
        ("http://[::1]:1234", True),
        ("http://10.0.0.5:8000", False),
        ("http://gpu-box.lan:8000", False),
    ],
)
def test_is_loopback_url(url, local):
    assert is_loopback_url(url) is local


@pytest.mark.skipif(nvml_present(), reason="this host has NVML")
def test_nvml_absent_gives_neutral_pressure_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="router.telemetry")
    cache = TelemetryCache()

    async def main():
        task = LocalScanTask(cache, lambda: ["local"])
        results = [await task.scan_once() for _ in range(5)]
        return results, cache.pressure("local", asyncio.get_running_loop().time())

    results, level = uvloop.run(main())
    assert results == [None] * 5
    assert level == NEUTRAL_PRESSURE
    assert [r.levelno for r in nvml_logs(caplog)] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_injected_readings_flow_through_the_local_scan_into_the_cache():
    cards = FakeCards(20.0, 97.0)
    cache = TelemetryCache()
    local_boxes = ["ollama-here", "hugpy-here"]

    async def main():
        loop = asyncio.get_running_loop()
        task = LocalScanTask(cache, lambda: local_boxes, interval_s=0.02, scanner=Scanner(cards))
        task.start()
        try:
            await wait_until(lambda: cards.calls >= 3, timeout_s=2.0)
        finally:
            await task.stop()
        now = loop.time()
        return [cache.get(box, now) for box in (*local_boxes, "remote")], [
            cache.pressure(box, now) for box in (*local_boxes, "remote")
        ]

    readings, levels = uvloop.run(main())
    for got in readings[:2]:
        assert (got.util_pct, got.mem_free_bytes, got.mem_total_bytes, got.source) == (
            97.0, 20 * GIB, 160 * GIB, SOURCE_SCAN,
        )
    assert readings[2] is None
    assert levels == [3, 3, NEUTRAL_PRESSURE]


# -- the agent and its link --------------------------------------------------------------------


async def get_json(port: int, target: str, timeout_s: float = 10.0) -> tuple[int, dict, float]:
    """(status, body, seconds taken) of one GET to the agent."""
    loop = asyncio.get_running_loop()
    origin = Origin("127.0.0.1", port)
    start = loop.time()
    try:
        status, _, body = await fetch(origin, "GET", target, timeout_s=timeout_s)
    finally:
        origin.close()
    return status, orjson.loads(body), loop.time() - start


def run_with_agent(cards, body, interval_s: float = 0.02):
    """Runs `body(server, port)` on a fresh uvloop with an agent scanning `cards`."""

    async def main():
        server = AgentServer(Scanner(cards), interval_s=interval_s)
        port = await server.start("127.0.0.1", 0)
        try:
            return await body(server, port)
        finally:
            await server.stop()

    return uvloop.run(main())


def test_agent_answers_at_once_without_since_then_on_change():
    cards = FakeCards(10.0)

    async def body(server, port):
        status, doc, _ = await get_json(port, "/v1/agent/reading")
        assert status == 200
        assert (doc["util_pct"], doc["mem_free_bytes"], doc["mem_total_bytes"], doc["error"]) == (
            10.0, 10 * GIB, 80 * GIB, None,
        )
        assert doc["cards"] == [
            {"index": 0, "uuid": "GPU-0", "util_pct": 10.0, "mem_free_bytes": 10 * GIB, "mem_total_bytes": 80 * GIB}
        ]
        # real time, here and below: the agent's own clock and long-poll timers, read over a socket.
        # Bounds are far below what a broken rule gives: an age from another clock, a poll that
        # waits out its 30 s.
        assert 0.0 <= doc["age_s"] < 5.0
        poll = asyncio.ensure_future(get_json(port, f"/v1/agent/reading?wait=30&since={doc['seq']}"))
        await asyncio.sleep(0.1)
        assert not poll.done()
        cards.set(60.0)
        status, changed, elapsed_s = await poll
        assert status == 200 and changed["util_pct"] == 60.0
        assert changed["seq"] == doc["seq"] + 1
        assert elapsed_s < 10
        # a `since` the agent is not at (it restarted) answers at once
        _, now_doc, elapsed_s = await get_json(port, f"/v1/agent/reading?wait=30&since={doc['seq'] + 100}")
        assert now_doc["seq"] == changed["seq"] and elapsed_s < 10

    run_with_agent(cards, body)


def test_agent_long_poll_times_out_with_the_same_seq_while_only_the_stamp_moves():
    cards = FakeCards(33.0)

    async def body(server, port):
        _, doc, _ = await get_json(port, "/v1/agent/reading")
        status, again, elapsed_s = await get_json(port, f"/v1/agent/reading?wait=0.3&since={doc['seq']}")
        assert status == 200
        assert 0.29 <= elapsed_s < 5  # real time (the agent's timer); the loop clock may wake a hair early
        assert cards.calls > 5  # scanned all along, yet nothing changed
        assert again["seq"] == doc["seq"] and again["util_pct"] == 33.0
        assert again["read_at"] > doc["read_at"]

    run_with_agent(cards, body)


@pytest.mark.parametrize(
    ("target", "status"),
    [
        ("/health", 200),
        ("/v1/agent/reading?wait=abc", 400),
        ("/v1/agent/reading?wait=nan", 400),
        ("/v1/agent/reading?since=1.5", 400),
        ("/v1/nothing", 404),
    ],
)
def test_agent_routes(target, status):
    async def body(server, port):
        got, _, _ = await get_json(port, target)
        assert got == status

    run_with_agent(FakeCards(1.0), body)


def test_agent_refuses_other_methods():
    async def body(server, port):
        origin = Origin("127.0.0.1", port)
        try:
            status, _, _ = await fetch(origin, "POST", "/v1/agent/reading", body=b"{}", timeout_s=5.0)
        finally:
            origin.close()
        assert status == 405

    run_with_agent(FakeCards(1.0), body)


def test_link_wait_renews_an_unchanged_reading_before_it_goes_stale():
    assert agent_mod.LINK_WAIT_S <= STALE_AFTER_S / 2


def test_a_reading_injected_at_the_agent_reaches_the_cache_before_the_long_poll_ends():
    """Real time: a link and an agent on one loop, over a socket. The change answers the link's
    pending long-poll at once; a link that missed it would wait out the poll (LINK_WAIT_S)."""
    cards = FakeCards(5.0)

    async def body(server, port):
        loop = asyncio.get_running_loop()
        cache = TelemetryCache()
        link = AgentLink(f"http://127.0.0.1:{port}", "remote-box", cache)
        link.start()
        try:
            await wait_until(lambda: cache.get("remote-box", loop.time()) is not None, timeout_s=2.0)
            cards.set(12.0, 91.0)
            elapsed_s = await wait_until(
                lambda: cache.get("remote-box", loop.time()).util_pct == 91.0, timeout_s=agent_mod.LINK_WAIT_S
            )
            got = cache.get("remote-box", loop.time())
            assert got.source == SOURCE_SCAN
            assert (got.mem_free_bytes, got.mem_total_bytes) == (20 * GIB, 160 * GIB)
            assert 0.0 <= loop.time() - got.read_at_s < 5.0  # stamped on this side's clock
            return elapsed_s
        finally:
            await link.stop()

    assert run_with_agent(cards, body) < agent_mod.LINK_WAIT_S / 2


def test_a_link_survives_its_agent_going_away():
    cards = FakeCards(50.0)

    async def main():
        loop = asyncio.get_running_loop()
        cache = TelemetryCache()
        server = AgentServer(Scanner(cards), interval_s=0.02)
        port = await server.start("127.0.0.1", 0)
        link = AgentLink(f"http://127.0.0.1:{port}", "remote-box", cache)
        link.start()
        try:
            await wait_until(lambda: cache.get("remote-box", loop.time()) is not None, timeout_s=2.0)
            await server.stop()
            await asyncio.sleep(0.3)  # the link fails and backs off meanwhile
            cards.set(88.0)
            server = AgentServer(Scanner(cards), interval_s=0.02)
            await server.start("127.0.0.1", port)
            await wait_until(lambda: cache.get("remote-box", loop.time()).util_pct == 88.0, timeout_s=4.0)
        finally:
            await link.stop()
            await server.stop()

    uvloop.run(main())


@pytest.mark.skipif(nvml_present(), reason="this host has NVML")
def test_agent_without_nvml_serves_nulls_and_the_link_gives_neutral(caplog):
    caplog.set_level(logging.INFO, logger="router.telemetry")

    async def body(server, port):
        loop = asyncio.get_running_loop()
        _, doc, _ = await get_json(port, "/v1/agent/reading")
        assert doc["util_pct"] is None and doc["cards"] == [] and "LibraryNotFound" in doc["error"]
        cache = TelemetryCache()
        link = AgentLink(f"http://127.0.0.1:{port}", "remote-box", cache)
        link.start()
        try:
            await wait_until(lambda: cache.age_s("remote-box", SOURCE_SCAN, loop.time()) is not None, 2.0)
        finally:
            await link.stop()
        return cache.pressure("remote-box", loop.time())

    assert run_with_agent(PynvmlBackend(), body) == NEUTRAL_PRESSURE
    assert len(nvml_logs(caplog)) == 1


@pytest.mark.parametrize(
    "doc",
    [
        {"util_pct": 5.0, "mem_free_bytes": 1, "mem_total_bytes": 2},  # no age_s
        {"util_pct": 5.0, "mem_free_bytes": 1, "mem_total_bytes": 2, "age_s": -1.0},
        {"util_pct": "5", "mem_free_bytes": 1, "mem_total_bytes": 2, "age_s": 0.0},
        {"util_pct": 5.0, "mem_free_bytes": 1.5, "mem_total_bytes": 2, "age_s": 0.0},
        {"util_pct": 5.0, "mem_free_bytes": 1, "mem_total_bytes": True, "age_s": 0.0},
    ],
)
def test_parse_reading_rejects_what_is_not_an_agent_reading(doc):
    with pytest.raises((KeyError, TypeError, ValueError)):
        parse_reading(doc, now_s=100.0)


def test_parse_reading_stamps_on_the_receivers_clock():
    doc = {"util_pct": 40, "mem_free_bytes": None, "mem_total_bytes": 8, "age_s": 0.25, "read_at": 1.0}
    assert parse_reading(doc, now_s=100.0) == Reading(40, None, 8, 99.75, SOURCE_SCAN)
