"""The operator's API (admin key, or loopback): the router's state, its schedule, the route
log cursor, keys, boxes, and a relay to each hugpy box's own management API.

Rules:
1. Every handler here is an admin route; the app checks access before calling it.
2. SQLite work (the route-log cursor, key changes) runs in a worker thread, never on the loop.
3. Bad input is a 400 (413 for a body over its limit, 415 for a JSON body sent as anything but
   `application/json`, 408 for a body that does not arrive within `body.BODY_TIMEOUT_S`, as for
   a proxied call) in the OpenAI error shape, never a 500.
4. The relay reaches only the listed management paths of a hugpy box, with the box's key
   (which never leaves the router). The path, as the server decoded it once, is split into
   segments and must start with one of `RELAY_PATHS` segment for segment (`v1/telemetryX` is
   not `v1/telemetry`); a `.` or `..` segment, a backslash, or anything but visible ASCII (a
   `%0D%0A` would split the request line) is refused. Each segment is percent-encoded again on
   the way out, so the box decodes exactly what was judged: a `%3F` stays in the path, never
   becoming a query, and nothing is decoded twice. Methods: `RELAY_METHODS`; a `HEAD` answers
   as soon as the box's head arrives.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Awaitable, Callable, Protocol
from urllib.parse import quote, unquote

import orjson
from prometheus_client import CollectorRegistry

from router.boxes import config as boxes_config
from router.boxes.fleet import Fleet
from router.boxes.listeners import check_peers
from router.core import access
from router.core.errors import BadRequest, ConfigError
from router.core.kinds import Capability, can
from router.core.types import BoxKind
from router.facades.openai import shape_error
from router.serve import alias_admin, batch_api, dashboard, event_feed, fleet_views
from router.serve.body import BodyTimeout, body_deadline, read_body, refusal
from router.serve.clock import CallClock
from router.serve.dashboard import box_view
from router.serve.edge import BodyTooLarge, ClientLeft, Edge
from router.serve.metrics import exposition
from router.serve.settings import ServeConfig
from router.store import route_log
from router.serve.limits import Tenancy
from router.store.keys import KeyStore
from router.upstream.fetch import fetch
from router.upstream.pool import UpstreamError, safe_target


class AdminState(Protocol):
    """What the admin routes read of the process's state (app.py's `ProcessState`)."""

    fleet: Fleet
    keys: KeyStore
    tenancy: Tenancy
    clock: CallClock
    config: ServeConfig  # the settings (serve/settings.py)
    store_path: Path
    scraped: CollectorRegistry


class AdminApp(Protocol):
    """The app the admin routes are mounted in (app.py's `RouterApp`, which imports this module:
    a protocol, so that this module need not import it back)."""

    process: AdminState


JSON = b"application/json"
BOX_BODY_MAX_BYTES = 64 * 1024
# The fields of a box that POST /v1/boxes takes (the boxes file's, router.boxes.config).
BOX_FIELDS = ("name", "url", "kind", "key", "store", "pool", "agent", "blocked", "max_inflight")
CURSOR_LIMIT_MAX = 5000
# route_log ids are SQLite integers: a cursor past them is a bad query, not an overflow.
CURSOR_SINCE_MAX = (1 << 63) - 1
# A key request is a name, a scope and an expiry: a few hundred bytes.
KEYS_BODY_LIMIT = 64 * 1024
CURSOR_LIMIT_DEFAULT = 500  # 0.0.4's
RELAY_TIMEOUT_S = 60.0
# hugpy-wrapper's management paths a router operator may reach (contracts §2, §6), as segments.
# §11.3 adds the rest an orchestrator reads; `v1/keys` is never relayed (the box's key admin).
RELAY_PATHS = (
    ("v1", "telemetry"),
    ("v1", "settings"),
    ("v1", "operator"),
    ("v1", "cores"),
    ("v1", "models"),
    ("storage",),
    ("v1", "verdicts"),
    ("v1", "queue"),
    ("v1", "next-call"),
    ("v1", "requests"),
    ("v1", "facts"),
    ("v1", "station"),
    ("v1", "hashes"),
    ("v1", "drives"),
    ("limits",),
    ("profiles",),
    ("residents",),
)
RELAY_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"})
# What a relayed segment may hold once decoded: visible ASCII but the backslash.
_VISIBLE = frozenset(chr(c) for c in range(0x21, 0x7F)) - {"\\"}
# Percent-encoded again on the way out: everything but RFC 3986 unreserved and sub-delims.
_SEGMENT_SAFE = "!$&'()*+,;=:@"

Handler = Callable[[AdminApp, Edge], Awaitable[None]]


async def _json(edge, status: int, doc) -> None:
    await edge.respond(status, [(b"content-type", JSON)], orjson.dumps(doc))


async def _error(app: AdminApp, edge: Edge, status: int, code: str, message: str) -> None:
    await edge.respond(status, [(b"content-type", JSON)], shape_error(status, code, message, None))


async def _body(app: AdminApp, edge: Edge, limit: int) -> bytes | None:
    """The request body, up to `limit` bytes and within the body timeout (body.py, as for a
    proxied call); None once a refusal (408, 413, 400) has been answered (rule 3)."""
    deadline_s = body_deadline(asyncio.get_running_loop().time())
    try:
        return await read_body(edge, limit, deadline_s, app.process.clock)
    except (BodyTooLarge, BodyTimeout, ClientLeft) as exc:
        await _error(app, edge, *refusal(exc, limit))
    return None


async def _json_object(app: AdminApp, edge: Edge, limit: int) -> dict | None:
    """The request body as a JSON object (rule 3); None once a refusal has been answered."""
    if not access.is_json(edge.header("content-type")):
        verdict = access.NOT_JSON
        await _error(app, edge, verdict.status, verdict.code, verdict.message)
        return None
    body = await _body(app, edge, limit)
    if body is None:
        return None
    try:
        doc = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError:
        await _error(app, edge, 400, "invalid_json", "the body is not valid JSON")
        return None
    if not isinstance(doc, dict):
        await _error(app, edge, 400, "invalid_request", "the body must be a JSON object")
        return None
    return doc


def _query(edge: Edge) -> dict[str, str]:
    pairs = (part.partition("=") for part in edge.query.split("&") if part)
    return {k: v for k, _, v in pairs}


async def state(app: AdminApp, edge: Edge) -> None:
    await _json(edge, 200, dashboard.state_doc(app.process))


async def telemetry(app: AdminApp, edge: Edge) -> None:
    """The route-log cursor: `since` (after that id) and `limit`, oldest first as 0.0.4; or
    `tail=N`, the newest N rows (still oldest first, with `next` to follow on from)."""
    query = _query(edge)
    try:
        since = int(query.get("since", "0"))
        limit = max(1, min(CURSOR_LIMIT_MAX, int(query.get("limit", str(CURSOR_LIMIT_DEFAULT)))))
        tail = int(query["tail"]) if "tail" in query else None
    except ValueError:
        await _error(app, edge, 400, "bad_query", "since, limit and tail must be numbers")
        return
    if not 0 <= since <= CURSOR_SINCE_MAX:
        await _error(app, edge, 400, "bad_query", f"since must be 0 to {CURSOR_SINCE_MAX}")
        return
    if tail is not None and not 1 <= tail <= CURSOR_LIMIT_MAX:
        await _error(app, edge, 400, "bad_query", f"tail must be 1 to {CURSOR_LIMIT_MAX}")
        return
    loop = asyncio.get_running_loop()
    try:
        doc = await loop.run_in_executor(None, app.process.route_log.read, since, limit, tail)
    except route_log.ReadFailed as exc:
        await _error(app, edge, 503, "store_unavailable", f"route log unreadable: {exc}")
        return
    await _json(edge, 200, doc)


async def keys(app: AdminApp, edge: Edge) -> None:
    store = app.process.keys
    loop = asyncio.get_running_loop()
    if edge.method == "GET":
        try:
            listed = await loop.run_in_executor(None, store.list, _query(edge).get("all") == "1")
        except store.errors as exc:
            await _store_down(app, edge, exc)
            return
        await _json(edge, 200, {"keys": listed})
        return
    doc = await _json_object(app, edge, KEYS_BODY_LIMIT)
    if doc is None:
        return
    name, scope, expires_days = doc.get("name", ""), doc.get("scope", "use"), doc.get("expires_days")
    priority_class, limits = doc.get("priority", "normal"), doc.get("limits")
    if not isinstance(name, str) or not isinstance(scope, str) or not isinstance(priority_class, str):
        await _error(app, edge, 400, "invalid_request", "name, scope and priority must be strings")
        return
    if limits is not None and not isinstance(limits, dict):
        await _error(app, edge, 400, "invalid_limits", "limits must be a JSON object (docs/tenancy.md)")
        return
    if expires_days is not None and (isinstance(expires_days, bool) or not isinstance(expires_days, (int, float))):
        await _error(app, edge, 400, "invalid_expiry", "expires_days must be a number")
        return
    try:
        key_id, key = await loop.run_in_executor(
            None, store.create, name, scope, expires_days, "api", priority_class, limits
        )
        rows = await loop.run_in_executor(None, store.list, True)
    except BadRequest as exc:
        await _error(app, edge, 400, exc.code, str(exc))
        return
    except store.errors as exc:
        await _store_down(app, edge, exc)
        return
    row = next(r for r in rows if r["id"] == key_id)
    await _json(edge, 201, {**row, "key": key, "note": "store this key now; it is not shown again"})


async def priority(app: AdminApp, edge: Edge) -> None:
    """POST /v1/keys/<id>/priority {"priority": "high"|"normal"|"low"}: the key's class."""
    key_id = edge.path.removeprefix("/v1/keys/").removesuffix("/priority")
    doc = await _json_object(app, edge, KEYS_BODY_LIMIT)
    if doc is None:
        return
    wanted = doc.get("priority")
    if not isinstance(wanted, str):
        await _error(app, edge, 400, "invalid_priority", 'the body must be {"priority": "high" | "normal" | "low"}')
        return
    if await _change_key(app, edge, key_id, app.process.keys.set_priority, wanted):
        await _json(edge, 200, {"id": key_id, "priority": wanted})


