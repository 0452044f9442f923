"""A keep-alive HTTP/1.1 client per box origin: `Conn` per socket, `Exchange` per request.

Invariants:
1. Every request carries Content-Length (boxes read bodies by length; chunked uploads are
   read as empty by a hugpy box) and the box's own Host.
2. A connection goes back to the idle list only when its response was read to the end and both
   sides allow keep-alive. Any error, timeout, abort or client disconnect closes it for good.
3. A reused idle connection found closing at write time is replaced by a fresh one (nothing was
   sent). Once bytes are written, a lost connection is a failure of this exchange: the same
   body is never sent twice to that box.
4. Flow: when an exchange holds more than `HIGH_WATER_BYTES` unread, the socket stops reading
   until the reader takes them; so a slow client bounds what the router buffers per stream.
5. Responses without length or chunking end when the box closes cleanly (hugpy's SSE does
   this); an abortive close (a reset) fails the exchange (RFC 9112 §6.3).
6. The one exception to rule 3's "never twice": a reused connection closed cleanly (FIN) before
   any answer byte within `STALE_RACE_S` of the write is the box's idle close meeting our request
   (the box read nothing), so the caller may send once more on a fresh connection
   (`Exchange.stale_race()`).
7. A response head is bounded: more than `MAX_HEAD_BYTES` received before the head is complete,
   or more than `MAX_HEADERS` header lines, fails the exchange with BadResponse and closes the
   connection, so a box sending a header that never ends costs at most the limit plus one read.
   This holds for every user of the pool: the proxy, the box links, the agent links.
8. An exchange keeps one deadline at a time (`keep(Deadline)`): past it, the exchange fails
   with the deadline's error. Whoever keeps time calls `expire(now)`: the proxy's CallClock,
   or a timer of the exchange's own (`keep(..., timer=True)`, for callers with no clock). A
   silence deadline counts from the box's last byte, and only while the reader waits for it.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from typing import NamedTuple

import httptools

from router.core.errors import UpstreamProtocolError
from router.core.refusal import RefusalCode

CONNECT_TIMEOUT_S = 10.0
# Below the 5 s idle timeout common to uvicorn, gunicorn and Go servers, so that we drop an idle
# connection before the box does and the close race stays rare.
KEEPALIVE_IDLE_S = 4.0
MAX_IDLE_PER_ORIGIN = 128
# Issue #2 bounds what waits per stream for a slow client at 1 MiB; the socket stops being read
# at a quarter of that. A box's burst still flows unpaused (nginx buffers 32-64 KiB per proxied
# answer by default), and a stalled client holds the router's RSS within its 2 MiB budget
# (bench: stalled reader) with room for Granian's and the allocator's share.
HIGH_WATER_BYTES = 256 << 10
NO_BODY_STATUSES = frozenset({204, 304})
# A box's idle close and our reuse cross within a round trip on loopback or a LAN; a box that
# took the request and then died does so later than this.
STALE_RACE_S = 0.1
# Rule 7. nginx reads a proxied head into proxy_buffer_size (4-8 KiB) and refuses a larger one
# as an invalid upstream answer (502); Envoy's default header limit is 60 KiB and 100 headers,
# Node's 16 KiB. A box's head is a dozen short lines; 64 KiB and 100 headers leave room for
# any honest one (with long cookies or CORS lists) and still bound a hostile one.
MAX_HEAD_BYTES = 64 << 10
MAX_HEADERS = 100


class UpstreamError(Exception):
    """A box exchange failed before or during the response; `refusal` is its stable code."""

    refusal = RefusalCode.UPSTREAM_ERROR


class ConnectFailed(UpstreamError):
    """No connection: `cause` says why in an operator's words (`connect_cause`)."""

    refusal = RefusalCode.UNREACHABLE

    def __init__(self, message: str, cause: str = "") -> None:
        super().__init__(message)
        self.cause = cause


