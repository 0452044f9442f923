"""The link to any OpenAI-compatible server (vLLM, llama.cpp server, SGLang): `GET /v1/models`
is both the health check and the inventory, and every listed model counts as resident.

A llama.cpp server also reports its capacity: `GET /props` has `total_slots`, the calls it
decodes at once (`--parallel`). It becomes the box's in-flight limit when the boxes file sets
none. A server without `/props` (vLLM, SGLang: 404) reports no capacity."""

from __future__ import annotations

import orjson

from router.boxes.link import POLL_TIMEOUT_S, InventoryError, Link
from router.boxes.state import Inventory
from router.core.types import Resident


class OpenAILink(Link):
    health_path = "/v1/models"

    async def read_inventory(self) -> Inventory:
        rows = orjson.loads(await self.get("/v1/models", POLL_TIMEOUT_S)).get("data") or []
        ids = [row["id"] for row in rows if isinstance(row.get("id"), str)]
        return Inventory(
            catalog={i: i for i in ids}, residents={i: Resident(key=i) for i in ids}, listing={"models": rows},
            capacity=await self.read_capacity(),
        )

    async def read_capacity(self) -> int | None:
        """llama.cpp's `total_slots`, or None where the server does not report one."""
        try:
            props = orjson.loads(await self.get("/props", POLL_TIMEOUT_S))
        except (InventoryError, orjson.JSONDecodeError):
            return None
        slots = props.get("total_slots") if isinstance(props, dict) else None
        return slots if type(slots) is int and slots > 0 else None
