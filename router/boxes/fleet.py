"""The fleet: every box's live state and link, kept in step with the boxes file.

Rules:
1. The boxes file (or the registry in its place: config rule 8) is re-read when its stamp
   (the file's size, mtime and inode) changes (checked every `WATCH_INTERVAL_S`): new boxes get a link, removed boxes lose theirs (calls already on them
   finish, they hold their own reference), changed boxes are rebuilt. `reload()` re-reads at
   once (an admin API edit, a SIGHUP); re-reads never overlap, so the last one applies the
   newest file. The file's aliases (`aliases`) are replaced whole with its boxes.
2. A box keeps its reservation-table index for the life of the process, even across removal
   and re-adding, so a late release can never land on another box.
3. A file is applied whole or not at all. At start, a file with a bad entry (config rule 3)
   stops the start with one line naming the file, the entry and why. At a reload it is not
   applied: that same line is logged once, the last good fleet keeps serving, and the watch
   goes on, so the next good version applies. A deleted file is not an empty fleet: the last
   fleet keeps serving, with a warning (an operator who wants no boxes writes a file with none).
   Nothing a reload meets stops the watch.
4. One entry never stops the rest from applying where it is bad only here: a box that is this
   router (listeners.py rule 5), in any registry, and any bad entry of the database's registry
   (shared by routers that may see it otherwise: pg_registry.py rule 5). It is skipped, the rest
   applies, and it is said: a WARNING line naming the registry, the entry, the box and why, once
   while it stays (`skipped`: the state's `registry.skipped`, the dashboard's).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from router._fastpath import Reservations
from router.boxes import config as boxes_config
from router.boxes.config import BoxConfig
from router.boxes.hugpy import HugpyLink
from router.boxes.link import Link
from router.boxes.listeners import Listening, NamesThisRouter
from router.boxes.lmstudio import LMStudioLink
from router.boxes.ollama import OllamaLink
from router.boxes.openai import OpenAILink
from router.boxes.state import BoxState
from router.boxes.store_watch import HugpyStoreLink
from router.core.aliases import Alias
from router.core.decide import Verdicts
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
    def __init__(self, path: Path, reservations: Reservations,
                 registry: boxes_config.Registry | None = None) -> None:
        self.path = path
        self.registry = registry if registry is not None else boxes_config.FileRegistry(path)
        self.reservations = reservations
        self.boxes: dict[str, BoxState] = {}
        self.links: dict[str, Link] = {}
        self._indexes: dict[str, int] = {}
        self._stamp: tuple | None = None
        self._watch: asyncio.Task | None = None
        self._ordered: list[BoxState] = []
        self._reloading = asyncio.Lock()
        self.on_change: list = []  # callables run after the fleet changed shape
        self.aliases: dict[str, Alias] = {}  # the boxes file's (router.core.aliases)
        self.listening: Listening | None = None  # this router's listeners, once it knows them
        self.verdicts = Verdicts()  # first decisions' memory (router.core.decide), per fleet shape
        self.skipped: list[str] = []  # the entries left out of the fleet and why (rule 4)

    def read(self) -> boxes_config.BoxesFile:
        """The boxes file, its boxes checked (rules 3-4): a box that is this router is left out
        and said. Raises ConfigError with one line."""
        loaded = self.registry.load()
        skipped = list(loaded.skipped)
        if self.listening is not None:
            kept = []
            for number, box in enumerate(loaded.boxes, 1):
                if self.listening.named_by(box):
                    skipped.append(f"{self.registry.where}, entry {number}: {NamesThisRouter(number, box)}")
                else:
                    kept.append(box)
            loaded.boxes = kept
        for line in skipped:
            if line not in self.skipped:
                log.warning("%s: skipped, the rest applies", line)
        self.skipped = skipped
        return loaded

    def _file_stamp(self) -> object:
        return self.registry.stamp()

    async def start(self) -> None:
        """Loads the file, starts every link and waits (bounded) for their first reads."""
        self._stamp = self._file_stamp()
        loaded = self.read()
        self.aliases = loaded.aliases
        fresh = self._apply(loaded.boxes)
        await asyncio.gather(*(self.links[name].first_read() for name in fresh))
        self._watch = asyncio.create_task(self._watch_file(), name="boxes-file")

    async def first_read(self, name: str) -> None:
        """Returns once box `name`'s link has read the box once (its first probe, and for a box
        that answered its first inventory read, in or failed: link.py rule 1), bounded as at
        start: a box just added through the admin API takes calls as soon as its answer says it
        was added, whichever of the edit's own reload and the file watch started its link. A link
        that has tried its inventory already is not waited for again."""
        link = self.links.get(name)
        if link is not None and not link.inventory_tried.is_set():
            await link.first_read()

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
                    current.reconfigure(cfg, order)
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
        self.verdicts.clear()
        for callback in self.on_change:
            callback()
        return started

    async def _watch_file(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                stamp = await loop.run_in_executor(None, self._file_stamp)  # file I/O off the loop
                if stamp != self._stamp:
                    await self.reload()
            except Exception:  # a bug: said with its traceback, and the watch goes on (rule 3)
                log.exception("boxes file watch: reload failed")

    async def reload(self) -> bool:
        """Re-reads the boxes file now and applies it (rules 1 and 3). A file that is gone or
        does not validate is logged and leaves the fleet as it is. Returns whether it applied."""
        loop = asyncio.get_running_loop()
        async with self._reloading:
            stamp = self._stamp = await loop.run_in_executor(None, self._file_stamp)
            if stamp is None:
                if self.boxes:
                    log.warning("%s is gone: the last fleet (%d boxes) keeps serving; "
                                "write a file with no boxes for an empty fleet", self.registry.where, len(self.boxes))
                    return False
                loaded = boxes_config.BoxesFile(self.path)
            else:
                try:
                    loaded = await loop.run_in_executor(None, self.read)
                except ConfigError as exc:
                    log.warning("%s: not applied, the last good fleet (%d boxes) keeps serving", exc,
                                len(self.boxes))
                    return False
            self.aliases = loaded.aliases
            self._apply(loaded.boxes)
            return True

    def facts(self) -> list[BoxFacts]:
        """The facts of every box, in boxes-file order, with live reservation counts."""
        count = self.reservations.count
        facts = []
        for box in self._ordered:  # a loop: a comprehension would make `count` a cell per call
            facts.append(box.facts(count(box.index)))
        return facts

    def get(self, name: str) -> BoxState | None:
        return self.boxes.get(name)

    def ordered(self) -> list[BoxState]:
        return list(self._ordered)
