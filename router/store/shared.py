"""The Redis-protocol server several routers share (Valkey or Redis): one connection's worth of
ordered, pipelined round trips, each with a short timeout, and whether the server is up.

Client: redis-py's asyncio client (`redis.asyncio`, the `shared` extra): the reference client of
the protocol, asyncio-native, and it speaks to Valkey and Redis alike. Its per-command cost in
Python (~0.1 ms of CPU each) is why the call path never sends a command alone: see rule 2.

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
        import redis.asyncio as aioredis
        from redis import exceptions
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.errors = (exceptions.RedisError, OSError, TimeoutError)  # what marks the server down
        self.reply_error = exceptions.ResponseError
        self.no_script = exceptions.NoScriptError
        self.url = shown_url(url)
        pool = aioredis.ConnectionPool.from_url(
            url, socket_timeout=ROUND_TRIP_TIMEOUT_S, socket_connect_timeout=SERVER_CONNECT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),  # a command is sent once: a take sent twice would hold two slots
        )
        self.redis = aioredis.Redis(connection_pool=pool)  # pub/sub (serve/shared.py)
        # rule 2's one connection: redis-py's Connection, driven directly (its pipeline object
        # costs ~2.5x the CPU of the round trip itself)
        self.conn = pool.make_connection()
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
        conn = self.conn
        packed = [(None, ("EVALSHA", script.sha, *args)) if script is not None else (None, args)
                  for script, args in commands]
        try:
            async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
                await conn.connect()  # at once when connected
                replies = await self._round_trip([args for _, args in packed])
                unknown = [i for i, reply in enumerate(replies) if isinstance(reply, self.no_script)]
                if unknown:
                    await self._round_trip([("SCRIPT", "LOAD", script.source) for script in self.scripts])
                    again = await self._round_trip([packed[i][1] for i in unknown])
                    for i, reply in zip(unknown, again):
                        replies[i] = reply
        except (*self.errors, asyncio.CancelledError) as exc:
            await conn.disconnect(nowait=True)  # a reply half read: the connection is unusable
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.went_down(exc)
            raise SharedDown(self.why_down) from None
        return replies

    async def _round_trip(self, commands: list[tuple]) -> list:
        conn = self.conn
        await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
        replies = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except self.reply_error as exc:
                replies.append(exc)
        return replies

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
                except SharedDown as exc:
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
        try:
            await self.conn.disconnect(nowait=True)
            await self.redis.aclose(close_connection_pool=True)
        except Exception:  # closing a connection to a server that is gone
            pass
