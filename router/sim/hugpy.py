"""A simulated hugpy-wrapper box: a real HTTP/1.1 server on loopback that speaks the contract.

Used by `router demo` (a demo fleet), by the tests (the fake box, scripted from the test
thread) and by the benchmark. It speaks contracts/hugpy-wrapper.md, quirks included. The wire,
steps, disconnects and threads follow `router.sim.server`; the rules of this kind are:

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
5. JSON is written with the stdlib encoder (`ensure_ascii=False`, default separators), as
   the box writes it, so byte scanners in the router meet the real spacing (`"a": 1`).
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
9. Pair and box settings, verdicts and `/residents` (§11): `router.sim.hugpy_settings`. A seat
   is reused only under the same load contract (pair settings included, §11.2.6).
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
import zlib
from email.parser import BytesParser
from email.policy import HTTP as EMAIL_HTTP_POLICY
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs

from router.sim.prefix_cache import NO_PROMPT, Prefill, elements_of
from router.sim.hugpy_settings import ROUTES as SETTINGS_ROUTES, PairSettings
from router.sim.server import (
    CT_JSON,
    STREAM_TOKEN,
    Behavior,
    CallRecord,
    Connection,
    Exchange,
    PatternRoutes,
    Routes,
    SimFleet,
    SimServer,
    Steps,
    answer_raw,
    answer_stalled_body,
    find_route,
    json_body as _json,
    sse_frame as _frame,
)

__all__ = ["Behavior", "CallRecord", "SimBox", "SimFleet"]

VERSION = "0.1.182"
INITIAL_CHANGES = 1  # the box counts discovery writes at start; a restart comes back this low
MAX_WAIT_S = 60.0  # manage.py MAX_WAIT_S: the long-poll clamp

# What a seat looks like in `residents` rows (sizes are plausible, not measured).
MODEL_BYTES = 4_920_000_000
GPU_TOTAL_BYTES = 150_754_820_096  # one H200, as in the contract's constructed gpu_state row
CTX_DEFAULT = 4096
CTX_BY_PRESET = {"ctx-low": 2048, "ctx-medium": 8192, "ctx-high": 32768, "ctx-xhigh": 65536, "ctx-max": 65536}
LOAD_ERROR_TEXT = "child exited rc=1: exiting due to model loading error"
QUANT_LABEL = "q4_k_m"  # every simulated model has one GGUF file with this quant

# §5: the option tokens the box accepts after `@` (case-insensitive, split on `+` or `,`).
OPTION_TOKENS = frozenset(
    "gpu-only ram-only max-gpu max-ram explicit moe no-moe 4bit fa ctx-low ctx-medium ctx-high "
    "ctx-xhigh ctx-max kv-f16 kv-q8_0 kv-q4_0 fit".split()
) | {QUANT_LABEL}
_CTX_PCT_RE = re.compile(r"ctx-(100|[1-9][0-9]?)")
_OPTION_SPLIT_RE = re.compile(r"[+,]")

PROXY_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")  # §6: these make a caller "outside"
REPLY_TEXT = "This is a simulated reply."
SPEECH_BYTES = bytes(range(256)) * 16  # every byte value, so a relay that decodes text breaks

# Canned bodies (§1, §4, §6), built once.
_NOT_FOUND = _json({"error": {"message": "not found", "code": 404}})
_BAD_WAIT = _json({"error": {"message": "wait and since must be numbers", "code": 400}})
_KEY_REQUIRED = _json({"error": {
    "message": "an API key is required from here: send Authorization: Bearer hpk_…",
    "type": "invalid_request_error", "code": "invalid_api_key"}})
_KEY_INVALID = _json({"error": {
    "message": "invalid, expired or revoked API key",
    "type": "invalid_request_error", "code": "invalid_api_key"}})
_CHAT_REQUIRED = _json({"error": {"message": "model and messages required", "code": 400}})
_MODEL_REQUIRED = _json({"error": {"message": "model required", "code": 400}})
_DONE = b"data: [DONE]\n\n"
_UNSUPPORTED = (b'<!DOCTYPE HTML>\n<html lang="en">\n    <head>\n        <meta charset="utf-8">\n'
                b"        <title>Error response</title>\n    </head>\n    <body>\n        <h1>Error response</h1>\n"
                b"        <p>Error code: 501</p>\n        <p>Message: Unsupported method ('%s').</p>\n"
                b"        <p>Error code explanation: 501 - Server does not support this operation.</p>\n"
                b"    </body>\n</html>\n")
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\n"
    b"X-Accel-Buffering: no\r\n"
    b"Connection: close\r\n"
    b"X-Hugpy-Execution-Request-Id: "
)


class _Connection(Connection):
    """A connection to a hugpy box: adds the close-delimited SSE head and cancel by parent id."""

    def sse_head(self, ex: Exchange) -> None:
        """Writes the §8 SSE head; the body then ends when the connection closes."""
        self.mark_head(ex, 200)
        self.write(_SSE_HEAD + ex.rid + b"\r\n\r\n")

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


# ---------------------------------------------------------------------------------------------
# The box


class SimBox(PairSettings, SimServer):
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

    # -- public API ---------------------------------------------------------------------------

    def script(self, model_base: str, *behaviors: Behavior) -> None:
        """Queues behaviours for the next tracked calls naming `model_base` (FIFO, once each)."""
        self._queue_behaviors(model_base, behaviors)

    def changed(self) -> None:
        """Bumps `changes` and wakes long-polls; callable from any thread."""
        self._on_loop(self._bump)

    def restart(self) -> None:
        """Simulates a box restart: `changes` back to 1, residents cleared, long-polls answered."""
        self._on_loop(self._restart)

    def snapshot(self) -> dict[str, Any]:
        """The trimmed `/v1/telemetry/state` body (§2.3): every row carries `worker`."""
        now = time.time()
        worker = self.name
        gpu = []
        if self.free_gpu_bytes is not None:
            total = max(GPU_TOTAL_BYTES, self.free_gpu_bytes)
            gpu.append({"worker": worker, "device": 0, "uuid": f"GPU-sim-{worker}", "name": "NVIDIA H200",
                        "total": total, "reserved": 0, "used": total - self.free_gpu_bytes,
                        "free": self.free_gpu_bytes, "processes": {}, "process_models": {},
                        "hugpy_pids": [], "probe_pids": [], "reason": "watch", "changes": self.changes,
                        "at": now})
        return {
            "gpu_state": gpu,
            "host_state": [{"worker": worker, "mem_total": 270_000_000_000, "mem_available": 200_000_000_000,
                            "swap_total": 0, "swap_free": 0, "hugpy_ram": {}, "reason": "watch",
                            "changes": self.changes, "at": now}],
            "residents": [self._resident_row(k, seat, now) for k, seat in sorted(list(self.residents.items()))],
            "models": [self._model_row(k) for k in sorted(self.catalog)],
            "cpu_state": [{"worker": worker, "cpus": 16, "physical_cores": 8, "mode": "affinity", "cpuset": 0,
                           "busy": {}, "hugpy_cpus": {}, "free_cores": 8, "reserved_cores": [],
                           "pressure_some": 0.0, "reason": "watch", "changes": self.changes, "at": now,
                           "reclaimable_cores": 0, "busy_held_cores": 0, "obtainable_cores": 8}],
            "pair_settings": self.pair_rows(),
            "store_id": self.store_id,
            "changes": self.changes,
            "data_service": {"protocol": "hugpy-wrapper-data", "version": 1, "authority": "wrapper",
                             "backend": "sqlite", "store_id": self.store_id, "schema_version": 37,
                             "paths": {"state": "/v1/telemetry/state", "log": "/v1/telemetry"},
                             "settings_confirmation": "write-then-read"},
        }

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
            conn.respond(ex, 501, _UNSUPPORTED % ex.method.encode(), b"text/html;charset=utf-8")
            return None
        handler = find_route(_ROUTES, _PATTERN_ROUTES, ex)
        if handler is None:
            conn.respond(ex, 404, _NOT_FOUND)  # also POST /v1/completions: not on the box (§8)
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
            return _KEY_REQUIRED if outside else None
        if not (admin or outside):
            return None
        bearer = sent[7:].strip() if sent[:7].lower() == "bearer " else ""
        return None if hmac.compare_digest(bearer.encode(), self.key.encode()) else _KEY_INVALID

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
            conn.respond(ex, 404, _NOT_FOUND)  # §1 quirk: the box matches the raw path, query included
            return None
        if not self.healthy_answer:
            return _forever(self._loop)  # held open, silent, until the peer leaves
        conn.respond(ex, 200, _json({
            "status": "ok", "service": "hugpy-wrapper", "worker": self.name, "version": VERSION,
            "source_version": VERSION, "deb_version": None, "version_label": VERSION, "fleet_url": None}))
        return None

    def _state(self, conn: _Connection, ex: Exchange) -> Steps:
        self.state_polls += 1
        denied = self._auth(ex, admin=True)
        if denied is not None:
            conn.respond(ex, 401, denied)
            return
        query = parse_qs(ex.query or "")
        try:
            wait_s = min(max(float(query.get("wait", [""])[0] or 0), 0.0), MAX_WAIT_S)
            since = int(query.get("since", [""])[0] or -1)
        except ValueError:
            conn.respond(ex, 400, _BAD_WAIT)
            return
        if wait_s and since >= 0 and self.changes <= since:
            yield self._wait_change(since, wait_s)
        conn.respond(ex, 200, _json(self.snapshot()))

    def _models(self, conn: _Connection, ex: Exchange) -> None:
        denied = self._auth(ex, admin=False)
        if denied is not None:
            conn.respond(ex, 401, denied)
            return
        data = [{"id": k, "object": "model", "owned_by": "hugpy"} for k in sorted(self.catalog)]
        conn.respond(ex, 200, _json({"object": "list", "data": data}))

    def _cancel(self, conn: _Connection, ex: Exchange) -> None:
        denied = self._auth(ex, admin=True)
        if denied is not None:
            conn.respond(ex, 401, denied)
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
        denied = self._auth(ex, admin=False)
        if denied is not None:
            conn.respond(ex, 401, denied)
            return None
        try:
            body = json.loads(ex.body)
        except ValueError as exc:
            conn.respond(ex, 400, _json({"error": {"message": f"bad json: {exc}", "code": 400}}))
            return None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model or not body.get("messages"):
            conn.respond(ex, 400, _CHAT_REQUIRED)
            return None
        rec.model = model
        rec.stream = bool(body.get("stream"))
        return self._placed(conn, ex, model, rec.stream, None, elements_of(body))

    def _task(self, conn: _Connection, ex: Exchange) -> Steps | None:
        rec = self._open_call(conn, ex)
        denied = self._auth(ex, admin=False)
        if denied is not None:
            conn.respond(ex, 401, denied)
            return None
        try:
            fields = _read_fields(ex)
        except ValueError as exc:
            conn.respond(ex, 400, _json({"error": {"message": f"bad request body: {exc}", "code": 400}}))
            return None
        model = fields.get("model")
        if not isinstance(model, str) or not model:
            conn.respond(ex, 400, _MODEL_REQUIRED)
            return None
        rec.model = model
        return self._placed(conn, ex, model, False, _TASK_REPLIES[ex.path])

    def _placed(self, conn: _Connection, ex: Exchange, model: str, stream: bool,
                reply: TaskReply | None, prompt: list[str] | None = None) -> Steps | None:
        """The `@options` check (a real status, §4.3), then a scripted behaviour or placement."""
        base, at, opts = model.partition("@")
        settings = None
        if at:
            if base not in self.catalog:  # §4.2: untyped 404 when the name has `@`
                conn.respond(ex, 404, _json({"error": {
                    "message": f"model not found on this box: {base}", "code": 404}}))
                return None
            tokens = [t.strip() for t in _OPTION_SPLIT_RE.split(opts) if t.strip()]
            bad = [t for t in tokens if t.lower() not in OPTION_TOKENS and not _CTX_PCT_RE.fullmatch(t.lower())]
            if bad:
                conn.respond(ex, 400, _json({"error": {
                    "message": f"unknown or infeasible option(s) {', '.join(bad)} for {base} on this box",
                    "type": "invalid_request_error", "code": 400}}))
                return None
            settings = "+".join(sorted({t.lower() for t in tokens})) or None
        behavior = self._next_behavior(base)
        return self._answer(conn, ex, base, settings, stream, reply, behavior, prompt)

    def _answer(self, conn: _Connection, ex: Exchange, base: str, settings: str | None, stream: bool,
                reply: TaskReply | None, behavior: Behavior | None, prompt: list[str] | None = None) -> Steps:
        """Generator: a scripted behaviour first, then the box's normal answer (a chat's prompt
        through the box's prefix cache: its prefill, its cached tokens in `usage`)."""
        stream_chunks = self.chunks
        die = False
        clean = True
        linger_s = 0.0
        stall_at, stall_s = -1, 0.0  # stall_after: silence before this content frame
        if behavior is not None:
            match behavior.kind:
                case "hang":
                    yield behavior.seconds  # then answer normally
                case "stall_after" if not stream:
                    yield behavior.seconds
                case "stall_after":
                    stall_at, stall_s = behavior.chunks, behavior.seconds
                case "stall_body":
                    yield from answer_stalled_body(conn, ex, behavior)
                    return
                case "reset":
                    conn.reset()
                    return
                case "raw":
                    answer_raw(conn, ex, behavior)
                    return
                case "refuse":
                    conn.respond(ex, behavior.status, self._error_body(ex, behavior.type, behavior.message,
                                                                       behavior.code))
                    return
                case "in_band":
                    self._refuse_placement(conn, ex, base, stream, behavior.status, behavior.type,
                                           behavior.message, behavior.code)
                    return
                case "die_after":
                    if not stream:
                        conn.reset()
                        return
                    stream_chunks, die = behavior.chunks, True
                    clean = behavior.clean
                case "drop":
                    if behavior.seconds > 0:
                        yield behavior.seconds
                    if behavior.clean:
                        conn.close()
                    else:
                        conn.reset()
                    return
                case "linger":
                    linger_s = behavior.seconds
                    if stream:
                        conn.slow_writes(1 << 30)  # each burst of writes goes out as one
                case "bad_head":
                    conn.bad_head(ex)
                    return
                case "trickle":
                    conn.slow_writes(behavior.size, behavior.seconds)
                    yield from self._answer(conn, ex, base, settings, stream, reply, None, prompt)
                    yield conn.drained()  # the call lasts until its last byte is out
                    conn.slow_writes(None)
                    return
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
                if reply is not None:
                    content_type, body = reply(self, base, ex.rid.decode())
                else:
                    content_type, body = _chat_reply(self, base, ex.rid.decode(), prefill)
                conn.respond(ex, 200, body, content_type)
                return
            created = int(time.time())
            rid = ex.rid.decode()
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": base}
            conn.write(_frame({**chunk, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
            content = _frame({**chunk, "choices": [
                {"index": 0, "delta": {"content": STREAM_TOKEN}, "finish_reason": None}]})
            cadence_s = self.cadence_s
            for sent in range(stream_chunks):
                if sent == stall_at:
                    yield stall_s
                if cadence_s > 0:
                    yield cadence_s
                conn.write(content)
            if die:  # cut off: no final frame, no [DONE]
                if clean:
                    conn.close()  # FIN, as the kernel of a crashed process sends
                else:
                    conn.reset()  # RST
                return
            conn.write(_frame({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                               "usage": _usage(prefill, stream_chunks), "hugpy": {"request_id": rid}}))
            conn.write(_DONE)
            if linger_s > 0:
                yield conn.drained()
                conn.slow_writes(None)
                yield linger_s
            conn.close()
        finally:
            self._release_seat(base, seat)

    def _error_body(self, ex: Exchange, type: str | None, message: str, code: int | str | None) -> bytes:
        """§4.1: a placement error carries the call's id in a top-level `hugpy`."""
        return _json({"error": _error(type, message, code), "hugpy": {"request_id": ex.rid.decode()}})

    def _refuse_placement(self, conn: _Connection, ex: Exchange, base: str, stream: bool, status: int,
                          type: str | None, message: str, code: int | str | None) -> None:
        """A placement refusal: a real status for a plain call, in-band after a 200 for a
        stream (§4.3: one error frame, `[DONE]`, close)."""
        if not stream:
            conn.respond(ex, status, self._error_body(ex, type, message, code))
            return
        rid = ex.rid.decode()
        conn.sse_head(ex)
        conn.write(_frame({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": base, "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}],
                           "error": _error(type, message, code), "hugpy": {"request_id": rid}}))
        conn.write(_DONE)
        conn.close()

    # -- seats --------------------------------------------------------------------------------

    def _take_seat(self, base: str, settings: str | None, knobs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Marks the seat busy. Returns (seat, needs a load): a load when the model is not
        resident, is resident under other settings (§5: reloaded), or is loading/errored."""
        now = time.time()
        seat = self.residents.get(base)
        contract = self.seat_contract(base, settings, knobs)
        if seat is None or seat.get("contract", self.seat_contract(base, seat.get("settings"))) != contract:
            seat = {"settings": settings, "contract": contract, "busy": 0, "state": "loading", "last_used": now,
                    "since": now}
            self.residents[base] = seat
        loading = seat.get("state") in ("loading", "error")
        seat["busy"] = seat.get("busy", 0) + 1
        seat["state"] = "loading" if loading else "serving"
        self._bump()
        return seat, loading

    def _release_seat(self, base: str, seat: dict[str, Any]) -> None:
        seat["busy"] = max(seat.get("busy", 1) - 1, 0)
        seat["last_used"] = time.time()
        seat["calls"] = seat.get("calls", 0) + 1
        # An interrupted load still completes on the box (the engine does not see the client).
        if seat["busy"] == 0 and seat.get("state") != "error":
            seat["state"] = "idle"
        if self.residents.get(base) is seat:
            self._bump()

    def _model_path(self, key: str) -> str:
        return f"/models/gguf/sim/{key}/{key}-{QUANT_LABEL.upper()}.gguf"

    def _model_row(self, key: str) -> dict[str, Any]:
        path = self._model_path(key)
        file = path.rsplit("/", 1)[1]
        return {"worker": self.name, "key": key, "path": path, "model_dir": path.rsplit("/", 1)[0],
                "quant": QUANT_LABEL, "bytes": MODEL_BYTES,
                "files": [{"file": file, "path": path, "quant": QUANT_LABEL, "bytes": MODEL_BYTES,
                           "mmproj": False, "elected": True, "variant": file, "variant_bytes": MODEL_BYTES,
                           "complete": True}],
                "engine": "gguf", "runner": "llama", "seen_at": 0.0}

    def _resident_row(self, key: str, seat: dict[str, Any], now: float) -> dict[str, Any]:
        state = seat.get("state", "idle")
        tokens = set((seat.get("settings") or "").split("+"))
        loaded = state in ("idle", "serving")
        fake_pid = 10_000 + zlib.crc32(key.encode()) % 50_000
        since = seat.get("since", seat.get("last_used"))
        path = self._model_path(key)
        return {
            "worker": self.name, "key": key, "pid": fake_pid, "port": fake_pid,
            "state": state, "alive": int(state != "error"), "healthy": int(loaded),
            "busy": int(seat.get("busy", 0) > 0 or state == "serving"), "loading": int(state == "loading"),
            "load_error": seat.get("load_error") or (LOAD_ERROR_TEXT if state == "error" else None),
            "vram_bytes": 0 if "ram-only" in tokens else MODEL_BYTES, "ram_bytes": 500_000_000,
            "device": 0, "n_gpu_layers": 0 if "ram-only" in tokens else -1, "total_layers": 32,
            "n_cpu_moe": None,
            "ctx": next((CTX_BY_PRESET[t] for t in sorted(tokens) if t in CTX_BY_PRESET), CTX_DEFAULT),
            "is_moe": 0, "quant": path.rsplit("/", 1)[1], "model_file": path,
            "endpoint": f"http://127.0.0.1:{fake_pid}", "resident_since": since,
            "weights_loaded_at": since if loaded else None, "last_used": seat.get("last_used"),
            "calls": seat.get("calls", 0), "engine": "gguf", "runner": "llama", "observed_at": now,
            "cpu_set": None, "threads": 1, "cpu_ms": 0.0,
        }


# ---------------------------------------------------------------------------------------------
# Bodies: reading task fields, building fixed replies


def _error(type: str | None, message: str, code: int | str | None) -> dict[str, Any]:
    """§4.1: `type` and `code` are each left out when None (the box has untyped errors and
    two code-less ones)."""
    error: dict[str, Any] = {"message": message}
    if type is not None:
        error["type"] = type
    if code is not None:
        error["code"] = code
    return error


def _forever(loop: asyncio.AbstractEventLoop) -> Steps:
    yield loop.create_future()  # never resolved: only the peer leaving ends it


def _read_fields(ex: Exchange) -> dict[str, Any]:
    """The task route's fields: JSON, or the text parts of a multipart body (§8: JSON-decoded
    when they start with `[` or `{`). File parts are skipped unread (rule 6).

    Raises ValueError for a body the box would call a bad request body."""
    content_type = ex.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/"):
        fields = json.loads(ex.body or b"{}")
        if not isinstance(fields, dict):
            raise ValueError("expected a JSON object")
        return fields
    message = BytesParser(policy=EMAIL_HTTP_POLICY).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + ex.body)
    if not message.is_multipart():
        raise ValueError("multipart body without parts")
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name or part.get_filename() is not None:
            continue
        text = part.get_payload(decode=True).decode("utf-8", "replace")
        fields[name] = json.loads(text) if text[:1] in ("[", "{") else text
    return fields


TaskReply = Callable[[SimBox, str, str], tuple[bytes, bytes]]  # (box, base, rid) -> (type, body)


def _usage(prefill: Prefill, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage, cached prompt tokens included (the box runs llama.cpp behind an OpenAI API)."""
    prompt_tokens = prefill.prompt_tokens or 8
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": prefill.cached_tokens}}


def _chat_reply(box: SimBox, base: str, rid: str, prefill: Prefill = NO_PROMPT) -> tuple[bytes, bytes]:
    # §5: a non-stream answer carries the engine's `model`, the GGUF path for llama-server.
    return CT_JSON, _json({
        "id": "chatcmpl-" + rid[3:], "object": "chat.completion", "created": int(time.time()),
        "model": box._model_path(base),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY_TEXT}, "finish_reason": "stop"}],
        "usage": _usage(prefill, 6), "hugpy": {"request_id": rid}})