def connect_cause(exc: BaseException) -> str:
    """Why a connection failed, as the state, the refusals and the log say it."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: certificate not trusted ({exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: handshake failed ({exc.reason or type(exc).__name__})"
    if isinstance(exc, TimeoutError):
        return f"connect timeout ({CONNECT_TIMEOUT_S:g} s)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return "host name not found"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return type(exc).__name__


class ConnectionLost(UpstreamError):
    refusal = RefusalCode.CONNECTION_LOST

    def __init__(self, message: str, *, clean: bool = False) -> None:
        super().__init__(message)
        self.clean = clean  # the box closed with a FIN (an orderly close), not a reset


class FirstByteTimeout(UpstreamError):
    refusal = RefusalCode.FIRST_BYTE_TIMEOUT


class StreamIdle(UpstreamError):
    """The box went silent after the first byte for longer than the stream idle timeout."""

    refusal = RefusalCode.STREAM_IDLE_TIMEOUT


class ExchangeAborted(UpstreamError):
    """The reader gave the exchange up: its client left, or it stopped before the body's end.
    (Not the edge's ClientLeft, which is the client's own disconnect as the server saw it.)"""

    refusal = RefusalCode.CANCELLED


class BadResponse(UpstreamError, UpstreamProtocolError):
    refusal = RefusalCode.BAD_RESPONSE


class Deadline(NamedTuple):
    """When an exchange fails, and with what (rule 8): `seconds` after it is kept; with
    `silence`, `seconds` after the box's last byte while the reader waits for the next."""

    seconds: float
    error: BaseException
    silence: bool = False


