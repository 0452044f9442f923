"""The proxy hot path: inspect → decide → reserve → send → judge → commit → relay → release.

The call's phase moves only through router.core.lifecycle's table (`self.life`): RECEIVING,
DECIDING, QUEUED, DISPATCHING, SENT, HELD, JUDGED, RELAYING, ENDED; the failover step is its
`next_attempt`. The route log's `state` (done, failed, refused, cancelled) is the outcome.

Times, by suffix, on three clocks: `*_at` is the wall clock in epoch seconds (`time.time()`:
what the route log stores: received_at, first_byte_at); `t_*` is `time.perf_counter()` (the
metrics' durations: t_received, t_body, t_sent, t_first_byte); `*_s` is the event loop's clock
(`loop.time()`, what the CallClock's `now` is: started_s, queued_s, last_keepalive_s), and a
plain `*_s` constant or setting is a duration in seconds.

Rules:
1. Nothing reaches the client before the box's answer is judged: a non-2xx head is read whole
   (it is small) and classified; a stream (SSE or NDJSON) is held until its first data frame
   has arrived and been judged. A refusal (router.core.refusal) excludes the box and the call
   is decided again among the first decision's boxes only, at most MAX_BOXES_PER_CALL boxes.
   A pinned call is never rerouted.
2. When no box is left, the last box's own answer goes back as it was sent; a transport
   failure (unreachable, lost, timeout) becomes a 502 in the facade's shape; a stream refused
   by its first frame gets the status that refusal stands for (router.core.refusal rule 7)
   with the box's error object in the facade's shape, never a 200 that carries an error.
3. After the first byte reaches the client nothing is rerouted; a box failing mid-stream
   ends the stream with an in-band error frame in the stream's own format (a body with no
   frames is cut instead, so it never looks complete). A box silent mid-answer for longer than
   the stream idle timeout has failed too, and a hugpy box also gets its cancel (rule 5).
4. The reservation is taken before the first send, moved on failover, released at the end,
   whatever the end.
5. A client that leaves ends the call at once: the box connection is closed (never reused)
   and a hugpy box also gets `POST /v1/requests/<call id>/cancel`.
   Its deadlines (the body's, the box's first byte, the box's silence after it, the queue's)
   and the start of the disconnect watcher are kept by the process's CallClock, not by timers
   of its own.
6. A call whose owners are all full or cooling waits in the queue (router.serve.admission)
   until one hands it a slot; a client that leaves the queue is never sent to a box.
   A streamed call of an SSE facade that has waited `stream_keepalive_s` (in the queue or for
   its first byte) gets a 200 stream head and then an SSE comment every `stream_keepalive_s`:
   until its first data frame it still fails over (the client has seen only comments), and
   any answer after the head goes out is written in the stream, as an error frame.
7. No body, chunk, prompt or key is logged; per-call lines are debug level.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING, Callable

import orjson

from router._fastpath import FIRST_SUSPECT, HOLD, NDJSON, SSE, TOO_BIG, FrameScanner
from router.boxes.state import BoxState
from router.core.decide import decide
from router.core.errors import BadRequest
from router.core.names import call_key
from router.core.admission import Priority, Waiter
from router.core.lifecycle import Event, Lifecycle, Phase, Stop, next_attempt
from router.core.refusal import (
    PLACEMENT_REFUSALS,
    RefusalCode,
    classify_first_frame,
    classify_reply,
    in_band_status,
)
from router.core.types import BoxFacts, BoxKind, Call, Decision, Path
from router.facades.body import Inspected, read_call
from router.facades.table import Facade, Route
from router.serve.edge import BodyTooLarge, ClientLeft, Edge
from router.store.route_log import Row
from router.upstream.fetch import fetch
from router.upstream.pool import (
    ExchangeAborted,
    ConnectFailed,
    ConnectionLost,
    Exchange,
    FirstByteTimeout,
    StreamIdle,
    UpstreamError,
    request_head,
)

if TYPE_CHECKING:  # the app imports this module: its type only, for the signatures
    from router.serve.app import RouterApp

log = logging.getLogger("router.proxy")

MAX_BOXES_PER_CALL = 3
# Error answers are small JSON; anything larger is not a refusal we could judge anyway.
ERROR_BODY_LIMIT = 1 << 20
# Success answers up to this size with a Content-Length go back in one piece; larger or
# unsized ones are relayed as they arrive.
INLINE_BODY_LIMIT = 1 << 20
CANCEL_TIMEOUT_S = 5.0
# A client that stalls mid-upload must not hold a connection forever; a 64 MiB upload at
# 10 Mbit/s still fits (nginx's client_body_timeout is 60 s between reads, ours is the whole).
BODY_TIMEOUT_S = 60.0
# The client-disconnect watcher (a task) starts only for calls still running after this: most
# non-stream answers are done by then, and a client that left earlier is seen the moment the
# watcher starts, so a disconnect is noticed within this delay (plus up to one CallClock tick)
# plus the box's close.
WATCH_AFTER_S = 0.05
# A body up to this size is inspected on the loop (the JSON scan runs at ~1 GB/s: ~0.25 ms);
# a larger one on a worker thread, where the scan holds no GIL, so the loop goes on serving
# (bench/body_stall.py). A thread hop costs ~0.1 ms, more than scanning a small body.
INLINE_INSPECT_BYTES = 256 << 10
# How often the CallClock looks at the calls in flight: a deadline fires up to this late.
CLOCK_TICK_S = 0.05
# The phases in which a call is at a box: its client is watched and its exchange's deadline kept.
AT_A_BOX = frozenset({Phase.DISPATCHING, Phase.SENT, Phase.HELD, Phase.JUDGED, Phase.RELAYING})

# Response headers that belong to one hop (RFC 9110 §7.6.1) or that the edge sets itself, and
# those about the box itself: `Server` and `Via` name its software and path (nothing a client of
# the router needs, and a map for an attacker), `Set-Cookie` would bind the client to a session
# with one box that the next call, on another box, does not have. A box's CORS headers
# (`Access-Control-*`, an LM Studio with CORS on sends `Allow-Origin: *`) would open the router's
# answers to every web page: the router grants no cross-origin reads (README, Security model).
HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"content-length",
        b"server",
        b"set-cookie",
        b"via",
    }
)
# Request headers passed from the client to the box; everything else (Authorization, Host,
# X-Forwarded-For, cookies) stays here.
FORWARDED_HEADERS = ("content-type", "accept", "x-task", "x-hugpy-root-request-id")

SSE_TYPE = b"text/event-stream"
SSE_DONE = b"data: [DONE]"
NDJSON_TYPE = b"application/x-ndjson"
MID_STREAM_FAILED = "box_failed_mid_stream"
# (framing, the call's failure) -> the in-band frame that ends a stream whose box failed.
KEEPALIVE_COMMENT = b": waiting\n\n"


def in_band_frame(status: int, body: bytes) -> bytes:
    """A whole error answer as an SSE stream's last frame: its `{"error": ...}` object when it
    has one, else one that says the status."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if not (isinstance(doc, dict) and "error" in doc):
        doc = {"error": {"message": f"the call ended with status {status}", "type": "upstream_error",
                         "code": status}}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


