"""A simulated llama.cpp server (`llama-server`), the OpenAI-compatible kind that reports its
own capacity: a real HTTP/1.1 server on loopback on the plumbing of `router.sim.server`.

Rules (llama.cpp's tools/server README):
1. `GET /health` is `{"status": "ok"}`; `GET /v1/models` lists the one model the server was
   started with, under its alias; `GET /props` carries `total_slots`, the calls it decodes at
   once (`--parallel`), and `model_path`.
2. `POST /v1/chat/completions` answers a chat completion as JSON (no stream here); the next
   scripted behaviour for the model runs first (`hang` waits, then answers).
3. Any other route is 404 `{"error": {"code": 404, "message": "File Not Found", "type":
   "not_found_error"}}`. Bodies are read only for `model`; replies are fixed texts.
"""

from __future__ import annotations

import json
import time

from router.sim.prefix_cache import elements_of
from router.sim.server import (
    ANSWERED,
    STREAM_TOKEN,
    Behavior,
    Connection,
    Exchange,
    SimServer,
    Steps,
    answer_raw,
    compact_json,
)

CT_JSON_UTF8 = b"application/json; charset=utf-8"
NOT_FOUND = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}


class SimLlamaCpp(SimServer):
    kind = "openai"

    def __init__(self, name: str, *, alias: str, total_slots: int = 1) -> None:
        super().__init__(name)
        self.alias = alias
        self.total_slots = total_slots

    def script(self, model: str, *behaviors: Behavior) -> None:
        """Queues behaviours for the next chat calls naming `model` (FIFO, once each)."""
        self._queue_behaviors(model, behaviors)

    def _json(self, conn: Connection, ex: Exchange, obj: object, status: int = 200) -> None:
        conn.respond(ex, status, compact_json(obj), CT_JSON_UTF8)

    def _crash_body(self, exc: Exception) -> bytes:
        return compact_json({"error": {"code": 500, "message": repr(exc), "type": "server_error"}})

    def _dispatch(self, conn: Connection, ex: Exchange) -> Steps | None:
        route = (ex.method, ex.path)
        if route == ("GET", "/health"):
            self._json(conn, ex, {"status": "ok"})
        elif route == ("GET", "/v1/models"):
            self._json(conn, ex, {"object": "list", "data": [
                {"id": self.alias, "object": "model", "created": int(time.time()), "owned_by": "llamacpp"}]})
        elif route == ("GET", "/props"):
            self._json(conn, ex, {"total_slots": self.total_slots, "model_path": f"/models/{self.alias}.gguf"})
        elif route == ("POST", "/v1/chat/completions"):
            return self._chat(conn, ex)
        else:
            self._json(conn, ex, NOT_FOUND, 404)
        return None

    def _chat(self, conn: Connection, ex: Exchange) -> Steps:
        rec = self._record(ex)
        try:
            body = json.loads(ex.body)
            model = body.get("model") or self.alias
        except (ValueError, AttributeError):
            self._json(conn, ex, {"error": {"code": 500, "message": "invalid JSON", "type": "server_error"}}, 500)
            return
        rec.model = model
        if (yield from self._apply_script(conn, ex, model, False, False)) is ANSWERED:
            return
        prefill = self.prefix_cache.take(model, elements_of(body))
        if prefill.seconds > 0:
            yield prefill.seconds
        # llama.cpp's own count: `timings.cache_n` (prompt tokens reused from the slot's cache)
        self._json(conn, ex, {"id": "chatcmpl-sim", "object": "chat.completion", "created": int(time.time()),
                              "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": STREAM_TOKEN}}],
                              "usage": {"prompt_tokens": prefill.prompt_tokens, "completion_tokens": 1,
                                        "total_tokens": prefill.prompt_tokens + 1},
                              "timings": {"cache_n": prefill.cached_tokens,
                                          "prompt_n": prefill.prompt_tokens - prefill.cached_tokens}})

    def _misbehave(self, conn: Connection, ex: Exchange, behavior: Behavior, stream: bool, shape: bool) -> None:
        if behavior.kind in ("refuse", "in_band"):
            self._json(conn, ex, {"error": {"code": behavior.status, "message": behavior.message,
                                            "type": behavior.type or "server_error"}}, behavior.status)
        elif behavior.kind == "raw":
            answer_raw(conn, ex, behavior)
        else:
            conn.reset()