async def limits(app: AdminApp, edge: Edge) -> None:
    """PUT /v1/keys/<id>/limits {"rpm": N, ..., "models": [...]}: changes the key's limits (a field
    absent kept, null removed), live from the next call (docs/tenancy.md)."""
    key_id = edge.path.removeprefix("/v1/keys/").removesuffix("/limits")
    doc = await _json_object(app, edge, KEYS_BODY_LIMIT)
    if doc is None:
        return
    if changed := await _change_key(app, edge, key_id, app.process.keys.set_limits, doc):
        await _json(edge, 200, {"id": key_id, "limits": changed.doc()})


async def usage(app: AdminApp, edge: Edge) -> None:
    """GET /v1/keys/<id>/usage (one key) and GET /v1/keys/usage (every live key): usage in the
    current and previous period, what is left of each limit, when it resets."""
    key_id = edge.path.removeprefix("/v1/keys/").removesuffix("usage").removesuffix("/")
    tenancy = app.process.tenancy
    docs = await asyncio.get_running_loop().run_in_executor(
        None, app.process.keys.usage_report, [key_id] if key_id else None, time.time())
    docs = [tenancy.with_left(doc) for doc in docs]
    if not key_id:
        await _json(edge, 200, {"keys": docs})
    elif docs:
        await _json(edge, 200, docs[0])
    else:
        await _error(app, edge, 404, "not_found", f"no key {key_id}")


