"""A hugpy box's verdicts: read with the box's key when its catalog or settings move, never per call.

contracts/hugpy-wrapper.md §11.1. Rules:
1. When. `GET /v1/verdicts` costs the box ~1.5 ms and ~12 KB per model file (§11.1.5) and is not
   in the state snapshot, so it is read once when the link first publishes, then after each
   published change of the catalog or the pair settings, `SETTLE_S` later: the box coalesces a
   burst of writes for 1 s before it prices (§11.1.1), and a burst of changes is one read.
2. A failed read (the box key is a use key: 403; the box is down) keeps what was last read and
   says why in the state; it is tried again after `RETRY_S`, or at the next change.
3. A model with no verdict row fits nowhere (router.core.pairs rule 6), but a model that joined
   the catalog less than `NO_ROW_GRACE_S` ago may simply not be priced yet (the box prices after
   it records the catalog): it counts as unknown, and the verdicts are read again every
   `SETTLE_S` until it has a row or its grace is over. A router that just started counts every
   model as new.
4. What is kept: the fit per catalog key (router.core.pairs rule 6) for the decision, and the
   rows themselves for the fleet view (`/v1/fleet/verdicts`) with when they were read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson

from router.boxes.link import Link
from router.boxes.state import Inventory
from router.core.pairs import Fit, fits_by_model

log = logging.getLogger("router.boxes")

PATH = "/v1/verdicts"
SETTLE_S = 2.0  # the box's 1 s coalescing plus pricing a few files (§11.1.4: ~1.45 s seen)
RETRY_S = 30.0
READ_TIMEOUT_S = 10.0
NO_ROW_GRACE_S = 10.0  # §11.1.4: a new model was priced 1.45 s after the catalog refresh


class VerdictReader:
    """The verdicts of a hugpy link's box, read through the link's `get` (its box key): a Link,
    not the HugpyLink that holds this reader, so that the two modules do not import each other."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.wanted = asyncio.Event()
        self.seen: tuple | None = None  # (catalog keys, pair settings) last asked about
        self.first = True
        self.first_seen: dict[str, float] = {}  # catalog key -> loop time it was first seen (rule 3)
        self.recheck_at: float | None = None
        # what the fleet view and the state show
        self.rows: list[dict[str, Any]] = []
        self.read_at: float | None = None  # wall clock of the last good read
        self.error = ""

    def consider(self, inventory: Inventory) -> None:
        """After each published inventory: ask for a read when the catalog or settings moved."""
        seen = (frozenset(inventory.catalog), inventory.pairs)
        if seen != self.seen:
            now = asyncio.get_running_loop().time()
            self.first_seen = {key: self.first_seen.get(key, now) for key in seen[0]}
            self.seen = seen
            self.wanted.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            wait_s = RETRY_S if self.error else None
            if self.recheck_at is not None:
                wait_s = max(0.0, min(wait_s or RETRY_S, self.recheck_at - loop.time()))
            try:
                async with asyncio.timeout(wait_s):
                    await self.wanted.wait()
            except TimeoutError:
                pass
            if not self.first:
                await asyncio.sleep(SETTLE_S)
            self.wanted.clear()
            await self.read()

    async def read(self) -> None:
        box = self.link.box
        try:
            doc = orjson.loads(await self.link.get(PATH, READ_TIMEOUT_S))
            rows = doc.get("verdicts")
            if not isinstance(rows, list):
                raise ValueError("no verdicts list")
        except Exception as exc:  # rule 2: any failure keeps the last read
            why = str(exc) if str(exc) else type(exc).__name__
            if why != self.error:
                log.warning("box %s: verdicts not read: %s", box.name, why)
            self.error = why
            return
        rows = [row for row in rows if isinstance(row, dict)]
        self.first, self.error = False, ""
        self.rows, self.read_at = rows, time.time()
        fits = fits_by_model(rows, box.catalog)
        priced = {row.get("model_key") for row in rows}
        now = asyncio.get_running_loop().time()
        young = [key for key, fit in fits.items() if fit is Fit.NONE and key not in priced
                 and now - self.first_seen.get(key, now) < NO_ROW_GRACE_S]
        for key in young:  # rule 3
            fits[key] = Fit.UNKNOWN
        self.recheck_at = now + SETTLE_S if young else None
        box.set_fits(fits)

    def state(self) -> dict[str, Any]:
        """For the admin state: per catalog key its fit, how long ago the verdicts were read,
        and when the box last priced each model (its rows' newest `at`, §11.1.4)."""
        box = self.link.box
        age = None if self.read_at is None else round(time.time() - self.read_at, 1)
        priced: dict[str, float] = {}
        for row in self.rows:
            key, at = row.get("model_key"), row.get("at")
            if isinstance(key, str) and isinstance(at, (int, float)):
                priced[key] = max(priced.get(key, at), at)
        return {"read_s_ago": age, "error": self.error or None,
                "fits": {key: fit.name.lower() for key, fit in sorted(box.fits.items())},
                "priced_at": priced}
