"""What every box link does: a health loop deciding online, and an inventory loop per kind.

Rules:
1. A box is online while its last good health answer is younger than `HEALTH_TTL_S`; the
   first probe and the first inventory read run before the router serves (bounded by
   `FIRST_READ_TIMEOUT_S`), so a fresh router knows who is up and what they hold. The wait
   ends with that first read, good or failed: a box whose inventory read fails waits out no
   bound (nor does every admin edit of it, which waits as the start does).
2. A link never dies: any exception from the box or from reading its answer (a bug included)
   is a failure, retried after `router.core.backoff` (capped, reset by the next published
   inventory) and logged when the streak starts and then rarely. A health probe that raises
   is a missed probe, so a broken box goes offline within `HEALTH_TTL_S` however it breaks.
   A good probe ends the inventory loop's wait at once: a box back from a long outage is read
   at the next probe, not at the end of a capped back-off.
3. Polled kinds (ollama, lmstudio, openai) re-read their inventory every `POLL_INTERVAL_S`,
   jittered so that many links do not beat in step; hugpy follows its box's long-poll instead.
4. A failed probe or inventory read says why in the operator's words (`why_down`), kept as the
   box's `down` (the probe's reason first; "" once both work) for the state, the refusals'
   `offline: ...` / `no_model: ...` and the dashboard: connection refused, timeout, TLS, the
   box refusing our key (401/403), or an answer that is not this kind's (wrong kind?).
"""

from __future__ import annotations

import asyncio
import logging
import random

from router.boxes.state import BoxState, Inventory
from router.core.backoff import Streak
from router.upstream.fetch import fetch
from router.upstream.pool import ConnectFailed, FirstByteTimeout

log = logging.getLogger("router.boxes")

HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 3.0
# Five missed probes: long enough to ride out a busy box's slow answer, short enough that a
# dead box stops being tried within seconds (failover covers the gap).
HEALTH_TTL_S = 10.0
POLL_INTERVAL_S = 2.0
POLL_TIMEOUT_S = 5.0
FIRST_READ_TIMEOUT_S = 5.0


