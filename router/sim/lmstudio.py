"""A simulated LM Studio server: a real HTTP/1.1 server on loopback that speaks LM Studio's HTTP
API as contracts/ollama-lmstudio.md §3 describes it, quirks included. The wire, steps and
disconnects follow `router.sim.connection`, threads and scripts `router.sim.server`.

Rules:
1. Ids are matched exactly, byte for byte: `qwen/qwen3-14b` is not `Qwen/qwen3-14b`, and
   there is no implicit tag (so are the names a script is queued under). A model-bearing call naming an id the box does not have gets 400
   `{"error": {"message": "Invalid model identifier \\"X\\". …", "type":
   "invalid_request_error", "param": "model", "code": "model_not_found"}}`.
2. Unknown endpoint or method → **200** `{"error": "Unexpected endpoint or method. (METHOD
   /path)"}`, `GET /` included; `GET /lmstudio-greeting` → `{"lmstudio": true}`.
3. Auth. With a `token`, every route but the greeting needs `Authorization: Bearer <token>`:
   none → 401 with the contract's "token is required" body, a wrong one → 401 in the same
   shape (its text is the sim's own; the contract has none).
4. JIT. Every downloaded id is listed; a call for one that is not loaded loads it first (it
   joins `loaded`, and `/api/v1/chat` streams `model_load.*` events). One instance per model:
   its instance id is the model id.
5. Streams. `stream` defaults to false everywhere. `/v1/*` and `/api/v0/*` stream OpenAI SSE
   ending in `data: [DONE]`; `/api/v1/chat` streams named events from `chat.start` to
   `chat.end`. Streams are chunked and keep the connection alive, as Express writes them;
   every answer carries `X-Powered-By: Express`, JSON is written without spaces.
6. Replies. `/api/v0` chat and completions add `stats`, `model_info` and `runtime`; the v0
   embeddings reply names the resolved variant (`id@q4_k_m`); embeddings are always float
   arrays, whatever `encoding_format` asks (the contract's open bug).
7. Behaviours: `refuse`/`busy`/`in_band` without a stream → that status with the OpenAI-shaped
   error (`type` and `code` from the behaviour); `in_band` on a stream → a 200 stream with
   one error frame (`data: {"error": …}`, or an `error` event on `/api/v1/chat`), then its
   end; `die_after(n)` → n content frames, then the connection closes without the last chunk;
   `stall_after(n, s)` → n content frames, then s seconds of silence.
8. Threads. The test thread may change `models`, `loaded`, `token`, `chunks` and `cadence_s`
   at any time; the box is polled, so there is nothing to notify.
9. Privacy. Bodies are read only for `model`, `stream`, `stream_options`, `input`, `store`
   and `instance_id` (and the prompt, by the prefix cache: router/sim/prefix_cache.py); replies
   are fixed texts.
10. `POST /v1/responses` is stateful (§3, 0.3.29+): each answer's `id` (`resp_…`) is kept by
   this box (the last RESPONSES_KEPT), and a call whose `previous_response_id` this box never
   answered gets 400 `previous_response_not_found` (the wording is the sim's). A stream is
   `response.created`, `response.output_text.delta` × chunks, `response.completed` (the whole
   response, usage included), as named SSE events, without `[DONE]`.
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from router.sim.behavior import Behavior
from router.sim.connection import Connection, Exchange, Steps
from router.sim.lmstudio_inventory import (
    CONTEXT_LENGTH,
    PATTERN_ROUTES as INVENTORY_PATTERN_ROUTES,
    QUANTIZATION,
    ROUTES as INVENTORY_ROUTES,
    Inventory,
    is_embedding,
)
from router.sim.prefix_cache import NO_PROMPT, Prefill
from router.sim.server import ANSWERED, Routes, SimServer, find_route, model_route
from router.sim.wire import (
    CT_JSON_UTF8,
    CT_SSE,
    EMBEDDING,
    PROMPT_TOKENS,
    SSE_DONE,
    STREAM_TOKEN,
    compact_json,
    sse_frame,
    wants_usage,
)

_TOKEN_REQUIRED = compact_json({"error": {
    "type": "invalid_request", "code": "invalid_api_key",
    "message": "An LM Studio API token is required to make requests to this server, but none was provided "
               "using the Authorization header using the 'Bearer' scheme."}})
_TOKEN_INVALID = compact_json({"error": {
    "type": "invalid_request", "code": "invalid_api_key",
    "message": "The LM Studio API token provided in the Authorization header is not valid."}})
_V0_EXTRAS = {
    "stats": {"tokens_per_second": 50.0, "time_to_first_token": 0.1, "generation_time": 0.2,
              "stop_reason": "eosFound"},
    "model_info": {"arch": "llama", "quant": QUANTIZATION, "format": "gguf", "context_length": CONTEXT_LENGTH},
    "runtime": {"name": "llama.cpp-linux-x86_64-avx2", "version": "1.3.0", "supported_formats": ["gguf"]},
}


def _event(name: str, obj: dict[str, Any]) -> bytes:
    """One named SSE event of `/api/v1/chat`."""
    return b"event: " + name.encode() + b"\n" + sse_frame({"type": name, **obj}, compact=True)


def _named(name: str, obj: dict[str, Any]) -> bytes:
    """One named SSE event of `/v1/responses` (the object carries its own `type`)."""
    return b"event: " + name.encode() + b"\n" + sse_frame(obj, compact=True)


def _error(message: str, type: str | None = "invalid_request_error", param: str | None = None,
           code: int | str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


RESPONSES_KEPT = 1000  # rule 10: response ids a box remembers


@dataclass(frozen=True, slots=True)
class _Call:
    """A model-bearing call once its model is known to the box."""

    body: dict[str, Any]
    model: str
    stream: bool
    loading: bool  # the call JIT-loaded its model
    v0: bool  # on /api/v0: the reply carries the v0 extras
    fault: Behavior | None  # a streamed die_after or stall_after, applied by _stream


Answer = Callable[["SimLMStudio", Connection, Exchange, _Call], "Steps | None"]


@dataclass(frozen=True, slots=True)
class _Route:
    answer: Answer
    v0: bool = False
    events: bool = False  # `/api/v1/chat`: errors in a stream are an `error` event


class SimLMStudio(Inventory, SimServer):
    """One simulated LM Studio server. See the module docstring for the rules."""

    kind = "lmstudio"
    server_headers = b"X-Powered-By: Express\r\n"

    def __init__(self, name: str, *, models: Iterable[str], loaded: Iterable[str] = (), token: str | None = None,
                 chunks: int = 5, cadence_s: float = 0.0) -> None:
        super().__init__(name, chunks=chunks, cadence_s=cadence_s)
        # public state, mutable from the test thread (rule 8)
        self.loaded: list[str] = list(loaded)
        self.models: list[str] = list(models)
        self.models += [m for m in self.loaded if m not in self.models]
        self.token = token
        self.responses: dict[str, None] = {}  # the ids it answered, oldest first (rule 10)

    @property
    def router_key(self) -> str | None:
        return self.token

    # -- routing ------------------------------------------------------------------------------

    def _dispatch(self, conn: Connection, ex: Exchange) -> Steps | None:
        if self.token is not None and ex.path != "/lmstudio-greeting":
            denied = self._auth(ex)
            if denied is not None:
                conn.respond(ex, 401, denied, CT_JSON_UTF8)
                return None
        handler = find_route(_ROUTES, INVENTORY_PATTERN_ROUTES, ex)
        if handler is None:
            path = ex.url.partition("?")[0]
            self._json(conn, ex, {"error": f"Unexpected endpoint or method. ({ex.method} {path})"})
            return None
        return handler(self, conn, ex)

    def _auth(self, ex: Exchange) -> bytes | None:
        """Rule 3: the 401 body, or None when the bearer token is right."""
        sent = ex.headers.get("authorization")
        if sent is None or sent[:7].lower() != "bearer ":
            return _TOKEN_REQUIRED
        return None if hmac.compare_digest(sent[7:].strip().encode(), self.token.encode()) else _TOKEN_INVALID

    def _crash_body(self, exc: Exception) -> bytes:
        return compact_json(_error(repr(exc), "internal_error"))

    def _unknown_model(self, conn: Connection, ex: Exchange, model: str) -> None:
        known = ", ".join(list(self.models))
        self._json(conn, ex, _error(f'Invalid model identifier "{model}". Please specify a valid downloaded '
                                    f"model (e.g., {known}).", param="model", code="model_not_found"), 400)

    # -- node-level routes --------------------------------------------------------------------

    def _greeting(self, conn: Connection, ex: Exchange) -> None:
        self._json(conn, ex, {"lmstudio": True})

    def _unload(self, conn: Connection, ex: Exchange) -> None:
        body = self._read_body(conn, ex)
        if body is None:
            return
        instance = body.get("instance_id")
        if not isinstance(instance, str) or instance not in self.loaded:
            self._json(conn, ex, _error(f'No loaded model instance with identifier "{instance}".',
                                        param="instance_id", code="model_not_found"), 400)
            return
        self.loaded.remove(instance)
        self._json(conn, ex, {"instance_id": instance})

    # -- model-bearing routes -----------------------------------------------------------------

    def _read_body(self, conn: Connection, ex: Exchange) -> dict[str, Any] | None:
        """The JSON object body (an empty body reads as `{}`), or None after answering 400."""
        try:
            body = json.loads(ex.body or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._json(conn, ex, _error("Invalid JSON in request body"), 400)
            return None
        return body

    def _model_call(self, conn: Connection, ex: Exchange, route: _Route) -> Steps:
        """Generator: record → body → the next scripted behaviour → exact id (rule 1) → JIT
        load (rule 4) → the route's answer."""
        rec = self._record(ex)
        body = self._read_body(conn, ex)
        if body is None:
            return
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        stream = body.get("stream") is True
        rec.model, rec.stream = model, stream
        fault = yield from self._apply_script(conn, ex, model, stream, route.events)
        if fault is ANSWERED:
            return
        if model not in self.models:
            self._unknown_model(conn, ex, model)
            return
        loading = model not in self.loaded
        if loading:
            self.prefix_cache.forget(model)  # JIT-loaded afresh: nothing computed yet
            self.loaded.append(model)
        steps = route.answer(self, conn, ex, _Call(body, model, stream, loading, route.v0, fault))
        if steps is not None:
            yield from steps

    def _refuse(self, conn: Connection, ex: Exchange, behavior: Behavior, stream: bool, events: bool) -> None:
        """A scripted refusal in LM Studio's dialect (rule 7)."""
        if not (behavior.kind == "in_band" and stream):
            self._json(conn, ex, _error(behavior.message, behavior.type, code=behavior.code), behavior.status)
            return
        conn.stream_head(ex, CT_SSE)
        if events:
            conn.send(_event("error", {"error": {"type": behavior.type or "unknown", "message": behavior.message}}))
        else:
            conn.send(sse_frame(_error(behavior.message, behavior.type, code=behavior.code), compact=True))
        conn.end_stream(ex)

    def _openai_stream(self, conn: Connection, ex: Exchange, call: _Call, head: dict[str, Any],
                       piece: dict[str, Any], last: dict[str, Any], prefill: Prefill = NO_PROMPT) -> Steps:
        """OpenAI SSE: `chunks` pieces, the last choice, usage when asked, `[DONE]`."""
        tail = [sse_frame({**head, "choices": [last]}, compact=True)]
        if wants_usage(call.body):
            tail.append(sse_frame({**head, "choices": [], "usage": self._usage(prefill)}, compact=True))
        tail.append(SSE_DONE)
        frame = sse_frame({**head, "choices": [piece]}, compact=True)
        return self._stream(conn, ex, CT_SSE, (), [frame] * self.chunks, tail, call.fault)

    def _usage(self, prefill: Prefill = NO_PROMPT) -> dict[str, Any]:
        """OpenAI's usage; a chat's cached prompt tokens the OpenAI way."""
        prompt_tokens = prefill.prompt_tokens or PROMPT_TOKENS
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": self.chunks,
                                 "total_tokens": prompt_tokens + self.chunks}
        if prefill.prompt_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": prefill.cached_tokens}
        return usage

    def _responses(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        """Rule 10."""
        previous = call.body.get("previous_response_id")
        if previous is not None and previous not in self.responses:
            self._json(conn, ex, _error(f"No response with id '{previous}' on this server.",
                                        param="previous_response_id", code="previous_response_not_found"), 400)
            return None
        return self.prefix_cache.prefill(call.model, call.body, lambda prefill: self._response_answer(
            conn, ex, call, prefill))

    def _response_answer(self, conn: Connection, ex: Exchange, call: _Call, prefill: Prefill) -> Steps | None:
        response_id = "resp_" + secrets.token_hex(12)
        self.responses[response_id] = None
        while len(self.responses) > RESPONSES_KEPT:
            del self.responses[next(iter(self.responses))]
        prompt_tokens = prefill.prompt_tokens or PROMPT_TOKENS
        response = {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "completed",
                    "model": call.model, "output": [{"type": "message", "role": "assistant", "content": [
                        {"type": "output_text", "text": STREAM_TOKEN * self.chunks}]}],
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": self.chunks,
                              "total_tokens": prompt_tokens + self.chunks,
                              "input_tokens_details": {"cached_tokens": prefill.cached_tokens}}}
        if not call.stream:
            self._json(conn, ex, response)
            return None
        created = {**response, "status": "in_progress", "output": [], "usage": None}
        lead = [_named("response.created", {"type": "response.created", "response": created})]
        delta = _named("response.output_text.delta", {"type": "response.output_text.delta", "delta": STREAM_TOKEN})
        tail = [_named("response.completed", {"type": "response.completed", "response": response})]
        return self._stream(conn, ex, CT_SSE, lead, [delta] * self.chunks, tail, call.fault)

    def _chat_completion(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        return self.prefix_cache.prefill(call.model, call.body, lambda prefill: self._chat_answer(
            conn, ex, call, prefill))

    def _chat_answer(self, conn: Connection, ex: Exchange, call: _Call, prefill: Prefill) -> Steps | None:
        head = {"id": "chatcmpl-" + secrets.token_hex(10), "object": "chat.completion.chunk",
                "created": int(time.time()), "model": call.model}
        if call.stream:
            return self._openai_stream(
                conn, ex, call, head,
                {"index": 0, "delta": {"role": "assistant", "content": STREAM_TOKEN}, "logprobs": None,
                 "finish_reason": None},
                {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}, prefill)
        self._json(conn, ex, {**head, "object": "chat.completion", "choices": [{
            "index": 0, "logprobs": None, "finish_reason": "stop",
            "message": {"role": "assistant", "content": STREAM_TOKEN * self.chunks}}],
            "usage": self._usage(prefill), **(_V0_EXTRAS if call.v0 else {})})
        return None

    def _completion(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        head = {"id": "cmpl-" + secrets.token_hex(10), "object": "text_completion", "created": int(time.time()),
                "model": call.model}
        if call.stream:
            return self._openai_stream(
                conn, ex, call, head, {"index": 0, "text": STREAM_TOKEN, "logprobs": None, "finish_reason": None},
                {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"})
        self._json(conn, ex, {**head, "choices": [{"index": 0, "text": STREAM_TOKEN * self.chunks, "logprobs": None,
                                                   "finish_reason": "stop"}],
                              "usage": self._usage(), **(_V0_EXTRAS if call.v0 else {})})
        return None

    def _embeddings(self, conn: Connection, ex: Exchange, call: _Call) -> None:
        given = call.body.get("input")
        count = 1 if isinstance(given, str) else len(given or [])
        model = f"{call.model}@{QUANTIZATION.lower()}" if call.v0 and "@" not in call.model else call.model
        self._json(conn, ex, {"object": "list",
                              "data": [{"object": "embedding", "embedding": EMBEDDING, "index": i} for i in range(count)],
                              "model": model, "usage": {"prompt_tokens": 2 * count, "total_tokens": 2 * count}})

    def _load(self, conn: Connection, ex: Exchange, call: _Call) -> None:
        self._json(conn, ex, {"type": "embedding" if is_embedding(call.model) else "llm", "instance_id": call.model,
                              "load_time_seconds": 0.5 if call.loading else 0.0, "status": "loaded"})

    def _rest_chat(self, conn: Connection, ex: Exchange, call: _Call) -> Steps | None:
        """`/api/v1/chat`: one result object, or named events whose `chat.end` carries it."""
        stats: dict[str, Any] = {"input_tokens": PROMPT_TOKENS, "total_output_tokens": self.chunks,
                                 "reasoning_output_tokens": 0, "tokens_per_second": 50.0,
                                 "time_to_first_token_seconds": 0.1}
        if call.loading:
            stats["model_load_time_seconds"] = 0.5
        result: dict[str, Any] = {"model_instance_id": call.model,
                                  "output": [{"type": "message", "content": STREAM_TOKEN * self.chunks}],
                                  "stats": stats}
        if call.body.get("store") is not False:
            result["response_id"] = "resp_" + secrets.token_hex(12)
        if not call.stream:
            self._json(conn, ex, result)
            return None
        instance = {"model_instance_id": call.model}
        lead = [_event("chat.start", instance)]
        if call.loading:
            lead += [_event("model_load.start", instance), _event("model_load.progress", {**instance, "progress": 1.0}),
                     _event("model_load.end", {**instance, "load_time_seconds": 0.5})]
        lead.append(_event("message.start", {}))
        pieces = [_event("message.delta", {"content": STREAM_TOKEN})] * self.chunks
        tail = [_event("message.end", {}), _event("chat.end", {"result": result})]
        return self._stream(conn, ex, CT_SSE, lead, pieces, tail, call.fault)


_ROUTES: Routes = {
    **INVENTORY_ROUTES,
    ("GET", "/lmstudio-greeting"): SimLMStudio._greeting,
    ("POST", "/api/v0/chat/completions"): model_route(_Route(SimLMStudio._chat_completion, v0=True)),
    ("POST", "/api/v0/completions"): model_route(_Route(SimLMStudio._completion, v0=True)),
    ("POST", "/api/v0/embeddings"): model_route(_Route(SimLMStudio._embeddings, v0=True)),
    ("POST", "/v1/chat/completions"): model_route(_Route(SimLMStudio._chat_completion)),
    ("POST", "/v1/completions"): model_route(_Route(SimLMStudio._completion)),
    ("POST", "/v1/embeddings"): model_route(_Route(SimLMStudio._embeddings)),
    ("POST", "/api/v1/models/load"): model_route(_Route(SimLMStudio._load)),
    ("POST", "/api/v1/models/unload"): SimLMStudio._unload,
    ("POST", "/api/v1/chat"): model_route(_Route(SimLMStudio._rest_chat, events=True)),
    ("POST", "/v1/responses"): model_route(_Route(SimLMStudio._responses)),
}