"""The operator's API (admin key, or loopback): the router's state, its schedule, the route
log cursor, keys, boxes, and a relay to each hugpy box's own management API.

Rules:
1. Every handler here is an admin route; the app checks access before calling it.
2. SQLite work (the route-log cursor, key changes) runs in a worker thread, never on the loop.
3. The relay reaches only the listed management prefixes of a hugpy box, with the box's key
   (which never leaves the router); a path with `..` or `.` segments, a backslash, or anything
   but visible ASCII once decoded (a `%0D%0A` would split the request line) is refused.
"""

from __future__ import annotations

import asyncio
import re
from typing import Awaitable, Callable

import apsw
import orjson

from router.core.errors import BadRequest
from router.core.types import BoxKind
from router.serve import dashboard
from router.serve.metrics import exposition
from router.store import db
from router.upstream.fetch import fetch
from router.upstream.pool import UpstreamError, safe_target

JSON = b"application/json"
CURSOR_LIMIT_MAX = 5000
RELAY_TIMEOUT_S = 60.0
# hugpy-wrapper's management prefixes a router operator may reach (contracts §2, §6).
RELAY_PREFIXES = (
    "v1/telemetry",
    "v1/settings/",
    "v1/operator/",
    "v1/cores",
    "v1/models",
    "storage",
)
_UNSAFE_PATH = re.compile(r"(^|/)\.\.?(/|$)|%2f|%2e|%5c|\\", re.IGNORECASE)

Handler = Callable[["object", "object"], Awaitable[None]]


async def _json(edge, status: int, doc) -> None:
    await edge.respond(status, [(b"content-type", JSON)], orjson.dumps(doc))


async def _error(app, edge, status: int, code: str, message: str) -> None:
    from router.facades.openai import shape_error

    await edge.respond(status, [(b"content-type", JSON)], shape_error(status, code, message, None))


def _query(edge) -> dict[str, str]:
    pairs = (part.partition("=") for part in edge.query.split("&") if part)
    return {k: v for k, _, v in pairs}


async def state(app, edge) -> None:
    await _json(edge, 200, dashboard.state_doc(app.shared))


async def schedule(app, edge) -> None:
    """`schedule:priority` server-sent events, one per published snapshot, until the client
    leaves or the router stops."""
    scheduler = app.shared.scheduler
    queue = scheduler.subscribe()
    gone, end_watch = dashboard.until_over(app.shared, edge)
    try:
        await edge.start(200, list(dashboard.SSE_HEADERS))
        while (snapshot := await dashboard.next_snapshot(queue, gone, None)) is not None:
            await edge.write(dashboard.sse_event(b"schedule:priority", snapshot.to_event()))
        await edge.finish()
    finally:
        end_watch()
        scheduler.unsubscribe(queue)


def _read_route_log(path, since: int, limit: int) -> dict:
    conn = db.connect(path)
    # Rows as dicts, named while the statement runs (an empty result has no description after).
    conn.row_trace = lambda cursor, row: dict(zip((d[0] for d in cursor.get_description()), row))
    try:
        rows = list(conn.execute(
            "SELECT * FROM route_log WHERE id > ? ORDER BY id LIMIT ?", (since, limit + 1)
        ))
    finally:
        conn.close()
    for row in rows:
        for column in ("decision", "attempts"):
            if isinstance(row.get(column), str):
                row[column] = orjson.loads(row[column])
    more = len(rows) > limit
    rows = rows[:limit]
    return {"table": "route_log", "rows": rows, "next": rows[-1]["id"] if rows else since, "more": more}


async def telemetry(app, edge) -> None:
    query = _query(edge)
    try:
        since = int(query.get("since", "0"))
        limit = max(1, min(CURSOR_LIMIT_MAX, int(query.get("limit", "100"))))
    except ValueError:
        await _error(app, edge, 400, "bad_query", "since and limit must be numbers")
        return
    loop = asyncio.get_running_loop()
    try:
        doc = await loop.run_in_executor(None, _read_route_log, app.shared.store_path, since, limit)
    except apsw.Error as exc:
        await _error(app, edge, 503, "store_unavailable", f"route log unreadable: {type(exc).__name__}")
        return
    await _json(edge, 200, doc)


