"""The OpenAI facade: `/v1/*` over every box kind (contracts/hugpy-wrapper.md §8 routes).

Errors take OpenAI's shape: `{"error": {"message", "type", "code", ...extra}}`.
"""

from __future__ import annotations

import orjson

from router.core.types import BoxKind
from router.facades.table import Body, Facade, Route, table

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


def shape_error(status: int, code: str, message: str, extra: dict | None = None) -> bytes:
    error = {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "code": code}
    if extra:
        error.update(extra)
    return orjson.dumps({"error": error})


ROUTES = table(
    Route("POST", "/v1/chat/completions", Body.JSON),
    Route("POST", "/v1/completions", Body.JSON),
    Route("POST", "/v1/embeddings", Body.JSON),
    Route("POST", "/v1/audio/transcriptions", Body.FORM),
    Route("POST", "/v1/audio/translations", Body.FORM),
    Route("POST", "/v1/audio/speech", Body.JSON),
    Route("POST", "/v1/images/generations", Body.JSON),
    Route("POST", "/v1/images/edits", Body.FORM),
    Route("POST", "/v1/images/variations", Body.FORM),
    Route("POST", "/v1/videos/generations", Body.FORM),
    Route("POST", "/v1/summarize", Body.JSON),
    Route("POST", "/v1/keywords", Body.JSON),
    Route("GET", "/v1/models", answer="models"),
    Route("GET", "/health", answer="health"),
)

FACADE = Facade(
    name="openai",
    kinds=frozenset(BoxKind),
    routes=ROUTES,
    no_box_status=503,
    shape_error=shape_error,
)


def models_answer(boxes: list[tuple[str, frozenset[str], frozenset[str]]]) -> bytes:
    """`GET /v1/models`: the union of catalogs; each model lists its `boxes` and `resident_on`.

    `boxes` is (box name, catalog keys, resident keys) per online box, in boxes-file order.
    """
    models: dict[str, dict] = {}
    for name, catalog, residents in boxes:
        for key in sorted(catalog | residents):
            entry = models.setdefault(
                key,
                {"id": key, "object": "model", "owned_by": "router", "boxes": [], "resident_on": []},
            )
            entry["boxes"].append(name)
            if key in residents:
                entry["resident_on"].append(name)
    return orjson.dumps({"object": "list", "data": [models[k] for k in sorted(models)]})
