"""The Redis-protocol server several routers share (Valkey or Redis): one connection's worth of
ordered, pipelined round trips, each with a short timeout, and whether the server is up.

Client (the `shared` extra): redis-py's asyncio client (`redis.asyncio`: the protocol's reference
client, asyncio-native, Valkey and Redis alike) for the URL and for pub/sub; the call path's round
trips go over `Wire`, one asyncio protocol that writes the commands as RESP and reads the replies
with hiredis (the Redis project's C parser). redis-py's own connection spends ~400 Python
function calls a round trip (per-command encoders, a timeout and a task per read and write):
more than the rest of the router's call; `Wire` spends a handful (bench/several_routers.py).

Rules:
1. Every key is under `hugpy-router:` so the server may hold other data. Scripts read the
   server's clock (`TIME`), never a router's: the routers' clocks may disagree, the server's is
   one.
2. The call path's commands (`call`) queue on the loop and go out in one pipeline per round
   trip: whatever calls asked in the same loop iteration, or while the previous round trip was
   out, share the next one. One round trip is out at a time, so the server applies commands in
   the order the router asked them (a slot given back before a waiter's take reaches the server
   first). A command that is in no hurry (`later`) waits for the next round trip anyone asks
   for.
3. Every round trip has a deadline, ROUND_TRIP_TIMEOUT_S; a round trip that passes it, or any
   connection error, marks the server down (`up` False) and fails every command in it with
   `SharedDown`. While it is down the call path asks nothing (`up` is read first, at no cost);
   the background `probe` (once a second, serve/shared.py) marks it up again on the first
   round trip that succeeds.
4. Going down and coming back are each one log line at warning level, with how long it was down;
   never one per call.
5. The URL's password never reaches a log line or the state (`shown_url`).
6. `Wire` connects as redis-py would from the same URL (host and port or a Unix socket, TLS for
   `rediss://`, AUTH with the user and password, SELECT the database): the first round trip on a
   new connection carries AUTH and SELECT before the commands.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("router.shared")

PREFIX = "hugpy-router:"
# A round trip on the call path waits this long at most: a loopback or LAN server answers in
# well under a millisecond; a call must never hang on it (issue 23).
ROUND_TRIP_TIMEOUT_S = 0.25
# Opening a connection to the server (at start, and after it came back).
SERVER_CONNECT_TIMEOUT_S = 0.5


class SharedDown(Exception):
    """The shared server did not answer (down, unreachable, or past ROUND_TRIP_TIMEOUT_S)."""


def shown_url(url: str) -> str:
    """`url` without its password (rule 5)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = (f"{parts.username}:***@" if parts.username else ":***@") + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class Script:
    """A Lua script known to the server by its SHA-1 (loaded again after a server restart)."""

    __slots__ = ("source", "sha")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class SharedServer:
    """One shared server: its client, whether it is up, and the pipelined call path (rules 2-3)."""

    def __init__(self, url: str) -> None:
        # the `shared` extra: only a router with --shared-url imports it
        import hiredis
        import redis.asyncio as aioredis
        from redis.asyncio.connection import SSLConnection, parse_url
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url = shown_url(url)
        self.redis = aioredis.Redis.from_url(  # pub/sub (serve/shared.py)
            url, socket_timeout=ROUND_TRIP_TIMEOUT_S, socket_connect_timeout=SERVER_CONNECT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),  # a command is sent once: a take sent twice would hold two slots
        )
        where = parse_url(url)
        self.address = where  # rule 6
        self.tls = where.get("connection_class") is SSLConnection
        self.reader = hiredis.Reader
        self.reply_error = hiredis.ReplyError
        self.wire: Wire | None = None
        self.up = False
        self.reached = False  # answered once: coming up after that is news (rule 4)
        self.down_since = time.time()  # epoch seconds; the state shows it
        self.why_down = "not reached yet"
        self.scripts: list[Script] = []
        # rule 2: (script or None, args, future) waiting for the next round trip
        self.queued: list[tuple[Script | None, tuple, asyncio.Future]] = []
        self.sending = False

    def script(self, source: str) -> Script:
        script = Script(source)
        self.scripts.append(script)
        return script

    # -- up and down (rules 3-4) ---------------------------------------------------------------
    def went_down(self, exc: BaseException) -> None:
        why = type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {str(exc)[:120]}"
        if self.up:
            self.up = False
            self.down_since = time.time()
            log.warning("shared server %s is DOWN (%s): counting in this router alone until it is back",
                        self.url, why)
        self.why_down = why

    def came_up(self) -> None:
        if not self.up:
            was_down_s = time.time() - self.down_since
            self.up = True
            self.why_down = ""
            if self.reached:
                log.warning("shared server %s is up (after %.1f s): counting across routers again",
                            self.url, was_down_s)
            self.reached = True

    # -- round trips ---------------------------------------------------------------------------
    async def run(self, commands: Sequence[tuple[Script | None, tuple]]) -> list:
        """One round trip of `commands` (a script and its keys-and-args, or None and a raw
        command), in order: their replies, an error reply as its exception. Raises SharedDown
        (rule 3). Scripts the server does not know (it restarted) are loaded and those commands
        sent again (a NOSCRIPT reply did nothing)."""
        packed = [("EVALSHA", script.sha, *args) if script is not None else args for script, args in commands]
        try:
            async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
                wire = self.wire if self.wire is not None and self.wire.open else await self._connect()
                replies = await wire.round_trip(packed)
                unknown = [i for i, reply in enumerate(replies)
                           if isinstance(reply, self.reply_error) and str(reply).startswith("NOSCRIPT")]
                if unknown:
                    await wire.round_trip([("SCRIPT", "LOAD", script.source) for script in self.scripts])
                    again = await wire.round_trip([packed[i] for i in unknown])
                    for i, reply in zip(unknown, again):
                        replies[i] = reply
        except (OSError, TimeoutError, asyncio.CancelledError) as exc:
            if self.wire is not None:
                self.wire.close()  # a reply half read: the connection is unusable
                self.wire = None
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.went_down(exc)
            raise SharedDown(self.why_down) from None
        return replies

    async def _connect(self) -> Wire:
        """A new connection, AUTH and SELECT done (rule 6). Raises OSError."""
        where, loop = self.address, asyncio.get_running_loop()
        reader = self.reader(replyError=self.reply_error)
        if "path" in where:
            _, wire = await loop.create_unix_connection(lambda: Wire(reader), where["path"])
        else:
            ssl = True if self.tls else None
            _, wire = await loop.create_connection(lambda: Wire(reader), where.get("host", "localhost"),
                                                   where.get("port", 6379), ssl=ssl)
        self.wire = wire
        hello: list[tuple] = []
        if where.get("password") is not None:
            hello.append(("AUTH", *((where["username"],) if where.get("username") else ()), where["password"]))
        if where.get("db"):
            hello.append(("SELECT", where["db"]))
        if hello:
            refused = [r for r in await wire.round_trip(hello) if isinstance(r, self.reply_error)]
            if refused:
                raise ConnectionRefusedError(f"the server refused the connection: {str(refused[0])[:80]}")
        return wire

    def call(self, script: Script | None, *args) -> asyncio.Future:
        """One command on the call path, sent with whatever else is queued (rule 2); the future
        raises SharedDown when the round trip failed."""
        future = self.later(script, *args)
        if not self.sending:
            self.sending = True
            asyncio.get_running_loop().create_task(self._send())
        return future

    def later(self, script: Script | None, *args) -> asyncio.Future:
        """A command that may wait for the next round trip anyone asks for (rule 2)."""
        future = asyncio.get_running_loop().create_future()
        self.queued.append((script, args, future))
        return future

    async def _send(self) -> None:
        try:
            while self.queued:
                batch, self.queued = self.queued, []
                try:
                    results = await self.run([(script, args) for script, args, _ in batch])
                except Exception as exc:  # SharedDown; anything else is a bug, said once: no caller waits on
                    if not isinstance(exc, SharedDown):
                        log.exception("a round trip to the shared server failed")
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(SharedDown(str(exc)))
                    continue
                for (_, _, future), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, Exception):  # an error reply: a bug, said as one
                        future.set_exception(SharedDown(f"the server answered {result}"))
                    else:
                        future.set_result(result)
        finally:
            self.sending = False

    async def close(self) -> None:
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        try:
            await self.redis.aclose(close_connection_pool=True)
        except Exception:  # closing a connection to a server that is gone
            pass


