"""The link to any OpenAI-compatible server (vLLM, llama.cpp server, SGLang): `GET /v1/models`
is both the health check and the inventory, and every listed model counts as resident."""

from __future__ import annotations

import orjson

from router.boxes.link import POLL_TIMEOUT_S, Link
from router.boxes.state import Inventory
from router.core.types import Resident


class OpenAILink(Link):
    health_path = "/v1/models"

    async def read_inventory(self) -> Inventory:
        rows = orjson.loads(await self.get("/v1/models", POLL_TIMEOUT_S)).get("data") or []
        ids = [row["id"] for row in rows if isinstance(row.get("id"), str)]
        return Inventory(
            catalog={i: i for i in ids}, residents={i: Resident(key=i) for i in ids}, listing={"models": rows}
        )
