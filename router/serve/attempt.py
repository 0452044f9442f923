"""One attempt: send a call to one box and judge its answer, before any of it reaches the client.

`Attempt.send` returns a verdict value: `Judged` (the answer may go out: its head, and the body
or the first bytes held so far), `Refusal` (the box refused before the first byte: the call
fails over), or `LEFT` (the client left meanwhile: the box connection is closed).

Rules:
1. A non-2xx head is read whole (it is small, up to ERROR_BODY_LIMIT; a larger one is left unread)
   and classified (router.core.refusal); a refusal keeps the box's answer, to go back when no box
   is left. A non-2xx that is not a refusal is the client's own error and goes back, except a
   context-length 400 where an alias's chain has another model to try (`context_moves_on`); either
   goes back as sent only in an API's error shape (reply.py rule 5).
2. A stream (SSE or NDJSON) is held until its first data frame has arrived and been judged; a
   first event larger than the hold limit cannot be judged cheaply and goes through unjudged (a
   refusal frame is small).
3. A sized answer up to INLINE_BODY_LIMIT is read whole; a larger or unsized one waits for its
   first body bytes, so that broken framing before them is a refusal, not a cut 200.
4. The box's first byte must come within the first-byte timeout; after it, the box may be silent
   for the stream idle timeout (the exchange's one deadline at a time, which the CallClock keeps:
   `Exchange.keep`, `Exchange.expire`).
5. A reused connection that the box closed as the request went out (it read nothing) is retried
   once on a fresh one (`Exchange.stale_race`).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import orjson

from router._fastpath import FIRST_SUSPECT, HOLD, NDJSON, SSE, TOO_BIG, FrameScanner
from router.boxes.state import BoxState
from router.core.aliases import context_exceeded
from router.core.lifecycle import Event, Lifecycle
from router.core.refusal import RefusalCode, classify_first_frame, classify_reply
from router.core.kinds import Capability, can, kinds_that
from router.core.types import new_tuple
from router.serve.edge import Edge
from router.serve.hops import hop_lines
from router.upstream.fetch import fetch
from router.upstream.pool import (
    ConnectFailed,
    Deadline,
    Exchange,
    ExchangeAborted,
    FirstByteTimeout,
    StreamIdle,
    UpstreamError,
    request_head,
)

# Error answers are small JSON; anything larger is not a refusal we could judge anyway.
ERROR_BODY_LIMIT = 1 << 20
# Success answers up to this size with a Content-Length go back in one piece; larger or
# unsized ones are relayed as they arrive.
INLINE_BODY_LIMIT = 1 << 20
CANCEL_TIMEOUT_S = 5.0
# Request headers passed from the client to the box; everything else (Authorization, Host,
# X-Forwarded-For, cookies) stays here.
PASSED_HEADERS = ("content-type", "accept", "x-task", "x-hugpy-root-request-id")
SSE_TYPE = b"text/event-stream"
NDJSON_TYPE = b"application/x-ndjson"
# Read on every call: module names, not their Enums' members, for speed
# (router.core.lifecycle: on Python 3.11 a member read off its Enum class takes a slow hook).
SENT, HEAD, JUDGED, CLIENT_LEFT = Event.SENT, Event.HEAD, Event.JUDGED, Event.CLIENT_LEFT
CALL_ID_KINDS = kinds_that(Capability.CALL_ID)


class Refusal(NamedTuple):
    """The box refused before the first byte (`code`). `status`, `headers` and `body` are its
    answer when it sent one; `frame` is an in-band refusal's first frame, parsed."""

    code: RefusalCode
    status: int | None = None
    headers: list[tuple[bytes, bytes]] | tuple[()] = ()
    body: bytes = b""
    frame: object = None


class Judged(NamedTuple):
    """An answer judged fit for the client. `body` is the whole answer when it was read whole
    (None: relay it, starting with `first`); `scanner` follows a framed stream's tail; `failure`
    names the client's own error (a non-2xx that is not a refusal)."""

    exchange: Exchange
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes | None
    first: bytes = b""
    scanner: FrameScanner | None = None
    stream: bool = False
    failure: str | None = None


LEFT = None  # the client left while the attempt was at the box
_CANCELS: set[asyncio.Task] = set()  # cancel posts in flight (a task needs a reference)


def framing_of(content_type: bytes) -> int:
    if content_type.startswith(SSE_TYPE):
        return SSE
    return NDJSON if content_type.startswith(NDJSON_TYPE) else 0


def _json(data: bytes) -> object:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


