"""A simulated hugpy-wrapper box: a real HTTP/1.1 server on loopback that speaks the contract.

Used by `router demo` (a demo fleet), by the tests (the fake box, scripted from the test
thread) and by the benchmark. It speaks contracts/hugpy-wrapper.md, quirks included. The wire,
steps and disconnects follow `router.sim.connection`, threads and scripts `router.sim.server`;
the rules of this kind are:

1. Streams. SSE streams are close-delimited (`Connection: close`, no length, no chunked
   encoding, §8); every other answer has a Content-Length and keeps the connection alive.
2. Counter. `changes` counts "something was written" like the box (§2.2): it moves when a
   tracked call arrives, when its seat changes state and when it ends, so long-polls answer
   at the call rate. `restart()` sets it back to 1 and answers pending long-polls (a real
   restart drops them; the low counter is what a router must notice).
3. Threads. After mutating the public state the test thread calls `changed()`/`restart()`,
   which hop onto the box's loop.
4. Privacy. Prompts, messages and uploaded files are parsed only to find `model`/`stream`;
   they are never logged or stored. Every reply text is fixed, not derived from the input.
5. Wire format. What the box writes (JSON spacing, errors, frames, replies) is
   `router.sim.hugpy_replies`; its catalog, seats and their rows are `router.sim.hugpy_inventory`.
6. A tracked POST goes, in order: record + `fe-` id (every answer carries it) → auth → body
   (400) → `@options` (untyped 404 / 400: real statuses even for streams) → the next scripted
   behaviour for its base, if any → catalog (typed 404, in-band for a stream) → seat (a load
   when not resident under these settings) → answer.
7. Auth from loopback (§6), only when the box has a key: a caller with a proxy header is
   outside and needs the box key everywhere but /health; otherwise use routes ignore the
   key and admin routes (state, cancel) accept none but reject a wrong one.
8. Fault behaviours (the fault suite): `die_after(n, clean)` cuts a stream after n content
   frames with a FIN or an RST; `drop(after_s, clean)` takes the call and closes without a
   byte; `bad_head()` breaks HTTP in the status line; `trickle(bytes, interval)` writes the
   whole normal answer, head included, a few bytes at a time; `linger(s)` keeps a finished
   stream's connection open `s` seconds after `data: [DONE]` (and writes each burst of
   frames as one piece, so without a cadence the whole stream is one write);
   `stall_after(n, s)` goes silent for s seconds after n content frames (connection open),
   `stall_body(...)` likewise inside a sized body. All are recorded calls.
9. Pair and box settings, `@options` and verdicts (§5, §11): `router.sim.hugpy_settings`. A
   seat is reused only under the same load contract (pair settings included, §11.2.6).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import re
import secrets
import threading
import time
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs

from router.sim.behavior import Behavior, answer_stalled_body
from router.sim.connection import CallRecord, Connection, Exchange, Steps
from router.sim.hugpy_inventory import ROUTES as INVENTORY_ROUTES, Inventory
from router.sim.hugpy_replies import (
    BAD_WAIT,
    CHAT_REQUIRED,
    CT_UNSUPPORTED,
    KEY_INVALID,
    KEY_REQUIRED,
    MODEL_REQUIRED,
    NOT_FOUND,
    SSE_HEAD,
    TASK_REPLIES,
    UNSUPPORTED,
    Reply,
    chat_reply,
    chunk_head,
    content_frame,
    error_frame,
    final_frame,
    placement_error,
    read_fields,
    role_frame,
)
from router.sim.hugpy_settings import ROUTES as SETTINGS_ROUTES, PairSettings, read_options
from router.sim.prefix_cache import Prefill, elements_of
from router.sim.server import PatternRoutes, Routes, SimServer, find_route
from router.sim.wire import SSE_DONE, json_body as _json

__all__ = ["Behavior", "SimBox"]  # the tests script a box with the behaviours beside it

VERSION = "0.1.182"
INITIAL_CHANGES = 1  # the box counts discovery writes at start; a restart comes back this low
MAX_WAIT_S = 60.0  # manage.py MAX_WAIT_S: the long-poll clamp
PROXY_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")  # §6: these make a caller "outside"


class _Connection(Connection):
    """A connection to a hugpy box: adds the close-delimited SSE head and cancel by parent id."""

    def sse_head(self, ex: Exchange) -> None:
        """Writes the §8 SSE head; the body then ends when the connection closes."""
        self.mark_head(ex, 200)
        self.write(SSE_HEAD + ex.rid + b"\r\n\r\n")

    def cancel(self, ex: Exchange) -> None:
        """Ends `ex` for a cancel by parent id: 499 if nothing was sent yet, then close (§7)."""
        if self._current is not ex:
            return
        if not ex.head_sent:
            ex.keep_alive = False
            self.respond(ex, 499, _json({"error": {"message": "request cancelled", "code": 499},
                                         "hugpy": {"request_id": ex.rid.decode()}}))
        self.close()
        self._stop_current()


class SimBox(PairSettings, Inventory, SimServer):
    """One simulated hugpy-wrapper box. See the module docstring for the rules."""

    kind = "hugpy"
    id_header = b"X-Hugpy-Execution-Request-Id"
    connection_class = _Connection

    def __init__(self, name: str, *, key: str | None = None, catalog: Iterable[str] = (),
                 residents: Iterable[str] = (), chunks: int = 5, cadence_s: float = 0.0,
                 load_s: float = 0.0, free_gpu_bytes: int | None = None) -> None:
        super().__init__(name, chunks=chunks, cadence_s=cadence_s)
        now = time.time()
        # public state, mutable from the test thread (rule 3)
        self.key = key
        self.residents: dict[str, dict[str, Any]] = {
            k: {"settings": None, "busy": 0, "state": "idle", "last_used": now} for k in residents}
        self.catalog: set[str] = set(catalog) | set(self.residents)
        self.free_gpu_bytes = free_gpu_bytes
        self.load_s = load_s
        self.healthy_answer = True
        self.store_id = secrets.token_hex(16)  # persistent per store: survives restart()
        # observations
        self.health_hits = 0
        self.state_polls = 0
        self.cancels: list[str] = []
        self.changes = INITIAL_CHANGES
        # internals
        self._waiters: set[asyncio.Future[None]] = set()  # pending long-polls
        self._epoch = 0  # bumped by restart(): pending long-polls answer at once
        self._live: dict[str, tuple[_Connection, Exchange]] = {}  # parent id -> call in progress
        self._init_pair_settings()
        for key, seat in self.residents.items():
            seat["contract"] = self.seat_contract(key, None)

    # -- public API (rule 3) -------------------------------------------------------------------

    @property
    def router_key(self) -> str | None:
        return self.key

    def changed(self) -> None:
        """Bumps `changes` and wakes long-polls; callable from any thread."""
        self._on_loop(self._bump)

    def restart(self) -> None:
        """Simulates a box restart: `changes` back to 1, residents cleared, long-polls answered."""
        self._on_loop(self._restart)

    # -- counter and long-polls ---------------------------------------------------------------

    def _on_loop(self, fn: Callable[[], None]) -> None:
        if self._loop is None or threading.get_ident() == self._loop_thread:
            fn()
        else:
            self._loop.call_soon_threadsafe(fn)

    def _bump(self) -> None:
        self.changes += 1
        self._wake()

    def _restart(self) -> None:
        self.changes = INITIAL_CHANGES
        self.residents.clear()
        self.prefix_cache.forget()
        self._epoch += 1
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wait_change(self, since: int, wait_s: float) -> None:
        """Store.wait_change: until `changes > since`, a restart, or the deadline."""
        epoch = self._epoch
        try:
            async with asyncio.timeout(wait_s):
                while self.changes <= since and self._epoch == epoch:
                    fut = self._loop.create_future()
                    self._waiters.add(fut)
                    try:
                        await fut
                    finally:
                        self._waiters.discard(fut)  # a poller that left must not linger
        except TimeoutError:
            pass  # the timeout answer: a normal 200 with the unchanged counter

    # -- routing ------------------------------------------------------------------------------

    def _dispatch(self, conn: _Connection, ex: Exchange) -> Steps | None:
        if ex.method in ("PUT", "PATCH", "DELETE"):  # §11: no do_PUT & co: the stdlib's 501, then close
            ex.keep_alive = False
            conn.respond(ex, 501, UNSUPPORTED % ex.method.encode(), CT_UNSUPPORTED)
            return None
        handler = find_route(_ROUTES, _PATTERN_ROUTES, ex)
        if handler is None:
            conn.respond(ex, 404, NOT_FOUND)  # also POST /v1/completions: not on the box (§8)
            return None
        return handler(self, conn, ex)

    def _crash_body(self, exc: Exception) -> bytes:
        return _json({"error": {"message": repr(exc), "code": 500}})  # §4.2: the box's 500

    def _auth(self, ex: Exchange, admin: bool) -> bytes | None:
        """§6 from loopback: returns the 401 body, or None when allowed.

        A caller behind a proxy header is "outside" and needs the box key. On admin routes a
        key that is sent must be right; on use routes an inside caller's key is not looked at."""
        if self.key is None:
            return None
        outside = any(h in ex.headers for h in PROXY_HEADERS)
        sent = ex.headers.get("authorization")
        if sent is None:
            return KEY_REQUIRED if outside else None
        if not (admin or outside):
            return None
        bearer = sent[7:].strip() if sent[:7].lower() == "bearer " else ""
        return None if hmac.compare_digest(bearer.encode(), self.key.encode()) else KEY_INVALID

    def _turned_away(self, conn: Connection, ex: Exchange, admin: bool) -> bool:
        """Answers 401 and returns True when `_auth` does not let the caller in."""
        denied = self._auth(ex, admin)
        if denied is not None:
            conn.respond(ex, 401, denied)
        return denied is not None

    def _finish(self, ex: Exchange) -> bool:
        if not super()._finish(ex):
            return False
        parent = ex.record.parent_id
        if parent is not None and self._live.get(parent, (None, None))[1] is ex:
            del self._live[parent]
        self._bump()  # "responded <rid>"
        return True

    # -- untracked routes ---------------------------------------------------------------------

    def _health(self, conn: _Connection, ex: Exchange) -> Steps | None:
        self.health_hits += 1
        if "?" in ex.url:
            conn.respond(ex, 404, NOT_FOUND)  # §1 quirk: the box matches the raw path, query included
            return None
        if not self.healthy_answer:
            return _held_open(self._loop)
        conn.respond(ex, 200, _json({
            "status": "ok", "service": "hugpy-wrapper", "worker": self.name, "version": VERSION,
            "source_version": VERSION, "deb_version": None, "version_label": VERSION, "fleet_url": None}))
        return None

    def _state(self, conn: _Connection, ex: Exchange) -> Steps:
        self.state_polls += 1
        if self._turned_away(conn, ex, admin=True):
            return
        query = parse_qs(ex.query or "")
        try:
            wait_s = min(max(float(query.get("wait", [""])[0] or 0), 0.0), MAX_WAIT_S)
            since = int(query.get("since", [""])[0] or -1)
        except ValueError:
            conn.respond(ex, 400, BAD_WAIT)
            return
        if wait_s and since >= 0 and self.changes <= since:
            yield self._wait_change(since, wait_s)
        conn.respond(ex, 200, _json(self.snapshot()))

    def _cancel(self, conn: _Connection, ex: Exchange) -> None:
        if self._turned_away(conn, ex, admin=True):
            return
        parent = ex.path_args[0]
        self.cancels.append(parent)
        conn.respond(ex, 202, _json({"request_id": parent, "state": "cancelling"}))
        live = self._live.get(parent)
        if live is not None:
            live[0].cancel(live[1])

    # -- tracked POSTs ------------------------------------------------------------------------

    def _open_call(self, conn: _Connection, ex: Exchange) -> CallRecord:
        rid = "fe-" + os.urandom(16).hex()
        ex.rid = rid.encode()
        rec = self._record(ex, rid, ex.headers.get("x-hugpy-parent-request-id"))
        if rec.parent_id is not None:
            self._live[rec.parent_id] = (conn, ex)
        self._bump()  # "received <rid>"
        return rec

    def _chat(self, conn: _Connection, ex: Exchange) -> Steps | None:
        rec = self._open_call(conn, ex)
        if self._turned_away(conn, ex, admin=False):
            return None
        try:
            body = json.loads(ex.body)
        except ValueError as exc:
            conn.respond(ex, 400, _json({"error": {"message": f"bad json: {exc}", "code": 400}}))
            return None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model or not body.get("messages"):
            conn.respond(ex, 400, CHAT_REQUIRED)
            return None
        rec.model = model
        rec.stream = bool(body.get("stream"))
        return self._placed(conn, ex, model, rec.stream, chat_reply, elements_of(body))

    def _task(self, conn: _Connection, ex: Exchange) -> Steps | None:
        rec = self._open_call(conn, ex)
        if self._turned_away(conn, ex, admin=False):
            return None
        try:
            fields = read_fields(ex)
        except ValueError as exc:
            conn.respond(ex, 400, _json({"error": {"message": f"bad request body: {exc}", "code": 400}}))
            return None
        model = fields.get("model")
        if not isinstance(model, str) or not model:
            conn.respond(ex, 400, MODEL_REQUIRED)
            return None
        rec.model = model
        return self._placed(conn, ex, model, False, TASK_REPLIES[ex.path])

    def _placed(self, conn: _Connection, ex: Exchange, model: str, stream: bool, reply: Reply,
                prompt: list[str] | None = None) -> Steps | None:
        """The `@options` check (a real status, §4.3), then a scripted behaviour or placement."""
        base, at, options = model.partition("@")
        settings = None
        if at:
            if base not in self.catalog:  # §4.2: untyped 404 when the name has `@`
                conn.respond(ex, 404, _json({"error": {
                    "message": f"model not found on this box: {base}", "code": 404}}))
                return None
            settings, unknown = read_options(options)
            if unknown:
                conn.respond(ex, 400, _json({"error": {
                    "message": f"unknown or infeasible option(s) {', '.join(unknown)} for {base} on this box",
                    "type": "invalid_request_error", "code": 400}}))
                return None
        behavior = self._next_behavior(base)
        return self._answer(conn, ex, base, settings, stream, reply, behavior, prompt)

    def _answer(self, conn: _Connection, ex: Exchange, base: str, settings: str | None, stream: bool,
                reply: Reply, behavior: Behavior | None, prompt: list[str] | None) -> Steps:
        """Generator: a scripted behaviour first (rule 8), then the box's normal answer."""
        cut: Behavior | None = None  # die_after on a stream: cut after its content frames
        stall: Behavior | None = None  # stall_after on a stream: silence before one content frame
        linger_s = 0.0
        match behavior.kind if behavior is not None else None:
            case None:
                pass
            case "hang":
                yield behavior.seconds  # then answer normally
            case "stall_after" if not stream:
                yield behavior.seconds
            case "stall_after":
                stall = behavior
            case "die_after" if stream:
                cut = behavior
            case "linger":
                linger_s = behavior.seconds
                if stream:
                    conn.slow_writes(1 << 30)  # each burst of writes goes out as one
            case "stall_body":
                yield from answer_stalled_body(conn, ex, behavior)
                return
            case "drop":
                if behavior.seconds > 0:
                    yield behavior.seconds
                conn.cut(behavior.clean)
                return
            case "bad_head":
                conn.bad_head(ex)
                return
            case "trickle":
                conn.slow_writes(behavior.size, behavior.seconds)
                yield from self._serve(conn, ex, base, settings, stream, reply, prompt)
                yield conn.drained()  # the call lasts until its last byte is out
                conn.slow_writes(None)
                return
            case _:
                self._misbehave(conn, ex, behavior, stream, base)
                return
        yield from self._serve(conn, ex, base, settings, stream, reply, prompt, cut, stall, linger_s)

    def _serve(self, conn: _Connection, ex: Exchange, base: str, settings: str | None, stream: bool,
               reply: Reply, prompt: list[str] | None, cut: Behavior | None = None,
               stall: Behavior | None = None, linger_s: float = 0.0) -> Steps:
        """Generator: catalog, seat (a load when not resident under these settings), the
        prompt's prefill through the box's prefix cache, then the reply or the stream."""
        if base not in self.catalog:
            self._refuse_placement(conn, ex, base, stream, 404, "not_found_error",
                                   f"model not found on this box: {base}", 404)
            return
        seat, loading = self._take_seat(base, settings, self.body_knobs(ex))
        try:
            if stream:
                conn.sse_head(ex)  # §4.3: the head goes out before placement; a load is silence
            if loading:
                if self.load_s > 0:
                    yield self.load_s
                seat["state"] = "serving"
                self._bump()
                self.prefix_cache.forget(base)  # loaded afresh: nothing computed yet
            prefill = self.prefix_cache.take(base, prompt or [])
            if prefill.seconds > 0:
                yield prefill.seconds
            if not stream:
                content_type, body = reply(base, ex.rid.decode(), prefill)
                conn.respond(ex, 200, body, content_type)
                return
            yield from self._stream_frames(conn, ex, base, prefill, cut, stall, linger_s)
        finally:
            self._release_seat(base, seat)

    def _stream_frames(self, conn: _Connection, ex: Exchange, base: str, prefill: Prefill,
                       cut: Behavior | None, stall: Behavior | None, linger_s: float) -> Steps:
        """Generator: a §8 stream after its head: the role frame, content frames (each after
        `cadence_s`), the final frame and `[DONE]`, then close. A `cut` sends its own count
        of content frames and then closes without the rest (FIN or RST); a `stall` goes silent
        before one content frame; `linger_s` holds the connection open after `[DONE]`."""
        head = chunk_head(ex.rid.decode(), base)
        conn.write(role_frame(head))
        content = content_frame(head)
        cadence_s = self.cadence_s
        stall_at = stall.chunks if stall is not None else -1
        for sent in range(cut.chunks if cut is not None else self.chunks):
            if sent == stall_at:
                yield stall.seconds
            if cadence_s > 0:
                yield cadence_s
            conn.write(content)
        if cut is not None:  # cut off: no final frame, no [DONE]
            conn.cut(cut.clean)
            return
        conn.write(final_frame(head, prefill, self.chunks))
        conn.write(SSE_DONE)
        if linger_s > 0:
            yield conn.drained()
            conn.slow_writes(None)
            yield linger_s
        conn.close()

    def _refuse(self, conn: _Connection, ex: Exchange, behavior: Behavior, stream: bool, base: str) -> None:
        """A scripted `refuse` is a real status; an `in_band` one a placement refusal."""
        if behavior.kind == "in_band":
            self._refuse_placement(conn, ex, base, stream, behavior.status, behavior.type, behavior.message,
                                   behavior.code)
        else:
            conn.respond(ex, behavior.status, placement_error(ex.rid.decode(), behavior.type, behavior.message,
                                                              behavior.code))

    def _refuse_placement(self, conn: _Connection, ex: Exchange, base: str, stream: bool, status: int,
                          type: str | None, message: str, code: int | str | None) -> None:
        """A placement refusal: a real status for a plain call, in-band after a 200 for a
        stream (§4.3: one error frame, `[DONE]`, close)."""
        rid = ex.rid.decode()
        if not stream:
            conn.respond(ex, status, placement_error(rid, type, message, code))
            return
        conn.sse_head(ex)
        conn.write(error_frame(rid, base, type, message, code))
        conn.write(SSE_DONE)
        conn.close()


def _held_open(loop: asyncio.AbstractEventLoop) -> Steps:
    """A health answer that never comes: only the peer leaving ends it."""
    yield loop.create_future()


# The route table. Anything else, POST /v1/completions included, is the box's 404 (§4.4).
_ROUTES: Routes = {
    ("GET", "/health"): SimBox._health,
    ("GET", "/v1/health"): SimBox._health,
    ("GET", "/harness/health"): SimBox._health,
    ("GET", "/v1/telemetry/state"): SimBox._state,
    ("POST", "/v1/chat/completions"): SimBox._chat,
    ("POST", "/chat/completions"): SimBox._chat,
    **{("POST", path): SimBox._task for path in TASK_REPLIES},
    **INVENTORY_ROUTES,
    **SETTINGS_ROUTES,
}
# §7: a parent id is `[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}`.
_PATTERN_ROUTES: PatternRoutes = [
    ("POST", re.compile(r"/v1/requests/([A-Za-z0-9][A-Za-z0-9_.:-]{0,199})/cancel"), SimBox._cancel),
]
