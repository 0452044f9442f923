"""A simulated Ollama server: a real HTTP/1.1 server on loopback that speaks Ollama's API as
contracts/ollama-lmstudio.md §1-§2 describes it, quirks included. The wire, steps and
disconnects follow `router.sim.connection`, threads and scripts `router.sim.server`.

Rules:
1. Names. A model is matched with Ollama's normalisation (`router.sim.ollama_names`, the
   sim's own reading of Ollama's code: `llama3` is `llama3:latest`, case-insensitive); the
   lists report the shortest display form (`router.sim.ollama_inventory`), while chat,
   generate and embed echo `model` exactly as the client sent it.
2. Host guard. Like Ollama bound to loopback, any request whose `Host` the guard refuses
   (`router.sim.ollama_wire.host_allowed`) gets 403 with no body (the DNS-rebinding guard).
3. Streams. `/api/chat`, `/api/generate` and `/api/pull` stream unless `stream` is `false`;
   `/v1/chat/completions` only when `stream` is `true`. Native streams are NDJSON lines
   (`application/x-ndjson`) ending in a `done:true` line with metrics; `/v1` streams are SSE
   ending in `data: [DONE]`. Both are chunked and keep the connection alive, as Go writes them.
   Whole answers are `application/json; charset=utf-8`, written without spaces, as Go does.
4. A model-bearing call goes, in order: record → body (400 `missing request body`) →
   `keep_alive` (400 when it is not a number or a Go duration) → empty model (chat 400
   `model is required`, generate 404 `model '' not found`) → name validity (400 `invalid
   model name`) → the next scripted behaviour for its normalised name → installed? (404 in
   the route's wording, §1.5) → answer. Errors are `{"error": "<text>"}`; on `/v1` they are
   wrapped as `{"error": {"message", "type", "param": null, "code": null}}` with the type
   Ollama derives from the status.
5. Residency. Generation and embedding calls load their model into `loaded` (expiring after
   `keep_alive`, default 5 m, never when negative: the expiry is reported, not enforced);
   `keep_alive: 0` unloads it after the answer. Generate without `prompt`, or chat with no
   `messages`, is the load idiom: one JSON object with `done_reason` `load` (or `unload`
   with `keep_alive: 0`), whatever `stream` says.
6. Behaviours are written in Ollama's dialect: `refuse`/`busy` → that status with
   `{"error": message}`; `in_band` on a stream → a 200 stream whose first line (or SSE frame)
   is the error, then its end; `die_after(n)` → n content lines, then the connection closes
   without the last chunk; `stall_after(n, s)` → n content lines, then s seconds of silence;
   `hang`, `reset` and `raw` as for every box.
7. Threads. The test thread may change `tags`, `loaded`, `version`, `chunks` and `cadence_s`
   at any time; the box is polled, so there is nothing to notify.
8. Privacy. Bodies are read only for the fields that steer the answer (`model`, `stream`,
   `keep_alive`, whether `prompt`/`messages`/`input` are empty, the answer's bound); replies are
   fixed texts.
9. Capacity. With `max_parallel` (OLLAMA_NUM_PARALLEL with OLLAMA_MAX_QUEUE=0), a
   model-bearing call that finds that many answers in progress gets Ollama's queue-full
   answer, 503 `server busy, please try again.  maximum pending requests exceeded`.
10. Length. An answer is `chunks` tokens long, or as many as the call bounds it to
   (`options.num_predict` on the native API, `max_tokens` or `max_completion_tokens` on `/v1`),
   ending for `length` then, as Ollama does. `honours_bound = False` plays a box that ignores
   the bound.
"""

from __future__ import annotations

import base64
import json
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from router.sim.behavior import BUSY_MESSAGE, Behavior
from router.sim.connection import Connection, Exchange, Steps
from router.sim.ollama_inventory import (
    MODEL_DETAILS,
    ROUTES as INVENTORY_ROUTES,
    Inventory,
    display_name,
    model_digest,
    model_size,
)
from router.sim.ollama_names import fold_key
from router.sim.ollama_wire import (
    DEFAULT_KEEP_ALIVE_S,
    evaluated_tokens,
    go_quote,
    host_allowed,
    keep_alive_s,
    ndjson_line,
    metrics,
    openai_error,
    rfc3339,
)
from router.sim.prefix_cache import Prefill
from router.sim.server import ANSWERED, Routes, SimServer, model_route
from router.sim.wire import (
    CT_NDJSON,
    CT_SSE,
    CT_TEXT,
    EMBEDDING,
    SSE_DONE,
    STREAM_TOKEN,
    compact_json,
    sse_frame,
    wants_usage,
)