class Attempt:
    """One box's try at the call. The call reaches its `exchange` to end it (`abort`, when the
    client leaves) or to keep its deadline (`expire`, each CallClock tick)."""

    __slots__ = ("box", "call_id", "life", "exchange", "first_byte_timeout_s", "idle_timeout_s", "context_moves_on")

    def __init__(
        self, box: BoxState, call_id: str, life: Lifecycle, first_byte_timeout_s: float, idle_timeout_s: float
    ) -> None:
        self.box = box
        self.call_id = call_id
        self.life = life
        self.exchange: Exchange | None = None
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.context_moves_on = False  # a context-length 400 is a refusal (an alias's next model)

    def request(self, edge: Edge, length: int) -> bytes:
        """The client's request line as the box gets it: the box's auth, this router's hop marks
        (hops.py), hugpy's parent id, and only the PASSED_HEADERS of the client's."""
        box = self.box
        lines = [box.auth_header, hop_lines(edge)]
        if box.config.kind in CALL_ID_KINDS:
            lines.append(b"X-Hugpy-Parent-Request-Id: %s\r\n" % self.call_id.encode())
        for name in PASSED_HEADERS:
            value = edge.header(name)
            if value is not None:
                lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        target = edge.path + ("?" + edge.query if edge.query else "")
        return request_head(edge.method, target, box.origin, b"".join(lines), length)

    async def send(self, edge: Edge, body: bytes) -> Judged | Refusal | None:
        head = self.request(edge, len(body))
        fresh = False
        while True:
            try:
                exchange = await self.box.origin.send(head, body, fresh=fresh)
            except ConnectFailed as exc:
                return Refusal(exc.refusal)
            self.exchange = exchange
            if self.life.ended_by is CLIENT_LEFT:  # while we connected: the request is out
                exchange.abort(ExchangeAborted("client left"))
                self.cancel()
                return LEFT
            self.life.fire(SENT)  # (again on a resend after a stale-connection race: SENT → SENT)
            exchange.keep(new_tuple(Deadline, (self.first_byte_timeout_s, FirstByteTimeout("no first byte"), False)))
            try:
                return await self.judge(exchange)
            except UpstreamError as exc:
                if isinstance(exc, ExchangeAborted) or self.life.ended_by is CLIENT_LEFT:
                    return LEFT
                if not fresh and exchange.stale_race():
                    fresh = True  # the box's idle close met our request: it read nothing (rule 5)
                    exchange.done()
                    self.exchange = None
                    continue
                return Refusal(exc.refusal)

    def done(self) -> None:
        """The call is finished with the box's answer, whatever the end."""
        if self.exchange is not None:
            self.exchange.done()
            self.exchange = None

    def abort(self, why: str) -> bool:
        """Ends the exchange now; False when no request is out yet."""
        if self.exchange is None:
            return False
        self.exchange.abort(ExchangeAborted(why))
        return True

    def cancel(self) -> None:
        """Posts the call's cancel to a hugpy box, in the background: a box in the middle of a
        cold load, or stuck mid-answer, may not notice a closed socket."""
        if can(self.box.config.kind, Capability.CANCEL):
            task = asyncio.get_running_loop().create_task(self._post_cancel())
            _CANCELS.add(task)
            task.add_done_callback(_CANCELS.discard)

    async def _post_cancel(self) -> None:
        box = self.box
        try:
            await fetch(box.origin, "POST", f"/v1/requests/{self.call_id}/cancel",
                        headers=box.auth_header, timeout_s=CANCEL_TIMEOUT_S)
        except UpstreamError:
            pass

    async def judge(self, exchange: Exchange) -> Judged | Refusal:
        await exchange.head
        self.life.fire(HEAD)
        status = exchange.status
        length = exchange.header(b"content-length")
        sized = length is not None and length.isdigit()
        if status >= 400:  # rule 1
            # one larger than the limit is no API's error: left unread (reply.py rule 5)
            data = b"" if sized and int(length) > ERROR_BODY_LIMIT else await exchange.read_all(ERROR_BODY_LIMIT)
            doc = _json(data)
            refusal = classify_reply(self.box.config.kind, status, doc)
            if refusal is None and self.context_moves_on and context_exceeded(status, doc):
                refusal = RefusalCode.CONTEXT_LENGTH
            if refusal is not None:
                return Refusal(refusal, status, exchange.headers, data)
            return self.judged(exchange, data, failure=f"http_{status}")
        framing = framing_of(exchange.header(b"content-type") or b"")
        if framing:
            return await self.hold_first_frame(exchange, framing)
        if sized and int(length) <= INLINE_BODY_LIMIT:  # rule 3
            data = await exchange.read_all(INLINE_BODY_LIMIT)  # still under the first-byte timer
            exchange.keep(None)
            return self.judged(exchange, data)
        chunks = await exchange.next_chunks()
        self.watch_silence(exchange)
        return self.judged(exchange, None, b"".join(chunks))

    async def hold_first_frame(self, exchange: Exchange, framing: int) -> Judged | Refusal:
        """Rule 2: reads until the first data frame has arrived, then judges it."""
        scanner = FrameScanner(framing)
        after: list[bytes] = []
        verdict = HOLD
        while verdict == HOLD:
            chunks = await exchange.next_chunks()
            if not chunks:
                return Refusal(RefusalCode.CONNECTION_LOST)  # ended before any frame
            for index, chunk in enumerate(chunks):
                verdict = scanner.feed(chunk)
                if verdict != HOLD:
                    after = chunks[index + 1 :]
                    break
        first = b"".join(scanner.take_held() + after)
        if verdict == TOO_BIG:
            self.watch_silence(exchange)
            return self.judged(exchange, None, first, stream=True)
        if verdict == FIRST_SUSPECT:
            frame = _json(scanner.first_data)
            refusal = classify_first_frame(self.box.config.kind, frame)
            if refusal is not None:
                return Refusal(refusal, exchange.status, exchange.headers, first, frame)
        for chunk in after:
            scanner.keep(chunk)
        self.watch_silence(exchange)
        return self.judged(exchange, None, first, scanner, stream=True)

    def judged(
        self, exchange: Exchange, body: bytes | None, first: bytes = b"", scanner: FrameScanner | None = None,
        *, stream: bool = False, failure: str | None = None,
    ) -> Judged:
        self.life.fire(JUDGED)
        return new_tuple(Judged, (exchange, exchange.status, exchange.headers, body, first, scanner, stream, failure))

    def watch_silence(self, exchange: Exchange) -> None:
        """The first byte is in: from now the box may be silent for the stream idle timeout."""
        timeout_s = self.idle_timeout_s
        exchange.keep(new_tuple(Deadline, (timeout_s, StreamIdle(f"the box was silent for {timeout_s} s mid-answer"), True)))
