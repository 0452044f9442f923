"""A simulated llama.cpp server (`llama-server`), the OpenAI-compatible kind that reports its
own capacity: a real HTTP/1.1 server on loopback on the plumbing of `router.sim.server`. Its
shapes are checked against a real llama-server by tests/real/test_real_sim_llamacpp.py.

Rules (llama.cpp's tools/server README, and what a real llama-server answers):
1. `GET /health` is `{"status": "ok"}`; `GET /v1/models` lists the one model the server was
   started with, under its alias; `GET /props` carries `total_slots`, the calls it decodes at
   once (`--parallel`), and `model_path`.
2. `POST /v1/chat/completions` answers `max_tokens` tokens, at most what the slot's context has
   left (else `chunks`; `finish_reason` "length" when `max_tokens` was given, else "stop"), as
   JSON or, with `"stream": true`, as SSE: a role frame (`"delta": {"role": "assistant",
   "content": null}`), a frame per token, a last frame with `finish_reason` and an empty delta,
   then `data: [DONE]`. `timings` ride on that last frame, unless the call asked for usage
   (`stream_options.include_usage`): then a `"choices": []` frame after it carries `usage` and
   `timings`. The next scripted behaviour for the model runs first (`hang` waits, then answers).
   `usage` (with `prompt_tokens_details.cached_tokens`) and `timings` (`cache_n`, `prompt_n`,
   `predicted_n` and their times and rates) count the prompt through the box's prefix cache
   (`cache_n`: the prompt tokens reused from the slot's cache).
3. Errors are `{"error": {"code", "message", "type"}}`, scripted ones included: a body that is
   not JSON is 400 `invalid_request_error`; a prompt over the slot's context (`n_ctx`, in the
   sim's own tokens) is 400 `exceed_context_size_error` with `n_prompt_tokens` and `n_ctx`, as
   JSON even for a stream; any other route is 404 `{"error": {"message": "File Not Found",
   "type": "not_found_error", "code": 404}}`. Bodies are read only for `model`, `stream`,
   `stream_options`, `max_tokens` and the prompt; replies are fixed texts.
"""

from __future__ import annotations

import json
import secrets
import time

from router.sim.behavior import Behavior
from router.sim.connection import Connection, Exchange, Steps
from router.sim.prefix_cache import Prefill, elements_of, prompt_tokens
from router.sim.server import ANSWERED, Routes, SimServer
from router.sim.wire import CT_SSE, SSE_DONE, STREAM_TOKEN, compact_json, sse_frame, wants_usage

NOT_FOUND = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
N_CTX = 32768  # a slot's context, in the sim's tokens: far above what tests send unless they mean to
# llama-server's own rates, for `timings`' times: nothing waits on them
PROMPT_MS_PER_TOKEN = 0.1
PREDICTED_MS_PER_TOKEN = 1.0


