"""The LM Studio link: `GET /lmstudio-greeting` answers `{"lmstudio": true}` (LM Studio says
200 to unknown routes, so the body is what counts); `/api/v0/models` lists downloaded models with
`state` loaded|not-loaded; `/api/v1/models` (LM Studio ≥ 0.4) is kept for the facade's union when
the box has it. Ids are matched exactly (contracts/ollama-lmstudio.md §3)."""

from __future__ import annotations

import orjson

from router.boxes.link import POLL_TIMEOUT_S, InventoryError, Link
from router.boxes.state import Inventory
from router.core.types import Resident
from router.upstream.pool import UpstreamError


class LMStudioLink(Link):
    speaks = "LM Studio"
    health_path = "/lmstudio-greeting"

    def healthy(self, status: int, body: bytes) -> bool:
        try:
            return status == 200 and orjson.loads(body).get("lmstudio") is True
        except (orjson.JSONDecodeError, AttributeError):
            return False

    async def read_inventory(self) -> Inventory:
        v0 = orjson.loads(await self.get("/api/v0/models", POLL_TIMEOUT_S)).get("data") or []
        try:
            v1 = orjson.loads(await self.get("/api/v1/models", POLL_TIMEOUT_S)).get("models")
        except (UpstreamError, InventoryError, orjson.JSONDecodeError):
            v1 = None  # an older LM Studio: the v1 REST API is 0.4+
        catalog = {row["id"]: row["id"] for row in v0 if isinstance(row.get("id"), str)}
        residents = {
            row["id"]: Resident(key=row["id"])
            for row in v0
            if isinstance(row.get("id"), str) and row.get("state") == "loaded"
        }
        return Inventory(catalog=catalog, residents=residents, listing={"v0": v0, "v1": v1})
