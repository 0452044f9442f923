"""The hugpy-wrapper link: `/health` decides online; the state long-poll keeps the inventory.

Rules (contracts/hugpy-wrapper.md §1, §2):
1. `GET /health` without a query string (the box answers 404 to one).
2. `GET /v1/telemetry/state?wait=10&since=<n>` with the box key. Every answer is a full
   snapshot; `changes` below our `since` means the box restarted: take the snapshot as the new
   truth and forget the settings we sent it (its seats are gone).
3. Under traffic the counter moves on every call, so an early answer is followed by a pause of
   `MIN_POLL_GAP_S` before the next poll: the view lags by at most that, and a busy box is not
   asked for a full snapshot per call.
4. Pair settings come with every snapshot (`pair_settings`, §11.2.7): only rows of the box's
   current worker name count, the name its `/health` answer gives (the boxes file's name until
   one has). The verdicts are not in the snapshot: `boxes/verdicts.py` reads them when the
   catalog or the settings move.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from router.boxes.link import Link
from router.boxes.state import BoxState, Inventory
from router.boxes.verdicts import VerdictReader
from router.core.pairs import pair_view
from router.core.types import Resident

log = logging.getLogger("router.boxes")

# Shorter than the box's 60 s cap: an idle box is asked again at least this often, which bounds
# how long a restart that fell between two polls (the new process holds a low counter, so our
# `since` waits out the whole wait) goes unseen.
POLL_WAIT_S = 10
POLL_TIMEOUT_S = POLL_WAIT_S + 10.0
MIN_POLL_GAP_S = 0.25
# The columns `parse_state` reads, per table: all that the store watch SELECTs (store_watch.py).
STATE_COLUMNS = {
    "residents": ("key", "state", "healthy", "busy", "loading", "last_used"),
    "models": ("key",),
    "gpu_state": ("free",),
    "pair_settings": ("worker", "model_key", "settings"),
}


def parse_state(doc: dict, worker: str | None = None) -> Inventory:
    """The inventory in a state snapshot: catalog keys, residents, max free GPU bytes.

    `doc` maps table names to row dicts: the state endpoint's answer, or the same rows read
    from the box's store file (store_watch.py), so both links build the view with this code.
    `worker` filters the pair settings (rule 4); None when the rows are already the box's own.
    """
    catalog = {row["key"]: row["key"] for row in doc.get("models") or () if isinstance(row.get("key"), str)}
    residents: dict[str, Resident] = {}
    for row in doc.get("residents") or ():
        key = row.get("key")
        if not isinstance(key, str):
            continue
        state = row.get("state")
        residents[key] = Resident(
            key=key,
            healthy=bool(row.get("healthy")) and state not in ("error", "dead"),
            loading=bool(row.get("loading")) or state == "loading",
            busy=bool(row.get("busy")),
            last_used_s=float(row.get("last_used") or 0.0),
        )
    free = [row["free"] for row in doc.get("gpu_state") or () if isinstance(row.get("free"), int)]
    return Inventory(catalog=catalog, residents=residents, free_gpu_bytes=max(free) if free else None,
                     pairs=pair_view(doc.get("pair_settings") or (), worker))


class HugpyLink(Link):
    health_path = "/health"
    mode = "api long-poll"  # how the inventory is kept, for the admin state

    def __init__(self, box: BoxState) -> None:
        super().__init__(box)
        self.worker: str | None = None  # FITEVICT_WORKER, from /health (rule 4)
        self.verdicts = VerdictReader(self)

    def healthy(self, status: int, body: bytes) -> bool:
        if status != 200:
            return False
        try:
            worker = orjson.loads(body).get("worker")
        except (orjson.JSONDecodeError, AttributeError):
            return True
        if isinstance(worker, str) and worker:
            self.worker = worker
        return True

    def start(self) -> None:
        super().start()
        self.tasks.append(asyncio.create_task(self.verdicts.run(), name=f"verdicts:{self.box.name}"))

    def publish(self, inventory: Inventory) -> None:
        super().publish(inventory)
        self.verdicts.consider(inventory)

    async def follow_inventory(self) -> None:
        box = self.box
        since = -1
        loop = asyncio.get_running_loop()
        while True:
            target = "/v1/telemetry/state"
            if since >= 0:
                target += f"?wait={POLL_WAIT_S}&since={since}"
            asked_s = loop.time()
            doc = orjson.loads(await self.get(target, POLL_TIMEOUT_S))
            changes = int(doc["changes"])
            inventory = parse_state(doc, self.worker or box.name)
            if 0 <= changes < since:
                log.info("box %s restarted (changes %d < %d): resync", box.name, changes, since)
                box.forget_contracts()
            self.publish(inventory)
            since = changes
            if loop.time() - asked_s < MIN_POLL_GAP_S:
                await asyncio.sleep(MIN_POLL_GAP_S)
