"""Admin event streams are bounded, and their cost does not grow with their number (issue 20 item
12, router/serve/event_feed.py)."""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import pytest

from router.serve import dashboard
from router.serve.event_feed import ENDED, STREAM_BACKLOG, EventFeed
from router.sim import SimBox

pytestmark = pytest.mark.timeout(60)


def open_stream(router, path: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path)
    return conn, conn.getresponse()


def events_of(resp: http.client.HTTPResponse, names: set[bytes], timeout_s: float = 5.0) -> dict[bytes, dict]:
    """The first event of each name in `names` on an open stream."""
    seen: dict[bytes, dict] = {}
    deadline = time.monotonic() + timeout_s
    while names - set(seen) and time.monotonic() < deadline:
        name = resp.readline().strip().removeprefix(b"event: ")
        data = resp.readline().strip().removeprefix(b"data: ")
        resp.readline()
        seen.setdefault(name, json.loads(data))
    return seen


def test_streams_past_the_cap_get_429_and_a_closed_one_frees_its_place(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"]), extra_args=("--max-event-streams", "2"))
    first = open_stream(router, "/v1/router/events")
    second = open_stream(router, "/v1/router/schedule")
    assert first[1].status == 200 and second[1].status == 200
    for path in ("/v1/router/events", "/v1/router/schedule"):
        conn, resp = open_stream(router, path)
        assert resp.status == 429 and json.loads(resp.read())["error"]["code"] == "too_many_streams"
        conn.close()
    assert set(events_of(first[1], {b"state", b"series"})) == {b"state", b"series"}
    first[0].close()
    conn, resp = None, None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the router sees the close within a tick
        conn, resp = open_stream(router, "/v1/router/events")
        if resp.status == 200:
            break
        conn.close()
        time.sleep(0.1)
    assert resp.status == 200 and b"state" in events_of(resp, {b"state"})
    conn.close()
    second[0].close()


def test_the_flag_is_range_checked(tmp_path):
    from router.cli.main import build_parser

    for value in ("0", "-1", "x", "100000"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", "--port", "auto", "--max-event-streams", value])
        assert info.value.code == 2


def test_one_state_document_and_one_route_log_read_per_tick_whatever_the_streams(start_fleet_in_process, monkeypatch):
    built, read = [], []
    real_state, real_tail = dashboard.state_doc, dashboard.route_log_tail
    monkeypatch.setattr(dashboard, "state_doc", lambda process: built.append(1) or real_state(process))
    monkeypatch.setattr(dashboard, "route_log_tail", lambda *a: read.append(1) or real_tail(*a))
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]))
    streams = [open_stream(router, "/v1/router/events") for _ in range(12)]
    started = time.monotonic()
    docs = [events_of(resp, {b"state", b"series"}) for _, resp in streams]
    assert all(set(doc) == {b"state", b"series"} for doc in docs)  # every stream got its welcome
    assert all(doc[b"state"] == docs[0][b"state"] for doc in docs)  # the same document
    time.sleep(2.2)
    # real time: the ticks are the router's own loop sleeps; counted against the time that
    # passed, so a loaded host only loosens the bound (12 streams would read 12 per tick)
    ticks = (time.monotonic() - started) / dashboard.STREAM_TICK_S + 2
    assert len(built) <= ticks and len(read) <= ticks, (len(built), len(read), ticks)  # not 12 per tick
    for conn, _ in streams:
        conn.close()


def test_a_stream_that_falls_behind_is_ended_and_the_others_go_on():
    class ProcessState:
        class metrics:
            class series:
                points: list = []

    async def main():
        feed = EventFeed(ProcessState(), max_streams=4)
        feed.task = asyncio.get_running_loop().create_future()  # no producer: frames by hand
        stalled, reading = feed.join(True), feed.join(True)
        for n in range(STREAM_BACKLOG + 5):
            for listener in list(feed.listeners):
                feed._send(listener, b"frame %d" % n)
            reading.frames.get_nowait()
        assert stalled not in feed.listeners and reading in feed.listeners
        frames = [stalled.frames.get_nowait() for _ in range(stalled.frames.qsize())]
        assert frames[-1] == ENDED and len(frames) <= STREAM_BACKLOG + 1
        assert feed.join(True) is not None  # its place is free
        feed.task.cancel()

    asyncio.run(main())
