"""The fleet: every box's live state and link, kept in step with the boxes file.

Rules:
1. The boxes file is re-read when its size, mtime or inode change (checked every
   `WATCH_INTERVAL_S`): new boxes get a link, removed boxes lose theirs (calls already on them
   finish, they hold their own reference), changed boxes are rebuilt. A file that fails to
   parse is logged and ignored: the last good fleet keeps serving. `reload()` re-reads at once
   (an admin API edit, a SIGHUP); re-reads never overlap, so the last one applies the newest
   file.
2. A box keeps its reservation-table index for the life of the process, even across removal
   and re-adding, so a late release can never land on another box.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from router._fastpath import Reservations
from router.boxes import config as boxes_config
from router.boxes.config import BoxConfig
from router.boxes.hugpy import HugpyLink
from router.boxes.link import Link
from router.boxes.lmstudio import LMStudioLink
from router.boxes.ollama import OllamaLink
from router.boxes.openai import OpenAILink
from router.boxes.state import BoxState
from router.boxes.store_watch import HugpyStoreLink
from router.core.errors import ConfigError
from router.core.kinds import Capability, can
from router.core.types import BoxFacts, BoxKind

log = logging.getLogger("router.boxes")

WATCH_INTERVAL_S = 1.0
LINKS: dict[BoxKind, type[Link]] = {
    BoxKind.HUGPY: HugpyLink,
    BoxKind.OLLAMA: OllamaLink,
    BoxKind.LMSTUDIO: LMStudioLink,
    BoxKind.OPENAI: OpenAILink,
}


def link_class(cfg: BoxConfig) -> type[Link]:
    """The box kind's link, except that a box with a `store` path watches that file."""
    if cfg.store and can(cfg.kind, Capability.STORE_WATCH):
        return HugpyStoreLink
    return LINKS[cfg.kind]


class Fleet:
    def __init__(self, path: Path, reservations: Reservations) -> None:
        self.path = path
        self.reservations = reservations
        self.boxes: dict[str, BoxState] = {}
        self.links: dict[str, Link] = {}
        self._indexes: dict[str, int] = {}
        self._stamp: tuple | None = None
        self._watch: asyncio.Task | None = None
        self._ordered: list[BoxState] = []
        self._reloading = asyncio.Lock()
        self.on_change: list = []  # callables run after the fleet changed shape

    def _file_stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    async def start(self) -> None:
        """Loads the file, starts every link and waits (bounded) for their first reads."""
        self._stamp = self._file_stamp()
        fresh = self._apply(boxes_config.load(self.path).boxes)
        await asyncio.gather(*(self.links[name].first_read() for name in fresh))
        self._watch = asyncio.create_task(self._watch_file(), name="boxes-file")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(link.stop() for link in self.links.values()))
        self.links.clear()

    def _apply(self, configs: list[BoxConfig]) -> list[str]:
        """Makes the fleet match `configs`; returns the names whose link (re)started."""
        started: list[str] = []
        wanted = {c.name: c for c in configs}
        for name in [n for n in self.boxes if n not in wanted]:
            log.info("box %s removed", name)
            del self.boxes[name]
            asyncio.get_running_loop().create_task(self.links.pop(name).stop())
        for order, cfg in enumerate(configs):
            current = self.boxes.get(cfg.name)
            if current is not None and current.config.link_fields == cfg.link_fields:
                # Same link: keep it and the view; pool, blocked, agent or order may have moved.
                if (current.config, current.order) != (cfg, order):
                    current.config, current.order = cfg, order
                    current.changed()
                continue
            if current is not None:
                asyncio.get_running_loop().create_task(self.links.pop(cfg.name).stop())
            index = self._indexes.setdefault(cfg.name, len(self._indexes))
            state = BoxState(cfg, index, order)
            self.boxes[cfg.name] = state
            link = link_class(cfg)(state)
            self.links[cfg.name] = link
            link.start()
            started.append(cfg.name)
            log.info("box %s at %s (%s)", cfg.name, cfg.url, cfg.kind.value)
        self._ordered = sorted(self.boxes.values(), key=lambda b: b.order)
        for callback in self.on_change:
            callback()
        return started

    async def _watch_file(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            stamp = await loop.run_in_executor(None, self._file_stamp)  # file I/O off the loop
            if stamp != self._stamp:
                await self.reload()

    async def reload(self) -> None:
        """Re-reads the boxes file now and applies it (rule 1). A file that does not parse is
        logged and leaves the fleet as it is."""
        loop = asyncio.get_running_loop()
        async with self._reloading:
            self._stamp = await loop.run_in_executor(None, self._file_stamp)
            try:
                configs = (await loop.run_in_executor(None, boxes_config.load, self.path)).boxes
            except ConfigError as exc:
                log.warning("boxes file not applied: %s", exc)
                return
            self._apply(configs)

    def facts(self) -> list[BoxFacts]:
        """The facts of every box, in boxes-file order, with live reservation counts."""
        count = self.reservations.count
        return [box.facts(count(box.index)) for box in self._ordered]

    def get(self, name: str) -> BoxState | None:
        return self.boxes.get(name)

    def ordered(self) -> list[BoxState]:
        return list(self._ordered)
