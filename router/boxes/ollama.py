"""The Ollama link: `GET /` says "Ollama is running"; `/api/tags` is the catalog, `/api/ps`
the residents (contracts/ollama-lmstudio.md §1). Names are keyed by Ollama's own normalisation;
the raw entries are kept as Ollama wrote them, for the facade's fleet answers."""

from __future__ import annotations

import orjson

from router.boxes.link import POLL_TIMEOUT_S, Link
from router.boxes.state import Inventory
from router.core.names import ollama_key
from router.core.types import Resident


class OllamaLink(Link):
    speaks = "Ollama"
    health_path = "/"

    def healthy(self, status: int, body: bytes) -> bool:
        return status == 200 and body.startswith(b"Ollama is running")

    async def read_inventory(self) -> Inventory:
        tags = orjson.loads(await self.get("/api/tags", POLL_TIMEOUT_S)).get("models") or []
        ps = orjson.loads(await self.get("/api/ps", POLL_TIMEOUT_S)).get("models") or []
        version = orjson.loads(await self.get("/api/version", POLL_TIMEOUT_S)).get("version")
        catalog: dict[str, str] = {}
        for entry in tags:
            key = ollama_key(str(entry.get("name") or entry.get("model") or ""))
            if key is not None:
                catalog[key] = entry.get("name") or entry.get("model")
        residents = {}
        for entry in ps:
            key = ollama_key(str(entry.get("name") or entry.get("model") or ""))
            if key is not None:
                residents[key] = Resident(key=key)
        return Inventory(
            catalog=catalog,
            residents=residents,
            listing={"tags": tags, "ps": ps, "version": version},
        )