MID_STREAM_ERROR = {
    (SSE, MID_STREAM_FAILED): b'data: {"error": {"message": "the box failed mid-stream", '
    b'"type": "upstream_error", "code": "box_failed"}}\n\n',
    (NDJSON, MID_STREAM_FAILED): b'{"error": "the box failed mid-stream"}\n',
    (SSE, StreamIdle.refusal): b'data: {"error": {"message": "the box went silent mid-stream", '
    b'"type": "upstream_error", "code": "stream_idle_timeout"}}\n\n',
    (NDJSON, StreamIdle.refusal): b'{"error": "the box went silent mid-stream"}\n',
}


class CallClock:
    """The deadlines of every call in flight, checked by one sweep each CLOCK_TICK_S.

    Why not a timer per deadline: a call has three (its body, the box's first byte, the start
    of its disconnect watcher; the box's silence after the first byte reuses the first byte's
    slot, `Exchange.arm_idle`), and arming and cancelling three uvloop timers cost ~8 µs of
    every call's CPU, while joining and leaving this set costs well under one. The price is
    precision: a deadline fires up to one tick late, nothing beside 60 s or 900 s, and a
    watcher starts 50-100 ms into a call instead of at 50 ms. A sweep costs ~0.08 µs per call
    in flight (timeit: 0.16 ms for 2,000 open streams, 0.3 % of a core at 20 sweeps a second).
    """

    def __init__(self, sweep: Callable[[float], None] = lambda now: None) -> None:
        self.calls: set[ProxyCall] = set()
        self.sweep = sweep  # the wait queue's look at back-offs and free slots, each tick
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sweep(), name="call-clock")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(CLOCK_TICK_S)
            self.tick_all(loop.time())

    def tick_all(self, now: float) -> None:
        # A function of its own, so that no local of the sleeping sweep keeps an ended call alive.
        for call in list(self.calls):  # a tick may end a call, which leaves the set
            call.tick(now)
        self.sweep(now)


class HeldAnswer:
    """A box's answer held before commit: head plus the bytes read so far (a refusal's, kept to
    go back as sent when no box is left)."""

    __slots__ = ("status", "headers", "chunks")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], chunks: list[bytes]):
        self.status = status
        self.headers = headers
        self.chunks = chunks


class RelayAborted(Exception):
    """The answer was cut after its head went out: the client connection must be aborted."""


class Refused(Exception):
    def __init__(self, code: RefusalCode, answer: HeldAnswer | None = None, frame: object = None) -> None:
        super().__init__(code)
        self.code = code
        self.answer = answer
        self.frame = frame  # an in-band refusal's first frame, parsed (bounded by the hold limit)


