"""The hugpy-wrapper link: `/health` decides online; the state long-poll keeps the inventory.

Rules (contracts/hugpy-wrapper.md §1, §2):
1. `GET /health` without a query string (the box answers 404 to one); 200 is a good answer.
   A box is online while its last good answer is younger than `HEALTH_TTL_S`.
2. `GET /v1/telemetry/state?wait=30&since=<n>` with the box key. The answer is always a full
   snapshot; `changes` below our `since` means the box restarted: take the snapshot as the new
   truth and forget the settings we sent it (its seats are gone).
3. Under traffic the counter moves on every call, so an early answer is followed by a pause of
   `MIN_POLL_GAP_S` before the next poll: the view lags by at most that, and a busy box is not
   asked for a full snapshot per call.
4. A link never dies: every failure is logged once per streak and retried with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import random

import orjson

from router.boxes.state import BoxState
from router.core.types import Resident
from router.upstream.fetch import fetch
from router.upstream.pool import UpstreamError

log = logging.getLogger("router.boxes")

HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 3.0
# Five missed probes: long enough to ride out a busy box's slow answer, short enough that a
# dead box stops being tried within seconds (failover covers the gap).
HEALTH_TTL_S = 10.0
POLL_WAIT_S = 30
POLL_TIMEOUT_S = POLL_WAIT_S + 10.0
MIN_POLL_GAP_S = 0.25
BACKOFF_MAX_S = 5.0


def parse_state(doc: dict) -> tuple[frozenset[str], dict[str, Resident], int | None]:
    """(catalog keys, residents by key, max free GPU bytes) from a state snapshot."""
    catalog = frozenset(
        row["key"] for row in doc.get("models") or () if isinstance(row.get("key"), str)
    )
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
    return catalog, residents, (max(free) if free else None)


class HugpyLink:
    def __init__(self, box: BoxState) -> None:
        self.box = box
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(self._health_loop(), name=f"health:{self.box.name}"),
            asyncio.create_task(self._state_loop(), name=f"state:{self.box.name}"),
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.box.origin.close()

    async def probe(self) -> bool:
        """One health probe; updates online. Returns whether the box answered 200."""
        box = self.box
        loop = asyncio.get_running_loop()
        try:
            status, _, _ = await fetch(box.origin, "GET", "/health", timeout_s=HEALTH_TIMEOUT_S)
            ok = status == 200
        except UpstreamError:
            ok = False
        now = loop.time()
        if ok:
            box.last_ok_s = now
        was_online = box.online
        box.set_online(ok or (box.last_ok_s > 0 and now - box.last_ok_s <= HEALTH_TTL_S))
        if was_online != box.online:
            log.info("box %s is %s", box.name, "online" if box.online else "offline")
        return ok

    async def _health_loop(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(HEALTH_INTERVAL_S * random.uniform(0.9, 1.1))

    async def _state_loop(self) -> None:
        box = self.box
        since = -1
        failures = 0
        while True:
            target = "/v1/telemetry/state"
            if since >= 0:
                target += f"?wait={POLL_WAIT_S}&since={since}"
            loop = asyncio.get_running_loop()
            asked_s = loop.time()
            try:
                status, _, body = await fetch(
                    box.origin, "GET", target, headers=box.auth_header, timeout_s=POLL_TIMEOUT_S
                )
                if status != 200:
                    raise UpstreamError(f"state answered {status}")
                doc = orjson.loads(body)
                changes = int(doc["changes"])
                catalog, residents, free = parse_state(doc)
            except (UpstreamError, ValueError, KeyError, TypeError, AttributeError) as exc:
                if failures == 0:
                    log.warning("box %s state link failing: %s", box.name, type(exc).__name__)
                failures += 1
                since = -1
                await asyncio.sleep(min(BACKOFF_MAX_S, 0.25 * 2**failures) * random.random())
                continue
            if failures:
                log.info("box %s state link recovered", box.name)
                failures = 0
            if 0 <= changes < since:
                log.info("box %s restarted (changes %d < %d): resync", box.name, changes, since)
                box.forget_contracts()
            box.set_inventory(catalog, residents, free)
            since = changes
            if loop.time() - asked_s < MIN_POLL_GAP_S:
                await asyncio.sleep(MIN_POLL_GAP_S)
