"""The proxy hot path: inspect → decide → reserve → send → judge → commit → relay → release.

Rules:
1. Nothing reaches the client before the box's answer is judged: a non-2xx head is read whole
   (it is small) and classified; a stream (SSE or NDJSON) is held until its first data frame
   has arrived and been judged. A refusal (router.core.refusal) excludes the box and the call
   is decided again among the first decision's boxes only, at most MAX_BOXES_PER_CALL boxes.
   A pinned call is never rerouted.
2. When no box is left, the last box's own answer goes back as it was sent; a transport
   failure (unreachable, lost, timeout) becomes a 502 in the facade's shape.
3. After the first byte reaches the client nothing is rerouted; a box failing mid-stream
   ends the stream with an in-band error frame in the stream's own format.
4. The reservation is taken before the first send, moved on failover, released at the end,
   whatever the end.
5. A client that leaves ends the call at once: the box connection is closed (never reused)
   and a hugpy box also gets `POST /v1/requests/<call id>/cancel`.
   Its deadlines (the body's, the box's first byte) and the start of the disconnect watcher are
   kept by the process's CallClock, not by timers of its own.
6. No body, chunk, prompt or key is logged; per-call lines are debug level.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

import orjson

from router._fastpath import FIRST_SUSPECT, HOLD, NDJSON, SSE, TOO_BIG, FrameScanner
from router.boxes.state import BoxState
from router.core.decide import decide
from router.core.errors import BadRequest
from router.core.names import call_key
from router.core.refusal import CONNECTION_LOST, classify_first_frame, classify_reply
from router.core.types import BoxKind, Call, Decision, Path
from router.facades.body import (
    alloc_pool,
    model_and_pin,
    multipart_field,
    parse_json_object,
    reject_duplicate_fields,
)
from router.facades.table import Body, Facade, Route
from router.serve.edge import BodyTooLarge, ClientLeft
from router.store.route_log import Row
from router.upstream.fetch import fetch
from router.upstream.pool import (
    ClientGone,
    ConnectFailed,
    ConnectionLost,
    Exchange,
    FirstByteTimeout,
    UpstreamError,
    request_head,
)

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
# How often the CallClock looks at the calls in flight: a deadline fires up to this late.
CLOCK_TICK_S = 0.05

# Response headers that belong to one hop (RFC 9110 §7.6.1) or that the edge sets itself.
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
    }
)
# Request headers passed from the client to the box; everything else (Authorization, Host,
# X-Forwarded-For, cookies) stays here.
FORWARDED_HEADERS = ("content-type", "accept", "x-task", "x-hugpy-root-request-id")

SSE_TYPE = b"text/event-stream"
SSE_DONE = b"data: [DONE]"
NDJSON_TYPE = b"application/x-ndjson"
MID_STREAM_ERROR = {
    SSE: b'data: {"error": {"message": "the box failed mid-stream", "type": "upstream_error", '
    b'"code": "box_failed"}}\n\n',
    NDJSON: b'{"error": "the box failed mid-stream"}\n',
}


class CallClock:
    """The deadlines of every call in flight, checked by one sweep each CLOCK_TICK_S.

    Why not a timer per deadline: a call has three (its body, the box's first byte, the start
    of its disconnect watcher), and arming and cancelling three uvloop timers cost ~8 µs of
    every call's CPU, while joining and leaving this set costs well under one. The price is
    precision: a deadline fires up to one tick late, nothing beside 60 s or 900 s, and a
    watcher starts 50-100 ms into a call instead of at 50 ms. A sweep costs ~0.08 µs per call
    in flight (timeit: 0.16 ms for 2,000 open streams, 0.3 % of a core at 20 sweeps a second).
    """

    def __init__(self) -> None:
        self.calls: set[ProxyCall] = set()
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


class Answer:
    """A box's answer held before commit: head plus the bytes read so far."""

    __slots__ = ("status", "headers", "chunks")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], chunks: list[bytes]):
        self.status = status
        self.headers = headers
        self.chunks = chunks


class RelayAborted(Exception):
    """The answer was cut after its head went out: the client connection must be aborted."""