_CANCELS: set[asyncio.Task] = set()  # cancel posts in flight (a task needs a reference)
_CALL_PREFIX = "rt-" + os.urandom(8).hex()  # this process's; the counter makes each id unique
_call_numbers = itertools.count(1)


def new_call_id() -> str:
    """Unique across processes (random prefix) and within one (counter): no syscall per call."""
    return f"{_CALL_PREFIX}{next(_call_numbers):016x}"


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


class ProxyCall:
    """One model-bearing call through one facade route."""

    __slots__ = (
        "app",
        "edge",
        "facade",
        "route",
        "call_id",
        "body",
        "call",
        "life",
        "exchange",
        "box",
        "attempts",
        "token",
        "loaded",
        # the call's record (one route_log row, the metrics)
        "status",
        "state",
        "failure",
        "decision",
        "stream",
        "received_at",
        "first_byte_at",
        "bytes_out",
        "t_received",
        "t_body",
        "t_sent",
        "t_first_byte",
        "delivered",
        "tail",
        # the CallClock's view (rule 5)
        "task",
        "started_s",
        "watch",
        # the wait queue's view (rule 6)
        "tried",
        "eligible",
        "waiter",
        "turn",
        "queued_s",
        "waited_ms",
        # keep-alive of a long wait (rule 6)
        "sse_wanted",
        "asked_priority",
        "headed",
        "keepalive",
        "last_keepalive_s",
    )

    def __init__(self, app: RouterApp, edge: Edge, facade: Facade, route: Route) -> None:
        self.app = app
        self.edge = edge
        self.facade = facade
        self.route = route
        self.call_id = new_call_id()
        self.body = b""
        self.call: Call | None = None
        self.life = Lifecycle()
        self.exchange: Exchange | None = None
        self.box: BoxState | None = None
        self.attempts: list[dict] = []  # {box, status, refusal, ms, error, at} per box tried
        self.token = 0  # reservation token; 0 = none held
        self.loaded: BoxState | None = None  # the box whose in-flight count holds this call
        self.status = 0
        self.state = "pending"
        self.failure: str | None = None  # a stable error code, never the box's text
        self.decision: Decision | None = None
        self.stream = False
        self.received_at = time.time()
        self.first_byte_at: float | None = None
        self.bytes_out = 0
        self.t_received = time.perf_counter()  # the call arrived
        self.t_body = 0.0  # its body was in: router time starts here
        self.t_sent = 0.0  # the first box was contacted
        self.t_first_byte = 0.0
        self.delivered = False  # the stream's end (`data: [DONE]`) reached the client
        self.tail: tuple[bytes, ...] = ()  # the answer's last two chunks, for a trace's token usage
        self.task: asyncio.Task | None = None
        self.started_s = 0.0  # loop time when the call began
        self.watch: asyncio.Task | None = None  # the disconnect watcher, once started
        self.tried: list[str] = []  # boxes that refused it (failover never returns to them)
        self.eligible: frozenset[str] | None = None  # the first decision's boxes, once decided
        self.waiter: Waiter | None = None  # its place in the wait queue, while it waits
        self.turn: asyncio.Future | None = None  # resolved with its Decision, or None: no box
        self.queued_s = 0.0  # loop time when it joined the queue
        self.waited_ms: float | None = None
        self.sse_wanted = False  # a streamed call of an SSE facade: a long wait is kept alive
        self.asked_priority: Priority | None = None  # X-Router-Priority or alloc.priority
        self.headed = False  # a keep-alive sent the stream head: every answer goes in-band
        self.keepalive: asyncio.Task | None = None  # the keep-alive write in progress
        self.last_keepalive_s = 0.0  # loop time of the last keep-alive

    @property
    def gone(self) -> bool:
        """The client left (the call ended by it)."""
        return self.life.ended_by is Event.CLIENT_LEFT

    # -- the client's side ---------------------------------------------------------------------
    async def error(
        self, status: int, code: str, message: str, extra: dict | None = None, state: str = "failed",
        retry_after_s: int | None = None,
    ) -> None:
        """The router's own answer, in the facade's shape."""
        body = self.facade.shape_error(status, code, message, extra)
        headers = [
            (b"content-type", b"application/json"),
            (b"x-hugpy-router-request-id", self.call_id.encode()),
        ]
        if retry_after_s is not None:
            headers.append((b"retry-after", b"%d" % retry_after_s))
        self.answered(status, state, code)
        await self.respond(status, headers, body)

    def answered(self, status: int, state: str, failure: str | None = None) -> None:
        self.status, self.state, self.failure = status, state, failure
        self.first_byte_at = time.time()
        self.t_first_byte = time.perf_counter()

    async def respond(self, status: int, headers: list, body: bytes) -> None:
        """A whole answer; in-band, as the stream's last frame, once a keep-alive sent a head."""
        await self.settle_keepalive()
        if self.headed:
            frame = in_band_frame(status, body)
            self.bytes_out += len(frame)
            try:
                await self.edge.write(frame)
                await self.edge.finish()
            except ClientLeft:
                self.client_left()
            return
        self.bytes_out += len(body)
        await self.edge.respond(status, headers, body)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The head of a relayed answer (a keep-alive may have sent one already)."""
        await self.settle_keepalive()
        if not self.headed:
            await self.edge.start(status, headers)

    # -- keep-alive of a long wait (rule 6) ----------------------------------------------------
    def keep_alive_due(self, now: float) -> None:
        """The CallClock's look: a streamed call still without an answer gets its comment."""
        every = self.app.stream_keepalive_s
        if (
            self.sse_wanted
            and every > 0
            and self.status == 0
            and now - max(self.started_s, self.last_keepalive_s) >= every
            and (self.keepalive is None or self.keepalive.done())
        ):
            self.last_keepalive_s = now
            self.keepalive = asyncio.get_running_loop().create_task(self.send_keepalive())

    async def send_keepalive(self) -> None:
        try:
            if not self.headed:
                self.headed = True
                await self.edge.start(200, [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    (b"x-hugpy-router-request-id", self.call_id.encode()),
                ])
            await self.edge.write(KEEPALIVE_COMMENT)
            self.bytes_out += len(KEEPALIVE_COMMENT)
        except ClientLeft:
            self.client_left()

    async def settle_keepalive(self) -> None:
        """No more keep-alives: the answer is about to go out; a write in progress ends first."""
        self.sse_wanted = False
        task, self.keepalive = self.keepalive, None
        if task is not None:
            await task

    def client_left(self) -> None:
        """The client went away: end the box's work now. Safe to call more than once."""
        if not self.life.can(Event.CLIENT_LEFT):
            return  # the call has ended already
        self.life.fire(Event.CLIENT_LEFT)
        if self.waiter is not None and self.app.admission.leave(self.waiter, "left"):
            self.state, self.failure = "cancelled", "client_left"
            self.turn.set_result(None)  # type: ignore[union-attr]
            return
        exchange, self.exchange = self.exchange, None
        if self.delivered:  # the answer is whole: a client hanging up now cancels nothing
            if exchange is not None:
                exchange.abort(ExchangeAborted("client left after the end"))
            return
        self.state, self.failure = "cancelled", "client_left"
        if exchange is not None:
            exchange.abort(ExchangeAborted("client left"))
            self.cancel_on_box()

    def cancel_on_box(self) -> None:
        """Posts the cancel for this call to its box when that is a hugpy box (in the background)."""
        box = self.box
        if box is not None and box.config.kind is BoxKind.HUGPY:
            task = asyncio.get_running_loop().create_task(self._cancel_on_box(box))
            _CANCELS.add(task)
            task.add_done_callback(_CANCELS.discard)

    async def _cancel_on_box(self, box: BoxState) -> None:
        """A box in the middle of a cold load, or stuck mid-answer, may not notice a closed
        socket: tell it."""
        try:
            await fetch(
                box.origin,
                "POST",
                f"/v1/requests/{self.call_id}/cancel",
                headers=box.auth_header,
                timeout_s=CANCEL_TIMEOUT_S,
            )
        except UpstreamError:
            pass

    # -- the call ------------------------------------------------------------------------------
    async def inspect(self) -> Inspected:
        """Reads model, pin, pool, stream and class from the body and headers; a large body on a
        worker thread (INLINE_INSPECT_BYTES). Raises BadRequest."""
        edge = self.edge
        args = (self.body, edge.header("content-type") or "", self.route, self.facade,
                edge.header("x-router-box"), edge.header("x-router-pool"), edge.header("x-router-priority"))
        if len(self.body) <= INLINE_INSPECT_BYTES:
            return read_call(*args)
        return await asyncio.get_running_loop().run_in_executor(None, read_call, *args)

    async def run(self) -> None:
        clock = self.app.clock
        self.task = asyncio.current_task()
        self.started_s = asyncio.get_running_loop().time()
        clock.calls.add(self)
        try:
            await self._run()
        finally:
            clock.calls.discard(self)
            if self.watch is not None:
                self.watch.cancel()
            if self.keepalive is not None:  # the call is over: no write may follow it
                self.keepalive.cancel()
            self.unload()
            try:
                if self.life.phase is not Phase.ENDED:
                    self.life.fire(Event.DONE)
            finally:
                self.app.observe(self)

    def tick(self, now: float) -> None:
        """The CallClock's look at this call: a deadline passed, or time to watch the client."""
        age = now - self.started_s
        phase = self.life.phase
        if phase is Phase.RECEIVING:
            if age > BODY_TIMEOUT_S:
                self.life.fire(Event.DEADLINE)
                self.task.cancel()  # type: ignore[union-attr]
        elif phase is Phase.QUEUED:
            if now - self.queued_s > self.app.admission.timeout_s and self.app.admission.leave(
                self.waiter, "queue_timeout"  # type: ignore[arg-type]
            ):
                self.life.fire(Event.DEADLINE)
                self.turn.set_result(None)  # type: ignore[union-attr]
        elif phase in AT_A_BOX:
            # Only once the body is in: until then receive() belongs to the body.
            if self.watch is None and age >= WATCH_AFTER_S:
                self.watch = self.edge.watch_disconnect(self.client_left)
            if self.exchange is not None:
                self.exchange.expire(now)
        if self.sse_wanted:
            self.keep_alive_due(now)

    async def _run(self) -> None:
        edge = self.edge
        try:
            self.body = await edge.read_body(self.app.max_body_bytes)
        except asyncio.CancelledError:
            if self.life.ended_by is not Event.DEADLINE:
                raise
            self.task.uncancel()  # type: ignore[union-attr]
            await self.error(408, "body_timeout", f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s")
            return
        except BodyTooLarge:
            await self.error(413, "body_too_large", f"body over {self.app.max_body_bytes} bytes")
            return
        except ClientLeft:
            # The client left mid-upload, or sent a body the server could not frame (a bad
            # chunked encoding reads as a disconnect): answer in case it is still there.
            await self.error(400, "bad_body", "the request body could not be read", state="cancelled")
            self.failure = "client_left"
            return
        self.t_body = time.perf_counter()
        self.life.fire(Event.BODY_IN)
        try:
            self.call, stream, self.asked_priority = await self.inspect()
        except BadRequest as exc:
            await self.error(exc.status_hint, exc.code, str(exc))
            return
        self.sse_wanted = stream and self.facade.sse_keepalive
        fleet = self.app.fleet
        self.decision = decision = self.decide_now(fleet.facts())
        if decision.path is Path.REFUSED:
            if not decision.waits_for:
                await self.refuse(decision)
                return
            decision = await self.wait_turn(decision)
            if decision is None or self.gone:
                return
        if log.isEnabledFor(logging.DEBUG):  # the ranking is built only when it is logged
            log.debug("call %s: %s", self.call_id, [(b, decision.why[b].rank) for b in decision.boxes])
        await self.attempt_all(decision)

    def load_on(self, box: BoxState | None) -> None:
        """Moves this call's in-flight count to `box` (None: the call ended); pokes the scheduler
        and offers the slot it left to the wait queue."""
        left = self.loaded
        if box is left:
            return
        if left is not None:
            left.in_flight -= 1
        if box is not None:
            box.in_flight += 1
        self.loaded = box
        self.app.scheduler.poke()
        if left is not None:
            self.app.admission.freed(left)

    # -- the wait queue (rule 6) ---------------------------------------------------------------
    async def wait_turn(self, decision: Decision) -> Decision | None:
        """Every owner left is full or cooling: wait for a slot. Returns the decision that
        dispatches the call, or None when it was answered instead (429, 503, or it left)."""
        admission = self.app.admission
        caller, priority = self.app.access.caller_of(self.edge, self.asked_priority)
        self.waiter = admission.join(self, caller, priority, decision.waits_for)
        if self.waiter is None:
            await self.error(
                429, "queue_full", "every box for this model is full and the queue is full",
                {"boxes": decision.reasons_text()}, state="refused",
                retry_after_s=admission.retry_after_s(),
            )
            return None
        loop = asyncio.get_running_loop()
        self.turn = loop.create_future()
        self.queued_s = loop.time()
        self.life.fire(Event.QUEUED)
        if self.watch is None:  # a client that leaves the queue must leave it at once
            self.watch = self.edge.watch_disconnect(self.client_left)
        try:
            turn = await self.turn
        finally:  # cancelled (the server stops): out of the queue, never handed out later
            if not self.turn.done():
                admission.leave(self.waiter, "left")
        self.waited_ms = round((loop.time() - self.queued_s) * 1000, 3)
        self.waiter = None
        if turn is None and self.life.ended_by is Event.DEADLINE:
            await self.error(
                503, "queue_timeout",
                f"no box for this model had room within {admission.timeout_s:g} s",
                {"boxes": decision.reasons_text()}, retry_after_s=admission.retry_after_s(),
            )
        return turn

    def admit(self, decision: Decision) -> None:
        """The queue hands this call a slot: count it on its box now, before anything else
        runs, then wake the call."""
        self.decision = decision
        self.life.fire(Event.DECIDED)
        self.load_on(self.app.fleet.get(decision.boxes[0]))
        self.turn.set_result(decision)  # type: ignore[union-attr]


    def row(self) -> Row:
        """This call's route_log row: metadata only, never a body or a key."""
        call, decision = self.call, self.decision
        return Row(
            request_id=self.call_id,
            state=self.state if self.state != "pending" else "failed",
            facade=self.facade.name,
            route=self.route.path,
            model=call.model if call else None,
            options=call.settings if call else None,
            pin=call.pin if call else None,
            client=self.edge.caller,
            waited_ms=self.waited_ms,
            stream=int(self.stream),
            path=decision.path.value if decision else None,
            decision=decision,  # encoded by the writer thread, off the loop
            attempts=self.attempts,
            box=self.box.name if self.box else None,
            http_status=self.status or None,
            error=self.failure,
            received_at=self.received_at,
            first_byte_at=self.first_byte_at,
            responded_at=time.time(),
            bytes_in=len(self.body),
            bytes_out=self.bytes_out,
        )

    async def refuse(self, decision: Decision) -> None:
        call = self.call
        pinned = call.pin is not None  # type: ignore[union-attr]
        what = f"box {call.pin}" if pinned else "no box"  # type: ignore[union-attr]
        await self.error(
            self.facade.no_box_status,
            "no_box",
            f"{what} can serve model {call.model!r}",  # type: ignore[union-attr]
            # 0.0.4's no_box fields, which hugpy-core reads: every box's reason and the call's id
            {"type": "no_box", "reasons": decision.reasons_text(), "request_id": self.call_id},
            state="refused",
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("call %s refused: %s", self.call_id, decision.reasons_text())

    async def attempt_all(self, decision: Decision) -> None:
        """Tries the decision's boxes in turn (the failover step: router.core.lifecycle's
        next_attempt) until one takes the call; else gives up with the last refusal."""
        fleet = self.app.fleet
        reservations = self.app.reservations
        call = self.call
        self.eligible = frozenset(decision.boxes)
        tried = self.tried
        last: Refused | None = None
        scheduler = self.app.scheduler
        while True:
            choice = next_attempt(decision, tried, call.pin, MAX_BOXES_PER_CALL)  # type: ignore[union-attr]
            if choice is Stop.WAIT:
                self.unload()  # it waits holding no slot, least of all the refusing box's
                decision = await self.wait_turn(decision)
                if decision is None or self.gone:
                    return
                continue
            if isinstance(choice, Stop):
                break
            box = fleet.get(choice)
            if box is None:  # removed from the boxes file since the decision
                tried.append(choice)
            else:
                if self.life.phase is Phase.DECIDING:  # (a call the queue admitted is dispatched)
                    self.life.fire(Event.DECIDED)
                self.box = box
                generation = scheduler.generation  # now: a snapshot may have come since
                self.token = (
                    reservations.move(self.token, box.index, generation)
                    if self.token
                    else reservations.reserve(box.index, generation)
                )
                self.load_on(box)
                started = time.perf_counter()
                try:
                    await self.attempt(box)
                    self.attempts.append(
                        {"box": box.name, "status": self.status, "ms": _ms_since(started), "at": time.time()}
                    )
                    return
                except Refused as refused:
                    self.life.fire(Event.BOX_FAILED)
                    last = refused
                    tried.append(box.name)
                    self.attempts.append({
                        "box": box.name,
                        "status": refused.answer.status if refused.answer else None,
                        "refusal": refused.code,
                        "ms": _ms_since(started),
                        "error": refused.code,  # 0.0.4's name for why the box was left
                        "at": time.time(),  # 0.0.4's: when the attempt ended (epoch s)
                    })
                    log.debug("call %s: box %s refused (%s)", self.call_id, box.name, refused.code)
                    self.remember_refusal(box, refused.code)
            if self.gone:
                return
            decision = self.decide_now(fleet.facts())
        await self.give_up(last)

    def decide_now(self, facts: list[BoxFacts]) -> Decision:
        """The call's decision over `facts`, never broadening past its first one (failover)."""
        return decide(self.call, facts, self.tried, self.eligible)  # type: ignore[arg-type]

    def unload(self) -> None:
        """Releases the call's reservation and its in-flight count."""
        if self.token:
            self.app.reservations.release(self.token)
            self.token = 0
        self.load_on(None)

    def remember_refusal(self, box: BoxState, code: RefusalCode) -> None:
        """A placement refusal makes the box full for the model for a back-off; a box that
        cannot be reached is out of the decision until its health probe sees it again."""
        if code is RefusalCode.UNREACHABLE:
            box.mark_unreachable()
        elif code in PLACEMENT_REFUSALS:
            named = call_key(box.config.kind, self.call.model, self.call.settings)  # type: ignore[union-attr]
            if named is not None:
                box.placement_refused(named[0], asyncio.get_running_loop().time())

    async def give_up(self, last: Refused | None) -> None:
        """Every box refused: the last box's answer as sent, the status an in-band refusal
        stands for, or a 502 for a transport failure (rule 2)."""
        if self.gone:
            return
        if last is not None and last.answer is not None and last.answer.status < 400:
            await self.refused_in_band(last)
            return
        if last is not None and last.answer is not None:
            answer = last.answer
            self.answered(answer.status, "failed", last.code)
            await self.respond(
                answer.status, self.client_headers(answer.headers), b"".join(answer.chunks)
            )
            return
        await self.error(
            502,
            last.code if last else "no_box",
            "no box could take the call",
            {"attempts": [{"box": a["box"], "refusal": a.get("refusal")} for a in self.attempts]},
        )

    async def refused_in_band(self, last: Refused) -> None:
        """The last box refused in its stream's first frame: the status that stands for, with
        the box's error (`type`, `code` and its other fields kept) in the facade's shape."""
        status = in_band_status(last.code, last.frame)
        error = last.frame.get("error") if isinstance(last.frame, dict) else None
        fields = dict(error) if isinstance(error, dict) else {}
        message = fields.pop("message", error if isinstance(error, str) else None)
        if not isinstance(message, str):
            message = "the box refused the call"
        body = self.facade.shape_error(status, last.code, message, fields)
        headers = [
            (b"content-type", b"application/json"),
            (b"x-hugpy-box", self.box.name.encode()),  # type: ignore[union-attr]
            (b"x-hugpy-router-request-id", self.call_id.encode()),
        ]
        self.answered(status, "failed", last.code)
        await self.respond(status, headers, body)

    def client_headers(self, box_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        headers = [
            (lower, value)
            for name, value in box_headers
            if (lower := name.lower()) not in HOP_HEADERS and not lower.startswith(b"access-control-")
        ]
        headers.append((b"x-hugpy-box", self.box.name.encode()))  # type: ignore[union-attr]
        headers.append((b"x-hugpy-router-request-id", self.call_id.encode()))
        return headers

    def request_headers(self, box: BoxState) -> bytes:
        edge = self.edge
        lines = [box.auth_header]
        if box.config.kind is BoxKind.HUGPY:
            lines.append(b"X-Hugpy-Parent-Request-Id: %s\r\n" % self.call_id.encode())
        for name in FORWARDED_HEADERS:
            value = edge.header(name)
            if value is not None:
                lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        return b"".join(lines)

    async def attempt(self, box: BoxState) -> None:
        """Sends the call to `box` and carries the answer through. Raises Refused."""
        edge = self.edge
        target = self.edge.path + ("?" + edge.query if edge.query else "")
        head = request_head(edge.method, target, box.origin, self.request_headers(box), len(self.body))
        if not self.attempts:
            self.t_sent = time.perf_counter()
        fresh = False
        while True:
            try:
                exchange = await box.origin.send(head, self.body, fresh=fresh)
            except ConnectFailed as exc:
                raise Refused(exc.refusal) from None
            self.exchange = exchange
            if self.gone:  # the client left while we connected: the request is out, cancel it
                exchange.abort(ExchangeAborted("client left"))
                self.cancel_on_box()
                return
            if self.life.phase is Phase.DISPATCHING:  # (a resend after a stale-connection race: SENT)
                self.life.fire(Event.SENT)
            exchange.arm_deadline(self.app.first_byte_timeout_s, FirstByteTimeout("no first byte"))
            try:
                await self.carry(box, exchange)
                return
            except UpstreamError as exc:
                if isinstance(exc, ExchangeAborted) or self.gone:
                    return
                if not fresh and exchange.stale_race():
                    fresh = True  # the box's idle close met our request: it read nothing
                    continue
                raise Refused(exc.refusal) from None
            finally:
                exchange.done()
                self.exchange = None

    async def carry(self, box: BoxState, exchange: Exchange) -> None:
        await exchange.head
        self.life.fire(Event.HEAD)
        status = exchange.status
        length = exchange.header(b"content-length")
        sized = length is not None and length.isdigit()
        if status >= 400 and not (sized and int(length) > ERROR_BODY_LIMIT):
            data = await exchange.read_all(ERROR_BODY_LIMIT)
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                doc = None
            refusal = classify_reply(box.config.kind, status, doc)
            if refusal is not None:
                raise Refused(refusal, HeldAnswer(status, exchange.headers, [data]))
            self.life.fire(Event.JUDGED)  # the client's own error: it goes back as sent
            self.life.fire(Event.COMMITTED)
            self.answered(status, "failed", f"http_{status}")
            await self.respond(status, self.client_headers(exchange.headers), data)
            return
        content_type = exchange.header(b"content-type") or b""
        framing = SSE if content_type.startswith(SSE_TYPE) else (
            NDJSON if content_type.startswith(NDJSON_TYPE) else 0
        )
        if framing:
            await self.carry_stream(box, exchange, framing)
            return
        if sized and int(length) <= INLINE_BODY_LIMIT:
            data = await exchange.read_all(INLINE_BODY_LIMIT)  # still under the first-byte timer
            exchange.disarm()
            self.life.fire(Event.JUDGED)
            self.commit(box, status)
            self.tail = (data,)
            await self.respond(status, self.client_headers(exchange.headers), data)
            return
        # The first body bytes are in before the head goes out: a box that breaks its framing
        # (a bad chunk size) before them is refused like a bad head, not cut after a 200.
        first = await exchange.next_chunks()
        self.watch_silence(exchange)
        self.life.fire(Event.JUDGED)
        self.commit(box, status)
        await self.start(status, self.client_headers(exchange.headers))
        await self.relay(exchange, None, first[0] if len(first) == 1 else b"".join(first))

    async def carry_stream(self, box: BoxState, exchange: Exchange, framing: int) -> None:
        """Holds the stream until its first data frame is judged, then relays it."""
        scanner = FrameScanner(framing)
        after: list[bytes] = []
        while True:
            chunks = await exchange.next_chunks()
            if not chunks:
                raise Refused(RefusalCode.CONNECTION_LOST, None)  # ended before any frame
            for index, chunk in enumerate(chunks):
                verdict = scanner.feed(chunk)
                if verdict == HOLD:
                    continue
                after = chunks[index + 1 :]
                break
            else:
                continue
            break
        held = scanner.take_held()
        if verdict == TOO_BIG:
            # No frame ended within the hold limit: a first event this large (a base64 image)
            # cannot be judged cheaply, and a refusal frame is small, so pass it through unjudged.
            self.watch_silence(exchange)
            self.life.fire(Event.JUDGED)
            self.stream = True
            self.commit(box, exchange.status)
            await self.start(exchange.status, self.client_headers(exchange.headers))
            await self.relay(exchange, None, b"".join(held + after))
            return
        if verdict == FIRST_SUSPECT:
            try:
                frame = orjson.loads(scanner.first_data)
            except orjson.JSONDecodeError:
                frame = None
            refusal = classify_first_frame(box.config.kind, frame)
            if refusal is not None:
                raise Refused(refusal, HeldAnswer(exchange.status, exchange.headers, held + after), frame)
        self.watch_silence(exchange)
        self.life.fire(Event.JUDGED)
        for chunk in after:
            scanner.keep(chunk)
        self.stream = True
        self.commit(box, exchange.status)
        await self.start(exchange.status, self.client_headers(exchange.headers))
        first = b"".join(held + after) if len(held) + len(after) > 1 else held[0]
        await self.relay(exchange, scanner, first)

    def watch_silence(self, exchange: Exchange) -> None:
        """The first byte is in: from now the box may be silent for the stream idle timeout."""
        timeout_s = self.app.stream_idle_timeout_s
        exchange.arm_idle(timeout_s, StreamIdle(f"the box was silent for {timeout_s} s mid-answer"))

    def commit(self, box: BoxState, status: int) -> None:
        """The box took the call: remember the settings it now runs for this model."""
        self.life.fire(Event.COMMITTED)
        self.answered(status, "done")
        call = self.call
        named = call_key(box.config.kind, call.model, call.settings)  # type: ignore[union-attr]
        if named is not None:
            box.record_dispatch(named[0], named[1], asyncio.get_running_loop().time())
            box.placement_ok(named[0])

    async def relay(self, exchange: Exchange, scanner: FrameScanner | None, first: bytes) -> None:
        """Writes `first` (what was held), then passes chunks through as they arrive; the write
        waits for the client (ASGI). The head has been sent."""
        edge = self.edge
        try:
            data, last = first, b""
            while True:
                if data:
                    self.bytes_out += len(data)
                    if scanner is not None and scanner.framing == SSE and scanner.ends_with(SSE_DONE):
                        self.delivered = True  # before the write, which the disconnect can race
                    await edge.write(data)
                chunks = await exchange.next_chunks()
                if not chunks:
                    if exchange.close_delimited and scanner is not None and scanner.framing == SSE \
                            and not scanner.ends_with(SSE_DONE):
                        # A close-delimited SSE stream (hugpy's) ends with `data: [DONE]`; an EOF
                        # before it is a box that died, not a finished answer.
                        raise ConnectionLost("stream closed before its end")
                    break
                if scanner is not None:
                    for chunk in chunks:
                        scanner.keep(chunk)
                last, data = data, chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self.tail = (last, data)
            await edge.finish()
        except ClientLeft:
            self.client_left()
        except UpstreamError as exc:
            if self.gone:
                return
            failure = StreamIdle.refusal if isinstance(exc, StreamIdle) else MID_STREAM_FAILED
            log.debug("call %s: box %s %s", self.call_id, self.box.name, failure)  # type: ignore[union-attr]
            self.life.fire(Event.BOX_FAILED)
            self.state, self.failure = "failed", failure
            if isinstance(exc, StreamIdle):
                self.cancel_on_box()  # its connection is closed; a stuck box may not notice
            if scanner is None:
                # A body with no frames has no way to say "error": cut the connection, so the
                # client sees a truncated answer as truncated, never as complete.
                raise RelayAborted("the box failed mid-body")
            try:
                await edge.write(MID_STREAM_ERROR[scanner.framing, failure])
                await edge.finish()
            except ClientLeft:
                self.client_left()
