"""The OpenAI facade: `/v1/*` (contracts/hugpy-wrapper.md §8 routes; Ollama and LM Studio speak
the same paths). On the main port it serves every box kind; a dedicated Ollama or LM Studio
listener serves it over that engine's boxes only.

Errors take OpenAI's shape: `{"error": {"message", "type", "code", ...extra}}`.

`/health` and `/v1/health` (hugpy-router 0.0.4's pair) are public liveness probes: they answer
in every require-key mode and say nothing about the fleet (no boxes, no models, no counts).
"""

from __future__ import annotations

from typing import Sequence

import orjson

from router import __version__
from router.core.bounds import clip
from router.core.aliases import Alias
from router.core.types import BoxKind
from router.facades.table import CHAT_BOUND, RESPONSES_BOUND, AliasListing, Body, Facade, Route

JSON = b"application/json"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


def shape_error(status: int, code: str, message: str, extra: dict | None = None) -> bytes:
    error = {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "code": code}
    if extra:
        error.update(extra)
    return orjson.dumps({"error": error})


def _as_delta(choice: object) -> object:
    if not isinstance(choice, dict) or "message" not in choice:
        return choice
    chunk = {key: value for key, value in choice.items() if key != "message"}
    chunk["delta"] = choice["message"]
    return chunk


def whole_as_stream(body: bytes) -> bytes | None:
    """A box's whole answer as the SSE stream a `stream: true` call expects (a box that answered
    whole after a keep-alive had sent the stream's head): one data frame, then `data: [DONE]`.
    A chat completion becomes the one chunk that sums it up (`object` `chat.completion.chunk`,
    each choice's `message` as its `delta`), which the SDKs read as a stream; a text completion's
    chunks have its own shape, and any other JSON object goes as it is. None when the body is
    not a JSON object."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    if doc.get("object") == "chat.completion" and isinstance(doc.get("choices"), list):
        doc = {**doc, "object": "chat.completion.chunk", "choices": [_as_delta(c) for c in doc["choices"]]}
    return b"data: " + orjson.dumps(doc) + b"\n\ndata: [DONE]\n\n"


def _models(boxes: Sequence) -> dict[str, dict]:
    """The union of catalogs by model name, each with its `boxes` and `resident_on`."""
    models: dict[str, dict] = {}
    for box in boxes:
        for key, name in box.inventory.catalog.items():
            entry = models.setdefault(
                name,
                {"id": name, "object": "model", "owned_by": "router", "boxes": [], "resident_on": []},
            )
            entry["boxes"].append(box.name)
            if key in box.inventory.residents:
                entry["resident_on"].append(box.name)
    return models


def models_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    """`GET /v1/models`: the union of catalogs, each model with its `boxes` and `resident_on`."""
    models = _models(boxes)
    return 200, JSON, orjson.dumps({"object": "list", "data": [models[k] for k in sorted(models)]})


def alias_row(alias: Alias) -> dict:
    return {"id": alias.name, "object": "model", "owned_by": "router", "alias": True, "chain": list(alias.chain)}


def model_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    """`GET /v1/models/{id}` (the id may hold `/`: the client percent-encodes it, ASGI decodes)."""
    model_id = path.removeprefix("/v1/models/")
    entry = _models(boxes).get(model_id)
    if entry is None:
        return 404, JSON, shape_error(404, "model_not_found", f"no box lists model {clip(model_id)!r}", None)
    return 200, JSON, orjson.dumps(entry)


HEALTH = orjson.dumps({"status": "ok", "service": "router", "version": __version__})


def health_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    return 200, JSON, HEALTH


ROUTES = (
    Route("POST", "/v1/chat/completions", Body.JSON, asks_usage=True, answer_bound=CHAT_BOUND),
    Route("POST", "/v1/completions", Body.JSON, asks_usage=True, answer_bound=CHAT_BOUND),
    Route("POST", "/v1/embeddings", Body.JSON),
    Route("POST", "/v1/responses", Body.JSON, answer_bound=RESPONSES_BOUND),
    Route("POST", "/v1/messages", Body.JSON, answer_bound=CHAT_BOUND),
    Route("POST", "/v1/audio/transcriptions", Body.FORM),
    Route("POST", "/v1/audio/translations", Body.FORM),
    Route("POST", "/v1/audio/speech", Body.JSON),
    Route("POST", "/v1/images/generations", Body.JSON),
    Route("POST", "/v1/images/edits", Body.FORM),
    Route("POST", "/v1/images/variations", Body.FORM),
    Route("POST", "/v1/videos/generations", Body.FORM),
    Route("POST", "/v1/summarize", Body.JSON),
    Route("POST", "/v1/keywords", Body.JSON),
    Route("GET", "/v1/models", answer=models_answer, aliases=AliasListing("data", alias_row)),
    Route("GET", "/v1/models/", answer=model_answer, prefix=True),
    Route("GET", "/health", answer=health_answer, scope="public"),
    Route("HEAD", "/health", answer=health_answer, scope="public"),
    Route("GET", "/v1/health", answer=health_answer, scope="public"),
    Route("HEAD", "/v1/health", answer=health_answer, scope="public"),
)

FACADE = Facade(
    name="openai",
    kinds=frozenset(BoxKind),
    routes=ROUTES,
    no_box_status=503,
    shape_error=shape_error,
    sse_keepalive=True,
    whole_as_stream=whole_as_stream,
    reads_knobs=True,
)