def pack(commands: Sequence[tuple]) -> bytes:
    """`commands` as RESP arrays of bulk strings (str, bytes and int arguments)."""
    parts: list[bytes] = []
    for args in commands:
        parts.append(b"*%d\r\n" % len(args))
        for arg in args:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


class Wire(asyncio.Protocol):
    """One connection to the server, one round trip at a time (rule 2): the commands written as
    one buffer, the replies read by hiredis until there are as many as commands."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.transport: asyncio.Transport | None = None
        self.open = False
        # the round trip out: its future, how many replies it waits for, those read so far
        self.waiting: asyncio.Future | None = None
        self.expected = 0
        self.replies: list = []

    def connection_made(self, transport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    def round_trip(self, commands: Sequence[tuple]) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiting, self.expected, self.replies = future, len(commands), []
        self.transport.write(pack(commands))  # type: ignore[union-attr]
        return future

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        try:
            reader.feed(data)
            while self.waiting is not None:
                reply = reader.gets()
                if reply is False:
                    return
                self.replies.append(reply)
                if len(self.replies) == self.expected:
                    waiting, self.waiting = self.waiting, None
                    if not waiting.done():
                        waiting.set_result(self.replies)
            if reader.gets() is not False:  # a reply nobody asked for: the stream is not ours to trust
                self.close()
        except Exception:  # hiredis.ProtocolError: not a Redis-protocol server, or a broken stream
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        waiting, self.waiting = self.waiting, None
        if waiting is not None and not waiting.done():
            waiting.set_exception(ConnectionResetError("the server closed the connection"))

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.abort()
