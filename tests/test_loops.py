"""Routing loops through a proxy (issue 20 item 5, second half): a call that comes back to the
router that sent it gets 508 at once (router/serve/hops.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.serve import hops
from router.sim import SimBox

from support.boxes import RawBox
from support.raw_calls import request, rows
from conftest import wait_for

pytestmark = pytest.mark.timeout(60)
CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()


class Forwarder(RawBox):
    """An `openai`-kind box that is a plain TCP proxy to `target_port` (set once the router is up):
    it passes every byte on, `Via` included, as a proxy in front of another router would."""

    def __init__(self, name: str) -> None:
        super().__init__(name, answer=None)
        self.target_port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.target_port:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def test_a_call_that_comes_back_through_a_proxy_gets_508_at_once(start_fleet_in_process):
    real = SimBox("real", catalog=["tiny"], residents=["tiny"])
    loop = Forwarder("loop")  # its models are the router's own /v1/models: `tiny` from `real`
    router = start_fleet_in_process(real, loop)
    loop.target_port = int(router.url.rsplit(":", 1)[1])
    wait_for(lambda: request(router, "GET", "/v1/router/state")[2].count(b'"online":true') == 2, 10)
    status, headers, body = request(router, "POST", "/v1/chat/completions", CHAT, {"X-Router-Box": "loop"})
    # The call went to `loop`, came back as a new call naming this router in Via, and ended there:
    # without the check it would have been served by `real` (or looped on, had `loop` ranked first).
    assert status == 508, body
    assert json.loads(body)["error"]["code"] == "loop_detected"
    assert headers["x-hugpy-box"] == "loop"
    assert not [c for c in real.calls if c.path == "/v1/chat/completions"]
    logged = wait_for(lambda: (r := [x for x in rows(router) if x["route"] == "/v1/chat/completions"])
                      and len(r) == 2 and r, 3)
    assert sorted((r["http_status"], r["error"]) for r in logged) == [(508, "http_508"), (508, "loop_detected")]
    # A call that has not passed this router carries its hop to the box, after the client's own.
    assert request(router, "POST", "/v1/chat/completions", CHAT, {"Via": "1.1 edge-proxy"})[0] == 200
    sent = [c for c in real.calls if c.path == "/v1/chat/completions"][-1]
    assert sent.headers["via"] == f"1.1 edge-proxy, 1.1 {hops.PSEUDONYM}"
    assert request(router, "POST", "/v1/chat/completions", CHAT,
                   {"Via": f"1.0 a, 1.1 {hops.PSEUDONYM}"})[0] == 508


class ViaDropper(RawBox):
    """An `openai`-kind box that is a proxy to `target_port` dropping every `Via` line of each
    request head (as a proxy hiding the path does) and passing the rest on as it came."""

    def __init__(self, name: str) -> None:
        super().__init__(name, answer=None)
        self.target_port = 0
        self.heads: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.target_port:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def requests() -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"via:")]
                    self.heads.append(b"\r\n".join(lines))
                    length = next((int(line.partition(b":")[2]) for line in lines
                                   if line.lower().startswith(b"content-length:")), 0)
                    up_writer.write(b"\r\n".join(lines) + await reader.readexactly(length))
                    await up_writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                pass
            finally:
                up_writer.close()

        async def answers() -> None:
            try:
                while data := await up_reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        await asyncio.gather(requests(), answers())


def test_a_call_that_comes_back_through_a_via_dropping_proxy_gets_508_at_once(start_fleet_in_process):
    real = SimBox("real", catalog=["tiny"], residents=["tiny"])
    loop = ViaDropper("loop")
    router = start_fleet_in_process(real, loop)
    loop.target_port = int(router.url.rsplit(":", 1)[1])
    wait_for(lambda: request(router, "GET", "/v1/router/state")[2].count(b'"online":true') == 2, 10)
    status, _, body = request(router, "POST", "/v1/chat/completions", CHAT, {"X-Router-Box": "loop"})
    # Came back without Via, but with the router's own mark: ended there, never served by `real`.
    assert status == 508, body
    assert json.loads(body)["error"]["code"] == "loop_detected"
    assert not [c for c in real.calls if c.path == "/v1/chat/completions"]
    sent = [h for h in loop.heads if h.startswith(b"POST /v1/chat/completions ")]
    assert len(sent) == 1 and b"via:" not in sent[0].lower()
    assert f"x-router-hops: {hops.PSEUDONYM}".encode() in sent[0].lower()
    logged = wait_for(lambda: (r := [x for x in rows(router) if x["route"] == "/v1/chat/completions"])
                      and len(r) == 2 and r, 3)
    assert sorted((r["http_status"], r["error"]) for r in logged) == [(508, "http_508"), (508, "loop_detected")]
    # Another router's mark is kept and this router's appended after it.
    assert request(router, "POST", "/v1/chat/completions", CHAT, {"X-Router-Hops": "hugpy-router-0"})[0] == 200
    sent = [c for c in real.calls if c.path == "/v1/chat/completions"][-1]
    assert sent.headers["x-router-hops"] == f"hugpy-router-0, {hops.PSEUDONYM}"
    assert sent.headers["via"] == f"1.1 {hops.PSEUDONYM}"