async def revoke(app: AdminApp, edge: Edge) -> None:
    key_id = edge.path.removeprefix("/v1/keys/").removesuffix("/revoke")
    if await _change_key(app, edge, key_id, app.process.keys.revoke):
        await _json(edge, 200, {"id": key_id, "revoked": True})


async def _store_down(app: AdminApp, edge: Edge, exc: BaseException) -> None:
    """A key change or listing the store cannot take now (a database down): 503, calls go on."""
    await _error(app, edge, 503, "store_unavailable", f"the key store cannot be reached now: {type(exc).__name__}")


async def _change_key(app: AdminApp, edge: Edge, key_id: str, change, *args):
    """Runs `change(key_id, *args)` on the key store off the loop (rule 2); its result, or None
    once the client was answered: 400 for a bad value, 404 for no such key (a result of False
    or None)."""
    try:
        result = await asyncio.get_running_loop().run_in_executor(None, change, key_id, *args)
    except BadRequest as exc:
        await _error(app, edge, 400, exc.code, str(exc))
        return None
    except app.process.keys.errors as exc:
        await _store_down(app, edge, exc)
        return None
    if result is None or result is False:
        await _error(app, edge, 404, "not_found", f"no key {key_id}")
        return None
    return result


async def boxes(app: AdminApp, edge: Edge) -> None:
    process = app.process
    await _json(edge, 200, {"boxes": [box_view(box) for box in process.fleet.ordered()]})