class Refused(Exception):
    def __init__(self, code: str, answer: Answer | None = None) -> None:
        super().__init__(code)
        self.code = code
        self.answer = answer


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
        "exchange",
        "gone",
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
        "phase",
        "watch",
    )

    def __init__(self, app, edge, facade: Facade, route: Route) -> None:
        self.app = app
        self.edge = edge
        self.facade = facade
        self.route = route
        self.call_id = new_call_id()
        self.body = b""
        self.call: Call | None = None
        self.exchange: Exchange | None = None
        self.gone = False
        self.box: BoxState | None = None
        self.attempts: list[dict] = []  # {box, status, refusal, ms} per box tried
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
        self.phase = "body"  # body | expired (the body's deadline passed) | deciding | boxes
        self.watch: asyncio.Task | None = None  # the disconnect watcher, once started

    # -- the client's side ---------------------------------------------------------------------
    async def error(
        self, status: int, code: str, message: str, extra: dict | None = None, state: str = "failed"
    ) -> None:
        """The router's own answer, in the facade's shape."""
        body = self.facade.shape_error(status, code, message, extra)
        headers = [
            (b"content-type", b"application/json"),
            (b"x-hugpy-router-request-id", self.call_id.encode()),
        ]
        self.answered(status, state, code)
        await self.respond(status, headers, body)

    def answered(self, status: int, state: str, failure: str | None = None) -> None:
        self.status, self.state, self.failure = status, state, failure
        self.first_byte_at = time.time()
        self.t_first_byte = time.perf_counter()

    async def respond(self, status: int, headers: list, body: bytes) -> None:
        self.bytes_out += len(body)
        await self.edge.respond(status, headers, body)

    def client_left(self) -> None:
        """The client went away: end the box's work now. Safe to call more than once."""
        self.gone = True
        exchange, self.exchange = self.exchange, None
        if self.delivered:  # the answer is whole: a client hanging up now cancels nothing
            if exchange is not None:
                exchange.abort(ClientGone("client left after the end"))
            return
        self.state, self.failure = "cancelled", "client_left"
        if exchange is not None:
            exchange.abort(ClientGone("client left"))
            box = self.box
            if box is not None and box.config.kind is BoxKind.HUGPY:
                task = asyncio.get_running_loop().create_task(self._cancel_on_box(box))
                _CANCELS.add(task)
                task.add_done_callback(_CANCELS.discard)

    async def _cancel_on_box(self, box: BoxState) -> None:
        """A box in the middle of a cold load may not notice a closed socket: tell it."""
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
    def inspect(self) -> Call:
        """Reads model and pin from the body. Raises BadRequest."""
        edge = self.edge
        content_type = edge.header("content-type") or ""
        if self.route.body is Body.FORM and content_type.startswith("multipart/form-data"):
            model = multipart_field(self.body, content_type.encode("latin-1"), b"model")
            if model is None or not model.strip():
                raise BadRequest("form field 'model' is required", code="model_required")
            pin, settings, pool = None, None, None
        else:
            doc = parse_json_object(self.body)
            reject_duplicate_fields(self.body, self.route.model_fields + ("alloc",))
            model, pin = model_and_pin(doc, self.route.model_fields)
            settings = self.facade.settings(doc)
            pool = alloc_pool(doc)
        pin = pin or edge.header("x-router-box")
        pool = pool or edge.header("x-router-pool")
        return Call(model=model, kinds=self.facade.kinds, settings=settings, pin=pin, pool=pool)

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
            self.app.observe(self)

    def tick(self, now: float) -> None:
        """The CallClock's look at this call: a deadline passed, or time to watch the client."""
        age = now - self.started_s
        if self.phase == "body":
            if age > BODY_TIMEOUT_S:
                self.phase = "expired"
                self.task.cancel()  # type: ignore[union-attr]
        elif self.phase == "boxes":
            # Only once the body is in: until then receive() belongs to the body.
            if self.watch is None and age >= WATCH_AFTER_S:
                self.watch = self.edge.watch_disconnect(self.client_left)
            if self.exchange is not None:
                self.exchange.expire(now)

    async def _run(self) -> None:
        edge = self.edge
        try:
            self.body = await edge.read_body(self.app.max_body_bytes)
        except asyncio.CancelledError:
            if self.phase != "expired":
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
        self.phase = "deciding"
        try:
            self.call = call = self.inspect()
        except BadRequest as exc:
            await self.error(exc.status_hint, exc.code, str(exc))
            return
        fleet = self.app.fleet
        self.decision = decision = decide(call, fleet.facts())
        if decision.path is Path.REFUSED:
            await self.refuse(decision)
            return
        if log.isEnabledFor(logging.DEBUG):  # the ranking is built only when it is logged
            log.debug("call %s: %s", self.call_id, [(b, decision.why[b].rank) for b in decision.boxes])
        self.phase = "boxes"
        try:
            await self.attempt_all(decision)
        finally:
            if self.token:
                self.app.reservations.release(self.token)
            self.load_on(None)

    def load_on(self, box: BoxState | None) -> None:
        """Moves this call's in-flight count to `box` (None: the call ended); pokes the scheduler."""
        if self.loaded is not None:
            self.loaded.in_flight -= 1
        if box is not None:
            box.in_flight += 1
        self.loaded = box
        self.app.scheduler.poke()

    def row(self) -> Row:
        """This call's route_log row: metadata only, never a body or a key."""
        call, decision = self.call, self.decision
        return Row(
            call_id=self.call_id,
            state=self.state if self.state != "pending" else "failed",
            facade=self.facade.name,
            route=self.route.path,
            model=call.model if call else None,
            settings=call.settings if call else None,
            pin=call.pin if call else None,
            client=self.edge.client,
            stream=int(self.stream),
            decision_path=decision.path.value if decision else None,
            decision=decision,  # encoded by the writer thread, off the loop
            attempts=self.attempts,
            box=self.box.name if self.box else None,
            status=self.status or None,
            error=self.failure,
            received_at=self.received_at,
            first_byte_at=self.first_byte_at,
            done_at=time.time(),
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
            {"boxes": decision.reasons_text()},
            state="refused",
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("call %s refused: %s", self.call_id, decision.reasons_text())

    async def attempt_all(self, decision: Decision) -> None:
        fleet = self.app.fleet
        reservations = self.app.reservations
        call = self.call
        eligible = frozenset(decision.boxes)
        tried: list[str] = []
        last: Refused | None = None
        scheduler = self.app.scheduler
        while True:
            box = fleet.get(decision.boxes[0])
            if box is None:  # removed from the boxes file since the decision
                tried.append(decision.boxes[0])
            else:
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
                        {"box": box.name, "status": self.status, "ms": _ms_since(started)}
                    )
                    return
                except Refused as refused:
                    last = refused
                    tried.append(box.name)
                    self.attempts.append({
                        "box": box.name,
                        "status": refused.answer.status if refused.answer else None,
                        "refusal": refused.code,
                        "ms": _ms_since(started),
                    })
                    log.debug("call %s: box %s refused (%s)", self.call_id, box.name, refused.code)
            if self.gone:
                return
            if call.pin is not None or len(tried) >= MAX_BOXES_PER_CALL:  # type: ignore[union-attr]
                break
            decision = decide(call, fleet.facts(), tried, eligible)  # type: ignore[arg-type]
            if decision.path is Path.REFUSED:
                break
        await self.give_up(last)

    async def give_up(self, last: Refused | None) -> None:
        """Every box refused: the last box's answer as sent, or a 502 for a transport failure."""
        if self.gone:
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

    def client_headers(self, box_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        headers = [
            (name.lower(), value) for name, value in box_headers if name.lower() not in HOP_HEADERS
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
                self.client_left()
                return
            exchange.arm_deadline(self.app.first_byte_timeout_s, FirstByteTimeout("no first byte"))
            try:
                await self.carry(box, exchange)
                return
            except UpstreamError as exc:
                if isinstance(exc, ClientGone) or self.gone:
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
                raise Refused(refusal, Answer(status, exchange.headers, [data]))
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
            self.commit(box, status)
            self.tail = (data,)
            await self.respond(status, self.client_headers(exchange.headers), data)
            return
        exchange.disarm()
        self.commit(box, status)
        await self.edge.start(status, self.client_headers(exchange.headers))
        await self.relay(exchange, None, b"")

    async def carry_stream(self, box: BoxState, exchange: Exchange, framing: int) -> None:
        """Holds the stream until its first data frame is judged, then relays it."""
        scanner = FrameScanner(framing)
        after: list[bytes] = []
        while True:
            chunks = await exchange.next_chunks()
            if not chunks:
                raise Refused(CONNECTION_LOST, None)  # ended before any frame
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
            exchange.disarm()
            self.stream = True
            self.commit(box, exchange.status)
            await self.edge.start(exchange.status, self.client_headers(exchange.headers))
            await self.relay(exchange, None, b"".join(held + after))
            return
        if verdict == FIRST_SUSPECT:
            try:
                frame = orjson.loads(scanner.first_data)
            except orjson.JSONDecodeError:
                frame = None
            refusal = classify_first_frame(box.config.kind, frame)
            if refusal is not None:
                raise Refused(refusal, Answer(exchange.status, exchange.headers, held + after))
        exchange.disarm()
        for chunk in after:
            scanner.feed(chunk)
        self.stream = True
        self.commit(box, exchange.status)
        await self.edge.start(exchange.status, self.client_headers(exchange.headers))
        first = b"".join(held + after) if len(held) + len(after) > 1 else held[0]
        await self.relay(exchange, scanner, first)

    def commit(self, box: BoxState, status: int) -> None:
        """The box took the call: remember the settings it now runs for this model."""
        self.answered(status, "done")
        call = self.call
        named = call_key(box.config.kind, call.model, call.settings)  # type: ignore[union-attr]
        if named is not None:
            box.record_dispatch(named[0], named[1], asyncio.get_running_loop().time())

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
                        scanner.feed(chunk)
                last, data = data, chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self.tail = (last, data)
            await edge.finish()
        except ClientLeft:
            self.client_left()
        except UpstreamError:
            if self.gone:
                return
            log.debug("call %s: box %s failed mid-stream", self.call_id, self.box.name)  # type: ignore[union-attr]
            self.state, self.failure = "failed", "box_failed_mid_stream"
            if scanner is None:
                # A body with no frames has no way to say "error": cut the connection, so the
                # client sees a truncated answer as truncated, never as complete.
                raise RelayAborted("the box failed mid-body")
            try:
                await edge.write(MID_STREAM_ERROR[scanner.framing])
                await edge.finish()
            except ClientLeft:
                self.client_left()
