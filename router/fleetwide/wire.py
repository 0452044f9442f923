"""The Redis-protocol server several routers share (Valkey or Redis): one connection's worth of
ordered, pipelined round trips, each with a short timeout, and whether the server is up.

Client (the `shared` extra): redis-py's asyncio client (`redis.asyncio`: the protocol's reference
client, asyncio-native, Valkey and Redis alike) for the URL and for pub/sub; the call path's round
trips go over `Wire`, one asyncio protocol that writes the commands as RESP
(`_fastpath.resp_commands`: hiredis' packer's bytes, without its sprintf per length) and reads the
replies with hiredis (the Redis project's C parser). redis-py's own connection spends ~400 Python
function calls a round trip (per-command encoders, a timeout and a task per read and write):
more than the rest of the router's call; `Wire` spends a handful (bench/several_routers.py).

Rules:
1. Every key is under `hugpy-router:` so the server may hold other data. Scripts read the
   server's clock (`TIME`), never a router's: the routers' clocks may disagree, the server's is
   one.
2. The call path's commands (`send`) queue on the loop and go out in one pipeline per round
   trip: whatever calls asked in the same loop iteration, or while the previous round trip was
   out, share the next one. One round trip is out at a time, so the server applies commands in
   the order the router asked them (a slot given back before a waiter's take reaches the server
   first). A command that is in no hurry (`send_later`) waits for the next round trip anyone
   asks for. The pipeline runs on loop callbacks (a flush when the loop comes round, the next one
   from the reply's own callback), no task per round trip: on a loopback server the kernel's
   share of a round trip is most of what it costs, and the Python around it is kept to a few
   calls.
3. Every round trip has a deadline, ROUND_TRIP_TIMEOUT_S, kept by one timer re-armed only when
   it fires (not one per round trip); a round trip that passes it, or any connection error (a
   connection closed while idle too: a restarted server closes it), marks the server down (`up`
   False) and fails every command in it with `SharedDown`. While it is down the call path asks
   nothing (`up` is read first, at no cost); the background sync (once a second,
   fleetwide/leases.py) marks it up again on the first round trip that succeeds.
4. Going down and coming back are each one log line at warning level, with why and what the
   router does meanwhile (`meanwhile`: the --shared-down mode's words), then how long it was
   down; never one per call. A server down at start is such a line too (serve/server.py `share`).
5. The URL's password never reaches a log line, an error or the state (`shown_url`).
6. `Wire` connects as redis-py would from the same URL (host and port or a Unix socket, TLS for
   `rediss://`, AUTH with the user and password, SELECT the database): the first round trip on a
   new connection carries AUTH and SELECT, and reads the server's `run_id` (`epoch` counts the
   runs: a new one lost whatever the old one held).
7. A call-path command (`send`) names what takes its reply, a plain function called as the reply
   is read, in the round trip's order, exactly once (the reply, or SharedDown when its round trip
   failed or the router stops). No future, and no loop callback, per command: the call that
   waits makes the one future it awaits. `call` and `later` are the same as futures.
8. A server that refuses this router (AUTH or SELECT answered with an error: a wrong password,
   an unknown database; or a TLS certificate that cannot be verified) fails the connection with
   `SharedRefused` and sets `refused`: waiting does not heal it, so a router starting meets it
   as a configuration error unless told to start anyway (serve/server.py `reach_shared`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import re
import ssl
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from router._fastpath import resp_commands

log = logging.getLogger("router.shared")

PREFIX = "hugpy-router:"
# A round trip on the call path waits this long at most: a loopback or LAN server answers in
# well under a millisecond; a call must never hang on it (issue 23).
ROUND_TRIP_TIMEOUT_S = 0.25
# Opening a connection to the server (at start, and after it came back).
SERVER_CONNECT_TIMEOUT_S = 0.5


class SharedDown(Exception):
    """The shared server did not answer (down, unreachable, or past ROUND_TRIP_TIMEOUT_S)."""


class SharedRefused(ConnectionRefusedError):
    """The server answered but refused this router (rule 8): its AUTH or SELECT failed, or its
    TLS certificate could not be verified."""


# What takes a command's reply (rule 7): called with the reply, or with a SharedDown
Done = Callable[[object], None]


# redis-py takes a password in the query too (unix:///run/redis.sock?password=...)
_QUERY_PASSWORD_RE = re.compile(r"(^|&)(password=)[^&]*")


def shown_url(url: str) -> str:
    """`url` without its password (rule 5). Taken apart by hand, never through `.port`: a URL too
    broken to use (a port that is not a number) is said in an error, masked too."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed IPv6 bracket: nothing of it is shown past the scheme
        return url.partition("://")[0] + "://…"
    userinfo, at, host = parts.netloc.rpartition("@")
    query = _QUERY_PASSWORD_RE.sub(r"\1\2***", parts.query)
    if ":" not in userinfo and query == parts.query:
        return url
    netloc = userinfo.partition(":")[0] + (":***" if ":" in userinfo else "") + at + host
    # by hand: urlunsplit writes `unix:/path` for a scheme it does not know to have a netloc
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


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
        self.redis = aioredis.Redis.from_url(  # pub/sub (fleetwide/leases.py)
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
        # the server's run (its `run_id`, read on every new connection) counted from 0: a restart
        # lost what it held, so what a step drew from an earlier run is not there any more
        self.epoch = 0
        self.run_id: str | None = None
        self.reached = False  # answered once (a come-back seeds the keys' budgets again)
        self.down_since = time.time()  # epoch seconds; the state shows it
        self.why_down = "not reached yet"
        self.refused = False  # the last failure was a refusal (rule 8)
        self.said_down = False  # a DOWN line was logged: its come-back line is owed (rule 4)
        self.meanwhile = "counting in this router alone"  # rule 4; serve/server.py sets --shared-down's
        self.scripts: list[Script] = []
        # rule 2: (command, what takes its reply) waiting for the next round trip; the round trip out
        self.queued: list[tuple[tuple, Done]] = []
        self.out: list[tuple[tuple, Done]] | None = None
        self.out_since = 0.0  # loop time it went out (rule 3)
        self.preparing: list[Callable[[], None]] = []  # `prepare`
        self.flush_soon = False
        self.round_trips = 0  # sent: the operator's measure of what the shared state costs a call
        self.watchdog: asyncio.TimerHandle | None = None
        self.connecting: asyncio.Task | None = None

    def script(self, source: str) -> Script:
        script = Script(source)
        self.scripts.append(script)
        return script

    # -- up and down (rules 3-4) ---------------------------------------------------------------
    def went_down(self, exc: BaseException) -> None:
        if isinstance(exc, SharedRefused):  # its words are the reason
            self.why_down = str(exc)
        else:
            self.why_down = type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {str(exc)[:120]}"
        self.refused = isinstance(exc, SharedRefused)
        if self.up:
            self.up = False
            self.down_since = time.time()
            self.say_down()

    def say_down(self) -> None:
        """Rule 4's DOWN line: why, and what the router does until the server is back."""
        self.said_down = True
        log.warning("shared server %s is DOWN (%s): %s until it is back", self.url, self.why_down, self.meanwhile)

    def came_up(self) -> None:
        if not self.up:
            was_down_s = time.time() - self.down_since
            self.up = True
            self.why_down = ""
            self.refused = False
            if self.said_down:
                log.warning("shared server %s is up (after %.1f s): counting across routers again",
                            self.url, was_down_s)
                self.said_down = False
            self.reached = True

    # -- round trips (rules 2-3) ---------------------------------------------------------------
    def send(self, done: Done, script: Script | None, *args) -> None:
        """One command on the call path, sent with whatever else is queued when the loop comes
        round (rule 2). `done` runs as its reply is read, with the reply, or with a SharedDown
        when its round trip failed (rule 7)."""
        self.queued.append((("EVALSHA", script.sha, *args) if script is not None else args, done))
        if not self.flush_soon:  # `soon`, inline: a call sends two or three
            self.flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def send_later(self, done: Done, script: Script | None, *args) -> None:
        """A command that may wait for the next round trip anyone asks for (rule 2)."""
        self.queued.append((("EVALSHA", script.sha, *args) if script is not None else args, done))

    def call(self, script: Script | None, *args) -> asyncio.Future:
        """`send` as a future (off the call path, and for tests): it raises SharedDown when its
        round trip failed."""
        future = asyncio.get_running_loop().create_future()
        self.send(functools.partial(_into, future), script, *args)
        return future

    def later(self, script: Script | None, *args) -> asyncio.Future:
        """`send_later` as a future."""
        future = asyncio.get_running_loop().create_future()
        self.send_later(functools.partial(_into, future), script, *args)
        return future

    def soon(self) -> None:
        """A round trip goes out when the loop comes round, with whatever is queued by then."""
        if not self.flush_soon:
            self.flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def prepare(self, prepare: Callable[[], None]) -> None:
        """`prepare` runs when the next round trip is packed, and may queue commands into it
        (`later`): a command whose arguments are known only then (a tally's compare-and-set
        carries every step asked until then: fleetwide/tallies.py)."""
        self.preparing.append(prepare)

    def _flush(self) -> None:
        """What is queued goes out as one round trip, unless one is out: its answer flushes again."""
        while self.preparing:
            preparing, self.preparing = self.preparing, []
            for prepare in preparing:
                prepare()
        self.flush_soon = False
        if self.out is not None or not self.queued:
            return
        wire = self.wire
        if wire is None or not wire.open:
            if self.connecting is None:
                self.connecting = asyncio.get_running_loop().create_task(self._reconnect())
            return
        self._send(wire)

    def _send(self, wire: Wire) -> None:
        batch, self.queued = self.queued, []
        self.round_trips += 1
        self.out = batch
        loop = asyncio.get_running_loop()
        self.out_since = loop.time()
        if self.watchdog is None:
            self.watchdog = loop.call_at(self.out_since + ROUND_TRIP_TIMEOUT_S, self._overdue)
        wire.round_trip([command for command, _ in batch], self._answered)

    def _answered(self, replies: list | Exception, load_scripts: bool = True) -> None:
        """The round trip out came back (its replies in order), or its connection broke."""
        batch, self.out = self.out, None
        if batch is None:  # already failed by the watchdog
            return
        if isinstance(replies, Exception):
            self._failed(batch, replies)
        elif (unknown := self._resolve(batch, replies, load_scripts)):
            self.out = unknown  # nothing else goes out before these (rule 2)
            asyncio.get_running_loop().create_task(self._load_scripts(unknown))
            return
        if self.queued:  # asked while it was out: the next round trip, packed as any other
            self._flush()

    def _resolve(self, batch: list, replies: list, load_scripts: bool) -> list:
        """Each command's `done` gets its reply, in order; those of scripts the server does not
        know (it restarted: a NOSCRIPT reply did nothing) are returned instead, to be sent again
        once the scripts are loaded."""
        unknown = []
        error = self.reply_error
        for item, reply in zip(batch, replies):
            if reply.__class__ is error:
                if load_scripts and str(reply).startswith("NOSCRIPT"):
                    unknown.append(item)
                    continue
                reply = SharedDown(f"the server answered {reply}")  # an error reply: a bug, said as one
            try:  # `_run`, inline (rule 7)
                item[1](reply)
            except Exception:
                log.exception("a shared server reply's handler failed")
        return unknown

    def _failed(self, batch: list, exc: BaseException) -> None:
        """The round trip's connection is unusable (a reply half read): closed, the server marked
        down, every command of `batch` failed with SharedDown."""
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        self._refuse(batch, exc)

    def _refuse(self, batch: list, exc: BaseException) -> None:
        """The server marked down, every command of `batch` failed with SharedDown."""
        self.went_down(exc)
        for _, done in batch:
            _run(done, SharedDown(self.why_down))

    def _overdue(self) -> None:
        """Rule 3's deadline, from one timer for every round trip: re-armed while the round trip
        out is younger than ROUND_TRIP_TIMEOUT_S, the round trip failed once it is older."""
        self.watchdog = None
        if self.out is None:
            return
        loop = asyncio.get_running_loop()
        due = self.out_since + ROUND_TRIP_TIMEOUT_S
        if loop.time() < due:
            self.watchdog = loop.call_at(due, self._overdue)
            return
        batch, self.out = self.out, None
        self._failed(batch, TimeoutError(f"no answer within {ROUND_TRIP_TIMEOUT_S} s"))
        self._flush()  # what queued meanwhile tries a new connection

    async def _reconnect(self) -> None:
        """A new connection for what is queued; the server marked down when it fails. A new run
        of the server (restarted: `epoch`) fails what was asked of the old one instead of sending
        it: a step read from a tally the new run does not hold must not be written there."""
        epoch = self.epoch
        try:
            async with asyncio.timeout(SERVER_CONNECT_TIMEOUT_S):
                await self._connect()
        except ssl.SSLCertVerificationError as exc:  # before OSError: it is one; no wait heals it
            batch, self.queued = self.queued, []
            self.connecting = None
            self._failed(batch, SharedRefused(f"TLS: the server's certificate is not trusted: {exc.verify_message}"))
            return
        except (OSError, TimeoutError) as exc:
            batch, self.queued = self.queued, []
            self.connecting = None
            self._failed(batch, exc)
            return
        except asyncio.CancelledError:
            self.connecting = None
            raise
        self.connecting = None
        if self.epoch != epoch and self.queued:
            batch, self.queued = self.queued, []
            self._refuse(batch, ConnectionResetError("the server restarted"))
        self._flush()

    async def _load_scripts(self, unknown: list) -> None:
        """The scripts loaded, then the commands that named one sent again."""
        wire = self.wire
        try:
            async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
                await answer(wire, [("SCRIPT", "LOAD", script.source) for script in self.scripts])
                again = await answer(wire, [command for command, _ in unknown])
        except (OSError, TimeoutError) as exc:
            if self.out is unknown:
                self.out = None
                self._failed(unknown, exc)
            return
        if self.out is unknown:  # else the watchdog failed them meanwhile
            self._answered(again, load_scripts=False)

    async def _connect(self) -> Wire:
        """A new connection, AUTH and SELECT done (rule 6). Raises OSError."""
        where, loop = self.address, asyncio.get_running_loop()
        reader = self.reader(replyError=self.reply_error)

        def protocol() -> Wire:
            return Wire(reader, self._lost_idle)

        if "path" in where:
            _, wire = await loop.create_unix_connection(protocol, where["path"])
        else:
            ssl = True if self.tls else None
            _, wire = await loop.create_connection(protocol, where.get("host", "localhost"), where.get("port", 6379),
                                                   ssl=ssl)
        self.wire = wire
        hello: list[tuple] = []
        if where.get("password") is not None:
            hello.append(("AUTH", *((where["username"],) if where.get("username") else ()), where["password"]))
        if where.get("db"):
            hello.append(("SELECT", where["db"]))
        try:
            replies = await answer(wire, [*hello, ("INFO", "server")])
        except ConnectionResetError:
            if self.tls:
                raise
            # what a TLS-only port does with a plain hello (not a refusal: a full server does it too)
            raise ConnectionResetError("the server closed the connection before answering "
                                       "(a TLS port? then rediss://)") from None
        refused = [r for r in replies if isinstance(r, self.reply_error)]
        if refused:  # rule 8: an AUTH or SELECT that failed; INFO fails only as NOAUTH
            reason = str(refused[0])[:120]
            if where.get("password"):  # should a server quote it (rule 5)
                reason = reason.replace(where["password"], "***")
            raise SharedRefused(f"the server refused this router: {reason}")
        run_id = next((line.partition(b":")[2].strip() for line in replies[-1].splitlines()
                       if line.startswith(b"run_id:")), b"").decode(errors="replace")
        if run_id != self.run_id:
            if self.run_id is not None:
                self.epoch += 1
            self.run_id = run_id
        return wire

    def _lost_idle(self, wire: Wire, exc: Exception) -> None:
        """Rule 3: the connection closed with no round trip out (the server restarted, or
        dropped this client): the server is down as after any connection error, until the sync
        finds it again."""
        if wire is self.wire:
            self.wire = None
            self.went_down(exc)

    async def close(self) -> None:
        if self.connecting is not None:
            self.connecting.cancel()
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        batch = (self.out or []) + self.queued
        self.out, self.queued = None, []
        for _, done in batch:
            _run(done, SharedDown("the router is stopping"))
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        try:
            await self.redis.aclose(close_connection_pool=True)
        except Exception:  # closing a connection to a server that is gone
            pass



def read_out(done: asyncio.Future) -> None:
    """A reply nobody waits for: its failure is the server's state's business, not the loop's log."""
    if not done.cancelled():
        done.exception()


def _run(done: Done, reply: object) -> None:
    """A command's `done`, called as its reply is read (rule 7): a bug in one is logged, and
    neither the connection nor the other commands of its round trip are failed for it."""
    try:
        done(reply)
    except Exception:
        log.exception("a shared server reply's handler failed")


def _into(future: asyncio.Future, reply: object) -> None:
    """A reply into `future`, or the exception that stands for it (a command's SharedDown, a
    round trip's broken connection): `call`'s, `later`'s and `answer`'s `done`."""
    if future.done():
        return
    if isinstance(reply, Exception):
        future.set_exception(reply)
    else:
        future.set_result(reply)


def answer(wire: Wire, commands: Sequence[tuple]) -> asyncio.Future:
    """One round trip on `wire` as a future (connecting, loading scripts: off the call path)."""
    future = asyncio.get_running_loop().create_future()
    wire.round_trip(commands, functools.partial(_into, future))
    return future


class Wire(asyncio.Protocol):
    """One connection to the server, one round trip at a time (rule 2): the commands written as
    one buffer, the replies read by hiredis until there are as many as commands, then handed to
    the round trip's `done` (a connection lost hands it the error instead)."""

    def __init__(self, reader, on_lost: Callable[[Wire, Exception], None] | None = None) -> None:
        self.reader = reader
        self.on_lost = on_lost  # the connection lost with no round trip out (its owner did not close it)
        self.transport: asyncio.Transport | None = None
        self.open = False
        # the round trip out: what it hands its replies to, how many it waits for, those read so far
        self.done: Callable[[list | Exception], None] | None = None
        self.expected = 0
        self.replies: list = []

    def connection_made(self, transport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    def round_trip(self, commands: Sequence[tuple], done: Callable[[list | Exception], None]) -> None:
        self.done, self.expected, self.replies = done, len(commands), []
        self.transport.write(resp_commands(commands))  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        try:
            reader.feed(data)
            while self.done is not None:
                reply = reader.gets()
                if reply is False:
                    return
                self.replies.append(reply)
                if len(self.replies) == self.expected:
                    done, self.done = self.done, None
                    done(self.replies)  # may start the next round trip
            if reader.gets() is not False:  # a reply nobody asked for: the stream is not ours to trust
                self.lost(ConnectionError("the server sent a reply nobody asked for"))
        except Exception as exc:  # hiredis.ProtocolError: not a Redis-protocol server, or a broken stream
            self.lost(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.open:  # else its owner closed it
            self.lost(ConnectionResetError("the server closed the connection"))

    def lost(self, exc: Exception) -> None:
        done = self.done
        self.close()
        if done is not None:
            done(exc)
        elif self.on_lost is not None:
            self.on_lost(self, exc)

    def close(self) -> None:
        """Closed by its owner: the round trip out (if any) is the owner's to fail."""
        self.open = False
        self.done = None
        if self.transport is not None:
            self.transport.abort()
