"""The bytes every simulated box kind writes: JSON in its two spacings, SSE frames, status lines,
content types, and the fixed pieces every reply is made of.

Rules:
1. Spacing follows the engine: the hugpy box writes with the stdlib encoder (`"a": 1`); Go
   (Ollama), JavaScript (LM Studio) and llama.cpp write without spaces (`"a":1`). Both keep
   non-ASCII text as is (`ensure_ascii=False`).
2. Replies are fixed texts, never derived from the input (the sims' privacy rule): every
   streamed content piece is STREAM_TOKEN, every embedding is EMBEDDING.
3. A status the stdlib does not name gets `Unknown` as its phrase, except 499 (nginx's
   Client Closed Request, which the hugpy box sends for a cancel).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

STREAM_TOKEN = "tok "  # every streamed content piece carries this text
EMBEDDING = [0.6, 0.8, 0.0]  # L2-normalised, as engines' vectors are
PROMPT_TOKENS = 8  # the prompt count a reply reports when the box did not count the prompt

CT_JSON = b"application/json"
CT_JSON_UTF8 = b"application/json; charset=utf-8"  # Go's and Express's JSON answers
CT_SSE = b"text/event-stream"
CT_NDJSON = b"application/x-ndjson"
CT_TEXT = b"text/plain; charset=utf-8"
SSE_DONE = b"data: [DONE]\n\n"  # the end of an OpenAI stream

_dumps = json.JSONEncoder(ensure_ascii=False).encode
_compact_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def json_body(obj: object) -> bytes:
    """JSON as Python's stdlib writes it (`"a": 1`): the hugpy box's spacing."""
    return _dumps(obj).encode()


def compact_json(obj: object) -> bytes:
    """JSON as Go and JavaScript write it (`"a":1`): Ollama's and LM Studio's spacing."""
    return _compact_dumps(obj).encode()


def sse_frame(obj: object, compact: bool = False) -> bytes:
    """One server-sent event, `data: <json>` and a blank line."""
    return b"data: " + (compact_json(obj) if compact else json_body(obj)) + b"\n\n"


def wants_usage(body: dict[str, Any]) -> bool:
    """An OpenAI stream request that asks for a usage frame (`stream_options.include_usage`)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} Unknown\r\n".encode()


_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_STATUS_LINES[499] = b"HTTP/1.1 499 Client Closed Request\r\n"
