"""What the operator sees: the fleet's state document, the dashboard's event stream and the
dashboard's files (`GET /ui`).

Rules:
1. The files under `ui/` are read once, at import, and served from memory: a shell of HTML, CSS
   and JS with no data in it, so it is served to anyone (a browser cannot send a key with a
   page load), with a Content-Security-Policy that allows only this origin and no inline script.
2. Everything the page shows comes from `GET /v1/router/events`, an admin route: loopback
   without a key, anyone else with an admin key that the page sends as `Authorization: Bearer`
   (read with fetch(), since EventSource cannot send a header). It is read-only.
3. The stream (event_feed.py: one producer for every stream) is server-sent events: `state` (the same document as `GET /v1/router/state`) and
   `calls` (new route-log rows) every `STREAM_TICK_S`; `series` (the per-box one-second points of
   metrics.CallSeries, the whole history first); `schedule:priority` for each scheduler snapshot
   as it is published. A box that goes offline is shown within one tick, under the health
   interval of its link (boxes.link.HEALTH_INTERVAL_S). The stream ends when the client leaves
   or the router stops.
4. A route-log row on the stream carries metadata only: ids, facade, model and settings, box,
   status, attempts and refusals, times, the router that served it. The store holds no prompt
   or body to begin with.
5. Reading the route log is a store read (SQLite or PostgreSQL): it runs in a worker thread,
   never on the event loop.
6. The batches panel lists the batches from `GET /v1/batches` (a use route, whose admin caller
   sees every owner's), polled by the page, which works out each live batch's lines per second
   from successive polls; the state document's `batches` adds this router's batch lines in
   flight and its lines by state since start (metrics.BatchCollector's counts).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable

import orjson

from router.core.batches import LINE_STATES
from router.core.names import ollama_key
from router.core.types import BoxKind
from router.serve import fleet_views
from router.serve.alias_admin import alias_views

UI_DIR = Path(__file__).parent / "ui"
UI_FILES = {
    "/ui": ("index.html", b"text/html; charset=utf-8"),
    "/ui/": ("index.html", b"text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", b"text/css; charset=utf-8"),
    "/ui/favicon.svg": ("favicon.svg", b"image/svg+xml"),
}
_UI_BODIES = {path: (UI_DIR / name).read_bytes() for path, (name, _) in UI_FILES.items()}
UI_HEADERS = (
    (b"cache-control", b"no-cache"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy",
     b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
     b"base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
)

# Once a second: under a link's 2 s health interval, and what a person reads at.
STREAM_TICK_S = 1.0
# Route-log rows sent when the page connects, and at most per tick after (the newest win: a
# page is a view of the recent calls, not an export; GET /v1/telemetry pages through all).
TAIL_ROWS = 100
TAIL_COLUMNS = (
    "id", "request_id", "facade", "route", "model", "options", "pin", "box", "http_status", "state",
    "error", "stream", "attempts", "received_at", "first_byte_at", "responded_at", "bytes_in", "bytes_out",
    "affinity", "router",
)
SSE_HEADERS = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))


async def ui(app, edge) -> None:
    content_type = UI_FILES[edge.path][1]
    await edge.respond_page(200, [(b"content-type", content_type), *UI_HEADERS], _UI_BODIES[edge.path])


def _resident(key: str, resident, box) -> dict:
    """A resident as 0.0.4 shows one (key, state, healthy, busy, last_used), plus `loading` and
    the settings this router last sent the box for it (`settings_sent`: whether it sent any)."""
    if resident.loading:
        state = "loading"
    elif not resident.healthy:
        state = "error"
    else:
        state = "serving" if resident.busy else "idle"
    return {"key": key, "state": state, "healthy": resident.healthy, "busy": resident.busy,
            "loading": resident.loading, "last_used": resident.last_used_s,
            "settings": box.contracts.get(key), "settings_sent": key in box.contracts}


def box_view(box) -> dict:
    """A box as GET /v1/boxes shows it: 0.0.4's fields (name, url, online, pool, blocked, with
    "" for no pool) always present, then this router's. Never the key."""
    cfg = box.config
    return {"name": cfg.name, "url": cfg.url, "online": box.online, "pool": cfg.pool or "",
            "blocked": cfg.blocked, "kind": cfg.kind.value, "store": cfg.store, "agent": cfg.agent,
            "has_key": cfg.key is not None, "max_inflight": cfg.max_inflight}


