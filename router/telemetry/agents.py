"""One AgentLink per box whose boxes-file entry names a `router agent`, kept in step with the
fleet: a box added with `--agent` gets a link, a removed box or a changed agent URL loses it."""

from __future__ import annotations

import asyncio

from router.boxes.fleet import Fleet
from router.telemetry.agent import AgentLink
from router.telemetry.cache import TelemetryCache


class AgentLinks:
    def __init__(self, fleet: Fleet, cache: TelemetryCache) -> None:
        self.fleet = fleet
        self.cache = cache
        self.links: dict[str, AgentLink] = {}
        fleet.on_change.append(self.sync)

    def sync(self) -> None:
        wanted = {box.name: box.config.agent for box in self.fleet.ordered() if box.config.agent}
        loop = asyncio.get_running_loop()
        for name, link in list(self.links.items()):
            if wanted.get(name) != link.url:
                loop.create_task(self.links.pop(name).stop())
        for name, url in wanted.items():
            if name not in self.links:
                link = AgentLink(url, name, self.cache)
                link.start()
                self.links[name] = link

    async def stop(self) -> None:
        await asyncio.gather(*(link.stop() for link in self.links.values()))
        self.links.clear()
