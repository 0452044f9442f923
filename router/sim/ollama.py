"""A simulated Ollama server: a real HTTP/1.1 server on loopback that speaks Ollama's API as
contracts/ollama-lmstudio.md §1-§2 describes it, quirks included. The wire, steps, disconnects
and threads follow `router.sim.server`.

Rules:
1. Names. A model is matched with Ollama's normalisation (`router.sim.ollama_names`, the
   sim's own reading of Ollama's code: `llama3` is `llama3:latest`, case-insensitive); `/api/tags` and `/api/ps` report the
   shortest display form (`llama3:latest`) in the installed name's case, while chat, generate
   and embed echo `model` exactly as the client sent it.
2. Host guard. Like Ollama bound to loopback, any request whose `Host` is not a loopback,
   private or unspecified IP, `localhost`, `*.localhost`, `*.local`, `*.internal` or this
   machine's name gets 403 with no body (the DNS-rebinding guard, §1.1).
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
9. Capacity. With `max_parallel` (OLLAMA_NUM_PARALLEL with OLLAMA_MAX_QUEUE=0), a
   model-bearing call that finds that many answers in progress gets Ollama's queue-full
   answer, 503 `server busy, please try again.  maximum pending requests exceeded`.
8. Privacy. Bodies are read only for the fields that steer the answer (`model`, `stream`,
   `keep_alive`, whether `prompt`/`messages`/`input` are empty, the answer's bound); replies are
   fixed texts.
10. Length. An answer is `chunks` tokens long, or as many as the call bounds it to
   (`options.num_predict` on the native API, `max_tokens` or `max_completion_tokens` on `/v1`),
   ending for `length` then, as Ollama does. `honours_bound = False` plays a box that ignores
   the bound.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import re
import secrets
import socket
import struct
import time
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable

from router.sim.ollama_names import fold_key, parse
from router.sim.prefix_cache import NO_PROMPT, Prefill
from router.sim.server import (
    ANSWERED,
    BUSY_MESSAGE,
    STREAM_TOKEN,
    Behavior,
    Connection,
    Exchange,
    Handler,
    Routes,
    SimServer,
    Steps,
    answer_raw,
    compact_json,
    sse_frame,
)

DEFAULT_KEEP_ALIVE_S = 300.0  # OLLAMA_KEEP_ALIVE's default, 5m
FOREVER_S = 2**63 / 1e9  # Go's time.Duration max: a negative keep_alive expires in ~292 years
MODEL_DETAILS = {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                 "parameter_size": "8.0B", "quantization_level": "Q4_K_M"}
CONTEXT_LENGTH = 4096
EMBEDDING = [0.6, 0.8, 0.0]  # L2-normalised, as Ollama's vectors are
PROMPT_TOKENS = 8

CT_JSON_UTF8 = b"application/json; charset=utf-8"
CT_NDJSON = b"application/x-ndjson"
CT_SSE = b"text/event-stream"
CT_TEXT = b"text/plain; charset=utf-8"
_DONE = b"data: [DONE]\n\n"

# §1.1: Go's netip IsPrivate (Python's is_private also takes in documentation ranges).
_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
_HOSTNAME = socket.gethostname().lower()  # Ollama also admits the machine's own name
_HOST_PORT_RE = re.compile(r"\[([^\]]*)\]:[^:]*|([^:]*):[^:]*")  # net.SplitHostPort's two shapes

# api.Duration: a string is a Go duration (`5m`, `1h30m`, `-1s`); a bare number has no unit.
_DURATION_RE = re.compile(r"[-+]?((\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h))+")
_DURATION_PART_RE = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# ---------------------------------------------------------------------------------------------
# Names, hosts, durations, times


def display_name(name: str) -> str | None:
    """Ollama's `DisplayShortest` of `name` in the name's own case (None when invalid): the
    default host and namespace dropped, `:latest` added when there is no tag."""
    parsed = parse(name)
    return None if parsed is None else parsed.display_shortest()


def host_allowed(host_header: str) -> bool:
    """Ollama's `allowedHostsMiddleware` for a server bound to loopback (§1.1)."""
    match = _HOST_PORT_RE.fullmatch(host_header)
    host = host_header if match is None else match.group(1) if match.group(1) is not None else match.group(2)
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if addr is not None and (addr.is_loopback or addr.is_unspecified or any(addr in n for n in _PRIVATE_NETS)):
        return True
    host = host.lower()
    return host in ("", "localhost", _HOSTNAME) or host.endswith(_LOCAL_SUFFIXES)


