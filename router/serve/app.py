"""The app: one callable per interface (ASGI `__call__`, RSGI `__rsgi__`), one dispatch.

Dispatch: the listener's mount names the facade that owns the path; the facade's table says
whether the route is model-bearing (the proxy path), a fleet answer (the router answers from its
own view), a wrong method (405) or unknown (404, or what the engine itself answers). Every answer
the router writes itself takes the facade's shape.
"""

from __future__ import annotations

import asyncio
import logging
import re

from pathlib import Path

from router._fastpath import Reservations
from router.boxes.fleet import Fleet
from router.core.access import Verdict
from router.core.bounds import clip
from router.core.memo import Memo
from router.facades import mounts, ollama
from router.facades.mounts import Mount
from router.facades.table import Body, Facade, Route, with_aliases
from router.fleetwide.seam import ONE_ROUTER_SLOTS, Slots
from router.fleetwide.several import SeveralRouters
from router.serve import admin
from router.serve.access import AccessGate
from router.serve.admission import Admission
from router.serve.affinity import Affinity
from router.serve.edge import AsgiEdge, Edge, RsgiEdge
from router.serve.event_feed import EventFeed
from router.serve.metrics import Metrics, registry as metrics_registry
from router.serve.clock import CallClock
from router.serve.deliver import RelayAborted
from router.serve.proxy import ProxyCall
from router.serve.limits import KeyCollector, Tenancy
from router.serve.record import CallRecord
from router.serve.settings import ServeConfig
from router.store.counters import LocalCounters
from router.store.keys import KeyStore
from router.store.route_log import RouteLogWriter, Row
from router.telemetry.scheduler import Scheduler

log = logging.getLogger("router.serve")

JSON = b"application/json"
# A Host header a refusal may repeat (`RouterApp.url_of`): a host name or an address, and a
# port; nothing else a client could slip into the answer.
HOST_RE = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253})(?::[0-9]{1,5})?")
BODY_JSON = Body.JSON  # read per call: a module name is cheaper than the Enum's (core/lifecycle.py)


def _routing(asked: tuple[Mount, bool, str, str]) -> tuple[Facade, tuple | None, Route | None, bool]:
    """What a request reaches on a listener (its mount, whether the router's own routes live
    there) by (method, path): the facade that owns the path, the router's own route (handler,
    scope) or None, the facade's route or None, and whether the path is known (a 405, not a 404).
    Pure: the tables are made at import."""
    mount, own_routes, method, path = asked
    facade = mount(path)
    route, known = facade.route(method, path)
    return facade, admin.route(method, path) if own_routes else None, route, known


# _routing remembered: a seen (method, path) costs a dict look-up, not three frames. Bounded:
# clients choose the paths.
ROUTING = Memo(_routing, 1024)


