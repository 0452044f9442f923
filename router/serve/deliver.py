"""The answer a box's attempt was judged fit to give: committed once, then sent whole or relayed.

Rules:
1. Commit happens once per call (router.core.lifecycle: JUDGED → RELAYING): the row's status and
   state are set, and the box remembers it took the call with these settings (not for the
   client's own error, which goes back as sent when it is an API's error: reply.py rule 5).
2. An answer read whole goes out in one piece; any other is relayed as it arrives
   (router._fastpath.Relay), its head first.
3. After the head nothing is rerouted: a box failing mid-stream ends the stream with an in-band
   error frame in the stream's own format; a body with no frames is cut instead (RelayAborted:
   the server aborts the connection), so it never looks complete. A box silent mid-answer for
   longer than the stream idle timeout has failed too, and a hugpy box also gets its cancel.
4. A close-delimited SSE stream (hugpy's) ends with `data: [DONE]`; an EOF before it is a box
   that died, not a finished answer.
5. A box that answers a kept-alive stream (its head went out: reply.py rule 1) with a whole
   answer rather than a stream has it read whole, up to INLINE_BODY_LIMIT, and put in the stream
   (reply.py rule 4); a larger one is `answer_not_a_stream`, never relayed raw into the stream.
6. A stream whose usage the router asked for (facades/usage.py) reaches the client without that
   usage chunk, otherwise byte for byte; the chunk goes to the call's record.
"""

from __future__ import annotations

import asyncio
import logging

from router._fastpath import NDJSON, SSE, Relay
from router.boxes.state import BoxState
from router.core.lifecycle import Event, Lifecycle
from router.facades.usage import UsageStrip
from router.serve.attempt import INLINE_BODY_LIMIT, Attempt, Judged
from router.serve.edge import ClientLeft
from router.serve.reply import NOT_A_STREAM, NOT_A_STREAM_FRAME, Reply
from router.upstream.pool import ConnectionLost, StreamIdle, UpstreamError

log = logging.getLogger("router.proxy")

COMMITTED = Event.COMMITTED  # read per call: a module name is cheaper than the Enum's (lifecycle.py)

MID_STREAM_FAILED = "box_failed_mid_stream"
# (framing, the call's failure) -> the in-band frame that ends a stream whose box failed.
MID_STREAM_ERROR = {
    (SSE, MID_STREAM_FAILED): b'data: {"error": {"message": "the box failed mid-stream", '
    b'"type": "upstream_error", "code": "box_failed"}}\n\n',
    (NDJSON, MID_STREAM_FAILED): b'{"error": "the box failed mid-stream"}\n',
    (SSE, StreamIdle.refusal): b'data: {"error": {"message": "the box went silent mid-stream", '
    b'"type": "upstream_error", "code": "stream_idle_timeout"}}\n\n',
    (NDJSON, StreamIdle.refusal): b'{"error": "the box went silent mid-stream"}\n',
}


class RelayAborted(Exception):
    """The answer was cut after its head went out: the client connection must be aborted."""


class Delivery:
    __slots__ = ("reply", "life", "relay")

    def __init__(self, reply: Reply, life: Lifecycle) -> None:
        self.reply = reply
        self.life = life
        self.relay: Relay | None = None  # once relaying

    @property
    def delivered(self) -> bool:
        """The stream's end (`data: [DONE]`) reached the client: a hang-up now cancels nothing."""
        return self.relay is not None and self.relay.delivered

    async def send(self, box: BoxState, judged: Judged, attempt: Attempt, asked_usage: bool = False) -> None:
        """Rules 1 and 2."""
        self.life.fire(COMMITTED)
        reply, record = self.reply, self.reply.record
        record.answered(judged.status, judged.failure, stream=judged.stream)
        if judged.failure is None:
            box.took(record.call, asyncio.get_running_loop().time())  # type: ignore[arg-type]
        headers = reply.box_headers(box.name, judged.headers)
        if judged.body is None and reply.headed and not judged.stream:
            await self.whole_into_stream(judged, attempt)
            return
        if judged.body is not None:
            if judged.failure is not None:  # the client's own error: an API's error, or the router's
                await reply.box_error(box.name, judged.status, judged.headers, judged.body)
                return
            record.kept_tail((judged.body,))
            await reply.respond(judged.status, headers, judged.body)
            return
        await reply.start(judged.status, headers)
        await self.relay_answer(judged, attempt, asked_usage)

    async def whole_into_stream(self, judged: Judged, attempt: Attempt) -> None:
        """Rule 5."""
        exchange = judged.exchange
        try:
            body = judged.first + await exchange.read_all(INLINE_BODY_LIMIT)
        except UpstreamError as exc:
            if self.life.ended_by is Event.CLIENT_LEFT:
                return
            if exchange.bytes_in > INLINE_BODY_LIMIT:
                self.reply.record.ended(NOT_A_STREAM)
                await self.end_stream(NOT_A_STREAM_FRAME)
                return
            await self.failed_mid_answer(judged, attempt, isinstance(exc, StreamIdle))
            return
        self.reply.record.kept_tail((body,))
        await self.reply.respond(judged.status, [], body)

    async def relay_answer(self, judged: Judged, attempt: Attempt, asked_usage: bool) -> None:
        relay = self.relay = Relay(judged.scanner)
        exchange, edge, record = judged.exchange, self.reply.edge, self.reply.record
        write, strip = edge.write, None
        if asked_usage and judged.scanner is not None and judged.scanner.framing == SSE:  # rule 6
            strip = UsageStrip(write)
            write = strip.write
        try:
            await relay.run(judged.first, write, exchange.next_chunks)
            if strip is not None:
                await strip.flush()
            if exchange.close_delimited and not relay.complete():  # rule 4
                raise ConnectionLost("stream closed before its end")
            record.kept_tail((relay.last, relay.data))  # a whole answer's end: a trace's token usage
            await edge.finish()
        except ClientLeft:
            self.reply.on_left()
        except UpstreamError as exc:
            if self.life.ended_by is None:  # (a client that left, or left after the end, ended it)
                await self.failed_mid_answer(judged, attempt, isinstance(exc, StreamIdle))
        finally:
            record.sent(relay.bytes_out - (strip.dropped_bytes if strip is not None else 0))
            if strip is not None:
                record.kept_usage(strip.usage)

    async def failed_mid_answer(self, judged: Judged, attempt: Attempt, silent: bool) -> None:
        """Rule 3."""
        failure = StreamIdle.refusal if silent else MID_STREAM_FAILED
        log.debug("call %s: box %s %s", self.reply.record.call_id, attempt.box.name, failure)
        self.life.fire(Event.BOX_FAILED)
        self.reply.record.ended(failure)
        if silent:
            attempt.cancel()  # its connection is closed; a stuck box may not notice
        if judged.scanner is not None:
            framing = judged.scanner.framing
        elif self.reply.headed:  # a kept-alive stream (rule 5)
            framing = SSE
        else:
            raise RelayAborted("the box failed mid-body")
        await self.end_stream(MID_STREAM_ERROR[framing, failure])

    async def end_stream(self, frame: bytes) -> None:
        """Ends a stream whose head went out with its last `frame`."""
        edge = self.reply.edge
        try:
            await edge.write(frame)
            await edge.finish()
        except ClientLeft:
            self.reply.on_left()