class InventoryError(Exception):
    """A box answered its inventory request with something we cannot read; `status` is the
    answer's status when that was the trouble."""

    def __init__(self, message: str, status: int | None = None, target: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.target = target


class Link:
    health_path = "/health"
    mode = "poll"  # how the inventory is followed, as the admin state reports it
    speaks = "hugpy-wrapper"  # what a healthy answer comes from, for `why_down`

    def __init__(self, box: BoxState) -> None:
        self.box = box
        self.tasks: list[asyncio.Task] = []
        self.inventory_tried = asyncio.Event()  # set once an inventory read came in or failed (rule 1)
        self.streak = Streak()  # the inventory loop's failures in a row (rule 2)
        self.probe_error = ""  # why the last probe failed, for the offline line
        self.inventory_error = ""  # why the inventory loop's last read failed ("" once one works)
        self.answering = asyncio.Event()  # set by a good probe; wakes the inventory loop's wait
        self.probed = False  # the first probe is always logged: a box down from the start says so

    def healthy(self, status: int, body: bytes) -> bool:
        return status == 200

    def why_down(self, status: int | None, exc: BaseException | None = None, *, inventory: bool = False) -> str:
        """Rule 4: why the health probe (`inventory`: an inventory read) that answered `status`
        (None: raised `exc`) failed."""
        asked = "an inventory read" if inventory else f"GET {self.health_path}"
        if isinstance(exc, InventoryError):
            status, asked = exc.status, f"GET {exc.target}"
        if isinstance(exc, ConnectFailed):
            return exc.cause or "unreachable"
        if isinstance(exc, FirstByteTimeout):
            return f"timeout: no answer to {asked}"
        if status in (401, 403):
            return f"{status} from the box on {asked}: it refuses the router's key (check the box's key)"
        if status == 200 or status == 404:
            return f"wrong kind? {asked} did not answer as {self.speaks} does ({status})"
        if status is not None:
            return f"{asked} answered {status}"
        if inventory:
            return f"its inventory could not be read ({type(exc).__name__})"
        return f"{type(exc).__name__} on {asked}"

    def say_down(self) -> None:
        """The box's `down`: the probe's failure, else the inventory's (rule 4)."""
        self.box.set_down(self.probe_error or self.inventory_error)

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(self._health_loop(), name=f"health:{self.box.name}"),
            asyncio.create_task(self._inventory_guarded(), name=f"inventory:{self.box.name}"),
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.inventory_tried.set()  # a first read waiting on this link (an admin edit's) ends now
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.box.origin.close()

    async def get(self, target: str, timeout_s: float) -> bytes:
        """GET with the box key; the body of a 200. Raises UpstreamError or InventoryError."""
        status, _, body = await fetch(
            self.box.origin, "GET", target, headers=self.box.auth_header, timeout_s=timeout_s
        )
        if status != 200:
            raise InventoryError(f"{target} answered {status}", status, target.partition("?")[0])
        return body

    async def first_read(self) -> None:
        """The first health probe, then (for a box that answered) the first inventory read, in
        or failed, within the bound: a box that is down does not hold up the start (rule 1)."""
        try:
            async with asyncio.timeout(FIRST_READ_TIMEOUT_S):
                if await self.probe():
                    await self.inventory_tried.wait()
        except TimeoutError:
            pass

    async def probe(self) -> bool:
        """One health probe; updates online. Returns whether the box answered well."""
        box = self.box
        try:
            status, _, body = await fetch(
                box.origin, "GET", self.health_path, headers=box.auth_header, timeout_s=HEALTH_TIMEOUT_S
            )
            ok = self.healthy(status, body)
            self.probe_error = "" if ok else self.why_down(status)
        except Exception as exc:  # whatever broke, a missed probe (rule 2)
            ok = False
            self.probe_error = self.why_down(None, exc)
        now = asyncio.get_running_loop().time()
        if ok:
            box.last_ok_s = now
            box.reachable()
            self.answering.set()
        was_online = box.online
        self.say_down()
        box.set_online(ok or (box.last_ok_s > 0 and now - box.last_ok_s <= HEALTH_TTL_S))
        if was_online != box.online or not self.probed:
            self.probed = True
            if box.online:
                log.info("box %s is online", box.name)
            else:
                log.info("box %s is offline (%s)", box.name, self.probe_error)
        return ok

    async def _health_loop(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(HEALTH_INTERVAL_S * random.uniform(0.9, 1.1))

    async def _inventory_guarded(self) -> None:
        loop = asyncio.get_running_loop()
        streak = self.streak
        while True:
            try:
                await self.follow_inventory()
                return
            except Exception as exc:  # rule 2: a link task that dies leaves a frozen inventory
                self.inventory_tried.set()
                self.inventory_error = self.why_down(None, exc, inventory=True)
                self.say_down()
                wait_s, say = streak.failed(loop.time(), random.random())
                if say:
                    log.warning(
                        "box %s inventory link failing (%d in a row, retrying every %.1f s at most): %s",
                        self.box.name, streak.failures, streak.cap_s, self.inventory_error,
                    )
                await self._retry_after(wait_s)

    async def _retry_after(self, wait_s: float) -> None:
        """Waits `wait_s`, or until a health probe finds the box answering (rule 2)."""
        self.answering.clear()
        try:
            async with asyncio.timeout(wait_s):
                await self.answering.wait()
        except TimeoutError:
            pass

    def publish(self, inventory: Inventory) -> None:
        self.box.set_inventory(inventory)
        self.inventory_tried.set()
        if self.inventory_error:
            self.inventory_error = ""
            self.say_down()
        if self.streak.failures:
            self.streak.succeeded()
            log.info("box %s inventory link recovered", self.box.name)

    async def follow_inventory(self) -> None:
        """Keeps the box's inventory current; raises on a failure (the guard retries)."""
        while True:
            self.publish(await self.read_inventory())
            await asyncio.sleep(POLL_INTERVAL_S * random.uniform(0.8, 1.2))

    async def read_inventory(self) -> Inventory:
        raise NotImplementedError