class ProcessState:
    """What every listener of the process shares: the fleet, the reservation table, the
    scheduler, the store (route log, keys), the access gate, the metrics, the limits, the
    settings (`config`, serve/settings.py), and the clock that keeps the deadlines of the calls
    in flight (started and stopped by the server)."""

    def __init__(self, fleet: Fleet, reservations: Reservations, scheduler: Scheduler, *,
                 store_path: Path, route_log: RouteLogWriter, keys: KeyStore, config: ServeConfig,
                 affinity: Affinity | None = None, several: SeveralRouters | None = None) -> None:
        self.config = config
        self.fleet = fleet
        self.reservations = reservations
        self.scheduler = scheduler
        self.store_path = store_path
        self.route_log = route_log
        self.keys = keys
        self.access = AccessGate(keys)
        self.metrics = Metrics()
        self.admission = Admission(fleet, config.queue_size, config.queue_timeout_s, config.queue_per_caller)
        # several routers on one shared server (fleetwide/several.py; None: this router alone): its
        # engines go to the pieces that meet them, the call never asks which (fleetwide/seam.py)
        self.several = several
        # a default limit of 0 is none
        self.tenancy = Tenancy(keys, LocalCounters() if several is None else several.tallies, self.admission,
                               default_rpm=config.default_rpm or None, default_tpm=config.default_tpm or None,
                               default_max_tokens=config.default_max_tokens)
        # the budgets are seeded again when the shared server is back (a restarted one lost them)
        self.slots: Slots = (ONE_ROUTER_SLOTS if several is None
                             else several.slots(self.admission.freed, self.stats, self.tenancy.seeded.clear))
        self.events = EventFeed(self, config.max_event_streams)  # the admin event streams' one producer
        self.tracer = None  # a tracing.CallTracer, set by the server when tracing is on
        self.database = None  # a router.store.pg.listen.Listener while the store is PostgreSQL
        self.batches = None  # the BatchRunner (serve/batches.py), set by the server: it needs an app
        self.scraped = metrics_registry(self.metrics, fleet, reservations, route_log, self.admission)
        self.affinity = affinity if affinity is not None else Affinity(fleet=fleet)
        self.scraped.register(self.affinity)
        if several is not None:
            self.scraped.register(self.slots)
        self.scraped.register(KeyCollector(self.tenancy))
        self.clock = CallClock(self.admission.sweep)
        self.in_flight = 0
        # client port (as the interface gives it) -> requests in flight from it: the connection
        # cap never closes those connections (serve/conn_cap.py rule 2)
        self.working_ports: dict[str | int, int] = {}
        # listener name ("router", "ollama", "lmstudio") -> its port, and their scheme, set by the
        # server: a refusal that points a client at another listener names it (`RouterApp.unknown`)
        self.ports: dict[str, int] = {}
        self.scheme = "http"
        self.stopping = asyncio.Event()  # set at stop: the admin event streams end
        self.idle = asyncio.Event()
        self.idle.set()

    def stats(self) -> dict:
        """This router's figures for the other routers (its heartbeat's doc)."""
        return {"calls": sum(self.metrics.calls.values()), "in_flight": self.in_flight}


