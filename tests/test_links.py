"""Links never die (issue 11, item 13): the back-off rule, and a box link and an agent link
through outages thousands of failures long, with the base interval made tiny so that the
outage takes a second instead of hours."""

from __future__ import annotations

import asyncio
import logging

import pytest
import uvloop
from hypothesis import given
from hypothesis import strategies as st

from router.boxes import link as link_mod
from router.boxes.config import BoxConfig
from router.boxes.hugpy import HugpyLink
from router.boxes.state import BoxState
from router.core.backoff import BACKOFF_CAP_S, LOG_EVERY_S, Streak, backoff_s
from router.sim import SimBox, SimFleet
from router.telemetry import agent as agent_mod
from router.telemetry.agent import AgentLink, AgentServer
from router.telemetry.cache import TelemetryCache
from router.telemetry.nvml import Scanner

from conftest import wait_until
from support.boxes import FakeCards

pytestmark = pytest.mark.timeout(30)

# Past the 1,024 failures at which `0.25 * 2**failures` overflowed and killed the link task.
MANY_FAILURES = 1_500
TINY = {"base_s": 1e-5, "cap_s": 1e-4}  # a failure streak of thousands in well under a second


# -- the rule ------------------------------------------------------------------------------------


@given(st.integers(min_value=1, max_value=10**9), st.floats(min_value=0.0, max_value=0.999999))
def test_backoff_is_capped_and_never_overflows(failures, jitter):
    wait_s = backoff_s(failures, jitter)
    assert 0.0 < wait_s < BACKOFF_CAP_S
    if failures > 10:  # capped: at least half the cap, so a link never spins
        assert wait_s >= BACKOFF_CAP_S / 2


def test_backoff_doubles_from_the_base_then_resets_on_success():
    streak = Streak(base_s=1.0, cap_s=8.0)
    waits = [streak.failed(float(n), 0.999999)[0] for n in range(6)]
    assert [round(w) for w in waits] == [1, 2, 4, 8, 8, 8]
    assert streak.succeeded() == 6 and streak.failures == 0
    assert round(streak.failed(10.0, 0.999999)[0]) == 1  # a new streak starts from the base


def test_a_streak_is_logged_when_it_starts_then_rarely():
    streak = Streak()
    said = [streak.failed(n * 0.5, 0.5)[1] for n in range(int(3 * LOG_EVERY_S / 0.5))]
    assert said[0] and sum(said) == 3
    streak.succeeded()
    assert streak.failed(0.0, 0.5)[1]  # the next streak is news again


# -- a box link ----------------------------------------------------------------------------------


def test_a_box_link_rides_out_thousands_of_failures_and_recovers_at_once(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="router.boxes")
    monkeypatch.setattr(link_mod, "HEALTH_INTERVAL_S", 0.02)
    monkeypatch.setattr(link_mod, "HEALTH_TTL_S", 0.1)
    a = SimBox("a", catalog=["tiny"])
    fleet = SimFleet([a])
    fleet.start()

    async def main():
        loop = asyncio.get_running_loop()
        box = BoxState(BoxConfig("a", a.url), 0, 0)
        link = HugpyLink(box)
        link.streak = Streak(**TINY)
        link.start()
        try:
            await link.first_read()
            assert box.online and box.catalog == {"tiny"}
            await loop.run_in_executor(None, fleet.stop_box, a)
            # The long-poll fails at once and keeps failing: thousands of refused connects.
            await wait_until(lambda: link.streak.failures > MANY_FAILURES, timeout_s=15)
            assert not box.online  # the health probes saw it go
            assert not any(task.done() for task in link.tasks)  # and no link task died
            a.catalog.add("big")  # the box comes back holding something new
            await loop.run_in_executor(None, fleet.start_box, a)
            back_s = await wait_until(lambda: box.online and "big" in box.catalog, timeout_s=5)
            assert link.streak.failures == 0  # the streak ended with the first good read
            return back_s
        finally:
            await link.stop()

    try:
        back_s = uvloop.run(main())
    finally:
        fleet.stop()
    # real time: the link's loops run against a real box; half the 2 s inventory poll interval
    assert back_s < link_mod.POLL_INTERVAL_S / 2
    failing = [r for r in caplog.records if "inventory link failing" in r.getMessage()]
    assert len(failing) == 1 and failing[0].levelno == logging.WARNING  # one line, not thousands
    assert any("inventory link recovered" in r.getMessage() for r in caplog.records)


