"""`router agent`: a host's GPU reading served to routers on other hosts, and the link that
reads it.

Rules of the agent:
1. Wire: HTTP/1.1 on asyncio with httptools' request parser. Requests on one connection are
   answered in order, keep-alive unless the client asks to close; request bodies are ignored.
   Only GET (else 405); unknown paths 404; a broken request 400 and close.
2. `GET /health` → 200 `{"ok": true}`.
3. `GET /v1/agent/reading?wait=W&since=K` → 200 with the compact reading
   `{"util_pct", "mem_free_bytes", "mem_total_bytes", "read_at", "age_s", "seq", "cards",
   "error"}`. It answers at once when `since` is absent or differs from the current `seq` (an
   agent restart shows as a `seq` below K); otherwise when the reading changes or after W
   seconds (clamped to [0, `MAX_WAIT_S`]), whichever comes first. A W or K that is not a
   number → 400.
4. The host is scanned every `interval_s` in a thread (router/telemetry/nvml.py); the first
   scan completes before the agent listens. `seq` increments when the reading's values
   (utilisation, memory, cards, error) change, not when only its stamp does. Without NVML the
   reading carries nulls and `error`, is logged once, and the scan is retried every
   `UNAVAILABLE_RETRY_S`.
5. `read_at` is the agent's wall clock, for people. `age_s` is the reading's age when the
   answer is written, from the agent's monotonic clock: the link stamps the reading
   `now - age_s` on its own clock, so the two hosts' clocks never need to agree.

Rules of the link (`AgentLink`):
6. It long-polls with `wait=LINK_WAIT_S`, well below `STALE_AFTER_S`, so that the reading of
   an idle card, which never changes, is still renewed long before it goes stale.
7. Each good answer is put into the cache as source `scan` for its box.
8. A link never dies: any exception (an agent that is gone, a broken answer, a bug) is a
   failure, retried after `router.core.backoff` (capped, reset by the next good reading) and
   logged when the streak starts and then rarely; the next poll then asks without `since`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from urllib.parse import parse_qsl, urlsplit

import httptools
import orjson

from router.core.backoff import Streak
from router.core.pressure import SOURCE_SCAN, Reading
from router.telemetry.cache import TelemetryCache
from router.telemetry.task import BackgroundTask, scan_on_schedule
from router.telemetry.nvml import CardReading, NvmlUnavailable, Scanner, reduce_cards
from router.upstream.fetch import fetch
from router.upstream.pool import Origin, UpstreamError

log = logging.getLogger("router.telemetry")

READING_PATH = "/v1/agent/reading"
HEALTH_PATH = "/health"
# The hugpy state long-poll's bound (contracts/hugpy-wrapper.md §2): long enough to save polls,
# short enough for proxies' idle timeouts.
MAX_WAIT_S = 30.0
# A client pipelining more than this is not a router link; it is cut off rather than queued.
MAX_PIPELINED = 16

# Rule 6: at most half of STALE_AFTER_S, so an idle card's unchanged reading is renewed at
# least twice before it would go stale.
LINK_WAIT_S = 5
LINK_TIMEOUT_S = LINK_WAIT_S + 5.0

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}
_HEALTH_BODY = b'{"ok":true}'
_BAD_REQUEST = (400, b'{"error":"bad request"}')


def _head(status: int, length: int, keep_alive: bool) -> bytes:
    return b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
        status,
        _REASONS[status],
        length,
        b"" if keep_alive else b"Connection: close\r\n",
    )


def _card_doc(card: CardReading) -> dict:
    return {
        "index": card.index,
        "uuid": card.uuid,
        "util_pct": card.util_pct,
        "mem_free_bytes": card.mem_free_bytes,
        "mem_total_bytes": card.mem_total_bytes,
    }


class AgentFeed(BackgroundTask):
    """The host's latest reading, its `seq`, and the wake-up of long-polls (rules 3–4)."""
    task_name = "agent:scan"

    def __init__(self, scanner: Scanner, interval_s: float) -> None:
        self._scanner = scanner
        self._interval_s = interval_s
        self.seq = 0
        self._values: dict = {}  # the reading's values, without its stamps
        self._read_mono_s = 0.0
        self._read_wall_s = 0.0
        self._changed = asyncio.Event()  # replaced at each change; set wakes that change's waiters
        self._nvml_logged = False

    async def scan_once(self) -> bool:
        """Scans and publishes (rule 4). Returns False when NVML is unavailable."""
        loop = asyncio.get_running_loop()
        error = None
        try:
            cards = await loop.run_in_executor(None, self._scanner.scan)
        except NvmlUnavailable as exc:
            cards, error = [], str(exc)
            if not self._nvml_logged:
                self._nvml_logged = True
                log.info("NVML unavailable (%s): the agent serves null readings", error)
        reading = reduce_cards(cards, loop.time(), SOURCE_SCAN)
        values = {
            "util_pct": reading.util_pct,
            "mem_free_bytes": reading.mem_free_bytes,
            "mem_total_bytes": reading.mem_total_bytes,
            "cards": [_card_doc(card) for card in cards],
            "error": error,
        }
        self._read_mono_s = reading.read_at_s
        self._read_wall_s = time.time()
        if values != self._values:
            self._values = values
            self.seq += 1
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()
        return error is None

    async def _run(self) -> None:
        await scan_on_schedule(self.scan_once, self._interval_s, "agent GPU scan")

    async def wait_change(self, since: int | None, wait_s: float) -> None:
        """Returns at once unless `since` is the current seq; then at the next change or after
        `wait_s`, whichever comes first (rule 3)."""
        if since != self.seq or wait_s <= 0.0:
            return
        try:  # asyncio.timeout: Python 3.11's wait_for can swallow a cancel (scheduler.py)
            async with asyncio.timeout(wait_s):
                await self._changed.wait()
        except TimeoutError:
            pass

    def answer(self) -> bytes:
        loop = asyncio.get_running_loop()
        doc = {
            **self._values,
            "read_at": self._read_wall_s,
            "age_s": max(0.0, loop.time() - self._read_mono_s),
            "seq": self.seq,
        }
        return orjson.dumps(doc)


