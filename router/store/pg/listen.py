"""Changes made on any router, live on every router: LISTEN on the store's channel.

Rules:
1. One asyncio connection (psycopg's AsyncConnection, on the event loop: it only waits) runs
   `LISTEN hugpy_router`. A notification's payload is a topic (conn.py rule 4); its callback
   re-reads that part of the store (off the loop: the callbacks run their reads in threads).
   Notifications arrive at the other routers' commit, so a change is live everywhere within a
   round trip and a re-read (well under the second the issue asks for).
2. On every (re)connect every callback runs once: what changed while this router was not
   listening is read again. So a missed notification costs at most one outage's staleness.
3. A lost connection is said once (`up` False, `router_database_up 0`, the state document);
   the task tries again every RETRY_S, each try bounded by the connect timeout. Until then
   keys, boxes and aliases are served from the last copy loaded (their own rules).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from router.store.pg import conn as pg

log = logging.getLogger("router.store")

RETRY_S = 1.0


class Listener:
    """The LISTEN task and what it knows of the database (rules 1-3)."""

    def __init__(self, url: str, topics: dict[str, Callable[[], Awaitable[object]]]) -> None:
        pg.require()
        self.url = url
        self.topics = topics
        self.up = False
        self.down_since: float | None = None  # epoch seconds; None while up
        self.notifications = 0

    def view(self) -> dict:
        """The state document's `database` entry."""
        return {"engine": "postgresql", "url": pg.shown(self.url), "up": self.up, "down_since": self.down_since}

    async def _reread(self, topics) -> None:
        for topic in topics:
            try:
                await self.topics[topic]()
            except Exception:  # a bug in a re-read must not stop the listening
                log.exception("re-reading %s after a change failed", topic)

    async def run(self) -> None:
        import psycopg

        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=pg.CONNECT_TIMEOUT_S,
                    keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=2,
                    application_name="hugpy-router-listen")
                async with conn:
                    await conn.execute(f"LISTEN {pg.CHANNEL}")
                    if self.down_since is not None:
                        log.warning("database %s is back after %.1f s; re-reading keys, boxes and aliases",
                                    pg.shown(self.url), time.time() - self.down_since)
                    self.up, self.down_since = True, None
                    await self._reread(list(self.topics))  # rule 2
                    async for note in conn.notifies():
                        self.notifications += 1
                        if note.payload in self.topics:
                            await self._reread([note.payload])
            except psycopg.Error as exc:
                if self.up or self.down_since is None:
                    log.warning("database %s unreachable (%s): serving the last keys, boxes and aliases "
                                "loaded; route-log rows are held until it is back", pg.shown(self.url),
                                type(exc).__name__)
                    self.down_since = time.time()
                self.up = False
            await asyncio.sleep(RETRY_S)

    def collect(self):
        """`router_database_up` for the metrics registry (rule 3)."""
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("router_database_up", "1 while the PostgreSQL store answers (LISTEN connection up).",
                                value=int(self.up))