@dataclass(frozen=True, slots=True)
class _Call:
    """A model-bearing call once its prologue (rule 4) has passed."""

    body: dict[str, Any]
    model: str  # as the client sent it: echoed verbatim
    key: str  # fold_key(model)
    name: str | None  # the installed tag's display name; None when not installed
    stream: bool
    keep_alive_s: float
    fault: Behavior | None  # a streamed die_after or stall_after, applied by _stream


Answer = Callable[["SimOllama", Connection, Exchange, _Call], "Steps | None"]


@dataclass(frozen=True, slots=True)
class _Route:
    """How one model-bearing path reads its call and words its errors."""

    answer: Answer
    openai: bool = False  # errors in the `/v1` wrapper instead of `{"error": text}`
    streams: bool | None = None  # the `stream` default: True (native), False (/v1), None (never)
    fields: tuple[str, ...] = ("model",)  # where the name is; the first non-empty one wins
    empty: tuple[int, str] = (400, "model is required")
    not_found: Callable[[str], str] | None = None  # client string -> 404 text; None: may be absent
    loads: bool = False  # the call loads its model (rule 5)


def _not_found(model: str) -> str:
    return f"model '{model}' not found"


def _not_pulled(model: str) -> str:
    return f"model {go_quote(model)} not found, try pulling it first"