class _Request:
    __slots__ = ("method", "url", "keep_alive")

    def __init__(self, method: bytes, url: bytes, keep_alive: bool) -> None:
        self.method = method
        self.url = url
        self.keep_alive = keep_alive


class _AgentConnection(asyncio.Protocol):
    """One client connection: the parser collects requests, one task answers them in order."""

    def __init__(self, server: AgentServer) -> None:
        # per connection
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._requests: asyncio.Queue[_Request | None] = asyncio.Queue()  # None: broken request
        self._task: asyncio.Task | None = None
        # per request
        self._url = b""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._transport = transport
        self._server._conns.add(self)
        self._task = asyncio.get_running_loop().create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._requests.put_nowait(None)
            self._transport.pause_reading()  # type: ignore[union-attr]  # nothing after it counts
            return
        if self._requests.qsize() > MAX_PIPELINED:
            self.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self._server._conns.discard(self)
        if self._task is not None:
            self._task.cancel()

    # -- parser callbacks: collect and return -------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_message_complete(self) -> None:
        self._requests.put_nowait(
            _Request(self._parser.get_method(), self._url, self._parser.should_keep_alive())
        )

    # -- answering ----------------------------------------------------------------------------
    async def _serve(self) -> None:
        while True:
            request = await self._requests.get()
            if request is None:
                status, body = _BAD_REQUEST
                keep_alive = False
            else:
                status, body = await self._server.answer(request.method, request.url)
                keep_alive = request.keep_alive
            self._transport.writelines((_head(status, len(body), keep_alive), body))  # type: ignore[union-attr]
            if not keep_alive:
                self.close()
                return

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class AgentServer:
    """The agent: its feed and its listener."""

    def __init__(self, scanner: Scanner, *, interval_s: float = 1.0) -> None:
        self.feed = AgentFeed(scanner, interval_s)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_AgentConnection] = set()

    async def start(self, host: str, port: int) -> int:
        """Scans once, starts the scan loop, listens. Returns the bound port (for port 0)."""
        await self.feed.scan_once()
        self.feed.start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _AgentConnection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
        await self.feed.stop()

    async def answer(self, method: bytes, url: bytes) -> tuple[int, bytes]:
        """(status, body) of one request (rules 1–3)."""
        if method != b"GET":
            return 405, b'{"error":"only GET"}'
        parts = urlsplit(url.decode("latin-1"))
        if parts.path == HEALTH_PATH:
            return 200, _HEALTH_BODY
        if parts.path != READING_PATH:
            return 404, b'{"error":"not found"}'
        query = dict(parse_qsl(parts.query))
        try:
            wait_s = float(query.get("wait", 0.0))
            since = int(query["since"]) if "since" in query else None
        except ValueError:
            return _BAD_REQUEST
        if not math.isfinite(wait_s):
            return _BAD_REQUEST
        await self.feed.wait_change(since, min(max(wait_s, 0.0), MAX_WAIT_S))
        return 200, self.feed.answer()


