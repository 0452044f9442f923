"""One HTTP/1.1 server connection of a simulated box, and one request on it (`Exchange`): the
wire plumbing every box kind shares. The box answers; this module reads and writes.

Rules:
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
4. Faults. `slow_writes` sends whatever the answer writes `chunk_bytes` at a time
   (`Behavior.trickle`); `bad_head` writes a head no HTTP parser accepts (`Behavior.bad_head`);
   the box's `idle_close_s` closes keep-alive connections that stay idle too long, like every
   real server's idle timeout, and can also stage the race where that close meets the
   client's next request (`idle_close_timer` False).
5. Callbacks stay tiny: the parser callbacks collect and return; the box's `_dispatch` runs
   after a request is whole.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Protocol

import httptools

from router.sim.wire import CT_JSON, status_line

log = logging.getLogger(__name__)

Steps = Iterator[Any]  # a handler's generator: yields a float (sleep) or an awaitable (rule 2)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST
_LAST_CHUNK = b"0\r\n\r\n"
# Behavior.bad_head: the letter O where the status digits belong.
BAD_HEAD = b"HTTP/1.1 2OO OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"



@dataclass(slots=True)
class CallRecord:
    """One tracked call as the box saw it (router.sim.server rule 2). `finished_at` is when the
    box stopped working on it (answered, cancelled, or the peer left); `client_closed_at` only
    when the peer left first."""

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


class Box(Protocol):
    """What a connection asks of the box it serves (router.sim.server.SimServer, which imports
    this module: a protocol, so that this module need not import it back)."""

    name: str
    id_header: bytes
    server_headers: bytes
    open_connections: int
    idle_close_s: float | None
    idle_close_timer: bool
    idle_closes: int
    idle_races: int
    _conns: set[Connection]
    _loop: asyncio.AbstractEventLoop | None

    def _dispatch(self, conn: Connection, ex: Exchange) -> Steps | None: ...

    def _finish(self, ex: Exchange) -> bool: ...

    def _crash_body(self, exc: Exception) -> bytes: ...


class Connection(asyncio.Protocol):
    """One TCP connection: parses requests, runs their handlers in order, writes answers."""

    def __init__(self, box: Box) -> None:
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

    def head(self, ex: Exchange, status: int, content_type: bytes,
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
        head = self.head(ex, status, content_type, extra)
        head += (b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n")
        if ex.method != "HEAD":
            head.append(body)
        self.write(b"".join(head))
        if not ex.keep_alive:
            self.close()

    def stream_head(self, ex: Exchange, content_type: bytes, extra: Iterable[tuple[str, str]] = ()) -> None:
        """Starts a 200 chunked answer; `send` writes each piece, `end_stream` the last chunk."""
        head = self.head(ex, 200, content_type, extra)
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

    def cut(self, clean: bool) -> None:
        """Ends the connection mid-answer: a FIN when `clean` (what a crashed process's kernel
        sends), else an RST."""
        if clean:
            self.close()
        else:
            self.reset()

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
