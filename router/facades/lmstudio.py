"""The LM Studio facade: its REST API v0 and v1 over lmstudio boxes (contracts §3, §4).

Rules:
1. Ids match exactly, byte for byte (LM Studio serves whatever is loaded when exactly one model
   is, whatever the name says, so the router must never forward a name no owner lists).
2. Fleet answers: `/api/v0/models` is the union by id (`state: loaded` when loaded anywhere);
   `/api/v0/models/<id>` one row of it; `/api/v1/models` the union by `key` with every box's
   `loaded_instances` concatenated.
3. An unknown route gets what LM Studio gives: 200 `{"error": "Unexpected endpoint or method.
   (METHOD /path)"}`. `/lmstudio-greeting` is not answered: the SDKs would then open
   websockets, which the router does not proxy.
4. Errors take the OpenAI shape LM Studio uses; an empty owner set is a local 502.
5. Engine management (`models/load`, `models/unload`, `models/download`) is admin scope: a
   `use` key is refused before any box is contacted.
"""

from __future__ import annotations

from typing import Sequence

import orjson

from router.core.bounds import clip
from router.core.aliases import Alias
from router.core.types import BoxKind
from router.facades.openai import shape_error
from router.facades.table import CHAT_BOUND, RESPONSES_BOUND, AliasListing, Body, Facade, Route

JSON = b"application/json"


def _v0_union(boxes: Sequence) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for box in boxes:
        for row in box.inventory.listing.get("v0") or ():
            model_id = row.get("id")
            if not isinstance(model_id, str):
                continue
            kept = rows.get(model_id)
            if kept is None or (row.get("state") == "loaded" and kept.get("state") != "loaded"):
                rows[model_id] = row
    return rows


def v0_models_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    rows = _v0_union(boxes)
    return 200, JSON, orjson.dumps({"object": "list", "data": [rows[k] for k in sorted(rows)]})


def v0_model_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    model_id = path.removeprefix("/api/v0/models/")
    row = _v0_union(boxes).get(model_id)
    if row is None:
        message = f'Model "{clip(model_id)}" not found'
        return 404, JSON, shape_error(404, "model_not_found", message, {"param": "model"})
    return 200, JSON, orjson.dumps(row)


def v1_models_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    models: dict[str, dict] = {}
    for box in boxes:
        for row in box.inventory.listing.get("v1") or ():
            key = row.get("key")
            if not isinstance(key, str):
                continue
            merged = models.setdefault(key, {**row, "loaded_instances": []})
            merged["loaded_instances"].extend(row.get("loaded_instances") or ())
    return 200, JSON, orjson.dumps({"models": [models[k] for k in sorted(models)]})


def v0_alias_row(alias: Alias) -> dict:
    return {"id": alias.name, "object": "model", "type": "llm", "state": "not-loaded", "alias": True,
            "chain": list(alias.chain)}


def v1_alias_row(alias: Alias) -> dict:
    return {"key": alias.name, "type": "llm", "loaded_instances": [], "alias": True, "chain": list(alias.chain)}


def unknown_route(method: str, path: str) -> tuple[int, bytes]:
    return 200, orjson.dumps({"error": f"Unexpected endpoint or method. ({method} {clip(path)})"})


ROUTES = (
    Route("GET", "/api/v0/models", answer=v0_models_answer, aliases=AliasListing("data", v0_alias_row)),
    Route("GET", "/api/v0/models/", answer=v0_model_answer, prefix=True),
    Route("POST", "/api/v0/chat/completions", Body.JSON, asks_usage=True, answer_bound=CHAT_BOUND),
    Route("POST", "/api/v0/completions", Body.JSON, asks_usage=True, answer_bound=CHAT_BOUND),
    Route("POST", "/api/v0/embeddings", Body.JSON),
    Route("GET", "/api/v1/models", answer=v1_models_answer, aliases=AliasListing("models", v1_alias_row)),
    Route("POST", "/api/v1/chat", Body.JSON, answer_bound=RESPONSES_BOUND),
    Route("POST", "/api/v1/models/load", Body.JSON, scope="admin"),
    Route("POST", "/api/v1/models/unload", Body.JSON, ("instance_id",), scope="admin"),
    Route("POST", "/api/v1/models/download", Body.JSON, scope="admin"),
)

FACADE = Facade(
    name="lmstudio",
    kinds=frozenset({BoxKind.LMSTUDIO}),
    routes=ROUTES,
    no_box_status=502,
    shape_error=shape_error,
    unknown=unknown_route,
)
