"""A simulated llama.cpp server (`llama-server`), the OpenAI-compatible kind that reports its
own capacity: a real HTTP/1.1 server on loopback on the plumbing of `router.sim.server`.

Rules (llama.cpp's tools/server README):
1. `GET /health` is `{"status": "ok"}`; `GET /v1/models` lists the one model the server was
   started with, under its alias; `GET /props` carries `total_slots`, the calls it decodes at
   once (`--parallel`), and `model_path`.
2. `POST /v1/chat/completions` answers a chat completion as JSON (no stream here); the next
   scripted behaviour for the model runs first (`hang` waits, then answers). Its `usage` and
   `timings` count the prompt through the box's prefix cache (`timings.cache_n`: the prompt
   tokens reused from the slot's cache).
3. Any other route is 404 `{"error": {"code": 404, "message": "File Not Found", "type":
   "not_found_error"}}`; errors, scripted ones included, are `{"error": {"code", "message",
   "type"}}`. Bodies are read only for `model` and the prompt; replies are fixed texts.
"""

from __future__ import annotations

import json
import time

from router.sim.behavior import Behavior
from router.sim.connection import Connection, Exchange, Steps
from router.sim.prefix_cache import elements_of
from router.sim.server import ANSWERED, Routes, SimServer
from router.sim.wire import STREAM_TOKEN, compact_json

NOT_FOUND = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}


class SimLlamaCpp(SimServer):
    """One simulated llama.cpp server. See the module docstring for the rules."""

    kind = "openai"

    def __init__(self, name: str, *, alias: str, total_slots: int = 1) -> None:
        super().__init__(name)
        self.alias = alias
        self.total_slots = total_slots

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
            self._json(conn, ex, {"error": {"code": 500, "message": "invalid JSON", "type": "server_error"}}, 500)
            return
        rec.model = model
        if (yield from self._apply_script(conn, ex, model, False, None)) is ANSWERED:
            return
        prefill = self.prefix_cache.take(model, elements_of(body))
        if prefill.seconds > 0:
            yield prefill.seconds
        self._json(conn, ex, {"id": "chatcmpl-sim", "object": "chat.completion", "created": int(time.time()),
                              "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": STREAM_TOKEN}}],
                              "usage": {"prompt_tokens": prefill.prompt_tokens, "completion_tokens": 1,
                                        "total_tokens": prefill.prompt_tokens + 1},
                              "timings": {"cache_n": prefill.cached_tokens,
                                          "prompt_n": prefill.prompt_tokens - prefill.cached_tokens}})


_ROUTES: Routes = {
    ("GET", "/health"): SimLlamaCpp._health,
    ("GET", "/v1/models"): SimLlamaCpp._models,
    ("GET", "/props"): SimLlamaCpp._props,
    ("POST", "/v1/chat/completions"): SimLlamaCpp._chat,
}
