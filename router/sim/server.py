"""Plumbing shared by the simulated boxes: one HTTP/1.1 server per box on loopback, a fleet of
them on one loop in a background thread, scripted behaviours and call records.

Each box kind (`hugpy`, `ollama`, `lmstudio`) is a `SimServer` subclass with its own route
table and its own answers; everything about the wire is here.

Rules and invariants:
1. Wire. One `asyncio.Protocol` per TCP connection with an `httptools.HttpRequestParser`.
   Requests on one connection are answered strictly in order (pipelining is queued);
   bodies are read by Content-Length; a chunked request body is read as empty. A whole
   answer has a Content-Length (a HEAD answer keeps the length and drops the body) and keeps
   the connection alive unless the request asked for `Connection: close`. A stream is either
   chunked (`stream_head`/`send`/`end_stream`, as Go and Express write them: the connection
   stays usable) or close-delimited (the hugpy box writes those itself).
2. Steps. A route handler is either a plain function that answers at once, or a generator
   that yields whenever it must wait (a float = sleep that many seconds, anything else is
   awaited). A call that never waits is answered synchronously inside `data_received`, with
   no task: that keeps the benchmark path cheap. The first wait moves the rest of the
   generator into one task; closing the generator runs its `finally` blocks.
3. Disconnects. When the peer closes while a call is being answered, the call's
   `client_closed_at` is stamped and its work is cancelled at once. Writes after a close
   are dropped, never raised.
4. Threads. The test thread may mutate a box's public state (plain attribute, dict, set and
   list operations); everything else runs on the loop thread.
5. Privacy. Bodies are parsed only to find the fields that steer an answer (`model`,
   `stream`, …); nothing is logged or stored, and every reply text is fixed.
6. Faults for the fault suite. `Connection.slow_writes` sends whatever the answer writes
   `chunk_bytes` at a time (`Behavior.trickle`); `Connection.bad_head` writes a head no HTTP
   parser accepts (`Behavior.bad_head`); `SimServer.close_idle_after` closes keep-alive
   connections that stay idle too long, like every real server's idle timeout, and can also
   stage the race where that close meets the client's next request (`timer=False`).
   `Behavior.cut` is a `raw` answer cut mid-body, so every kind can be scripted with it.
   `Behavior.stall_after` goes silent mid-stream (`_stream` applies it, as it does `die_after`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable, Iterable, Iterator

import httptools
import uvloop

from router.sim.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

# Kept call records: the newest CALLS_KEPT survive a trim at twice that, so a benchmark of
# millions of calls stays bounded while a test never loses one.
CALLS_KEPT = 10_000
START_TIMEOUT_S = 10.0  # SimFleet.start: binding loopback sockets takes milliseconds
LISTEN_BACKLOG = 1024  # the benchmark opens hundreds of connections at once

STREAM_TOKEN = "tok "  # every streamed content piece carries this text

_dumps = json.JSONEncoder(ensure_ascii=False).encode
# Go's encoding/json and JavaScript's JSON.stringify write without spaces.
_compact_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def json_body(obj: object) -> bytes:
    """JSON as Python's stdlib writes it (`"a": 1`): the hugpy box's spacing."""
    return _dumps(obj).encode()


def compact_json(obj: object) -> bytes:
    """JSON as Go and JavaScript write it (`"a":1`): Ollama's and LM Studio's spacing."""
    return _compact_dumps(obj).encode()


def sse_frame(obj: object, compact: bool = False) -> bytes:
    """One server-sent event, `data: <json>` and a blank line."""
    return b"data: " + (compact_json(obj) if compact else json_body(obj)) + b"\n\n"


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} Unknown\r\n".encode()


_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_STATUS_LINES[499] = b"HTTP/1.1 499 Client Closed Request\r\n"

CT_JSON = b"application/json"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST
_LAST_CHUNK = b"0\r\n\r\n"
# Behavior.bad_head: the letter O where the status digits belong.
BAD_HEAD = b"HTTP/1.1 2OO OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

# The scripted behaviours a stream applies as it goes (`_stream`), rather than answered at once.
STREAM_FAULTS = frozenset({"die_after", "stall_after"})

Steps = Iterator[Any]  # a handler's generator: yields a float (sleep) or an awaitable (rule 2)
ANSWERED = object()  # _apply_script's result when a scripted behaviour answered the call


# ---------------------------------------------------------------------------------------------
# Scripted behaviours and call records


@dataclass(frozen=True, slots=True)
class Behavior:
    """One scripted answer for one call; build it with the constructors below. Each box kind
    writes it in its own error dialect (see its module docstring)."""

    kind: str
    status: int = 0
    type: str | None = None
    message: str = ""
    code: int | str | None = None
    seconds: float = 0.0
    chunks: int = 0
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    clean: bool = True  # die_after, drop, cut: FIN (True) or RST (False)
    size: int = 0  # trickle: bytes per write
    cut_at: int = -1  # raw: body bytes sent before the connection is cut (-1: the whole body)
    length: bool = True  # raw: with a Content-Length (False: close-delimited)

    @staticmethod
    def refuse(status: int, type: str | None, message: str = "refused by the simulated box",
               code: int | str | None = None) -> Behavior:
        """A JSON error with that status before any byte of success; `code` defaults to the
        status, `type=None` leaves `type` out (the box's untyped errors)."""
        return Behavior("refuse", status=status, type=type, message=message,
                        code=status if code is None else code)

    @staticmethod
    def busy() -> Behavior:
        """Ollama's queue-full answer: 503 `server busy, please try again.  maximum pending
        requests exceeded` (a `refuse`, so every kind can be scripted with it)."""
        return Behavior.refuse(503, None, BUSY_MESSAGE)

    @staticmethod
    def in_band(type: str | None = None, message: str = "refused by the simulated box",
                code: int | str = 503) -> Behavior:
        """Stream: a 200 stream head, one error frame or line in the kind's dialect, end.
        Non-stream: the same as `refuse(code, type)` (503 unless `code` is an int status)."""
        return Behavior("in_band", status=code if isinstance(code, int) else 503, type=type,
                        message=message, code=code)

    @staticmethod
    def hang(seconds: float) -> Behavior:
        """Send nothing for `seconds`, then answer normally."""
        return Behavior("hang", seconds=seconds)

    @staticmethod
    def reset() -> Behavior:
        """Close the socket (RST) without any response byte."""
        return Behavior("reset")

    @staticmethod
    def die_after(chunks: int, clean: bool = True) -> Behavior:
        """Stream: head, lead-in frames, `chunks` content frames, then close (no final frame):
        with `clean` (the default) an orderly close (FIN, what a crashed process's kernel
        sends), else an abortive one (RST). A chunked stream (ollama, lmstudio) is cut without
        its last chunk; those kinds always close with FIN. Non-stream: like `reset()`, since
        there is no partial JSON answer."""
        return Behavior("die_after", chunks=chunks, clean=clean)

    @staticmethod
    def stall_after(chunks: int, seconds: float) -> Behavior:
        """Stream: head, lead-in frames, `chunks` content frames, then `seconds` of silence with
        the connection open, then the rest as normal (a box stuck mid-answer). Non-stream: like
        `hang(seconds)`."""
        return Behavior("stall_after", chunks=chunks, seconds=seconds)

    @staticmethod
    def drop(after_s: float = 0.0, clean: bool = True) -> Behavior:
        """The box takes the call (it is recorded), then after `after_s` closes the connection
        without sending a byte: FIN when `clean`, else RST. (hugpy boxes; the other kinds answer
        unknown behaviours with a reset.)"""
        return Behavior("drop", seconds=after_s, clean=clean)

    @staticmethod
    def linger(seconds: float) -> Behavior:
        """The normal answer, but a close-delimited stream stays open `seconds` after its last
        frame (`data: [DONE]`) before the box closes it, as a box busy tearing down may. Each
        burst of the stream's writes goes out as one write: without a cadence the head, every
        frame and [DONE] reach the client in one piece. (hugpy boxes; the other kinds answer
        unknown behaviours with a reset.)"""
        return Behavior("linger", seconds=seconds)

    @staticmethod
    def bad_head() -> Behavior:
        """An answer whose status line no HTTP parser accepts (`HTTP/1.1 2OO OK`), then close.
        The call is recorded first: the box took it and then broke HTTP. (hugpy boxes; the
        other kinds answer unknown behaviours with a reset.)"""
        return Behavior("bad_head")

    @staticmethod
    def trickle(chunk_bytes: int, interval_s: float) -> Behavior:
        """The normal answer (stream or not, head included), written `chunk_bytes` at a time
        with `interval_s` between writes; the call ends when the last byte is out. (hugpy
        boxes; the other kinds answer unknown behaviours with a reset.)"""
        if chunk_bytes < 1 or interval_s < 0:
            raise ValueError("trickle needs chunk_bytes >= 1 and interval_s >= 0")
        return Behavior("trickle", size=chunk_bytes, seconds=interval_s)

    @staticmethod
    def raw(status: int, headers: list[tuple[str, str]], body: bytes) -> Behavior:
        """Answer exactly this (Content-Length is added)."""
        return Behavior("raw", status=status, headers=tuple(headers), body=body)

    @staticmethod
    def stall_body(status: int, headers: list[tuple[str, str]], body: bytes, after_bytes: int,
                   seconds: float) -> Behavior:
        """Like `raw` with a Content-Length, but after `after_bytes` of the body the box goes
        silent for `seconds`, connection open, then sends the rest. (hugpy boxes; the other
        kinds answer unknown behaviours with a reset.)"""
        if not 0 <= after_bytes <= len(body):
            raise ValueError("after_bytes must be within the body")
        return Behavior("stall_body", status=status, headers=tuple(headers), body=body, cut_at=after_bytes,
                        seconds=seconds)

    @staticmethod
    def cut(status: int, headers: list[tuple[str, str]], body: bytes, after_bytes: int, *,
            clean: bool = True, length: bool = True) -> Behavior:
        """Like `raw`, but the connection is cut after `after_bytes` of the body: closed with a
        FIN when `clean`, else an RST. With `length` the head declares the whole body's
        Content-Length (so the cut is visible to any client); without, the answer is
        close-delimited (`Connection: close`, no length), where only an RST marks the cut.
        An RST drops whatever the kernel has not sent yet, so at most `after_bytes` arrive.
        Every kind answers it (it is a `raw` behaviour)."""
        if not 0 <= after_bytes <= len(body):
            raise ValueError("after_bytes must be within the body")
        return Behavior("raw", status=status, headers=tuple(headers), body=body, cut_at=after_bytes,
                        clean=clean, length=length)


BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"  # sic: two spaces


@dataclass(slots=True)
class CallRecord:
    """One tracked call as the box saw it. `finished_at` is when the box stopped working on it
    (answered, cancelled, or the peer left); `client_closed_at` only when the peer left first."""

    path: str
    method: str
    model: str | None
    stream: bool
    parent_id: str | None  # X-Hugpy-Parent-Request-Id (hugpy boxes only)
    headers: dict[str, str]  # lower-cased names, as received
    body_len: int
    content_type: str | None
    started_at: float  # time.monotonic()
    finished_at: float | None = None
    client_closed_at: float | None = None
    status: int | None = None
    request_id: str = ""  # the box's own id for the call, where it has one (hugpy: fe-…)


def _raw_parts(behavior: Behavior) -> tuple[bytes, list[tuple[str, str]]]:
    """A `raw` answer's Content-Type (defaulted) and its other headers."""
    content_type = next((v.encode("latin-1") for n, v in behavior.headers if n.lower() == "content-type"),
                        b"application/octet-stream")
    extra = [(n, v) for n, v in behavior.headers if n.lower() not in ("content-type", "content-length")]
    return content_type, extra


def answer_raw(conn: Connection, ex: Exchange, behavior: Behavior) -> None:
    """Writes a `Behavior.raw` answer: its status, headers and body as given."""
    content_type, extra = _raw_parts(behavior)
    if behavior.cut_at < 0:
        conn.respond(ex, behavior.status, behavior.body, content_type, extra)
        return
    # Behavior.cut: the head (with the whole length, or close-delimited), part of the body, cut.
    ex.keep_alive = behavior.length  # close-delimited: the head says Connection: close
    head = conn._head(ex, behavior.status, content_type, extra)
    if behavior.length:
        head += (b"Content-Length: ", str(len(behavior.body)).encode(), b"\r\n")
    head += (b"\r\n", behavior.body[:behavior.cut_at])
    conn.write(b"".join(head))
    if behavior.clean:
        conn.close()
    else:
        conn.reset()


def answer_stalled_body(conn: Connection, ex: Exchange, behavior: Behavior) -> Steps:
    """Generator: a `Behavior.stall_body` answer: head and the first bytes, silence, the rest."""
    head = conn._head(ex, behavior.status, *_raw_parts(behavior))
    head += (b"Content-Length: ", str(len(behavior.body)).encode(), b"\r\n\r\n", behavior.body[:behavior.cut_at])
    conn.write(b"".join(head))
    yield behavior.seconds
    conn.write(behavior.body[behavior.cut_at:])
    if not ex.keep_alive:
        conn.close()


# ---------------------------------------------------------------------------------------------
# One connection and one request


class Exchange:
    """One request on a connection, from its first byte to the end of its answer."""

    __slots__ = ("url", "path", "query", "method", "headers", "body_parts", "body", "keep_alive",
                 "path_args", "record", "rid", "head_sent")

    def __init__(self) -> None:
        # parsed request
        self.url = ""
        self.path = ""
        self.query: str | None = None
        self.method = ""
        self.headers: dict[str, str] = {}
        self.body_parts: list[bytes] = []
        self.body = b""
        self.keep_alive = True
        self.path_args: tuple[str, ...] = ()
        # answer
        self.record: CallRecord | None = None  # tracked calls only
        self.rid = b""  # the box's call id, sent in its `id_header` on every answer
        self.head_sent = False


class Connection(asyncio.Protocol):
    """One TCP connection: parses requests, runs their handlers in order, writes answers."""

    def __init__(self, box: SimServer) -> None:
        # per connection
        self._box = box
        self._loop = box._loop
        self._transport: asyncio.Transport = None  # type: ignore[assignment]  # connection_made sets it
        self._parser = httptools.HttpRequestParser(self)
        self._queue: deque[Exchange] = deque()  # parsed, waiting for the one being answered
        self._we_closed = False
        self._lost = False
        # per request
        self._incoming = Exchange()  # being parsed
        self._current: Exchange | None = None  # being answered
        self._task: asyncio.Task[None] | None = None  # the current answer once it waits
        self._steps: Steps | None = None  # its generator
        # keep-alive idle timeout (SimServer.close_idle_after)
        self._idle_since: float | None = None  # loop time the connection went idle
        self._parsing = False  # a request is partly parsed
        self._idle_timer: asyncio.TimerHandle | None = None
        # slow writes (Behavior.trickle): None, or (bytes per write, seconds between writes)
        self._slow: tuple[int, float] | None = None
        self._slow_buf = bytearray()
        self._slow_task: asyncio.Task[None] | None = None
        self._slow_close = False  # close once the buffer is out
        self._slow_waiters: list[asyncio.Future[None]] = []

    # -- transport callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # create_server gives a Transport
        self._box.open_connections += 1
        self._box._conns.add(self)
        self._went_idle()

    def data_received(self, data: bytes) -> None:
        if self._idle_since is not None and self._box.idle_close_s is not None and self._idle_stale(data):
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no upgrades here; whatever follows is ignored
        except httptools.HttpParserError:
            self.write(status_line(400) + b"Content-Length: 0\r\nConnection: close\r\n\r\n")
            self.close()
            return
        self._next()

    def eof_received(self) -> bool:
        return False  # the peer is gone: close our side too (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._box.open_connections -= 1
        self._box._conns.discard(self)
        self._cancel_idle_timer()
        if self._slow_task is not None:
            self._slow_task.cancel()
        self._wake_slow_waiters()
        ex = self._current
        if ex is not None and not self._we_closed:
            if ex.record is not None and ex.record.finished_at is None:
                ex.record.client_closed_at = time.monotonic()
        self._stop_current()

    # -- parser callbacks (tiny: collect, then return) ----------------------------------------

    def on_message_begin(self) -> None:
        self._incoming = Exchange()
        self._parsing = True

    def on_url(self, url: bytes) -> None:
        self._incoming.url += url.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self._incoming.headers
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        # Servers answer `Expect: 100-continue` before reading the body; so do we.
        if self._incoming.headers.get("expect", "").lower() == "100-continue":
            self._transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._incoming.body_parts.append(body)

    def on_message_complete(self) -> None:
        self._parsing = False
        ex = self._incoming
        ex.method = self._parser.get_method().decode("latin-1")
        ex.keep_alive = self._parser.should_keep_alive()
        path, sep, query = ex.url.partition("?")
        ex.path = path.rstrip("/") or "/"
        ex.query = query if sep else None
        # Bodies are exactly Content-Length bytes; a chunked body is read as empty.
        if "content-length" in ex.headers:
            ex.body = b"".join(ex.body_parts)
        ex.body_parts = []
        self._queue.append(ex)

    # -- running handlers ---------------------------------------------------------------------

    def _next(self) -> None:
        """Answers queued requests in order until one has to wait (rule 2)."""
        while self._current is None and self._queue and not self._lost and not self._we_closed:
            ex = self._queue.popleft()
            self._current = ex
            steps: Steps | None = None
            step = None
            try:
                steps = self._box._dispatch(self, ex)
                step = next(steps, None) if steps is not None else None
            except Exception as exc:  # a bug in the sim: answer the box's 500
                self._fail(ex, exc)
            if step is None:
                self._end(ex, steps)
            else:
                self._steps = steps
                self._task = self._loop.create_task(self._run_later(ex, steps, step))

    async def _run_later(self, ex: Exchange, steps: Steps, step: Any) -> None:
        try:
            while step is not None:
                await (asyncio.sleep(step) if isinstance(step, (int, float)) else step)
                step = next(steps, None)
        except asyncio.CancelledError:
            return  # _stop_current already ended the call
        except Exception as exc:
            self._fail(ex, exc)
        self._end(ex, steps)
        self._next()

    def _end(self, ex: Exchange, steps: Steps | None) -> None:
        """Ends the call being answered; safe to call twice."""
        if steps is not None:
            steps.close()  # runs the handler's finally blocks (seat release)
        if self._current is ex:
            self._current = None
            self._task = None
            self._steps = None
        self._box._finish(ex)
        if self._current is None and not self._queue:
            self._went_idle()

    def _fail(self, ex: Exchange, exc: Exception) -> None:
        log.exception("sim box %s: handler failed", self._box.name, exc_info=exc)
        if not ex.head_sent:
            ex.keep_alive = False
            self.respond(ex, 500, self._box._crash_body(exc))
        self.close()

    def _stop_current(self) -> None:
        """Stops the waiting call now. Cleanup is done here, not in the task: a task cancelled
        before its first step never runs its body."""
        ex, task = self._current, self._task
        if task is not None:
            task.cancel()
        if ex is not None:
            self._end(ex, self._steps)

    # -- writing ------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._slow is not None:
            self._slow_write(data)
        elif not self._transport.is_closing():
            self._transport.write(data)

    def _head(self, ex: Exchange, status: int, content_type: bytes,
              extra: Iterable[tuple[str, str]]) -> list[bytes]:
        """Status line and the headers every answer carries; the caller adds the framing."""
        head = [status_line(status)]
        if content_type:
            head += (b"Content-Type: ", content_type, b"\r\n")
        if ex.rid:
            head += (self._box.id_header, b": ", ex.rid, b"\r\n")
        if self._box.server_headers:
            head.append(self._box.server_headers)
        for name, value in extra:
            head += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
        if not ex.keep_alive:
            head.append(b"Connection: close\r\n")
        self.mark_head(ex, status)
        return head

    def respond(self, ex: Exchange, status: int, body: bytes, content_type: bytes = CT_JSON,
                extra: Iterable[tuple[str, str]] = ()) -> None:
        """Writes a whole answer with a Content-Length (no body for HEAD; no Content-Type when
        `content_type` is empty); closes unless keep-alive."""
        head = self._head(ex, status, content_type, extra)
        head += (b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n")
        if ex.method != "HEAD":
            head.append(body)
        self.write(b"".join(head))
        if not ex.keep_alive:
            self.close()

    def stream_head(self, ex: Exchange, content_type: bytes, extra: Iterable[tuple[str, str]] = ()) -> None:
        """Starts a 200 chunked answer; `send` writes each piece, `end_stream` the last chunk."""
        head = self._head(ex, 200, content_type, extra)
        head.append(b"Transfer-Encoding: chunked\r\n\r\n")
        self.write(b"".join(head))

    def send(self, data: bytes) -> None:
        """One chunk of a chunked answer."""
        self.write(b"%x\r\n%b\r\n" % (len(data), data))

    def end_stream(self, ex: Exchange) -> None:
        """Ends a chunked answer; the connection stays open unless the request asked to close."""
        self.write(_LAST_CHUNK)
        if not ex.keep_alive:
            self.close()

    @staticmethod
    def mark_head(ex: Exchange, status: int) -> None:
        ex.head_sent = True
        if ex.record is not None:
            ex.record.status = status

    def close(self) -> None:
        """Closes after the buffered bytes are sent (FIN)."""
        self._we_closed = True
        if self._slow_buf:
            self._slow_close = True  # the trickle closes once its last byte is out
            return
        self._transport.close()

    def reset(self) -> None:
        """Closes at once with an RST, dropping anything buffered."""
        self._we_closed = True
        self._slow_buf.clear()
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        self._transport.abort()

    def abort(self) -> asyncio.Task[None] | None:
        """For SimServer.stop: drop the connection; returns the task still to be awaited."""
        task = self._task
        self._we_closed = True
        self._slow_buf.clear()
        self._transport.abort()
        self._stop_current()
        return task

    def bad_head(self, ex: Exchange) -> None:
        """Behavior.bad_head: a status line no parser accepts, then close (FIN)."""
        self.mark_head(ex, 200)
        ex.keep_alive = False
        self.write(BAD_HEAD)
        self.close()

    # -- slow writes (Behavior.trickle) -------------------------------------------------------

    def slow_writes(self, chunk_bytes: int | None, interval_s: float = 0.0) -> None:
        """From now on every write goes out `chunk_bytes` at a time, `interval_s` apart;
        `None` switches back to plain writes once the buffer is out."""
        self._slow = None if chunk_bytes is None else (chunk_bytes, interval_s)

    def drained(self) -> asyncio.Future[None]:
        """A future that resolves once every slow write is out (or the peer is gone)."""
        fut = self._loop.create_future()
        if not self._slow_buf or self._lost:
            fut.set_result(None)
        else:
            self._slow_waiters.append(fut)
        return fut

    def _slow_write(self, data: bytes) -> None:
        if self._lost or self._transport.is_closing():
            return
        self._slow_buf += data
        if self._slow_task is None or self._slow_task.done():
            self._slow_task = self._loop.create_task(self._slow_drain())

    async def _slow_drain(self) -> None:
        buf = self._slow_buf
        while buf and not self._lost:
            size, interval_s = self._slow or (len(buf), 0.0)
            piece = bytes(buf[:size])
            del buf[:size]
            if not self._transport.is_closing():
                self._transport.write(piece)
            if buf and interval_s > 0:
                await asyncio.sleep(interval_s)
        self._wake_slow_waiters()
        if self._slow_close and not self._lost:
            self._slow_close = False
            self._transport.close()

    def _wake_slow_waiters(self) -> None:
        waiters, self._slow_waiters = self._slow_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- keep-alive idle timeout (SimServer.close_idle_after) ---------------------------------

    def _went_idle(self) -> None:
        """Between requests: the idle clock runs (and the idle timer, when the box has one)."""
        if self._lost or self._we_closed or self._parsing:
            return
        self._idle_since = self._loop.time()
        self._cancel_idle_timer()
        limit = self._box.idle_close_s
        if limit is not None and self._box.idle_close_timer:
            self._idle_timer = self._loop.call_later(limit, self._idle_expired)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if self._idle_since is not None and self._current is None and not self._queue and not self._lost:
            self._box.idle_closes += 1
            self.close()

    def _idle_stale(self, data: bytes) -> bool:
        """The first bytes of a request on an idle connection. When it sat idle past the box's
        limit, the box's close has raced this request: the box closes (FIN) without reading a
        byte of it, so no call starts. Returns True when the data was dropped that way."""
        idle_s = self._loop.time() - self._idle_since  # type: ignore[operator]
        self._idle_since = None
        self._cancel_idle_timer()
        if idle_s <= self._box.idle_close_s:  # type: ignore[operator]
            return False
        self._box.idle_closes += 1
        self._box.idle_races += 1
        self.close()
        return True


Handler = Callable[[Any, Connection, Exchange], "Steps | None"]  # (box, conn, ex)
Routes = dict[tuple[str, str], Handler]  # (method, path) -> handler
PatternRoutes = list[tuple[str, Any, Handler]]  # (method, compiled pattern, handler); groups -> path_args


def find_route(routes: Routes, patterns: PatternRoutes, ex: Exchange) -> Handler | None:
    """The handler for `ex` (exact paths first, then patterns, whose groups become
    `ex.path_args`), or None."""
    handler = routes.get((ex.method, ex.path))
    if handler is not None:
        return handler
    for method, pattern, pattern_handler in patterns:
        match = pattern.fullmatch(ex.path) if ex.method == method else None
        if match is not None:
            ex.path_args = match.groups()
            return pattern_handler
    return None


# ---------------------------------------------------------------------------------------------
# The box base


class SimServer:
    """One simulated box: listening, connections, call records and scripts. Subclasses set
    `kind`, implement `_dispatch` and `_crash_body`, and may set `id_header` (the header that
    carries `ex.rid`) and `server_headers` (raw header lines on every answer)."""

    kind = ""
    id_header = b""
    server_headers = b""
    connection_class: type[Connection] = Connection

    def __init__(self, name: str, *, chunks: int = 5, cadence_s: float = 0.0) -> None:
        self.name = name
        self.chunks = chunks  # content pieces per stream
        self.cadence_s = cadence_s  # pause before each content piece
        self.prefix_cache = PrefixCache()  # what it computed for recent prompts (sim/prefix_cache.py)
        # observations
        self.calls: list[CallRecord] = []
        self.open_connections = 0
        self.idle_closes = 0  # keep-alive connections closed for idling (close_idle_after)
        self.idle_races = 0  # of those, closed as a request arrived on them (timer=False)
        # keep-alive idle timeout: None = connections may idle forever
        self.idle_close_s: float | None = None
        self.idle_close_timer = True
        # an ssl.SSLContext (server side) to serve HTTPS with, set before start: an https box
        self.tls = None
        # set by start()
        self.port = 0
        self.url = ""
        # internals
        self._scripts: dict[str, deque[Behavior]] = {}
        self._conns: set[Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Binds and listens. Returns the port; sets `port` and `url`."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._server = await self._loop.create_server(
            lambda: self.connection_class(self), host, port, backlog=LISTEN_BACKLOG, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://{host}:{self.port}"
        return self.port

    def close_idle_after(self, seconds: float | None, *, timer: bool = True) -> None:
        """Closes keep-alive connections idle for more than `seconds` (None: never), as real
        servers do (uvicorn and Go default to 5 s). With `timer` (the default) the box closes
        the connection when the time is up, as a server's idle timer does; a client sees the
        FIN before it reuses the connection unless it is unlucky. With `timer=False` the close
        always meets the client's next request: a request arriving on a connection idle past
        `seconds` is dropped unread and the connection closed, which is the race at its worst
        (the box never starts that call). Callable from any thread; applies from the next
        idle period."""
        self.idle_close_s = seconds
        self.idle_close_timer = timer

    async def stop(self) -> None:
        """Stops listening and drops every connection."""
        if self._server is None:
            return
        self._server.close()
        tasks = [t for t in (c.abort() for c in list(self._conns)) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # let the aborted transports report connection_lost
        await self._server.wait_closed()
        self._server = None

    # -- for subclasses -----------------------------------------------------------------------

    def _dispatch(self, conn: Connection, ex: Exchange) -> Steps | None:
        raise NotImplementedError

    def _crash_body(self, exc: Exception) -> bytes:
        """The 500 body when a handler raises (a bug in the sim)."""
        raise NotImplementedError

    def _misbehave(self, conn: Connection, ex: Exchange, behavior: Behavior, stream: bool, shape: bool) -> None:
        """Answers a scripted refusal in the engine's own shape (`shape`: its variant flag)."""
        raise NotImplementedError

    def _queue_behaviors(self, key: str, behaviors: Iterable[Behavior]) -> None:
        self._scripts.setdefault(key, deque()).extend(behaviors)

    def _next_behavior(self, key: str) -> Behavior | None:
        queue = self._scripts.get(key)
        return queue.popleft() if queue else None

    def _apply_script(self, conn: Connection, ex: Exchange, key: str, stream: bool, shape: bool) -> Steps:
        """Generator: the next scripted behaviour for `key`, if any. `hang` (and `stall_after`
        without a stream) waits it out and a streamed `die_after` or `stall_after` is returned
        for `_stream` to apply, both for the call to go on; any other behaviour is answered by
        the subclass's `_misbehave(conn, ex, behavior, stream, shape)` and returns ANSWERED. No
        behaviour (or a hang) returns None."""
        behavior = self._next_behavior(key)
        if behavior is None:
            return None
        if behavior.kind == "hang" or (behavior.kind == "stall_after" and not stream):
            yield behavior.seconds
            return None
        if behavior.kind in STREAM_FAULTS and stream:
            return behavior
        self._misbehave(conn, ex, behavior, stream, shape)
        return ANSWERED

    def _record(self, ex: Exchange, rid: str = "", parent_id: str | None = None) -> CallRecord:
        """Opens the call record for `ex` (model and stream are filled in once read)."""
        headers = ex.headers
        rec = CallRecord(path=ex.path, method=ex.method, model=None, stream=False, parent_id=parent_id,
                         headers=headers, body_len=len(ex.body), content_type=headers.get("content-type"),
                         started_at=time.monotonic(), request_id=rid)
        ex.record = rec
        calls = self.calls
        calls.append(rec)
        if len(calls) > 2 * CALLS_KEPT:
            del calls[:-CALLS_KEPT]
        return rec

    def _finish(self, ex: Exchange) -> bool:
        """Stamps the record's `finished_at`; True the first time for a tracked call."""
        rec = ex.record
        if rec is None or rec.finished_at is not None:
            return False
        rec.finished_at = time.monotonic()
        return True

    def _stream(self, conn: Connection, ex: Exchange, content_type: bytes, lead: Iterable[bytes],
                pieces: Iterable[bytes], tail: Iterable[bytes], fault: Behavior | None) -> Iterator[Any]:
        """Generator: a chunked stream of `lead`, then `pieces` (each after `cadence_s`), then
        `tail`. With a `die_after` fault it closes after that many pieces (or all of them)
        instead of sending the tail; a `stall_after` fault goes silent for its seconds after
        that many pieces. Returns True when the stream ended normally."""
        conn.stream_head(ex, content_type)
        for data in lead:
            conn.send(data)
        for sent, data in enumerate(pieces):
            if fault is not None and sent == fault.chunks:
                if fault.kind == "die_after":
                    break
                yield fault.seconds
            if self.cadence_s > 0:
                yield self.cadence_s
            conn.send(data)
        if fault is not None and fault.kind == "die_after":
            conn.close()  # abrupt: no last chunk, so the client sees a cut-off body
            return False
        for data in tail:
            conn.send(data)
        conn.end_stream(ex)
        return True


# ---------------------------------------------------------------------------------------------
# A fleet on one loop in a background thread


class SimFleet:
    """Runs several simulated boxes (any mix of kinds) on one uvloop loop in a daemon thread."""

    def __init__(self, boxes: list[SimServer]) -> None:
        self.boxes = boxes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the loop thread and every box; returns once all are listening."""
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sim-fleet", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start_boxes(), self._loop).result(START_TIMEOUT_S)
        except BaseException:
            self.stop()  # no half-started fleet left behind
            raise

    def stop(self) -> None:
        """Stops every box, then the loop and its thread."""
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._stop_boxes(), self._loop).result(START_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_S)
        self._loop.close()
        self._loop = None

    def stop_box(self, box: SimServer) -> None:
        """Stops one box (its port refuses connections afterwards); the others keep serving."""
        asyncio.run_coroutine_threadsafe(box.stop(), self._loop).result(START_TIMEOUT_S)

    def start_box(self, box: SimServer) -> None:
        """Starts a box stopped with `stop_box` again, on the port it had (a process restart
        as a client sees it: refused connections, then the same address answers again)."""
        asyncio.run_coroutine_threadsafe(box.start(port=box.port), self._loop).result(START_TIMEOUT_S)

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Runs `fn(*args)` on the fleet loop, thread-safely."""
        self._loop.call_soon_threadsafe(fn, *args)

    def __enter__(self) -> SimFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _start_boxes(self) -> None:
        for box in self.boxes:
            await box.start()

    async def _stop_boxes(self) -> None:
        for box in self.boxes:
            await box.stop()