# ---------------------------------------------------------------------------------------------
# The link: a router reading one agent into its cache


def _number(value: object, kind: type) -> float | int | None:
    """`value` if it is None or a number of `kind` (ints count as floats); else TypeError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise TypeError(f"expected {kind.__name__} or null, got {type(value).__name__}")
    return value


def parse_reading(doc: dict, now_s: float) -> Reading:
    """The cache's reading from an agent's answer received at `now_s` (rule 5).

    Raises KeyError, TypeError or ValueError for an answer that is not an agent reading.
    """
    age_s = _number(doc["age_s"], float)
    if age_s is None or not 0.0 <= age_s < math.inf:
        raise ValueError(f"bad age_s {age_s!r}")
    return Reading(
        util_pct=_number(doc["util_pct"], float),  # range checked by the pressure rules
        mem_free_bytes=_number(doc["mem_free_bytes"], int),  # type: ignore[arg-type]
        mem_total_bytes=_number(doc["mem_total_bytes"], int),  # type: ignore[arg-type]
        read_at_s=now_s - age_s,
        source=SOURCE_SCAN,
    )


class AgentLink:
    """Long-polls one agent and keeps its box's `scan` reading current (rules 6–8)."""

    def __init__(self, url: str, box_name: str, cache: TelemetryCache) -> None:
        parts = urlsplit(url)
        self.url = url
        self.box_name = box_name
        self._cache = cache
        self._origin = Origin(parts.hostname or "127.0.0.1", parts.port or 80)
        self._task: asyncio.Task | None = None
        self.streak = Streak()  # failures in a row (rule 8)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"agent-link:{self.box_name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._origin.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        seq: int | None = None
        streak = self.streak
        agent_error = None
        while True:
            target = READING_PATH if seq is None else f"{READING_PATH}?wait={LINK_WAIT_S}&since={seq}"
            try:
                status, _, body = await fetch(self._origin, "GET", target, timeout_s=LINK_TIMEOUT_S)
                if status != 200:
                    raise UpstreamError(f"agent answered {status}")
                doc = orjson.loads(body)
                new_seq = doc["seq"]
                if isinstance(new_seq, bool) or not isinstance(new_seq, int):
                    raise TypeError("seq is not an integer")
                reading = parse_reading(doc, loop.time())
            except Exception as exc:  # rule 8: a dead link task would freeze the box's reading
                wait_s, say = streak.failed(loop.time(), random.random())
                if say:
                    log.warning(
                        "agent link %s (%s) failing (%d in a row, retrying every %.1f s at most): %s",
                        self.box_name, self.url, streak.failures, streak.cap_s, type(exc).__name__,
                    )
                seq = None
                await asyncio.sleep(wait_s)
                continue
            if streak.failures:
                streak.succeeded()
                log.info("agent link %s recovered", self.box_name)
            if doc.get("error") != agent_error:
                agent_error = doc.get("error")
                if agent_error:
                    log.info("agent for %s has no GPU reading: %s", self.box_name, agent_error)
            self._cache.put(self.box_name, reading)
            seq = new_seq