class Exchange:
    """One request and its response. The response body is read with `next_chunks()`."""

    __slots__ = (
        "conn",
        "status",
        "headers",
        "keep_alive",
        "close_delimited",
        "head",
        "chunks",
        "buffered",
        "waiter",
        "complete",
        "error",
        "bytes_in",
        "head_bytes",
        "timer",
        "deadline",
        "due_s",
        "idle_mark",
        "reused",
        "sent_s",
    )

    def __init__(self, conn: "Conn", loop: asyncio.AbstractEventLoop, reused: bool) -> None:
        self.conn: Conn | None = conn
        self.reused = reused  # the connection had served an earlier request
        self.sent_s = loop.time()
        # response head
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # names lower-case (Conn.on_header)
        self.keep_alive = False
        self.close_delimited = False
        self.head: asyncio.Future = loop.create_future()
        self.head_bytes = 0  # bytes received while the head was incomplete (rule 7)
        # response body
        # A list, handed over whole (`next_chunks`): an empty deque is a 600-byte block, held
        # for as long as the answer runs (per open stream), a list grows with what arrives.
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.waiter: asyncio.Future | None = None
        self.complete = False
        self.error: BaseException | None = None
        self.bytes_in = 0
        self.deadline: Deadline | None = None  # the one it keeps (rule 8)
        self.due_s = 0.0  # loop time past which expire() fails the exchange
        self.idle_mark = 0  # a silence deadline's: bytes_in when expire() last saw the box send
        self.timer: asyncio.TimerHandle | None = None  # keep(timer=True)'s

    # -- fed by Conn --------------------------------------------------------------------------
    def _feed(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.buffered += len(chunk)
        self.bytes_in += len(chunk)
        if self.buffered > HIGH_WATER_BYTES and self.conn is not None:
            self.conn.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self.complete or self.error is not None:
            return
        self.error = exc
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # mark retrieved: the reader may be gone already
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- used by the reader -------------------------------------------------------------------
    def stale_race(self) -> bool:
        """Lost on a reused connection before any answer byte, right after the write (rule 6)."""
        return (
            self.reused
            and isinstance(self.error, ConnectionLost)
            and self.error.clean  # an idle close is orderly; a box that took the call and died resets
            and self.status == 0  # no head: not one answer byte arrived
            and asyncio.get_running_loop().time() - self.sent_s < STALE_RACE_S
        )

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def next_chunks(self) -> list[bytes]:
        """Every chunk that has arrived (at least one), or [] at the end of the body.

        Raises the exchange's error (ConnectionLost, FirstByteTimeout, ExchangeAborted, BadResponse).
        """
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                return []
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None
        taken, self.chunks = self.chunks, []
        self.buffered = 0
        if self.conn is not None:
            self.conn.resume_reading()
        return taken

    async def read_all(self, limit: int) -> bytes:
        """The whole body (for small answers). Raises BadResponse past `limit` bytes."""
        parts: list[bytes] = []
        while True:
            chunks = await self.next_chunks()
            if not chunks:
                return b"".join(parts)
            parts.extend(chunks)
            if self.bytes_in > limit:
                self.abort(BadResponse(f"answer larger than {limit} bytes"))
                raise self.error  # type: ignore[misc]

    def keep(self, deadline: Deadline | None, *, timer: bool = False) -> None:
        """Keeps `deadline` from now on, in place of any earlier one (None: none). With `timer`,
        a loop timer of its own calls `expire` when it is due (a fixed deadline only)."""
        self.deadline = deadline
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        self.due_s = loop.time() + deadline.seconds
        self.idle_mark = self.bytes_in
        if timer:
            self.timer = loop.call_at(self.due_s, self.expire, self.due_s)

    def expire(self, now: float) -> None:
        """Fails the exchange with its deadline's error when `now` (loop time) is past it. A
        silence deadline moves on when the box sent since the last look, or when the reader is
        busy elsewhere (writing to a slow client): so it fails only once the box has been
        silent for its seconds (up to one look later) while the reader waited for it."""
        deadline = self.deadline
        if deadline is None:
            return
        if deadline.silence and (self.bytes_in != self.idle_mark or self.waiter is None):
            self.idle_mark = self.bytes_in
            self.due_s = now + deadline.seconds
        elif now >= self.due_s:
            self.abort(deadline.error)

    def abort(self, exc: BaseException) -> None:
        """Ends the exchange now: the error is recorded and the connection closed, never reused."""
        self.keep(None)
        if not self.complete:
            self._fail(exc)
        conn, self.conn = self.conn, None
        if conn is not None and conn.exchange is self:
            conn.close()

    def done(self) -> None:
        """The reader is finished with this exchange (after the body or after giving up)."""
        self.keep(None)
        if not self.complete:
            self.abort(ExchangeAborted("reader stopped before the end of the body"))


class Conn(asyncio.Protocol):
    """One socket to a box, parsing responses with httptools."""

    def __init__(self, origin: "Origin") -> None:
        # per connection
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reading_paused = False
        self.idle_since = 0.0
        self.served = 0  # requests started on this connection
        # per request
        self.exchange: Exchange | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is not None and exchange.status == 0:
            exchange.head_bytes += len(data)  # head so far, and maybe what follows it in this read
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.close()
            if exchange is not None:
                cause = exc.__context__  # what a callback of ours raised
                exchange._fail(cause if isinstance(cause, BadResponse) else BadResponse(f"box broke HTTP: {exc}"))
            return
        except httptools.HttpParserUpgrade:
            self.close()
            return
        if exchange is not None and exchange.status == 0 and exchange.head_bytes > MAX_HEAD_BYTES:
            self.close()
            exchange._fail(BadResponse(f"response head over {MAX_HEAD_BYTES} bytes"))

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        # The transport and the parser each hold this protocol: dropped, a closed connection
        # (a close-delimited answer closes one per call) is freed by reference counting, not
        # left to the cycle collector.
        self.transport = None
        self.parser = None  # type: ignore[assignment]
        exchange, self.exchange = self.exchange, None
        if exchange is None or exchange.complete:
            return
        exchange.conn = None
        if exchange.head.done() and exchange.close_delimited and exc is None:
            exchange._finish()  # a clean close ends a close-delimited body; a reset never does
        else:
            exchange._fail(
                ConnectionLost("box closed the connection before the answer ended", clean=exc is None)
            )

    # -- httptools callbacks: forward and return ----------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        # Lower-cased once here: every reader looks a name up, or passes it on, lower-case.
        self.exchange.headers.append((name.lower(), value))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        if exchange is None:
            return
        if len(exchange.headers) > MAX_HEADERS:
            raise BadResponse(f"response head with over {MAX_HEADERS} headers")
        # The head came in within one read: measure the lines only when that read was large.
        if exchange.head_bytes > MAX_HEAD_BYTES and _head_size(exchange.headers) > MAX_HEAD_BYTES:
            raise BadResponse(f"response head over {MAX_HEAD_BYTES} bytes")
        exchange.status = self.parser.get_status_code()
        exchange.keep_alive = self.parser.should_keep_alive()
        _mark_close_delimited(exchange)  # now, not later: EOF may follow in the same read
        if not exchange.head.done():
            exchange.head.set_result(None)  # not the exchange: it holds this future (a cycle)

    def on_body(self, body: bytes) -> None:
        self.exchange._feed(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        exchange = self.exchange
        if exchange is None:
            return
        exchange.keep(None)  # complete: no deadline left to keep
        exchange._finish()
        self.exchange = None
        exchange.conn = None
        # Reusable only when idle in both directions: reading (it may have been paused for a
        # slow reader) and writing (a box may answer before our upload is out, e.g. a 413).
        self.resume_reading()
        writing = self.transport is not None and self.transport.get_write_buffer_size() > 0
        if exchange.keep_alive and not self.closed and not writing:
            self.origin.release(self)
        else:
            self.close()

    # -- flow control -------------------------------------------------------------------------
    def pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def start(self, payload: list[bytes], loop: asyncio.AbstractEventLoop) -> Exchange:
        exchange = Exchange(self, loop, reused=self.served > 0)
        self.served += 1
        self.exchange = exchange
        self.transport.writelines(payload)  # type: ignore[union-attr]
        return exchange


def _head_size(headers: list[tuple[bytes, bytes]]) -> int:
    """The bytes of the header lines, as written (`name: value` and CRLF)."""
    return sum(len(name) + len(value) + 4 for name, value in headers)


def _mark_close_delimited(exchange: Exchange) -> None:
    """After the head: a body with neither length nor chunking ends at EOF (RFC 9112 §6.3)."""
    if exchange.status in NO_BODY_STATUSES or exchange.status < 200:
        return
    for key, _ in exchange.headers:
        if key == b"content-length" or key == b"transfer-encoding":
            return
    exchange.close_delimited = True


class Origin:
    """Connections to one box (host, port; TLS for an https box), with its idle keep-alive list.
    A TLS box's certificate is checked against the system's trusted CAs (`SSL_CERT_FILE` and
    `SSL_CERT_DIR` name others) and its host name."""

    def __init__(self, host: str, port: int, tls: bool = False) -> None:
        self.host = host
        self.port = port
        self.tls = _tls_context() if tls else None
        self.host_header = f"Host: {host}:{port}\r\n".encode("latin-1")
        self.idle: list[Conn] = []

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> Conn:
        tls = self.tls
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):  # no extra task, unlike wait_for
                _, conn = await loop.create_connection(
                    lambda: Conn(self), self.host, self.port, ssl=tls, server_hostname=self.host if tls else None
                )
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc!r}", connect_cause(exc)) from None
        return conn

    def _take_idle(self, now: float) -> Conn | None:
        while self.idle:
            conn = self.idle.pop()
            if conn.closed or now - conn.idle_since > KEEPALIVE_IDLE_S:
                conn.close()
                continue
            return conn
        return None

    def release(self, conn: Conn) -> None:
        if len(self.idle) >= MAX_IDLE_PER_ORIGIN:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        self.idle.append(conn)

    async def send(self, head: bytes, body: bytes, *, fresh: bool = False) -> Exchange:
        """Writes one request (`head` ends with the blank line) and returns its Exchange;
        `fresh` skips the idle connections.

        Raises ConnectFailed when no connection can be made.
        """
        loop = asyncio.get_running_loop()
        conn = None if fresh else self._take_idle(loop.time())
        if conn is None or conn.transport is None or conn.transport.is_closing():
            conn = await self._connect(loop)
        return conn.start([head, body] if body else [head], loop)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


_tls: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
    """One client context for every TLS box (it loads the trusted CAs once)."""
    global _tls
    if _tls is None:
        _tls = ssl.create_default_context()
    return _tls


_SAFE_TARGET = re.compile(r"[\x21-\x7e]+")


def safe_target(target: str) -> bool:
    """A request target made of visible ASCII only: a decoded `%0D%0A` or space can never
    split the request line or smuggle a second request to a box."""
    return _SAFE_TARGET.fullmatch(target) is not None


def request_head(method: str, target: str, origin: Origin, extra: bytes, length: int) -> bytes:
    """The request line and headers, ending with the blank line. `extra` is header lines;
    `target` must pass `safe_target` (a bug otherwise)."""
    return b"".join(
        (
            f"{method} {target} HTTP/1.1\r\n".encode("latin-1"),
            origin.host_header,
            extra,
            b"Content-Length: %d\r\n\r\n" % length,
        )
    )
