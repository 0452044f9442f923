"""The CallClock (router/serve/clock.py, router/serve/proxy.py rule 5): one sweep keeps every call's deadlines, so no
call arms a timer of its own. Driven in-process with a stub ASGI client."""

from __future__ import annotations

import asyncio
import types

import orjson
import pytest
import uvloop

from router.facades.openai import FACADE
from router.core.lifecycle import Event
from router.fleetwide.seam import ONE_ROUTER_SLOTS
from router.serve import body, proxy
from router.serve.clock import CallClock
from router.serve.edge import AsgiEdge
from router.serve.proxy import ProxyCall

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
         "client": ("127.0.0.1", 50000), "headers": [(b"content-type", b"application/json")]}


class StubClient:
    """An ASGI client that sends its headers, then the body messages `pieces`, and then nothing:
    receive() never returns."""

    def __init__(self, pieces: tuple[dict, ...] = ()) -> None:
        self.sent: list[dict] = []
        self.receives = 0
        self.pieces = list(pieces)

    async def receive(self) -> dict:
        self.receives += 1
        if self.pieces:
            return self.pieces.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def stub_app(clock: CallClock, observed: list) -> types.SimpleNamespace:
    return types.SimpleNamespace(clock=clock, config=types.SimpleNamespace(max_body_bytes=1 << 20),
                                 observe=observed.append,
                                 reservations=None, scheduler=None, admission=None, slots=ONE_ROUTER_SLOTS,
                                 tenancy=types.SimpleNamespace(ended=lambda record, charge: None))


@pytest.mark.parametrize("declared, pieces", [
    (None, ()),
    # Part of a declared body, then a stall: read until its length is in (edge.py invariant 8),
    # so still due.
    (100, ({"type": "http.request", "body": b"{" * 10, "more_body": True},)),
], ids=["nothing", "part-of-a-declared-body"])
def test_a_body_that_never_comes_gets_a_408_once_its_deadline_passes(declared, pieces):
    """The clock's sweep is the test's: time is injected, so the deadline is checked to the
    instant (a real sweep fires it up to one CLOCK_TICK_S late)."""
    scope = SCOPE if declared is None else {
        **SCOPE, "headers": [*SCOPE["headers"], (b"content-length", b"%d" % declared)]}

    async def main():
        clock = CallClock()  # never started: the test ticks it
        client, observed = StubClient(pieces), []
        route, _ = FACADE.route("POST", "/v1/chat/completions")
        call = ProxyCall(stub_app(clock, observed), AsgiEdge(scope, client.receive, client.send), FACADE, route)
        running = asyncio.get_running_loop().create_task(call.run())
        while client.receives <= len(pieces):  # the body's read has begun, and waits
            await asyncio.sleep(0)
        due_s = call.started_s + body.BODY_TIMEOUT_S
        clock.tick_all(due_s - 0.001)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not running.done() and not client.sent  # not yet
        clock.tick_all(due_s + 0.001)
        await asyncio.wait_for(running, 5)
        return client, observed, call, clock

    client, observed, call, clock = uvloop.run(main())
    assert client.sent[0]["status"] == 408
    error = orjson.loads(client.sent[1]["body"])["error"]
    assert error["code"] == "body_timeout"
    assert observed == [call.record] and (call.record.state, call.record.failure) == ("failed", "body_timeout")
    assert client.receives == 1 + len(pieces)  # the watcher never read the client while the body was due
    assert not clock.calls  # the call and its body's read left the clock


def test_the_watcher_starts_only_once_the_body_is_in():
    watched = []

    class WatchedEdge(AsgiEdge):
        def watch_disconnect(self, on_left):
            watched.append(on_left)

    route, _ = FACADE.route("POST", "/v1/chat/completions")
    edge = WatchedEdge(SCOPE, StubClient().receive, StubClient().send)
    call = ProxyCall(stub_app(CallClock(), []), edge, FACADE, route)
    call.tick(now=10.0)  # long past WATCH_AFTER_S, but the body is still due
    assert watched == []
    for event in (Event.BODY_IN, Event.DECIDED, Event.SENT):
        call.life.fire(event)
    call.tick(now=proxy.WATCH_AFTER_S / 2)
    assert watched == []  # too early: most calls end before their watcher would start
    call.tick(now=proxy.WATCH_AFTER_S)
    assert watched == [call.client_left]
