"""The simulated LM Studio server's inventory: the models it has downloaded, those it has
loaded, and the three lists that report them (`/api/v0/models`, `/v1/models`,
`/api/v1/models`; contracts/ollama-lmstudio.md §3).

Rules:
1. `models` and `loaded` are the public state (the test thread may edit them); every model in
   `loaded` is in `models`. One instance per model: its instance id is the model id.
2. An id with `embed` in it is an embedding model (its own type, architecture and context);
   the publisher is the id's part before `/` (`lmstudio-community` without one).
3. `GET /api/v0/models/{id}` takes the id URL-encoded too (`%2F` for `/`); an unknown id is
   the same 400 as a call naming it.
"""

from __future__ import annotations

import re
import zlib
from typing import Any
from urllib.parse import unquote

from router.sim.connection import Connection, Exchange

QUANTIZATION = "Q4_K_M"
CONTEXT_LENGTH = 4096  # a loaded instance's context
PARALLEL = 4  # "Max Concurrent Predictions" default


def is_embedding(model: str) -> bool:
    return "embed" in model.lower()


def publisher(model: str) -> str:
    return model.split("/", 1)[0] if "/" in model else "lmstudio-community"


def max_context(model: str) -> int:
    return 2048 if is_embedding(model) else 32768


class Inventory:
    """Mixed into SimLMStudio: its lists."""

    def _v0_models(self, conn: Connection, ex: Exchange) -> None:
        self._json(conn, ex, {"object": "list", "data": [self._v0_row(m) for m in list(self.models)]})

    def _v0_model(self, conn: Connection, ex: Exchange) -> None:
        model = unquote(ex.path_args[0])  # ids with `/` may arrive as %2F
        if model not in self.models:
            self._unknown_model(conn, ex, model)
            return
        self._json(conn, ex, self._v0_row(model))

    def _v0_row(self, model: str) -> dict[str, Any]:
        embedding = is_embedding(model)
        return {"id": model, "object": "model", "type": "embeddings" if embedding else "llm",
                "publisher": publisher(model), "arch": "nomic-bert" if embedding else "llama",
                "compatibility_type": "gguf", "quantization": QUANTIZATION,
                "state": "loaded" if model in self.loaded else "not-loaded", "max_context_length": max_context(model)}

    def _v1_models(self, conn: Connection, ex: Exchange) -> None:
        data = [{"id": m, "object": "model", "owned_by": "organization_owner"} for m in list(self.models)]
        self._json(conn, ex, {"object": "list", "data": data})

    def _rest_models(self, conn: Connection, ex: Exchange) -> None:
        self._json(conn, ex, {"models": [self._rest_row(m) for m in list(self.models)]})

    def _rest_row(self, model: str) -> dict[str, Any]:
        embedding = is_embedding(model)
        row: dict[str, Any] = {
            "type": "embedding" if embedding else "llm", "publisher": publisher(model), "key": model,
            "display_name": model.rsplit("/", 1)[-1], "architecture": "nomic-bert" if embedding else "llama",
            "quantization": {"name": QUANTIZATION, "bits_per_weight": 4.8},
            "size_bytes": 1_000_000_000 + zlib.crc32(model.encode()) % 4_000_000_000,
            "params_string": None if embedding else "8B",
            "loaded_instances": [{"id": model, "config": {"context_length": CONTEXT_LENGTH, "parallel": PARALLEL}}]
            if model in self.loaded else [],
            "max_context_length": max_context(model), "format": "gguf"}
        if not embedding:
            row["capabilities"] = {"vision": False, "trained_for_tool_use": False}
        return row


ROUTES = {
    ("GET", "/api/v0/models"): Inventory._v0_models,
    ("GET", "/v1/models"): Inventory._v1_models,
    ("GET", "/api/v1/models"): Inventory._rest_models,
}
PATTERN_ROUTES = [
    ("GET", re.compile(r"/api/v0/models/(.+)"), Inventory._v0_model),
]