class RouterApp:
    """One listener's app: the process state plus the mount that maps paths to facades."""

    def __init__(self, process: ProcessState, mount: Mount) -> None:
        self.process = process
        self.mount = mount
        # The router's own routes (admin API, metrics) live on the main listener only.
        self.admin = mount is mounts.main
        # The proxy reads these per call; bound here once.
        self.fleet = process.fleet
        self.reservations = process.reservations
        self.clock = process.clock
        self.admission = process.admission
        self.tenancy = process.tenancy
        self.access = process.access
        self.scheduler = process.scheduler
        self.affinity = process.affinity
        self.config = process.config  # the settings (serve/settings.py): `app.config.first_byte_timeout_s`
        self.fallbacks = process.metrics.fallbacks  # an alias call's moves (serve/aliases.py)
        self.slots = process.slots

    # -- interfaces ----------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            await self.dispatch(AsgiEdge(scope, receive, send))

    async def __rsgi__(self, scope, proto) -> None:
        if scope.proto == "http":
            await self.dispatch(RsgiEdge(scope, proto))

    # -- dispatch ------------------------------------------------------------------------------
    async def dispatch(self, edge: Edge) -> None:
        facade, owned, route, known = ROUTING[(self.mount, self.admin, edge.method, edge.path)]
        process = self.process
        process.in_flight += 1
        if process.in_flight == 1:  # idle is set exactly while nothing is in flight
            process.idle.clear()
        working, port = process.working_ports, edge.port
        working[port] = working.get(port, 0) + 1
        try:
            if owned is not None:
                handler, scope = owned
                if scope == "public" or (verdict := self.access.check(edge, scope)).ok:
                    await handler(self, edge)
                else:
                    await self.refuse(edge, facade, verdict)
                return
            if route is not None and not (verdict := self.access.check(edge, route.scope,
                                                                        json_body=route.body is BODY_JSON)).ok:
                await self.refuse(edge, facade, verdict)
                return
            if route is None:
                await self.unknown(edge, facade, known)
            elif route.answer is not None:
                await self.answer(edge, facade, route)
            else:
                await ProxyCall(self, edge, facade, route).run()
        except RelayAborted:
            raise  # the server aborts the connection: a cut answer must not look complete
        except Exception as exc:  # a bug: answer 500 if we still can, never the details
            log.exception("call failed inside the router: %s", type(exc).__name__)
            try:
                body = facade.shape_error(500, "router_error", "internal router error", None)
                await edge.respond(500, [(b"content-type", JSON)], body)
            except Exception:
                pass
        finally:
            process.in_flight -= 1
            if process.in_flight == 0:
                process.idle.set()
            left = working[port] - 1
            if left:
                working[port] = left
            else:
                del working[port]

    async def refuse(self, edge: Edge, facade: Facade, verdict: Verdict) -> None:
        """The access gate's 401/403/415 (access.check; a check is no coroutine, so an allowed
        call pays none), in the facade's shape."""
        body = facade.shape_error(verdict.status, verdict.code, verdict.message, None)
        await edge.respond(verdict.status, [(b"content-type", JSON)], body)

    def observe(self, record: CallRecord) -> Row:
        """A call ended: its route_log row (returned), its span when tracing is on, and its metrics."""
        process = self.process
        row = record.row()
        process.route_log.record(row)
        if process.tracer is not None:  # tracing off: this check is all a call pays
            process.tracer.record(record, row)
        process.metrics.observe(record)
        return row

    async def unknown(self, edge: Edge, facade: Facade, known: bool) -> None:
        """A path no route of the listener serves: a 404 that says where the client meant to go
        when the path says it (mounts.py: an Ollama client, a base URL without its `/v1`), else
        the facade's answer to an unknown route (404, 405, or the engine's own)."""
        if mounts.ollama_call(facade, edge.method, edge.path):
            # in Ollama's shape whatever the facade: the Ollama client then raises its ResponseError
            body = ollama.shape_error(404, "unknown_route", self.ollama_hint(edge), None)
            await edge.respond(404, [(b"content-type", JSON)], body)
            return
        if not known and (meant := mounts.meant_under_v1(self.mount, edge.path)) is not None:
            message = (f"{edge.method} {clip(edge.path)} is not a route of this router: did you mean {meant}? "
                       "(the OpenAI API is under /v1: a client's base URL ends in /v1)")
            await edge.respond(404, [(b"content-type", JSON)], facade.shape_error(404, "unknown_route", message, None))
            return
        if facade.unknown is not None:
            status, body = facade.unknown(edge.method, edge.path)
        else:
            status, code = (405, "method_not_allowed") if known else (404, "unknown_route")
            message = f"{edge.method} {clip(edge.path)} is not a route of this router"
            body = facade.shape_error(status, code, message, None)
        await edge.respond(status, [(b"content-type", JSON)], body)

    def ollama_hint(self, edge: Edge) -> str:
        """Where an Ollama client goes: the router's Ollama listener, else its main port (which
        serves Ollama's `/api/*` too) and the flag that adds a listener of Ollama's own."""
        ports = self.process.ports
        said = f"{edge.method} {clip(edge.path)} is not a route here: it is Ollama's API"
        if "ollama" in ports:
            listener = self.url_of(edge, ports["ollama"])
            return f"{said}; point the Ollama client at {listener} (the router's Ollama listener)"
        main = f" {self.url_of(edge, ports['router'])}" if "router" in ports else ""
        return (f"{said}; point the Ollama client at the router's main port{main} (its /api/*, not under /v1), "
                "or start the router with --ollama-port 11434 for a listener of Ollama's own")

    def url_of(self, edge: Edge, port: int) -> str:
        """This router's listener on `port` as the client reached the router: the host of its
        `Host` header when that is a plain host name or address, else this machine's loopback."""
        found = HOST_RE.fullmatch(edge.header("host") or "")
        return f"{self.process.scheme}://{found.group(1) if found else '127.0.0.1'}:{port}"

    async def answer(self, edge: Edge, facade: Facade, route: Route) -> None:
        boxes = [
            box
            for box in self.fleet.ordered()
            if box.online and not box.config.blocked and box.config.kind in facade.kinds
        ]
        status, content_type, body = route.answer(boxes, edge.path)  # type: ignore[misc]
        if route.aliases is not None and self.fleet.aliases:
            body = with_aliases(body, route.aliases, self.fleet.aliases.values())
        await edge.respond(status, [(b"content-type", content_type)], b"" if edge.method == "HEAD" else body)