async def keys(app, edge) -> None:
    store = app.shared.keys
    loop = asyncio.get_running_loop()
    if edge.method == "GET":
        listed = await loop.run_in_executor(None, store.list, _query(edge).get("all") == "1")
        await _json(edge, 200, {"keys": listed})
        return
    try:
        doc = orjson.loads(await edge.read_body(64 * 1024) or b"{}")
        if not isinstance(doc, dict):
            raise BadRequest("body must be a JSON object")
        key_id, key = await loop.run_in_executor(
            None, store.create, doc.get("name", ""), doc.get("scope", "use"), doc.get("expires_days"), "api"
        )
    except (BadRequest, orjson.JSONDecodeError) as exc:
        await _error(app, edge, 400, getattr(exc, "code", "invalid_request"), str(exc))
        return
    rows = await loop.run_in_executor(None, store.list, True)
    row = next(r for r in rows if r["id"] == key_id)
    await _json(edge, 201, {**row, "key": key, "note": "store this key now; it is not shown again"})


async def revoke(app, edge) -> None:
    key_id = edge.path.removeprefix("/v1/keys/").removesuffix("/revoke")
    revoked = await asyncio.get_running_loop().run_in_executor(None, app.shared.keys.revoke, key_id)
    if not revoked:
        await _error(app, edge, 404, "not_found", f"no key {key_id}")
        return
    await _json(edge, 200, {"id": key_id, "revoked": True})


async def boxes(app, edge) -> None:
    listed = [
        {k: v for k, v in box.config.to_json().items() if k != "key"} | {"has_key": box.config.key is not None}
        for box in app.shared.fleet.ordered()
    ]
    await _json(edge, 200, {"boxes": listed})


async def relay(app, edge) -> None:
    rest = edge.path.removeprefix("/v1/boxes/")
    name, _, path = rest.partition("/")
    box = app.shared.fleet.get(name)
    if box is None:
        await _error(app, edge, 404, "unknown_box", f"no box {name}")
        return
    relayed = safe_target("/" + path) and not _UNSAFE_PATH.search(path) and path.startswith(RELAY_PREFIXES)
    if box.config.kind is not BoxKind.HUGPY or not relayed:
        await _error(app, edge, 403, "not_relayed", f"/{path} is not a relayed management path")
        return
    body = await edge.read_body(app.shared.max_body_bytes)
    target = "/" + path + ("?" + edge.query if edge.query else "")
    content_type = edge.header("content-type")
    headers = box.auth_header + (f"Content-Type: {content_type}\r\n".encode("latin-1") if content_type else b"")
    try:
        status, exchange, data = await fetch(
            box.origin, edge.method, target, headers=headers, body=body, timeout_s=RELAY_TIMEOUT_S
        )
    except UpstreamError as exc:
        await _error(app, edge, 502, exc.refusal, f"box {name} did not answer")
        return
    answer_type = exchange.header(b"content-type") or JSON
    await edge.respond(status, [(b"content-type", answer_type), (b"x-hugpy-box", name.encode())], data)


async def metrics(app, edge) -> None:
    body, content_type = exposition(app.shared.scraped, edge.header("accept"))
    await edge.respond(200, [(b"content-type", content_type)], body)


EXACT: dict[tuple[str, str], Handler] = {
    ("GET", "/v1/router/state"): state,
    ("GET", "/v1/router/schedule"): schedule,
    ("GET", "/v1/telemetry"): telemetry,
    ("GET", "/v1/keys"): keys,
    ("POST", "/v1/keys"): keys,
    ("GET", "/v1/boxes"): boxes,
    ("GET", "/metrics"): metrics,
    ("GET", "/v1/router/events"): dashboard.events,
    **{("GET", path): dashboard.ui for path in dashboard.UI_FILES},
}


def route(method: str, path: str) -> tuple[Handler, str] | None:
    """(handler, access scope) for a router-owned route, or None. `/metrics` is a use route:
    scrapers inside the trusted nets need no key. The dashboard's files are `public`: they hold
    no data (dashboard.py rule 1), and what they show comes from an admin route."""
    handler = EXACT.get((method, path))
    if handler is not None:
        return handler, ("use" if handler is metrics else "public" if handler is dashboard.ui else "admin")
    if method == "POST" and path.startswith("/v1/keys/") and path.endswith("/revoke"):
        return revoke, "admin"
    if path.startswith("/v1/boxes/"):
        return relay, "admin"
    return None