class SimLlamaCpp(SimServer):
    """One simulated llama.cpp server. See the module docstring for the rules."""

    kind = "openai"

    def __init__(self, name: str, *, alias: str, total_slots: int = 1, n_ctx: int = N_CTX) -> None:
        super().__init__(name)
        self.alias = alias
        self.total_slots = total_slots
        self.n_ctx = n_ctx
        self.prefix_cache.repeat_costs_one = True  # prefix_cache rule 1: llama-server's own count

    def _crash_body(self, exc: Exception) -> bytes:
        return compact_json({"error": {"code": 500, "message": repr(exc), "type": "server_error"}})

    def _dispatch(self, conn: Connection, ex: Exchange) -> Steps | None:
        handler = _ROUTES.get((ex.method, ex.path))
        if handler is None:
            self._json(conn, ex, NOT_FOUND, 404)
            return None
        return handler(self, conn, ex)

    def _refuse(self, conn: Connection, ex: Exchange, behavior: Behavior, stream: bool, dialect: None) -> None:
        self._json(conn, ex, {"error": {"code": behavior.status, "message": behavior.message,
                                        "type": behavior.type or "server_error"}}, behavior.status)

    def _health(self, conn: Connection, ex: Exchange) -> None:
        self._json(conn, ex, {"status": "ok"})

    def _models(self, conn: Connection, ex: Exchange) -> None:
        self._json(conn, ex, {"object": "list", "data": [
            {"id": self.alias, "object": "model", "created": int(time.time()), "owned_by": "llamacpp"}]})

    def _props(self, conn: Connection, ex: Exchange) -> None:
        self._json(conn, ex, {"total_slots": self.total_slots, "model_path": f"/models/{self.alias}.gguf"})

    def _chat(self, conn: Connection, ex: Exchange) -> Steps:
        rec = self._record(ex)
        try:
            body = json.loads(ex.body)
            model = body.get("model") or self.alias
        except (ValueError, AttributeError):
            self._error(conn, ex, 400, "invalid_request_error", "[json.exception.parse_error.101] parse error")
            return
        stream = body.get("stream") is True
        rec.model, rec.stream = model, stream
        fault = yield from self._apply_script(conn, ex, model, stream, None)
        if fault is ANSWERED:
            return
        asked = prompt_tokens(body)
        if asked > self.n_ctx:
            self._error(conn, ex, 400, "exceed_context_size_error",
                        f"request ({asked} tokens) exceeds the available context size ({self.n_ctx} tokens), "
                        "try increasing it", n_prompt_tokens=asked, n_ctx=self.n_ctx)
            return
        prefill = self.prefix_cache.take(model, elements_of(body))
        if prefill.seconds > 0:
            yield prefill.seconds
        max_tokens = body.get("max_tokens")
        bounded = isinstance(max_tokens, int) and max_tokens > 0
        # a slot's context bounds the answer too: the engine stops when it is full
        tokens, reason = (min(max_tokens, self.n_ctx - asked), "length") if bounded else (self.chunks, "stop")
        head = {"created": int(time.time()), "model": model, "system_fingerprint": "b0-sim",
                "object": "chat.completion.chunk" if stream else "chat.completion",
                "id": f"chatcmpl-{secrets.token_hex(16)}"}
        usage = {"completion_tokens": tokens, "prompt_tokens": prefill.prompt_tokens,
                 "total_tokens": prefill.prompt_tokens + tokens,
                 "prompt_tokens_details": {"cached_tokens": prefill.cached_tokens}}
        if not stream:
            self._json(conn, ex, {"choices": [{"finish_reason": reason, "index": 0, "message": {
                "role": "assistant", "content": STREAM_TOKEN * tokens}}], **head, "usage": usage,
                "timings": timings(prefill, tokens)})
            return

        def frame(delta: dict, finish: str | None = None, **extra) -> bytes:
            return sse_frame({"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], **head, **extra},
                             compact=True)

        if wants_usage(body):  # `timings` go with the usage, else on the last frame
            tail = [frame({}, reason), sse_frame({"choices": [], **head, "usage": usage,
                                                  "timings": timings(prefill, tokens)}, compact=True)]
        else:
            tail = [frame({}, reason, timings=timings(prefill, tokens))]
        tail.append(SSE_DONE)
        yield from self._stream(conn, ex, CT_SSE, [frame({"role": "assistant", "content": None})],
                                [frame({"content": STREAM_TOKEN})] * tokens, tail, fault)

    def _error(self, conn: Connection, ex: Exchange, status: int, kind: str, message: str, **extra) -> None:
        self._json(conn, ex, {"error": {"code": status, "message": message, "type": kind, **extra}}, status)


def timings(prefill: Prefill, predicted: int) -> dict:
    """llama-server's `timings`: its counts (rule 2) with times at the sim's own rates."""
    prompt_n = prefill.prompt_tokens - prefill.cached_tokens
    prompt_ms, predicted_ms = prompt_n * PROMPT_MS_PER_TOKEN, predicted * PREDICTED_MS_PER_TOKEN
    return {"cache_n": prefill.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": PROMPT_MS_PER_TOKEN, "prompt_per_second": 1000 / PROMPT_MS_PER_TOKEN,
            "predicted_n": predicted, "predicted_ms": predicted_ms, "predicted_per_token_ms": PREDICTED_MS_PER_TOKEN,
            "predicted_per_second": 1000 / PREDICTED_MS_PER_TOKEN}


_ROUTES: Routes = {
    ("GET", "/health"): SimLlamaCpp._health,
    ("GET", "/v1/models"): SimLlamaCpp._models,
    ("GET", "/props"): SimLlamaCpp._props,
    ("POST", "/v1/chat/completions"): SimLlamaCpp._chat,
}