async def _edit_boxes(app: AdminApp, edge: Edge, name: str, change, status: int = 200,
                      note: dict | None = None) -> None:
    """One boxes-file edit (router.boxes.config.edit: locked, atomic, the CLI's code path),
    off the loop; a box that is this router itself, or another router on its database
    (router.boxes.listeners rule 4), is refused before anything is written. The
    fleet applies the edit, and a new or re-linked box has been read once (bounded), before the
    answer, which shows the box (never its key) and `note`, which `change` may fill in."""
    process = app.process
    fleet = process.fleet

    def checked_edit():
        peers = fleet.registry.peers()  # any router on the database; read before the edit's lock

        def checked(boxes: boxes_config.BoxesFile):
            result = change(boxes)
            edited = [box] if (box := boxes.find(name)) is not None else []
            if fleet.listening is not None:
                fleet.listening.check(edited)
            check_peers(edited, peers)
            return result

        return fleet.registry.edit(checked)

    try:
        result = await asyncio.get_running_loop().run_in_executor(None, checked_edit)
    except boxes_config.UnknownBox as exc:
        await _error(app, edge, 404, "unknown_box", str(exc))
        return
    except ConfigError as exc:
        await _error(app, edge, 400, "invalid_box", str(exc))
        return
    except OSError as exc:  # a system unit's read-only /etc (ProtectSystem=strict); a database down
        await _error(app, edge, 503, "boxes_file_unwritable",
                     f"cannot write the {fleet.registry.where}: {exc.strerror or exc}")
        return
    await fleet.reload()
    box = fleet.get(name)
    if box is None:
        await _json(edge, status, {"name": name, "removed": True})
        return
    await fleet.first_read(name)
    await _json(edge, 201 if result is True else status, {**box_view(box), **(note or {})})


async def box_put(app: AdminApp, edge: Edge) -> None:
    """POST /v1/boxes: add a box, or replace the one of that name (201 added, 200 replaced)."""
    doc = await _json_object(app, edge, BOX_BODY_MAX_BYTES)  # never quoted: it may hold a key
    if doc is None:
        return
    try:
        wrong = sorted(set(doc) - set(BOX_FIELDS))
        if wrong:
            raise BadRequest(f"unknown fields: {', '.join(wrong)} (a box has {', '.join(BOX_FIELDS)})",
                             code="invalid_box")
        if not isinstance(doc.get("name"), str) or not isinstance(doc.get("url"), str):
            raise BadRequest("a box needs a string name and url", code="invalid_box")
        try:
            kind = BoxKind(doc.get("kind", BoxKind.HUGPY.value))
        except ValueError:
            raise BadRequest(f"kind must be one of {', '.join(k.value for k in BoxKind)}",
                             code="invalid_box") from None
        box = boxes_config.BoxConfig(
            name=doc["name"], url=doc["url"].rstrip("/"), kind=kind, key=doc.get("key"),
            store=doc.get("store"), pool=doc.get("pool") or None, agent=doc.get("agent"),
            blocked=doc.get("blocked", False), max_inflight=doc.get("max_inflight"),
        )
    except BadRequest as exc:
        await _error(app, edge, 400, exc.code, str(exc))
        return
    note: dict = {}

    def change(boxes: boxes_config.BoxesFile) -> bool:
        old = boxes.find(box.name)
        if old is not None and old.key and not box.key:  # never dropped without saying so
            note["key_dropped"] = True
        return boxes.put(box)

    await _edit_boxes(app, edge, box.name, change, note=note)


def _box_name(edge) -> str:
    return edge.path.removeprefix("/v1/boxes/").partition("/")[0]


async def box_delete(app: AdminApp, edge: Edge) -> None:
    """DELETE /v1/boxes/<name>."""
    name = _box_name(edge)
    await _edit_boxes(app, edge, name, lambda boxes: boxes.remove(name))


async def box_update(app: AdminApp, edge: Edge) -> None:
    """PUT /v1/boxes/<name>: change its pool, kind, store, agent, max_inflight or key (null
    clears one); every other field stays."""
    name = _box_name(edge)
    fields = await _json_object(app, edge, BOX_BODY_MAX_BYTES)
    if fields is None:
        return
    if "pool" in fields:
        fields["pool"] = fields["pool"] or None
    await _edit_boxes(app, edge, name, lambda boxes: boxes.update(name, **fields))


async def box_block(app: AdminApp, edge: Edge) -> None:
    """POST /v1/boxes/<name>/block and /unblock."""
    name = _box_name(edge)
    blocked = edge.path.endswith("/block")
    await _edit_boxes(app, edge, name, lambda boxes: boxes.update(name, blocked=blocked))


def relay_target(path: str, query: str) -> str | None:
    """The request target for the box for a relayed `path` (decoded once, without the leading
    `/`) and raw `query`, or None when rule 4 refuses it."""
    segments = path.split("/")
    if segments[-1] == "":
        segments.pop()  # one trailing slash is allowed, as hugpy allows it
    if not any(tuple(segments[:len(allowed)]) == allowed for allowed in RELAY_PATHS):
        return None
    for segment in segments:
        if segment in ("", ".", "..") or not _VISIBLE.issuperset(segment):
            return None
    target = "/" + "/".join(quote(segment, safe=_SEGMENT_SAFE) for segment in segments)
    if query:
        target += "?" + query
    return target if safe_target(target) else None


