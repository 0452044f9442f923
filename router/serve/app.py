"""The app: one callable per interface (ASGI `__call__`, RSGI `__rsgi__`), one dispatch.

Dispatch: the facade owns the path; its table says whether the route is model-bearing (the
proxy path), a fleet answer (the router answers itself), a wrong method (405) or unknown
(404). Every answer the router writes itself takes the facade's error shape.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from router import __version__
from router._fastpath import Reservations
from router.boxes.fleet import Fleet
from router.facades import openai
from router.facades.table import Facade
from router.serve.edge import AsgiEdge, RsgiEdge
from router.serve.proxy import ProxyCall

log = logging.getLogger("router.serve")


class RouterApp:
    def __init__(
        self,
        fleet: Fleet,
        reservations: Reservations,
        *,
        max_body_bytes: int,
        first_byte_timeout_s: float,
    ) -> None:
        self.fleet = fleet
        self.reservations = reservations
        self.max_body_bytes = max_body_bytes
        self.first_byte_timeout_s = first_byte_timeout_s
        # The scheduler's snapshot generation that new reservations are stamped with; no
        # snapshot is published yet, so every reservation counts until its call ends.
        self.generation = 0
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.answers = {"models": self.models_answer, "health": self.health_answer}

    # -- interfaces ----------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            await self.dispatch(AsgiEdge(scope, receive, send))

    async def __rsgi__(self, scope, proto) -> None:
        if scope.proto == "http":
            await self.dispatch(RsgiEdge(scope, proto))

    # -- dispatch ------------------------------------------------------------------------------
    def facade_for(self, path: str) -> Facade:
        return openai.FACADE

    async def dispatch(self, edge) -> None:
        self.in_flight += 1
        self.idle.clear()
        facade = self.facade_for(edge.path)
        try:
            route, known = facade.route(edge.method, edge.path)
            if route is None:
                status, code = (405, "method_not_allowed") if known else (404, "unknown_route")
                message = f"{edge.method} {edge.path} is not a route of this router"
                body = facade.shape_error(status, code, message, None)
                await edge.respond(status, [(b"content-type", b"application/json")], body)
            elif route.answer is not None:
                await self.answers[route.answer](edge)
            else:
                await ProxyCall(self, edge, facade, route).run()
        except Exception as exc:  # a bug: answer 500 if we still can, never the details
            log.exception("call failed inside the router: %s", type(exc).__name__)
            try:
                body = facade.shape_error(500, "router_error", "internal router error", None)
                await edge.respond(500, [(b"content-type", b"application/json")], body)
            except Exception:
                pass
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    # -- the router's own answers --------------------------------------------------------------
    async def models_answer(self, edge) -> None:
        boxes = [
            (box.name, box.catalog, frozenset(box.residents))
            for box in self.fleet.ordered()
            if box.online and not box.config.blocked
        ]
        body = openai.models_answer(boxes)
        await edge.respond(200, [(b"content-type", b"application/json")], body)

    async def health_answer(self, edge) -> None:
        boxes = self.fleet.ordered()
        body = orjson.dumps(
            {
                "status": "ok",
                "service": "router",
                "version": __version__,
                "boxes": len(boxes),
                "online": sum(1 for box in boxes if box.online),
            }
        )
        await edge.respond(200, [(b"content-type", b"application/json")], body)
