"""The base of every simulated box kind (`SimServer`): listening on loopback, call records,
scripted behaviours, route tables and the chunked stream. The wire itself is
`router.sim.connection`; a fleet on a background thread is `router.sim.fleet`.

Rules:
1. A kind is a subclass: it sets `kind`, reads its route table in `_dispatch`, and writes
   `_crash_body` (its 500) and `_refuse` (its error dialect); it may set `id_header` (the
   header that carries `ex.rid`), `server_headers` (raw header lines on every answer),
   `connection_class`, and `_script_key` (which names share a script queue). Model-bearing
   routes go through the kind's `_model_call(conn, ex, route)` (`model_route`).
2. Records. Each tracked call gets a `CallRecord` (router.sim.connection) when it starts; the
   newest CALLS_KEPT survive a trim at twice that, so a benchmark of millions of calls stays
   bounded while a test never loses one. Times are `time.monotonic()`.
3. Scripts. `script(model, *behaviors)` queues behaviours per `_script_key(model)`;
   `_apply_script` takes the next one at the kind's chosen point in the call: it waits out a
   `hang`, hands a stream fault to `_stream`, or answers the rest (`_misbehave`).
4. Threads. The test thread may mutate a box's public state (plain attribute, dict, set and
   list operations); everything else runs on the loop thread.
5. Privacy. Bodies are parsed only to find the fields that steer an answer (`model`,
   `stream`, …); nothing is logged or stored, and every reply text is fixed.
6. Keep-alive. `close_idle_after` closes connections that idle too long, as real servers do
   (the connection applies it, rule 4 of `router.sim.connection`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Iterator

from router.sim.behavior import STREAM_FAULTS, Behavior, answer_raw
from router.sim.connection import CallRecord, Connection, Exchange, Steps
from router.sim.prefix_cache import PrefixCache
from router.sim.wire import CT_JSON_UTF8, compact_json

CALLS_KEPT = 10_000  # rule 2
LISTEN_BACKLOG = 1024  # the benchmark opens hundreds of connections at once

ANSWERED = object()  # _apply_script's result when a scripted behaviour answered the call


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


def model_route(route: Any) -> Handler:
    """The handler of a model-bearing path: the kind's `_model_call` with that path's `route`."""
    return lambda box, conn, ex: box._model_call(conn, ex, route)



class SimServer:
    """One simulated box: listening, connections, call records and scripts (rule 1 says what
    a kind adds)."""

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

    @property
    def router_key(self) -> str | None:
        """The key a router sends this box (`router boxes add --key`), where it has one."""
        return None

    # -- for subclasses -----------------------------------------------------------------------

    def _dispatch(self, conn: Connection, ex: Exchange) -> Steps | None:
        raise NotImplementedError

    def _crash_body(self, exc: Exception) -> bytes:
        """The 500 body when a handler raises (a bug in the sim)."""
        raise NotImplementedError

    def _refuse(self, conn: Connection, ex: Exchange, behavior: Behavior, stream: bool, dialect: Any) -> None:
        """Answers a scripted `refuse` or `in_band` in the engine's own error shape (`dialect`:
        what the kind needs to word it, e.g. Ollama's `/v1` flag)."""
        raise NotImplementedError

    def _script_key(self, model: str) -> str:
        """The queue a model's behaviours share: the name as given (a kind that folds names
        says so here)."""
        return model

    # -- scripted behaviours (rule 3) ---------------------------------------------------------

    def script(self, model: str, *behaviors: Behavior) -> None:
        """Queues behaviours for the next model-bearing calls naming `model` (FIFO, once
        each); `_script_key` says which names share a queue."""
        self._scripts.setdefault(self._script_key(model), deque()).extend(behaviors)

    def _next_behavior(self, key: str) -> Behavior | None:
        queue = self._scripts.get(key)
        return queue.popleft() if queue else None

    def _apply_script(self, conn: Connection, ex: Exchange, key: str, stream: bool, dialect: Any) -> Steps:
        """Generator: the next scripted behaviour for `key`, if any. `hang` (and `stall_after`
        without a stream) waits it out and a streamed `die_after` or `stall_after` is returned
        for `_stream` to apply, both for the call to go on; any other behaviour is answered by
        `_misbehave` and returns ANSWERED. No behaviour (or a hang) returns None."""
        behavior = self._next_behavior(key)
        if behavior is None:
            return None
        if behavior.kind == "hang" or (behavior.kind == "stall_after" and not stream):
            yield behavior.seconds
            return None
        if behavior.kind in STREAM_FAULTS and stream:
            return behavior
        self._misbehave(conn, ex, behavior, stream, dialect)
        return ANSWERED

    def _misbehave(self, conn: Connection, ex: Exchange, behavior: Behavior, stream: bool, dialect: Any) -> None:
        """Answers a behaviour that ends the call (rule 3): `refuse`/`in_band` in the kind's
        dialect, `raw` as given, anything else (`reset`, `die_after` without a stream, another
        kind's behaviour) with a reset."""
        if behavior.kind in ("refuse", "in_band"):
            self._refuse(conn, ex, behavior, stream, dialect)
        elif behavior.kind == "raw":
            answer_raw(conn, ex, behavior)
        else:
            conn.reset()

    # -- answering ----------------------------------------------------------------------------

    def _json(self, conn: Connection, ex: Exchange, obj: object, status: int = 200) -> None:
        """A whole JSON answer as Go, Express and llama.cpp write it: compact, with a charset
        (the hugpy box writes its own, rule 1 of `router.sim.hugpy`)."""
        conn.respond(ex, status, compact_json(obj), CT_JSON_UTF8)

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