class BuggyLink(HugpyLink):
    """Its first reads raise what no link expects (a bug in reading an answer)."""

    bugs = 3

    async def follow_inventory(self) -> None:
        if self.bugs:
            self.bugs -= 1
            raise RuntimeError("a bug")
        await super().follow_inventory()


def test_a_box_link_survives_an_exception_no_one_expected():
    a = SimBox("a", catalog=["tiny"])
    fleet = SimFleet([a])
    fleet.start()

    async def main():
        box = BoxState(BoxConfig("a", a.url), 0, 0)
        link = BuggyLink(box)
        link.streak = Streak(**TINY)
        link.start()
        try:
            await wait_until(lambda: box.catalog == {"tiny"}, timeout_s=3)
            assert link.bugs == 0 and link.streak.failures == 0
        finally:
            await link.stop()

    try:
        uvloop.run(main())
    finally:
        fleet.stop()


# -- an agent link -------------------------------------------------------------------------------


def test_an_agent_link_rides_out_thousands_of_failures_and_recovers_at_once():
    cards = FakeCards(50.0)

    async def main():
        loop = asyncio.get_running_loop()
        cache = TelemetryCache()
        server = AgentServer(Scanner(cards), interval_s=0.02)
        port = await server.start("127.0.0.1", 0)
        link = AgentLink(f"http://127.0.0.1:{port}", "remote-box", cache)
        link.streak = Streak(**TINY)
        link.start()
        try:
            await wait_until(lambda: cache.get("remote-box", loop.time()) is not None, timeout_s=2.0)
            await server.stop()
            await wait_until(lambda: link.streak.failures > MANY_FAILURES, timeout_s=15)
            assert not link._task.done()
            cards.set(88.0)
            server = AgentServer(Scanner(cards), interval_s=0.02)
            await server.start("127.0.0.1", port)
            back_s = await wait_until(lambda: cache.get("remote-box", loop.time()).util_pct == 88.0, timeout_s=5.0)
            assert link.streak.failures == 0
            return back_s
        finally:
            await link.stop()
            await server.stop()

    # real time: the link against a real agent; well under the 5 s long-poll it would wait out
    # if it asked with its old `since`
    assert uvloop.run(main()) < agent_mod.LINK_WAIT_S / 2


def test_a_box_back_from_an_outage_is_read_at_the_next_probe_not_after_the_back_off(monkeypatch):
    """After a few failures the inventory loop may be asleep for seconds when the box comes back;
    the first good health probe wakes it."""
    monkeypatch.setattr(link_mod, "HEALTH_INTERVAL_S", 0.05)
    a = SimBox("a", catalog=["tiny"])
    fleet = SimFleet([a])
    fleet.start()

    async def main():
        loop = asyncio.get_running_loop()
        box = BoxState(BoxConfig("a", a.url), 0, 0)
        link = HugpyLink(box)
        link.streak = Streak(base_s=2.0, cap_s=10.0)  # waits of 1-2 s, 2-4 s, then 4-8 s
        link.start()
        try:
            await link.first_read()
            await loop.run_in_executor(None, fleet.stop_box, a)
            await wait_until(lambda: link.streak.failures >= 3, timeout_s=12)  # asleep for 4-8 s now
            a.catalog.add("big")
            await loop.run_in_executor(None, fleet.start_box, a)
            return await wait_until(lambda: "big" in box.catalog, timeout_s=10)
        finally:
            await link.stop()

    try:
        # real time: the link's two loops against a real box; half the shortest sleep (4 s) the
        # inventory loop would finish without the probe's wake-up
        assert uvloop.run(main()) < 2.0
    finally:
        fleet.stop()