def _json_reply(make: Callable[[str], dict[str, Any]]) -> TaskReply:
    def reply(box: SimBox, base: str, rid: str) -> tuple[bytes, bytes]:
        return CT_JSON, _json({**make(base), "hugpy": {"request_id": rid}})
    return reply


def _speech_reply(box: SimBox, base: str, rid: str) -> tuple[bytes, bytes]:
    return b"audio/wav", SPEECH_BYTES  # §8: raw bytes with the artifact's mime


_IMAGE = _json_reply(lambda base: {"created": int(time.time()), "data": [{"b64_json": "AAAA"}], "artifacts": []})
_TRANSCRIPT = _json_reply(lambda base: {"text": REPLY_TEXT})
_TASK_REPLIES: dict[str, TaskReply] = {
    "/v1/embeddings": _json_reply(lambda base: {
        "object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
        "model": base, "usage": {"prompt_tokens": 4, "total_tokens": 4}}),
    "/v1/audio/transcriptions": _TRANSCRIPT,
    "/v1/audio/translations": _TRANSCRIPT,
    "/v1/audio/speech": _speech_reply,
    "/v1/images/generations": _IMAGE,
    "/v1/images/edits": _IMAGE,
    "/v1/images/variations": _IMAGE,
    "/v1/videos/generations": _json_reply(lambda base: {
        "created": int(time.time()), "data": [{"url": "file:///spool/sim/video.mp4", "path": "/spool/sim/video.mp4"}],
        "artifacts": [{"id": "sim-video", "path": "/spool/sim/video.mp4", "mime": "video/mp4"}]}),
    "/v1/summarize": _json_reply(lambda base: {"summary": REPLY_TEXT}),
    "/v1/keywords": _json_reply(lambda base: {"keywords": ["simulated", "reply"]}),
}


# The route table. Anything else, POST /v1/completions included, is the box's 404 (§4.4).
_ROUTES: Routes = {
    ("GET", "/health"): SimBox._health,
    ("GET", "/v1/health"): SimBox._health,
    ("GET", "/harness/health"): SimBox._health,
    ("GET", "/v1/telemetry/state"): SimBox._state,
    ("GET", "/v1/models"): SimBox._models,
    ("POST", "/v1/chat/completions"): SimBox._chat,
    ("POST", "/chat/completions"): SimBox._chat,
    **{("POST", path): SimBox._task for path in _TASK_REPLIES},
    **SETTINGS_ROUTES,
}
# §7: a parent id is `[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}`.
_PATTERN_ROUTES: PatternRoutes = [
    ("POST", re.compile(r"/v1/requests/([A-Za-z0-9][A-Za-z0-9_.:-]{0,199})/cancel"), SimBox._cancel),
]