def keep_alive_s(value: Any) -> float:
    """`keep_alive` in seconds (§1.3): a number is seconds, a string a Go duration; absent is
    the 5 m default and a negative value is forever. Raises ValueError like Go's binding."""
    if value is None:
        return DEFAULT_KEEP_ALIVE_S
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and value in ("0", "+0", "-0"):
        seconds = 0.0
    elif isinstance(value, str) and _DURATION_RE.fullmatch(value):
        seconds = sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART_RE.findall(value))
        seconds = -seconds if value.startswith("-") else seconds
    elif isinstance(value, str) and re.fullmatch(r"[-+]?[\d.]+", value):
        raise ValueError(f'time: missing unit in duration "{value}"')
    elif isinstance(value, str):
        raise ValueError(f'time: invalid duration "{value}"')
    else:
        raise ValueError(f"Unsupported type: '{type(value).__name__}'")
    return FOREVER_S if seconds < 0 else seconds


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _go_quote(text: str) -> str:
    """Go's `%q` for plain names (a JSON string literal is the same for them)."""
    return json.dumps(text, ensure_ascii=False)


def _model_size(key: str) -> int:
    return 1_000_000_000 + zlib.crc32(key.encode()) % 4_000_000_000  # plausible, stable per name


def _model_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _evaluated(prefill: Prefill) -> int:
    """Ollama counts only the prompt tokens it evaluated: a cached prefix is left out."""
    return prefill.prompt_tokens - prefill.cached_tokens if prefill.prompt_tokens else PROMPT_TOKENS


def _metrics(eval_count: int, prefill: Prefill = NO_PROMPT) -> dict[str, int]:
    """The final line's metrics, in nanoseconds; zero values are left out (Go's omitempty)."""
    metrics = {"total_duration": 150_000_000 + eval_count * 10_000_000, "load_duration": 1_000_000,
               "prompt_eval_count": _evaluated(prefill), "prompt_eval_duration": 20_000_000,
               "eval_count": eval_count, "eval_duration": eval_count * 10_000_000}
    return {k: v for k, v in metrics.items() if v}


def _line(obj: object) -> bytes:
    return compact_json(obj) + b"\n"


# ---------------------------------------------------------------------------------------------
# Model-bearing routes


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
    return f"model {_go_quote(model)} not found, try pulling it first"


# ---------------------------------------------------------------------------------------------
# The box


