"""The scheduler task: publishes snapshots of pending work and GPU pressure per box.

Rules:
1. A snapshot is published when load moves (a call dispatched or ended: `poke()`), at most
   every `MIN_SNAPSHOT_GAP_S`, and at least every `MAX_SNAPSHOT_AGE_S` (telemetry moves at the
   1 Hz scan rate, so the ceiling also carries every pressure change).
2. Publishing takes the snapshot (router.core.schedule.take), supersedes every reservation
   stamped before its generation (the snapshot's pending counts those calls), and hands each box
   its pending and pressure, in that order, all on the event loop: no decision ever sees a box
   whose pending already counts a call that a reservation still counts too.
3. Subscribers (the admin `schedule:priority` stream) get every snapshot through a small queue;
   a subscriber that does not keep up loses the oldest snapshots, never slows publishing.
"""

from __future__ import annotations

import asyncio
import logging

from router._fastpath import Reservations
from router.boxes.fleet import Fleet
from router.core import schedule
from router.core.schedule import BoxLoad, Snapshot
from router.telemetry.cache import TelemetryCache
from router.telemetry.task import BackgroundTask

log = logging.getLogger("router.telemetry")

MIN_SNAPSHOT_GAP_S = 0.1
MAX_SNAPSHOT_AGE_S = 1.0
SUBSCRIBER_QUEUE = 16


class Scheduler(BackgroundTask):
    task_name = "scheduler"

    def __init__(self, fleet: Fleet, reservations: Reservations, cache: TelemetryCache) -> None:
        self.fleet = fleet
        self.reservations = reservations
        self.cache = cache
        self.snapshot: Snapshot = schedule.EMPTY
        self.generation = self.snapshot.generation  # the snapshot's, read by every dispatch (no property)
        self._moved = asyncio.Event()
        # poke(): load moved, publish soon. The event's own set, bound: two calls a call.
        self.poke = self._moved.set
        self._subscribers: set[asyncio.Queue] = set()

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def publish(self, now_s: float) -> Snapshot:
        loads = [
            BoxLoad(
                id=box.name,
                order=box.order,
                in_flight=box.in_flight,
                busy_seats=box.busy_seats,
                pressure=self.cache.pressure(box.name, now_s),
            )
            for box in self.fleet.ordered()
        ]
        snap = schedule.take(self.snapshot.generation + 1, loads, now_s)
        self.reservations.supersede(snap.generation)
        for box in self.fleet.ordered():
            box.set_load(snap.pending.get(box.name, 0), snap.pressure.get(box.name, 1))
        self.snapshot, self.generation = snap, snap.generation
        for queue in self._subscribers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(snap)
        return snap

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel that
            # meets a poke (the stop's last calls poke as they end), and the stop then waits
            # on this task for ever.
            try:
                async with asyncio.timeout(MAX_SNAPSHOT_AGE_S - MIN_SNAPSHOT_GAP_S):
                    await self._moved.wait()
            except TimeoutError:
                pass
            self._moved.clear()
            try:
                self.publish(loop.time())
            except Exception:  # never let the scheduler die: the next tick tries again
                log.exception("snapshot failed")
            await asyncio.sleep(MIN_SNAPSHOT_GAP_S)
