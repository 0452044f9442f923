"""The app: one callable per interface (ASGI `__call__`, RSGI `__rsgi__`), one dispatch.

Dispatch: the listener's mount names the facade that owns the path; the facade's table says
whether the route is model-bearing (the proxy path), a fleet answer (the router answers from its
own view), a wrong method (405) or unknown (404, or what the engine itself answers). Every answer
the router writes itself takes the facade's shape.
"""

from __future__ import annotations

import asyncio
import logging

from router._fastpath import Reservations
from router.boxes.fleet import Fleet
from router.facades.mounts import Mount
from router.facades.table import Facade, Route
from router.serve.edge import AsgiEdge, RsgiEdge
from router.serve.proxy import ProxyCall
from router.telemetry.scheduler import Scheduler

log = logging.getLogger("router.serve")

JSON = b"application/json"


class Shared:
    """What every listener of the process shares: the fleet, the reservation table, limits."""

    def __init__(self, fleet: Fleet, reservations: Reservations, scheduler: Scheduler, *,
                 max_body_bytes: int, first_byte_timeout_s: float) -> None:
        self.fleet = fleet
        self.reservations = reservations
        self.scheduler = scheduler
        self.max_body_bytes = max_body_bytes
        self.first_byte_timeout_s = first_byte_timeout_s
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()


class RouterApp:
    """One listener's app: the shared state plus the mount that maps paths to facades."""

    def __init__(self, shared: Shared, mount: Mount) -> None:
        self.shared = shared
        self.mount = mount
        # The proxy reads these per call; bound here once.
        self.fleet = shared.fleet
        self.reservations = shared.reservations
        self.scheduler = shared.scheduler
        self.max_body_bytes = shared.max_body_bytes
        self.first_byte_timeout_s = shared.first_byte_timeout_s

    # -- interfaces ----------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            await self.dispatch(AsgiEdge(scope, receive, send))

    async def __rsgi__(self, scope, proto) -> None:
        if scope.proto == "http":
            await self.dispatch(RsgiEdge(scope, proto))

    # -- dispatch ------------------------------------------------------------------------------
    async def dispatch(self, edge) -> None:
        shared = self.shared
        shared.in_flight += 1
        shared.idle.clear()
        facade = self.mount(edge.path)
        try:
            route, known = facade.route(edge.method, edge.path)
            if route is None:
                await self.unknown(edge, facade, known)
            elif route.answer is not None:
                await self.answer(edge, facade, route)
            else:
                await ProxyCall(self, edge, facade, route).run()
        except Exception as exc:  # a bug: answer 500 if we still can, never the details
            log.exception("call failed inside the router: %s", type(exc).__name__)
            try:
                body = facade.shape_error(500, "router_error", "internal router error", None)
                await edge.respond(500, [(b"content-type", JSON)], body)
            except Exception:
                pass
        finally:
            shared.in_flight -= 1
            if shared.in_flight == 0:
                shared.idle.set()

    async def unknown(self, edge, facade: Facade, known: bool) -> None:
        if facade.unknown is not None:
            status, body = facade.unknown(edge.method, edge.path)
        else:
            status, code = (405, "method_not_allowed") if known else (404, "unknown_route")
            message = f"{edge.method} {edge.path} is not a route of this router"
            body = facade.shape_error(status, code, message, None)
        await edge.respond(status, [(b"content-type", JSON)], body)

    async def answer(self, edge, facade: Facade, route: Route) -> None:
        boxes = [
            box
            for box in self.fleet.ordered()
            if box.online and not box.config.blocked and box.config.kind in facade.kinds
        ]
        status, content_type, body = route.answer(boxes, edge.path)  # type: ignore[misc]
        await edge.respond(status, [(b"content-type", content_type)], b"" if edge.method == "HEAD" else body)
