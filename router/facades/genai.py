"""What the OpenTelemetry GenAI semantic conventions ask of a call, in each facade's words: the
operation a route performs, and the token usage in a box's last frame.

Rules:
1. A route's operation is a well-known `gen_ai.operation.name` value; a route that is no
   inference (a pull, an image upload) has none.
2. Usage is read from the last JSON frame of an answer only (an SSE `data:` line, an NDJSON
   line, or a whole JSON body): OpenAI's `usage` (`prompt_tokens`/`completion_tokens`, or the
   Responses API's `input_tokens`/`output_tokens`) and Ollama's final `prompt_eval_count` and
   `eval_count`. No frame, no usage: never a guess. Nothing else of the answer is kept.
3. Engine-cached prompt tokens (`answer_facts`), from the same last frame, the engine's way:
   OpenAI's `usage.prompt_tokens_details.cached_tokens` (the Responses API's
   `usage.input_tokens_details.cached_tokens`; hugpy boxes and LM Studio answer the same way),
   llama.cpp's `timings.cache_n`. Ollama reports none (its `prompt_eval_count` is only the part
   it evaluated). A Responses stream's last frame carries its answer under `response`.
"""

from __future__ import annotations

import orjson

OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/api/chat": "chat",
    "/api/v0/chat/completions": "chat",
    "/api/v1/chat": "chat",
    "/v1/completions": "text_completion",
    "/api/generate": "text_completion",
    "/api/v0/completions": "text_completion",
    "/v1/responses": "generate_content",
    "/v1/embeddings": "embeddings",
    "/api/embed": "embeddings",
    "/api/embeddings": "embeddings",
    "/api/v0/embeddings": "embeddings",
}


def _last_frame(tail: bytes) -> dict | None:
    try:
        whole = orjson.loads(tail)  # a non-stream answer: one JSON body, maybe over many lines
    except orjson.JSONDecodeError:
        pass
    else:
        return whole if isinstance(whole, dict) else None
    for line in reversed(tail.splitlines()):
        line = line.strip()
        if line.startswith(b"data:"):
            line = line[5:].strip()
        if not line or line == b"[DONE]" or line.startswith((b"event:", b"id:", b":")):
            continue
        try:
            frame = orjson.loads(line)
        except orjson.JSONDecodeError:
            return None  # the last frame is cut or not JSON
        return frame if isinstance(frame, dict) else None
    return None


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_of(tail: bytes) -> tuple[int | None, int | None] | None:
    """(input tokens, output tokens) in the last frame of `tail` (rule 2), or None."""
    frame = _last_frame(tail)
    if frame is None:
        return None
    usage = frame.get("usage")
    if isinstance(usage, dict):
        found = (
            _count(usage.get("prompt_tokens", usage.get("input_tokens"))),
            _count(usage.get("completion_tokens", usage.get("output_tokens"))),
        )
    else:
        found = (_count(frame.get("prompt_eval_count")), _count(frame.get("eval_count")))
    return None if found == (None, None) else found


def answer_facts(tail: bytes) -> tuple[int | None, str | None]:
    """(engine-cached prompt tokens, the answer's Responses id) in the last frame of `tail`
    (rule 3); each None when it is not there."""
    frame = _last_frame(tail)
    if frame is None:
        return None, None
    inner = frame.get("response")
    if isinstance(inner, dict):  # a Responses stream's `response.completed` event
        frame = inner
    cached = None
    usage = frame.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
        if isinstance(details, dict):
            cached = _count(details.get("cached_tokens"))
    if cached is None:
        timings = frame.get("timings")
        if isinstance(timings, dict):
            cached = _count(timings.get("cache_n"))
    response_id = frame.get("id")
    return cached, response_id if isinstance(response_id, str) and response_id.startswith("resp") else None