class SimOllama(SimServer):
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

    def script(self, model: str, *behaviors: Behavior) -> None:
        """Queues behaviours for the next model-bearing calls whose name normalises like
        `model` (`llama3` and `llama3:latest` share a queue; FIFO, once each)."""
        key = fold_key(model)
        if key is None:
            raise ValueError(f"not a valid Ollama name: {model!r}")
        self._queue_behaviors(key, behaviors)

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

    def _json(self, conn: Connection, ex: Exchange, obj: object, status: int = 200) -> None:
        conn.respond(ex, status, compact_json(obj), CT_JSON_UTF8)

    def _error(self, conn: Connection, ex: Exchange, status: int, message: str, openai: bool,
               type: str | None = None) -> None:
        self._json(conn, ex, _openai_error(status, message, type) if openai else {"error": message}, status)

    def _misbehave(self, conn: Connection, ex: Exchange, behavior: Behavior, stream: bool, openai: bool) -> None:
        """Answers a scripted refusal (rule 6); `hang` and a streamed `die_after` or `stall_after`
        never get here."""
        match behavior.kind:
            case "in_band" if stream and openai:
                conn.stream_head(ex, CT_SSE)
                conn.send(sse_frame(_openai_error(500, behavior.message, behavior.type), compact=True))
                conn.end_stream(ex)
            case "in_band" if stream:
                conn.stream_head(ex, CT_NDJSON)
                conn.send(_line({"error": behavior.message}))
                conn.end_stream(ex)
            case "refuse" | "in_band":
                self._error(conn, ex, behavior.status, behavior.message, openai, behavior.type)
            case "raw":
                answer_raw(conn, ex, behavior)
            case _:  # reset, and die_after without a stream
                conn.reset()

    # -- node-level routes --------------------------------------------------------------------

    def _root(self, conn: Connection, ex: Exchange) -> None:
        conn.respond(ex, 200, b"Ollama is running", CT_TEXT)

    def _version(self, conn: Connection, ex: Exchange) -> None:
        self._json(conn, ex, {"version": self.version})

    def _tags(self, conn: Connection, ex: Exchange) -> None:
        rows = [self._tag_row(name) for name in self._installed_names()]
        rows.sort(key=lambda row: self._modified[fold_key(row["name"])], reverse=True)
        self._json(conn, ex, {"models": rows})

    def _ps(self, conn: Connection, ex: Exchange) -> None:
        rows = []
        for loaded in list(self.loaded):
            key = fold_key(loaded)
            name = self._installed(key) or display_name(loaded)
            expires = self._expires.setdefault(key, time.time() + DEFAULT_KEEP_ALIVE_S)
            size = _model_size(key)
            rows.append((expires, {"name": name, "model": name, "size": size, "digest": _model_digest(key),
                                   "details": MODEL_DETAILS, "expires_at": _rfc3339(expires),
                                   "size_vram": size, "context_length": CONTEXT_LENGTH}))
        rows.sort(key=lambda pair: pair[0], reverse=True)
        self._json(conn, ex, {"models": [row for _, row in rows]})

    def _v1_models(self, conn: Connection, ex: Exchange) -> None:
        data = [{"id": name, "object": "model", "created": int(self._modified[fold_key(name)]),
                 "owned_by": _namespace(name)} for name in self._installed_names()]
        data.sort(key=lambda row: row["created"], reverse=True)
        self._json(conn, ex, {"object": "list", "data": data or None})  # Go's nil slice: null

    def _tag_row(self, name: str) -> dict[str, Any]:
        key = fold_key(name)
        return {"name": name, "model": name, "modified_at": _rfc3339(self._modified[key]),
                "size": _model_size(key), "digest": _model_digest(key), "details": MODEL_DETAILS}

    # -- inventory ----------------------------------------------------------------------------

    def _installed_names(self) -> list[str]:
        """Display names of `tags`, one per normalised name; stamps names new to the box."""
        names: dict[str, str] = {}
        for tag in list(self.tags):
            key = fold_key(tag)
            if key is not None and key not in names:
                names[key] = display_name(tag)
                self._modified.setdefault(key, time.time())
        return list(names.values())

    def _installed(self, key: str) -> str | None:
        return next((n for n in self._installed_names() if fold_key(n) == key), None)

    def _install(self, name: str) -> None:
        key = fold_key(name)
        if self._installed(key) is None:
            self.tags.append(name)
        self._modified[key] = time.time()

    def _uninstall(self, key: str) -> None:
        self.tags[:] = [t for t in self.tags if fold_key(t) != key]
        self._unload(key)

    def _load(self, name: str, key: str, keep_alive: float) -> None:
        if not any(fold_key(n) == key for n in list(self.loaded)):
            self.loaded.append(name)
            self.prefix_cache.forget(key)  # a fresh runner has computed nothing
        self._expires[key] = time.time() + keep_alive

    def _unload(self, key: str) -> None:
        self.loaded[:] = [n for n in self.loaded if fold_key(n) != key]
        self._expires.pop(key, None)

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
        self._json(conn, ex, {"model": call.model, "created_at": _rfc3339(time.time()), field: empty, "done": True,
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
        head = {"model": call.model, "created_at": _rfc3339(time.time())}
        final: dict[str, Any] = {**head, field: empty, "done": True, "done_reason": reason}
        if field == "response" and not call.body.get("raw"):
            final["context"] = [1, 2, 3]  # deprecated, but still sent unless raw
        final.update(_metrics(tokens, prefill))
        if not call.stream:
            self._json(conn, ex, {**final, field: whole})
            return None
        line = _line({**head, field: piece, "done": False})
        return self._stream(conn, ex, CT_NDJSON, (), [line] * tokens, [_line(final)], call.fault)

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
            "capabilities": ["completion"], "modified_at": _rfc3339(self._modified[call.key])})

    def _pull(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        name = call.name or display_name(call.model)
        if not call.stream:
            self._install(name)
            self._json(conn, ex, {"status": "success"})
            return None
        return self._pull_stream(conn, ex, call, name)

    def _pull_stream(self, conn: Connection, ex: Exchange, call: _Call, name: str) -> Steps:
        digest, total = "sha256:" + _model_digest(call.key), _model_size(call.key)
        progress = [_line({"status": f"pulling {digest[7:19]}", "digest": digest, "total": total,
                           "completed": total * (i + 1) // self.chunks}) for i in range(self.chunks)]
        tail = [_line({"status": s}) for s in ("verifying sha256 digest", "writing manifest", "success")]
        if (yield from self._stream(conn, ex, CT_NDJSON, [_line({"status": "pulling manifest"})], progress,
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
            self._error(conn, ex, 400, f"destination {_go_quote(destination)} is invalid", False)
            return
        self._install(name)
        conn.respond(ex, 200, b"", b"")

    def _v1_chat(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        return self.prefix_cache.prefill(call.key, call.body, lambda prefill: self._v1_chat_answer(
            conn, ex, call, prefill))

    def _v1_chat_answer(self, conn: Connection, ex: Exchange, call: _Call, prefill: Prefill) -> Steps | None:
        evaluated = _evaluated(prefill)  # no cached count: Ollama's compat layer has none
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
        options = call.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            tail.append(sse_frame({**head, "choices": [], "usage": usage}, compact=True))
        tail.append(_DONE)
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


def _openai_error(status: int, message: str, type: str | None = None) -> dict[str, Any]:
    """`openai.NewError`: the type follows the status unless a behaviour names one."""
    if type is None:
        type = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    return {"error": {"message": message, "type": type, "param": None, "code": None}}


def _namespace(name: str) -> str:
    parts = name.rsplit(":", 1)[0].split("/")
    return parts[-2] if len(parts) >= 2 else "library"


def _model_route(route: _Route) -> Handler:
    return lambda box, conn, ex: box._model_call(conn, ex, route)


_NATIVE_STREAM = dict(streams=True, loads=True, not_found=_not_found)
_ROUTES: Routes = {
    ("GET", "/"): SimOllama._root,
    ("HEAD", "/"): SimOllama._root,
    ("GET", "/api/version"): SimOllama._version,
    ("HEAD", "/api/version"): SimOllama._version,
    ("GET", "/api/tags"): SimOllama._tags,
    ("HEAD", "/api/tags"): SimOllama._tags,
    ("GET", "/api/ps"): SimOllama._ps,
    ("GET", "/v1/models"): SimOllama._v1_models,
    ("POST", "/api/chat"): _model_route(_Route(SimOllama._chat, **_NATIVE_STREAM)),
    ("POST", "/api/generate"): _model_route(_Route(SimOllama._generate, empty=(404, _not_found("")), **_NATIVE_STREAM)),
    ("POST", "/api/embed"): _model_route(_Route(SimOllama._embed, loads=True, not_found=_not_pulled)),
    ("POST", "/api/embeddings"): _model_route(_Route(SimOllama._embeddings, loads=True, not_found=_not_pulled)),
    ("POST", "/api/show"): _model_route(_Route(SimOllama._show, fields=("model", "name"),
                                               not_found=lambda model: _not_found(display_name(model)))),
    ("POST", "/api/pull"): _model_route(_Route(SimOllama._pull, streams=True, fields=("model", "name"))),
    ("DELETE", "/api/delete"): _model_route(_Route(SimOllama._delete, fields=("model", "name"),
                                                   not_found=_not_found)),
    ("POST", "/api/copy"): _model_route(_Route(SimOllama._copy, fields=("source",),
                                               empty=(400, "source and destination are required"),
                                               not_found=lambda model: f"model {_go_quote(model)} not found")),
    ("POST", "/v1/chat/completions"): _model_route(_Route(SimOllama._v1_chat, openai=True, streams=False, loads=True,
                                                          not_found=_not_found)),
    ("POST", "/v1/embeddings"): _model_route(_Route(SimOllama._v1_embeddings, openai=True, loads=True,
                                                    not_found=_not_pulled)),
}