def state_doc(process) -> dict:
    """The fleet as the operator sees it (`GET /v1/router/state`, the dashboard's `state`): every
    box with 0.0.4's fields, its load, limits and back-offs, its residents with the settings this
    router last sent; the models, one row per model a caller can name (`model_rows`), with
    where each is resident; the aliases with their first available model; the wait queue."""
    now = asyncio.get_running_loop().time()
    boxes, contracts = [], []
    for box in process.fleet.ordered():
        cfg = box.config
        link = process.fleet.links.get(cfg.name)
        boxes.append({
            **box_view(box),
            "link": link.mode if link is not None else None,
            "health_age_s": round(now - box.last_ok_s, 1) if box.last_ok_s else None,
            "room_gpu": box.inventory.free_gpu_bytes,
            "models": len(box.catalog),
            "residents": [_resident(key, r, box) for key, r in sorted(box.residents.items())],
            "catalog_size": len(box.catalog),
            "free_gpu_bytes": box.inventory.free_gpu_bytes,
            "pressure": box.pressure,
            "pending": box.pending,
            "in_flight": box.in_flight,
            "max_inflight": box.limit,
            "limit_source": box.limit_source,
            "full": box.full,
            "unreachable": box.unreachable,
            "down": box.down or None,  # why its last health probe failed (link.py rule 4)
            "cooling": {key: {"seconds_left": round(max(until - now, 0.0), 3), "ceiling": ceiling}
                        for key, (until, ceiling) in box.cooling.items()},
            "placement_refusals": box.refusals,
            "reservations": process.reservations.count(box.index),
            "contracts": box.contracts,
            **fleet_views.box_state(box, link),
        })
        contracts.extend({"box": cfg.name, "model": model, "options": options}
                         for model, options in box.contracts.items())
    doc = {
        "generation": process.scheduler.generation,
        "boxes": boxes,
        "contracts": contracts,
        "models": model_rows(process.fleet.ordered()),
        "aliases": alias_views(process.fleet),
        "registry": {"where": process.fleet.registry.where, "skipped": process.fleet.skipped},  # fleet.py rule 4
        "queue": process.admission.snapshot(),
        "affinity": process.affinity.view(),
        "database": _database_view(process),
        "batches": _batches_view(process.batches),
    }
    if process.several is not None:  # several routers: the shared server, the routers seen
        doc["shared"] = process.several.view()
    return doc


def model_rows(boxes) -> list[dict]:
    """One row per model a caller can name, with the boxes it is resident on and can load on.
    An Ollama box keys its names by Ollama's rule (router.core.names rule 2: `tiny-llama` is
    `tiny-llama:latest`), the other kinds as written; another kind's name joins an Ollama key's
    row when that rule reads it as that key, since a call naming it reaches both. A row is
    called by the other kind's spelling (the one that reaches every box in it) and lists every
    spelling in `names`."""
    ollama_keys = {key for box in boxes if box.config.kind is BoxKind.OLLAMA for key in (*box.catalog, *box.residents)}
    rows: dict[str, dict] = {}  # an Ollama key, or another kind's name no Ollama box has
    for box in boxes:
        ollama = box.config.kind is BoxKind.OLLAMA
        for keys, where in ((box.catalog, "available_on"), (box.residents, "resident_on")):
            for key in keys:
                folded = key if ollama else ollama_key(key)
                row_id = folded if folded in ollama_keys else key
                row = rows.setdefault(row_id, {"model": None, "names": [], "resident_on": [], "available_on": []})
                if not ollama and row["model"] is None:
                    row["model"] = key
                if key not in row["names"]:
                    row["names"].append(key)
                if box.config.name not in row[where]:
                    row[where].append(box.config.name)
    for row_id, row in rows.items():
        row["model"] = row["model"] or row_id
        row["names"].sort()
    return sorted(rows.values(), key=lambda row: row["model"])


def _batches_view(runner) -> dict | None:
    """This router's batch lines (rule 6); None before the server made the runner."""
    if runner is None:
        return None
    return {"inflight": runner.inflight, "lines": {state: runner.lines_total[state] for state in LINE_STATES}}


def _database_view(process) -> dict:
    """Where the store is, whether it answers, and the route-log rows held back or lost while
    it did not (docs/several-routers.md)."""
    route_log = process.route_log
    held = {"route_log_parked": route_log.parked, "route_log_dropped_while_down": route_log.outage_dropped}
    if process.database is None:
        return {"engine": "sqlite", "up": True, **held}
    return {**process.database.view(), **held}


def route_log_tail(route_log, since: int, limit: int) -> list[dict]:
    """The newest `limit` rows after `since`, oldest first (rule 4), from the route log's store
    (router.store.route_log.RouteLogWriter.read). Raises route_log.ReadFailed."""
    return route_log.read(since, limit, tail=limit, columns=TAIL_COLUMNS)["rows"]


def sse_event(name: bytes, doc) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(doc) + b"\n\n"


def until_over(process, edge) -> tuple[asyncio.Event, Callable[[], None]]:
    """An event set when the client leaves or the router stops (an open stream must not hold
    up a stop for the whole grace period), and the function that ends the watch."""
    over = asyncio.Event()
    watcher = edge.watch_disconnect(over.set)
    stopping = asyncio.ensure_future(process.stopping.wait())
    stopping.add_done_callback(lambda _: over.set())

    def end() -> None:
        watcher.cancel()
        stopping.cancel()

    return over, end


async def next_snapshot(queue: asyncio.Queue, gone: asyncio.Event, timeout_s: float | None):
    """The next item of `queue` (a scheduler snapshot, a stream's frame); None once `gone` is set
    or `timeout_s` passed."""
    getter = asyncio.ensure_future(queue.get())
    left = asyncio.ensure_future(gone.wait())
    await asyncio.wait({getter, left}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    left.cancel()
    if getter.done():
        return getter.result()
    getter.cancel()
    return None
