"""The link to any OpenAI-compatible server (vLLM, llama.cpp server, SGLang): `GET /v1/models`
is both the health check and the inventory, and every listed model counts as resident.

A llama.cpp server (its models are `owned_by: "llamacpp"`) also reports its capacity: `GET
/props` has `total_slots`, the calls it decodes at once (`--parallel`). It becomes the box's
in-flight limit when the boxes file sets none. It is read when the model list changes (a
restart with other settings shows there), not at every poll; other servers are never asked, and
a `/props` that fails leaves the box without a reported capacity, never without its inventory."""

from __future__ import annotations

import orjson

from router.boxes.link import POLL_TIMEOUT_S, InventoryError, Link
from router.upstream.pool import UpstreamError
from router.boxes.state import Inventory
from router.core.types import Resident


class OpenAILink(Link):
    speaks = "an OpenAI-compatible server"
    health_path = "/v1/models"

    async def read_inventory(self) -> Inventory:
        rows = orjson.loads(await self.get("/v1/models", POLL_TIMEOUT_S)).get("data") or []
        ids = [row["id"] for row in rows if isinstance(row.get("id"), str)]
        known = self.box.inventory
        if any(row.get("owned_by") == "llamacpp" for row in rows):
            capacity = known.capacity if known.catalog.keys() == set(ids) else await self.read_capacity()
        else:
            capacity = None
        return Inventory(
            catalog={i: i for i in ids}, residents={i: Resident(key=i) for i in ids}, listing={"models": rows},
            capacity=capacity,
        )

    async def read_capacity(self) -> int | None:
        """llama.cpp's `total_slots`, or None where the server does not report one."""
        try:
            props = orjson.loads(await self.get("/props", POLL_TIMEOUT_S))
        except (InventoryError, UpstreamError, orjson.JSONDecodeError):
            return None
        slots = props.get("total_slots") if isinstance(props, dict) else None
        return slots if type(slots) is int and slots > 0 else None
