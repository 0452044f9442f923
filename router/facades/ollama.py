"""The Ollama facade: Ollama's API over ollama boxes (contracts/ollama-lmstudio.md §1, §4).

Rules:
1. Model-bearing calls go to an owner of the model (a box whose `/api/tags` or `/api/ps`
   lists it under Ollama's name normalisation); the body, and so the echoed `model`, is the
   client's, untouched. `stream` absent means stream (the box applies its own default).
2. Runner options (`num_ctx`, `num_batch`, `num_gpu`, `main_gpu`, `use_mmap`, `num_thread`)
   are the call's settings: a loaded model with other runner options is a reload, not a match.
   Only numbers and booleans count, normalised (`8192` == `8192.0`).
3. Fleet answers: `GET|HEAD /` "Ollama is running"; `/api/version` the lowest version among the
   boxes (clients must not assume features some box lacks); `/api/tags` and `/api/ps` unions,
   deduplicated by normalised name (newest `modified_at` / latest `expires_at` wins), each entry
   as Ollama wrote it, sorted as Ollama sorts them.
4. Blob uploads (`/api/blobs/*`) need one box for the blob and the `/api/create` after it;
   the router refuses them rather than guess (send them to a box directly).
5. Engine management (`pull`, `push`, `delete`, `copy`, `create`, blobs) is admin scope: it
   changes what a box stores, so a `use` key is refused before any box is contacted.
6. Errors take Ollama's shape `{"error": "..."}`; an empty owner set is a local 502, except a
   model no ollama box lists: Ollama's own 404 (`model 'x' not found`; embed and embeddings add
   "try pulling it first", contracts/ollama-lmstudio.md §1.5), every box's reason kept beside it.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Sequence

import orjson

from router.core.names import ollama_key
from router.core.aliases import Alias
from router.core.types import BoxKind
from router.facades.table import AliasListing, Body, Facade, Route

JSON = b"application/json; charset=utf-8"
RUNNER_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread")
_FRACTION_RE = re.compile(r"(\.\d{6})\d+")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def shape_error(status: int, code: str, message: str, extra: dict | None = None) -> bytes:
    return orjson.dumps({"error": message, **(extra or {})})


def runner_settings(doc: dict) -> str | None:
    """The runner options of a call, normalised (`num_ctx=8192,num_gpu=1`), or None."""
    options = doc.get("options")
    if not isinstance(options, dict):
        return None
    picked = []
    for name in RUNNER_OPTIONS:
        value = options.get(name)
        if isinstance(value, bool):
            picked.append(f"{name}={str(value).lower()}")
        elif isinstance(value, (int, float)) and abs(value) < 1e12:
            number = int(value) if float(value).is_integer() else value
            picked.append(f"{name}={number}")
        # anything else is not a runner option Ollama would take: it changes nothing here
    return ",".join(picked) or None


def _when(stamp: object) -> datetime:
    """An RFC 3339 time as Ollama writes it (nanoseconds allowed); unparsable sorts oldest."""
    if not isinstance(stamp, str):
        return _EPOCH
    try:
        parsed = datetime.fromisoformat(_FRACTION_RE.sub(r"\1", stamp.replace("Z", "+00:00")))
    except ValueError:
        return _EPOCH
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _union(boxes: Sequence, listing: str, stamp_field: str) -> list[dict]:
    newest: dict[str, dict] = {}
    for box in boxes:
        for entry in box.inventory.listing.get(listing) or ():
            key = ollama_key(str(entry.get("name") or entry.get("model") or ""))
            if key is None:
                continue
            kept = newest.get(key)
            if kept is None or _when(entry.get(stamp_field)) > _when(kept.get(stamp_field)):
                newest[key] = entry
    return sorted(newest.values(), key=lambda e: _when(e.get(stamp_field)), reverse=True)


def tags_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    return 200, JSON, orjson.dumps({"models": _union(boxes, "tags", "modified_at")})


def alias_row(alias: Alias) -> dict:
    return {"name": alias.name, "model": alias.name, "size": 0, "digest": "", "alias": True,
            "chain": list(alias.chain)}


def ps_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    return 200, JSON, orjson.dumps({"models": _union(boxes, "ps", "expires_at")})


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3]) or (0,)


def version_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    versions = [v for box in boxes if isinstance(v := box.inventory.listing.get("version"), str)]
    lowest = min(versions, key=_version_key) if versions else "0.0.0"
    return 200, JSON, orjson.dumps({"version": lowest})


def root_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    return 200, b"text/plain; charset=utf-8", b"Ollama is running"


def model_not_found(model: str) -> str:
    """Rule 6: what Ollama's generate, chat, show and delete say."""
    return f"model '{model}' not found"


def model_not_pulled(model: str) -> str:
    """Rule 6: what Ollama's embed and embeddings say (Go's `%q` quotes the name)."""
    return f"model {orjson.dumps(model).decode()} not found, try pulling it first"


def source_not_found(model: str) -> str:
    """Rule 6: what Ollama's copy says of its source."""
    return f"model {orjson.dumps(model).decode()} not found"


def blobs_answer(boxes: Sequence, path: str) -> tuple[int, bytes, bytes]:
    message = "blob uploads need one box for the blob and the create after it: send them to the box directly"
    return 501, JSON, shape_error(501, "not_supported", message)


ROUTES = (
    Route("GET", "/", answer=root_answer),
    Route("HEAD", "/", answer=root_answer),
    Route("GET", "/api/version", answer=version_answer),
    Route("HEAD", "/api/version", answer=version_answer),
    Route("GET", "/api/tags", answer=tags_answer, aliases=AliasListing("models", alias_row)),
    Route("HEAD", "/api/tags", answer=tags_answer),
    Route("GET", "/api/ps", answer=ps_answer),
    Route("POST", "/api/generate", Body.JSON, answer_bound=("options.num_predict",), model_not_found=model_not_found),
    Route("POST", "/api/chat", Body.JSON, answer_bound=("options.num_predict",), model_not_found=model_not_found),
    Route("POST", "/api/embed", Body.JSON, model_not_found=model_not_pulled),
    Route("POST", "/api/embeddings", Body.JSON, model_not_found=model_not_pulled),
    Route("POST", "/api/show", Body.JSON, ("model", "name"), model_not_found=model_not_found),
    Route("POST", "/api/pull", Body.JSON, ("model", "name"), scope="admin"),
    Route("POST", "/api/push", Body.JSON, ("model", "name"), scope="admin"),
    Route("DELETE", "/api/delete", Body.JSON, ("model", "name"), scope="admin", model_not_found=model_not_found),
    Route("POST", "/api/copy", Body.JSON, ("source",), scope="admin", model_not_found=source_not_found),
    Route("POST", "/api/create", Body.JSON, ("from", "model"), scope="admin"),
    Route("POST", "/api/blobs/", answer=blobs_answer, prefix=True, scope="admin"),
    Route("HEAD", "/api/blobs/", answer=blobs_answer, prefix=True, scope="admin"),
)

FACADE = Facade(
    name="ollama",
    kinds=frozenset({BoxKind.OLLAMA}),
    routes=ROUTES,
    no_box_status=502,
    shape_error=shape_error,
    settings=runner_settings,
    settings_fields=("options",),
)
