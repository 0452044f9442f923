"""The CallClock (router/serve/clock.py, router/serve/proxy.py rule 5): one sweep keeps every call's deadlines, so no
call arms a timer of its own. Driven in-process with a stub ASGI client."""

from __future__ import annotations

import asyncio
import types

import orjson
import uvloop

from router.facades.openai import FACADE
from router.core.lifecycle import Event, Lifecycle
from router.serve import clock as call_clock, proxy
from router.serve.clock import CallClock
from router.serve.edge import AsgiEdge
from router.serve.proxy import ProxyCall

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
         "client": ("127.0.0.1", 50000), "headers": [(b"content-type", b"application/json")]}


class StubClient:
    """An ASGI client that sends its headers and then nothing: receive() never returns."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.receives = 0

    async def receive(self) -> dict:
        self.receives += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def stub_app(clock: CallClock, observed: list) -> types.SimpleNamespace:
    return types.SimpleNamespace(clock=clock, max_body_bytes=1 << 20, observe=observed.append,
                                 reservations=None, scheduler=None, admission=None,
                                 tenancy=types.SimpleNamespace(ended=lambda record, charge: None))


def test_a_body_that_never_comes_gets_a_408_once_its_deadline_passes(monkeypatch):
    monkeypatch.setattr(proxy, "BODY_TIMEOUT_S", 0.2)

    async def main():
        clock = CallClock()
        clock.start()
        client, observed = StubClient(), []
        route, _ = FACADE.route("POST", "/v1/chat/completions")
        call = ProxyCall(stub_app(clock, observed), AsgiEdge(SCOPE, client.receive, client.send), FACADE, route)
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(call.run(), 5)
        took = asyncio.get_running_loop().time() - started
        await clock.stop()
        return client, observed, call, took, clock

    client, observed, call, took, clock = uvloop.run(main())
    # the deadline, plus at most one tick
    assert 0.2 <= took <= 0.2 + call_clock.CLOCK_TICK_S + 0.1
    assert client.sent[0]["status"] == 408
    error = orjson.loads(client.sent[1]["body"])["error"]
    assert error["code"] == "body_timeout"
    assert observed == [call.record] and (call.record.state, call.record.failure) == ("failed", "body_timeout")
    assert client.receives == 1  # the watcher never read the client while the body was due
    assert not clock.calls  # the call left the clock


def test_the_watcher_starts_only_once_the_body_is_in():
    watched = []
    call = types.SimpleNamespace(life=Lifecycle(), started_s=0.0, watch=None, attempt=None,
                                 reply=types.SimpleNamespace(keepalive_s=0.0),
                                 edge=types.SimpleNamespace(watch_disconnect=watched.append),
                                 client_left=object())
    ProxyCall.tick(call, now=10.0)  # long past WATCH_AFTER_S, but the body is still due
    assert watched == []
    for event in (Event.BODY_IN, Event.DECIDED, Event.SENT):
        call.life.fire(event)
    ProxyCall.tick(call, now=proxy.WATCH_AFTER_S / 2)
    assert watched == []  # too early: most calls end before their watcher would start
    ProxyCall.tick(call, now=proxy.WATCH_AFTER_S)
    assert watched == [call.client_left]