async def relay(app: AdminApp, edge: Edge) -> None:
    rest = edge.path.removeprefix("/v1/boxes/")
    name, _, path = rest.partition("/")
    box = app.process.fleet.get(name)
    if box is None:
        await _error(app, edge, 404, "unknown_box", f"no box {name}")
        return
    if edge.method not in RELAY_METHODS:
        await _error(app, edge, 405, "method_not_allowed", f"{edge.method} is not relayed")
        return
    target = relay_target(path, edge.query)
    if not can(box.config.kind, Capability.RELAY) or target is None:
        await _error(app, edge, 403, "not_relayed", "this is not a relayed management path")
        return
    body = await _body(app, edge, app.process.config.max_body_bytes)
    if body is None:
        return
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


async def metrics(app: AdminApp, edge: Edge) -> None:
    body, content_type = exposition(app.process.scraped, edge.header("accept"))
    await edge.respond(200, [(b"content-type", content_type)], body)


async def aliases(app: AdminApp, edge: Edge) -> None:
    await _json(edge, 200, {"aliases": alias_admin.alias_views(app.process.fleet)})


async def alias_edit(app: AdminApp, edge: Edge) -> None:
    """PUT /v1/aliases/<name> {"chain": [...]} and DELETE /v1/aliases/<name> (alias_admin.py)."""
    doc = None
    if edge.method == "PUT" and (doc := await _json_object(app, edge, alias_admin.ALIAS_BODY_MAX_BYTES)) is None:
        return
    try:
        status, answer = await alias_admin.edit(app.process.fleet, unquote(edge.path.removeprefix("/v1/aliases/")), doc)
    except alias_admin.AliasRefused as exc:
        await _error(app, edge, exc.status, exc.code, str(exc))
        return
    await _json(edge, status, answer)


EXACT: dict[tuple[str, str], Handler] = {
    ("GET", "/v1/router/state"): state,
    ("GET", "/v1/router/schedule"): event_feed.schedule,
    ("GET", "/v1/telemetry"): telemetry,
    ("GET", "/v1/keys"): keys,
    ("POST", "/v1/keys"): keys,
    ("GET", "/v1/boxes"): boxes,
    ("POST", "/v1/boxes"): box_put,
    ("GET", "/metrics"): metrics,
    ("GET", "/v1/aliases"): aliases,
    ("GET", "/v1/router/events"): event_feed.events,
    **fleet_views.ROUTES,
    **{("GET", path): dashboard.ui for path in dashboard.UI_FILES},
}


# /v1/boxes/<name>[/<action>]: the box edits; every other path under a box is the relay.
BOX_ROUTES: dict[tuple[str, str], Handler] = {
    ("DELETE", ""): box_delete,
    ("PUT", ""): box_update,
    ("POST", "block"): box_block,
    ("POST", "unblock"): box_block,
}


# /v1/aliases/<name>: the alias edits (alias_admin.py).
ALIAS_ROUTES: dict[str, Handler] = {"PUT": alias_edit, "DELETE": alias_edit}


def route(method: str, path: str) -> tuple[Handler, str] | None:
    """(handler, access scope) for a router-owned route, or None. `/metrics` is a use route:
    scrapers inside the trusted nets need no key. The dashboard's files are `public`: they hold
    no data (dashboard.py rule 1), and what they show comes from an admin route. The Files and
    Batch API (batch_api.py) is a use route: it sorts out its callers' files itself."""
    batch_handler = batch_api.route(method, path)
    if batch_handler is not None:
        return batch_handler, "use"
    handler = EXACT.get((method, path))
    if handler is not None:
        return handler, ("use" if handler is metrics else "public" if handler is dashboard.ui else "admin")
    if method == "POST" and path.startswith("/v1/keys/") and path.endswith("/revoke"):
        return revoke, "admin"
    if method == "POST" and path.startswith("/v1/keys/") and path.endswith("/priority"):
        return priority, "admin"
    if method == "PUT" and path.startswith("/v1/keys/") and path.endswith("/limits"):
        return limits, "admin"
    if method == "GET" and (path == "/v1/keys/usage" or path.startswith("/v1/keys/") and path.endswith("/usage")):
        return usage, "admin"
    if path.startswith("/v1/aliases/"):
        handler = ALIAS_ROUTES.get(method)
        return (handler, "admin") if handler is not None else None
    if path.startswith("/v1/boxes/"):
        action = path.removeprefix("/v1/boxes/").partition("/")[2]
        return BOX_ROUTES.get((method, action), relay), "admin"
    return None