class SimOllama(Inventory, SimServer):
    """One simulated Ollama server. See the module docstring for the rules."""

    kind = "ollama"

    def __init__(self, name: str, *, tags: Iterable[str], loaded: Iterable[str] = (), chunks: int = 5,
                 cadence_s: float = 0.0, version: str = "0.12.6", max_parallel: int | None = None) -> None:
        super().__init__(name, chunks=chunks, cadence_s=cadence_s)
        self.max_parallel = max_parallel
        self.honours_bound = True  # rule 10
        self.answering = 0  # model-bearing answers in progress (rule 9)
        self.busy_refusals = 0
        # public state, mutable from the test thread (rule 7)
        self.tags: list[str] = list(tags)
        self.loaded: list[str] = list(loaded)
        self.version = version
        bad = [t for t in self.tags + self.loaded if fold_key(t) is None]
        if bad:
            raise ValueError(f"not valid Ollama names: {bad}")
        # internals: when each name was installed (the given order is newest first) and expires
        now = time.time()
        self._modified: dict[str, float] = {}
        for age, tag in enumerate(self.tags):
            self._modified.setdefault(fold_key(tag), now - age)
        self._expires: dict[str, float] = {fold_key(n): now + DEFAULT_KEEP_ALIVE_S for n in self.loaded}

    def _script_key(self, model: str) -> str:
        """Names that normalise alike share a queue (`llama3` and `llama3:latest`)."""
        key = fold_key(model)
        if key is None:
            raise ValueError(f"not a valid Ollama name: {model!r}")
        return key

    # -- routing ------------------------------------------------------------------------------

    def _dispatch(self, conn: Connection, ex: Exchange) -> Steps | None:
        if not host_allowed(ex.headers.get("host", "")):
            conn.respond(ex, 403, b"", b"")
            return None
        handler = _ROUTES.get((ex.method, ex.path))
        if handler is not None:
            return handler(self, conn, ex)
        if any(path == ex.path for _, path in _ROUTES):
            conn.respond(ex, 405, b"405 method not allowed", CT_TEXT)
        else:
            conn.respond(ex, 404, b"404 page not found", CT_TEXT)
        return None

    def _crash_body(self, exc: Exception) -> bytes:
        return compact_json({"error": repr(exc)})

    # -- answers and errors -------------------------------------------------------------------

    def _error(self, conn: Connection, ex: Exchange, status: int, message: str, openai: bool,
               type: str | None = None) -> None:
        self._json(conn, ex, openai_error(status, message, type) if openai else {"error": message}, status)

    def _refuse(self, conn: Connection, ex: Exchange, behavior: Behavior, stream: bool, openai: bool) -> None:
        """A scripted refusal in Ollama's dialect (rule 6)."""
        match behavior.kind:
            case "in_band" if stream and openai:
                conn.stream_head(ex, CT_SSE)
                conn.send(sse_frame(openai_error(500, behavior.message, behavior.type), compact=True))
                conn.end_stream(ex)
            case "in_band" if stream:
                conn.stream_head(ex, CT_NDJSON)
                conn.send(ndjson_line({"error": behavior.message}))
                conn.end_stream(ex)
            case _:
                self._error(conn, ex, behavior.status, behavior.message, openai, behavior.type)

    # -- node-level routes --------------------------------------------------------------------

    def _root(self, conn: Connection, ex: Exchange) -> None:
        conn.respond(ex, 200, b"Ollama is running", CT_TEXT)

    def _version(self, conn: Connection, ex: Exchange) -> None:
        self._json(conn, ex, {"version": self.version})

    # -- model-bearing routes -----------------------------------------------------------------

    def _model_call(self, conn: Connection, ex: Exchange, route: _Route) -> Steps:
        """Generator: the prologue of rule 4, then the route's answer."""
        rec = self._record(ex)
        body = self._read_body(conn, ex, route.openai)
        if body is None:
            return
        model = next((v for f in route.fields if isinstance(v := body.get(f), str) and v), "")
        stream = route.streams is not None and (
            body.get("stream") is not False if route.streams else body.get("stream") is True)
        rec.model, rec.stream = model, stream
        try:
            keep_alive = keep_alive_s(body.get("keep_alive"))
        except ValueError as exc:
            self._error(conn, ex, 400, str(exc), route.openai)
            return
        if not model:
            self._error(conn, ex, *route.empty, route.openai)
            return
        key = fold_key(model)
        if key is None:
            self._error(conn, ex, 400, "invalid model name", route.openai)
            return
        fault = yield from self._apply_script(conn, ex, key, stream, route.openai)
        if fault is ANSWERED:
            return
        name = self._installed(key)
        if name is None and route.not_found is not None:
            self._error(conn, ex, 404, route.not_found(model), route.openai)
            return
        if self.max_parallel is not None and self.answering >= self.max_parallel:
            self.busy_refusals += 1
            self._error(conn, ex, 503, BUSY_MESSAGE, route.openai)
            return
        if route.loads:
            self._load(name, key, keep_alive)
        self.answering += 1
        try:
            steps = route.answer(self, conn, ex, _Call(body, model, key, name, stream, keep_alive, fault))
            if steps is not None:
                yield from steps
        finally:
            self.answering -= 1
            if route.loads and keep_alive == 0:
                self._unload(key)

    def _read_body(self, conn: Connection, ex: Exchange, openai: bool) -> dict[str, Any] | None:
        """The JSON object body, or None after answering 400."""
        if not ex.body:
            self._error(conn, ex, 400, "missing request body", openai)
            return None
        try:
            body = json.loads(ex.body)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._error(conn, ex, 400, "invalid JSON body", openai)
            return None
        return body

    def _length(self, body: dict[str, Any], openai: bool) -> tuple[int, str]:
        """Rule 10: (the answer's tokens, why it ends)."""
        if openai:
            bound = body.get("max_tokens") or body.get("max_completion_tokens")
        else:
            options = body.get("options")
            bound = options.get("num_predict") if isinstance(options, dict) else None
        if self.honours_bound and isinstance(bound, int) and 0 < bound < self.chunks:
            return bound, "length"
        return self.chunks, "stop"

    def _chat(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        if not call.body.get("messages"):
            return self._load_idiom(conn, ex, call, "message", {"role": "assistant", "content": ""})
        length = self._length(call.body, False)
        return self._generate_answer(conn, ex, call, "message", {"role": "assistant", "content": STREAM_TOKEN},
                                     {"role": "assistant", "content": ""},
                                     {"role": "assistant", "content": STREAM_TOKEN * length[0]}, length)

    def _generate(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        if not call.body.get("prompt"):
            return self._load_idiom(conn, ex, call, "response", "")
        length = self._length(call.body, False)
        return self._generate_answer(conn, ex, call, "response", STREAM_TOKEN, "", STREAM_TOKEN * length[0], length)

    def _load_idiom(self, conn: Connection, ex: Exchange, call: _Call, field: str, empty: object) -> None:
        self._json(conn, ex, {"model": call.model, "created_at": rfc3339(time.time()), field: empty, "done": True,
                              "done_reason": "unload" if call.keep_alive_s == 0 else "load"})

    def _generate_answer(self, conn: Connection, ex: Exchange, call: _Call, field: str, piece: object,
                         empty: object, whole: object, length: tuple[int, str]) -> Steps | None:
        """Chat (`message`) or generate (`response`): NDJSON pieces and a final line, or one
        object with the whole text and the final line's metrics; after the prompt's prefill.
        `length`: the answer's tokens and why it ends (rule 10)."""
        return self.prefix_cache.prefill(call.key, call.body, lambda prefill: self._generated(
            conn, ex, call, field, piece, empty, whole, length, prefill))

    def _generated(self, conn: Connection, ex: Exchange, call: _Call, field: str, piece: object,
                   empty: object, whole: object, length: tuple[int, str], prefill: Prefill) -> Steps | None:
        tokens, reason = length
        head = {"model": call.model, "created_at": rfc3339(time.time())}
        final: dict[str, Any] = {**head, field: empty, "done": True, "done_reason": reason}
        if field == "response" and not call.body.get("raw"):
            final["context"] = [1, 2, 3]  # deprecated, but still sent unless raw
        final.update(metrics(tokens, prefill))
        if not call.stream:
            self._json(conn, ex, {**final, field: whole})
            return None
        line = ndjson_line({**head, field: piece, "done": False})
        return self._stream(conn, ex, CT_NDJSON, (), [line] * tokens, [ndjson_line(final)], call.fault)

    def _embed(self, conn: Connection, ex: Exchange, call: _Call) -> None:
        given = call.body.get("input")
        inputs = ([given] if given else []) if isinstance(given, str) else list(given or [])
        self._json(conn, ex, {"model": call.model, "embeddings": [EMBEDDING] * len(inputs),
                              "total_duration": 14_000_000, "load_duration": 1_000_000,
                              **({"prompt_eval_count": 2 * len(inputs)} if inputs else {})})

    def _embeddings(self, conn: Connection, ex: Exchange, call: _Call) -> None:
        self._json(conn, ex, {"embedding": EMBEDDING if call.body.get("prompt") else []})

    def _show(self, conn: Connection, ex: Exchange, call: _Call) -> None:
        self._json(conn, ex, {
            "modelfile": f'# Modelfile generated by "ollama show"\nFROM {call.name}\n',
            "parameters": 'stop "<|eot_id|>"', "template": "{{ .Prompt }}", "details": MODEL_DETAILS,
            "model_info": {"general.architecture": "llama", "general.parameter_count": 8_030_261_248,
                           "llama.context_length": 8192, "llama.embedding_length": 4096},
            "capabilities": ["completion"], "modified_at": rfc3339(self._modified[call.key])})

    def _pull(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        name = call.name or display_name(call.model)
        if not call.stream:
            self._install(name)
            self._json(conn, ex, {"status": "success"})
            return None
        return self._pull_stream(conn, ex, call, name)

    def _pull_stream(self, conn: Connection, ex: Exchange, call: _Call, name: str) -> Steps:
        digest, total = "sha256:" + model_digest(call.key), model_size(call.key)
        progress = [ndjson_line({"status": f"pulling {digest[7:19]}", "digest": digest, "total": total,
                           "completed": total * (i + 1) // self.chunks}) for i in range(self.chunks)]
        tail = [ndjson_line({"status": s}) for s in ("verifying sha256 digest", "writing manifest", "success")]
        if (yield from self._stream(conn, ex, CT_NDJSON, [ndjson_line({"status": "pulling manifest"})], progress,
                                    tail, call.fault)):
            self._install(name)

    def _delete(self, conn: Connection, ex: Exchange, call: _Call) -> None:
        self._uninstall(call.key)
        conn.respond(ex, 200, b"", b"")

    def _copy(self, conn: Connection, ex: Exchange, call: _Call) -> None:
        destination = call.body.get("destination")
        if not isinstance(destination, str) or not destination:
            self._error(conn, ex, 400, "source and destination are required", False)
            return
        name = display_name(destination)
        if name is None:
            self._error(conn, ex, 400, f"destination {go_quote(destination)} is invalid", False)
            return
        self._install(name)
        conn.respond(ex, 200, b"", b"")

    def _v1_chat(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        return self.prefix_cache.prefill(call.key, call.body, lambda prefill: self._v1_chat_answer(
            conn, ex, call, prefill))

    def _v1_chat_answer(self, conn: Connection, ex: Exchange, call: _Call, prefill: Prefill) -> Steps | None:
        evaluated = evaluated_tokens(prefill)  # no cached count: Ollama's compat layer has none
        tokens, reason = self._length(call.body, True)
        usage = {"prompt_tokens": evaluated, "completion_tokens": tokens, "total_tokens": evaluated + tokens}
        head = {"id": f"chatcmpl-{secrets.randbelow(999)}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": call.model, "system_fingerprint": "fp_ollama"}
        if not call.stream:
            self._json(conn, ex, {**head, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": STREAM_TOKEN * tokens},
                "finish_reason": reason}], "usage": usage})
            return None
        piece = sse_frame({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": STREAM_TOKEN},
                                                "finish_reason": None}]}, compact=True)
        tail = [sse_frame({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": reason}]}, compact=True)]
        if wants_usage(call.body):
            tail.append(sse_frame({**head, "choices": [], "usage": usage}, compact=True))
        tail.append(SSE_DONE)
        return self._stream(conn, ex, CT_SSE, (), [piece] * tokens, tail, call.fault)

    def _v1_embeddings(self, conn: Connection, ex: Exchange, call: _Call) -> None:
        encoding = call.body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            self._error(conn, ex, 400, 'encoding_format must be "float" or "base64"', True)
            return
        given = call.body.get("input")
        count = 1 if isinstance(given, str) else len(given or [])
        vector: object = EMBEDDING
        if encoding == "base64":  # little-endian float32, as OpenAI sends it
            vector = base64.b64encode(struct.pack(f"<{len(EMBEDDING)}f", *EMBEDDING)).decode()
        self._json(conn, ex, {"object": "list",
                              "data": [{"object": "embedding", "embedding": vector, "index": i} for i in range(count)],
                              "model": call.model, "usage": {"prompt_tokens": 2 * count, "total_tokens": 2 * count}})


_NATIVE_STREAM = dict(streams=True, loads=True, not_found=_not_found)
_ROUTES: Routes = {
    ("GET", "/"): SimOllama._root,
    ("HEAD", "/"): SimOllama._root,
    ("GET", "/api/version"): SimOllama._version,
    ("HEAD", "/api/version"): SimOllama._version,
    **INVENTORY_ROUTES,
    ("POST", "/api/chat"): model_route(_Route(SimOllama._chat, **_NATIVE_STREAM)),
    ("POST", "/api/generate"): model_route(_Route(SimOllama._generate, empty=(404, _not_found("")), **_NATIVE_STREAM)),
    ("POST", "/api/embed"): model_route(_Route(SimOllama._embed, loads=True, not_found=_not_pulled)),
    ("POST", "/api/embeddings"): model_route(_Route(SimOllama._embeddings, loads=True, not_found=_not_pulled)),
    ("POST", "/api/show"): model_route(_Route(SimOllama._show, fields=("model", "name"),
                                               not_found=lambda model: _not_found(display_name(model)))),
    ("POST", "/api/pull"): model_route(_Route(SimOllama._pull, streams=True, fields=("model", "name"))),
    ("DELETE", "/api/delete"): model_route(_Route(SimOllama._delete, fields=("model", "name"),
                                                   not_found=_not_found)),
    ("POST", "/api/copy"): model_route(_Route(SimOllama._copy, fields=("source",),
                                               empty=(400, "source and destination are required"),
                                               not_found=lambda model: f"model {go_quote(model)} not found")),
    ("POST", "/v1/chat/completions"): model_route(_Route(SimOllama._v1_chat, openai=True, streams=False, loads=True,
                                                          not_found=_not_found)),
    ("POST", "/v1/embeddings"): model_route(_Route(SimOllama._v1_embeddings, openai=True, loads=True,
                                                    not_found=_not_pulled)),
}
