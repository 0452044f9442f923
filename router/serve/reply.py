"""The client's side of one proxied call: the router's own answers in the facade's shape, the head
and body of a box's answer, and the keep-alive of a long wait.

Rules:
1. A streamed call of an SSE facade that has waited `stream_keepalive_s` (in the queue or for its
   first byte) gets a 200 stream head and then an SSE comment every `stream_keepalive_s`; until
   its first data frame it still fails over (the client has seen only comments). Any answer after
   that head goes out in the stream, as an error frame (`in_band_frame`).
2. Once the answer is about to go out no keep-alive follows, and a keep-alive write in progress
   ends first (`settle`).
3. Every answer carries the call's id (`x-hugpy-router-request-id`); a box's answer also names the
   box (and, for an alias call, the model and its place in the chain) and loses its hop-by-hop
   headers and the headers about the box itself (`HOP_HEADERS`).
4. A box's whole 2xx answer after a keep-alive's head goes out as the stream the call asked for
   (`Facade.whole_as_stream`: one data frame and the stream's end). One the stream cannot carry
   (not JSON) ends the stream with an error frame that says so, and the row is `failed`
   (`answer_not_a_stream`): never `done` for an answer the client did not get (issue 20 item 9).
5. A box's error answer goes to the client as the box sent it only in an API's error shape
   (router.core.refusal rule 8); any other body (a traceback that may hold the box's secrets, an
   HTML page) becomes the router's `box_error` in the facade's shape, with the box's status and
   naming the box, and the log gets the box body's first LOGGED_BODY_CHARS, on one line
   (`box_error`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import orjson

from router.core.refusal import api_error
from router.facades.table import Facade
from router.serve.affinity import HEADER as AFFINITY_HEADER
from router.serve.edge import ClientLeft, Edge
from router.serve.record import CallRecord

# Response headers that belong to one hop (RFC 9110 §7.6.1) or that the edge sets itself, and
# those about the box itself: `Server`, `X-Powered-By` and `Via` name its software and path
# (nothing a client of the router needs, and a map for an attacker), `Set-Cookie` would bind the
# client to a session with one box that the next call, on another box, does not have. A box's CORS headers
# (`Access-Control-*`, an LM Studio with CORS on sends `Allow-Origin: *`) would open the router's
# answers to every web page: the router grants no cross-origin reads (docs/security.md).
# `X-Router-Model` and `X-Router-Fallback` are the router's own (serve/aliases.py rule 5): a box's
# would say another model served.
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
        b"x-powered-by",
        b"x-router-model",
        b"x-router-fallback",
        # set by this router on every box answer: a router box's own would come out twice
        b"x-hugpy-box",
        b"x-hugpy-router-request-id",
    }
)
# Dropped by prefix (one startswith a header): the CORS headers above, and the headers a box
# names as its own internals (`X-Internal-Trace`, `X-Internal-Host`), as `Server` is.
DROPPED_PREFIXES = (b"access-control-", b"x-internal-")
KEEPALIVE_COMMENT = b": waiting\n\n"
NOT_A_STREAM = "answer_not_a_stream"
NOT_A_STREAM_FRAME = (b'data: {"error": {"message": "the box answered whole, in a form the stream cannot carry", '
                      b'"type": "upstream_error", "code": "answer_not_a_stream"}}\n\n')
JSON = b"application/json"
BOX_ERROR = "box_error"
LOGGED_BODY_CHARS = 200  # of a box's error body that is no API's error (rule 5)

log = logging.getLogger("router.proxy")


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


class Reply:
    __slots__ = ("edge", "facade", "record", "on_left", "keepalive_s", "headed", "keepalive", "last_keepalive_s",
                 "model_headers")

    def __init__(self, edge: Edge, facade: Facade, record: CallRecord, on_left: Callable[[], None]) -> None:
        self.edge = edge
        self.facade = facade
        self.record = record
        self.on_left = on_left  # the call's client_left: a write found the client gone (RSGI: edge.ClientLeft)
        self.keepalive_s = 0.0  # > 0 once the call is a stream of an SSE facade (rule 1)
        self.headed = False  # a keep-alive sent the stream head: every answer goes in-band
        self.keepalive: asyncio.Task | None = None  # the keep-alive write in progress
        self.last_keepalive_s = 0.0
        self.model_headers: tuple[tuple[bytes, bytes], ...] = ()  # an alias call's (serve/aliases.py rule 5)

    def id_header(self) -> tuple[bytes, bytes]:
        return (b"x-hugpy-router-request-id", self.record.call_id.encode())

    async def error(
        self, status: int, code: str, message: str, extra: dict | None = None, turned_away: bool = False,
        retry_after_s: int | None = None, more_headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        """The router's own answer, in the facade's shape; `turned_away` when it says that no box
        would take the call (the row's state `refused`)."""
        body = self.facade.shape_error(status, code, message, extra)
        headers = [(b"content-type", JSON), self.id_header()]
        if retry_after_s is not None:
            headers.append((b"retry-after", b"%d" % retry_after_s))
        headers += more_headers
        self.record.answered(status, code, turned_away=turned_away)
        await self.respond(status, headers, body)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer; in-band, as the stream's last frame, once a keep-alive sent a head."""
        if (keepalive := self.settle()) is not None:
            await keepalive
        if self.headed:
            frame = self.in_stream(status, body)
            self.record.sent(len(frame))
            try:
                await self.edge.write(frame)
                await self.edge.finish()
            except ClientLeft:
                self.on_left()
            return
        self.record.sent(len(body))
        await self.edge.respond(status, headers, body)

    async def box_error(self, box_name: str, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Rule 5: a box's error answer (`status` >= 400), committed."""
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if api_error(doc):
            await self.respond(status, self.box_headers(box_name, headers), body)
            return
        log.warning("call %s: box %s answered %d with a body that is no API's error: %s", self.record.call_id,
                    box_name, status, " ".join(body[:LOGGED_BODY_CHARS].decode("utf-8", "replace").split()))
        shaped = self.facade.shape_error(
            status, BOX_ERROR, f"box {box_name} answered {status} with a body that is not an API error (it is in "
            "the router's log)", {"box": box_name, "status": status})
        await self.respond(status, self.box_headers(box_name, [(b"content-type", JSON)]), shaped)

    def in_stream(self, status: int, body: bytes) -> bytes:
        """A whole answer as the end of a stream whose head went out (rules 1 and 4)."""
        if status >= 300:
            return in_band_frame(status, body)
        whole_as_stream = self.facade.whole_as_stream
        frames = whole_as_stream(body) if whole_as_stream is not None else None
        if frames is None:
            self.record.ended(NOT_A_STREAM)
            return NOT_A_STREAM_FRAME
        return frames

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The head of a relayed answer (a keep-alive may have sent one already)."""
        if (keepalive := self.settle()) is not None:
            await keepalive
        if not self.headed:
            await self.edge.start(status, headers)

    def box_headers(self, box_name: str, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """A box's answer headers (names lower-case: upstream.pool) as the client gets them (rule 3)."""
        kept = [
            (name, value)
            for name, value in headers
            if name not in HOP_HEADERS and not name.startswith(DROPPED_PREFIXES)
        ]
        kept.append((b"x-hugpy-box", box_name.encode()))
        kept.append(self.id_header())
        kept.extend(self.record.limit_headers)  # its key's x-ratelimit-* (serve/limits.py)
        if self.model_headers:
            kept.extend(self.model_headers)
        if self.record.affinity is not None:
            kept.append((AFFINITY_HEADER, self.record.affinity.encode()))
        return kept

    # -- keep-alive of a long wait (rule 1) ----------------------------------------------------
    def keep_alive_due(self, now: float, started_s: float) -> None:
        """The CallClock's look: a streamed call still without an answer gets its comment."""
        every = self.keepalive_s
        if (
            every > 0
            and self.record.status == 0
            and now - max(started_s, self.last_keepalive_s) >= every
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
                    self.id_header(),
                ])
            await self.edge.write(KEEPALIVE_COMMENT)
            self.record.sent(len(KEEPALIVE_COMMENT))
        except ClientLeft:
            self.on_left()

    def settle(self) -> asyncio.Task | None:
        """No more keep-alives (rule 2): the keep-alive write in progress, which the answer
        awaits, if there is one (no coroutine a call when there is none)."""
        self.keepalive_s = 0.0
        task, self.keepalive = self.keepalive, None
        return task

    def stop(self) -> None:
        """The call is over: no write may follow it."""
        if self.keepalive is not None:
            self.keepalive.cancel()
