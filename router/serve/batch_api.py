"""OpenAI's Files and Batch API on the router's main listener: a client uploads a JSONL file,
makes a batch of it, and reads the output file when the batch is done; the lines run on the
fleet's idle capacity (serve/batches.py, docs/batches.md).

Rules:
1. These are use routes (admin.py's `route` mounts them): whoever may call a model may make a
   batch. Each file and batch has an owner, the caller's key id (`admin` for HUGPY_ROUTER_KEY),
   or `inside` for every keyless caller. A caller sees only its owner's; another owner's id is
   a 404, never a 403, so that no one learns what exists. An admin caller (an admin key, or a
   keyless caller the admin routes take: loopback) sees every owner's.
2. An upload is read whole up to `--batch-max-file-bytes` of file (plus the form around it), not
   `--max-body`, within a deadline that grows with that cap (UPLOAD_BYTES_PER_S); a larger file
   is a 413. Its purpose is `batch`; the files the router writes (`batch_output`) are read, never
   a batch's input.
3. A batch is judged when it is made: its file read and checked whole (router.core.batches rule
   5) before the answer, so the answer is already `in_progress`, or `failed` with the lines at
   fault in its `errors` (a bad file is never a 4xx nor a 500). The runner is then woken.
4. Store work, and the parsing of an upload or a file, run in a worker thread, never on the loop.
   A store that fails is a 503; bad input a 4xx in OpenAI's error shape. Nothing of a file or a
   line is logged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Awaitable, Callable, Protocol
from urllib.parse import parse_qsl

import orjson

from router.core import access
from router.core import batches as rules
from router.core.bounds import positive_int
from router.core.errors import BadRequest
from router.facades.openai import shape_error
from router.serve.access import AccessGate
from router.serve.body import BodyTimeout, body_deadline, read_body, refusal
from router.serve.clock import CallClock
from router.serve.edge import BodyTooLarge, ClientLeft, Edge
from router.serve.settings import ServeConfig
from router.store.batches import BatchStore

log = logging.getLogger("router.batches")


class Runner(Protocol):
    """What the routes use of the batch runner (serve/batches.py's BatchRunner)."""

    store: BatchStore
    clock: Callable[[], float]  # the wall clock of the batches' times

    def wake(self) -> None: ...


class BatchState(Protocol):
    """What the routes read of the process's state (app.py's `ProcessState`)."""

    batches: Runner
    config: ServeConfig
    clock: CallClock


class BatchApp(Protocol):
    """The app the routes are mounted in (app.py's `RouterApp`)."""

    process: BatchState
    access: AccessGate


JSON = b"application/json"
# A batch request is a few ids and at most 16 metadata pairs of 512 characters.
CREATE_BODY_LIMIT = 64 * 1024
# The form around an upload's file: its boundaries, the part headers and the purpose field.
FORM_OVERHEAD_BYTES = 64 * 1024
# An upload's deadline grows by a second per this many bytes of the cap (rule 2): 200 MB at
# 1 MiB/s (8 Mbit/s), over 3 minutes, where a request body gets body.BODY_TIMEOUT_S.
UPLOAD_BYTES_PER_S = 1 << 20
# OpenAI's list pages: files up to 10000 (all by default), batches 1 to 100, 20 by default.
FILES_LIMIT_MAX = FILES_LIMIT_DEFAULT = 10_000
BATCHES_LIMIT_MAX = 100
BATCHES_LIMIT_DEFAULT = 20

Handler = Callable[[BatchApp, Edge], Awaitable[None]]


def _answers(handler: Handler) -> Handler:
    """The handler, with its BadRequest (any 4xx, the store's 503) answered in OpenAI's shape."""

    @functools.wraps(handler)
    async def answered(app: BatchApp, edge: Edge) -> None:
        try:
            await handler(app, edge)
        except BadRequest as exc:
            await edge.respond(exc.status_hint, [(b"content-type", JSON)],
                               shape_error(exc.status_hint, exc.code, str(exc), None))

    return answered


async def _json(edge: Edge, doc: dict) -> None:
    await edge.respond(200, [(b"content-type", JSON)], orjson.dumps(doc))


def _not_found(what: str, ident: str) -> BadRequest:
    return BadRequest(f"no {what} {ident}", code="not_found", status_hint=404)


async def _in_thread(app: BatchApp, fn, *args):
    """`fn(*args)` in a worker thread (rule 4); a store that fails is a 503."""
    store = app.process.batches.store
    try:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except store.errors as exc:
        raise BadRequest(f"the batch store cannot be reached now: {type(exc).__name__}",
                         code="store_unavailable", status_hint=503) from None


async def _body(app: BatchApp, edge: Edge, limit: int, deadline_s: float) -> bytes:
    """The request body, up to `limit` bytes, by `deadline_s` (loop time) (body.py)."""
    try:
        return await read_body(edge, limit, deadline_s, app.process.clock)
    except (BodyTooLarge, BodyTimeout, ClientLeft) as exc:
        status, code, message = refusal(exc, limit)
        raise BadRequest(message, code=code, status_hint=status) from None


def _owner(edge: Edge) -> str:
    return edge.key_id or rules.INSIDE


def _sees_all(app: BatchApp, edge: Edge) -> bool:
    """Whether the caller sees every owner's files and batches (rule 1): a key is judged by its
    own scope (a use key on loopback is that key, not the operator); a keyless caller by the
    admin routes' rules."""
    gate = app.access
    if edge.key_id is None:
        return gate.check(edge, "admin").ok
    token = access.bearer_token(edge.header("authorization")) or ""
    return gate.keys.scope_of(token, time.time(), gate.admin_key) == "admin"


def _query(edge: Edge) -> dict[str, str]:
    return dict(parse_qsl(edge.query, keep_blank_values=True))


def _limit(query: dict[str, str], default: int, high: int) -> int:
    try:
        return positive_int(query.get("limit", str(default)), high)
    except ValueError:
        raise BadRequest(f"limit must be a whole number from 1 to {high}", code="bad_query") from None


async def _page(app: BatchApp, edge: Edge, query: dict[str, str], default: int, high: int, shown, listed) -> None:
    """One page of a list, newest first (`?limit`, `?after`): `listed(owner, limit, after)` is the
    store's (owner None: every owner's, for an admin), `shown` a row's OpenAI object."""
    limit = _limit(query, default, high)
    owner = None if _sees_all(app, edge) else _owner(edge)
    rows = await _in_thread(app, listed, owner, limit + 1, query.get("after") or None)
    await _json(edge, rules.list_object([shown(row) for row in rows[:limit]], len(rows) > limit))


def _ident(edge: Edge, prefix: str) -> str:
    """The id in `prefix<id>` or `prefix<id>/<action>`."""
    return edge.path.removeprefix(prefix).partition("/")[0]


def _visible(app: BatchApp, edge: Edge, row, what: str, ident: str):
    """`row` when the caller may see it (rule 1), else the 404 of no such thing."""
    if row is None or (row.owner != _owner(edge) and not _sees_all(app, edge)):
        raise _not_found(what, ident)
    return row


async def _file(app: BatchApp, edge: Edge):
    file_id = _ident(edge, "/v1/files/")
    return _visible(app, edge, await _in_thread(app, app.process.batches.store.file, file_id), "file", file_id)


async def _batch(app: BatchApp, edge: Edge):
    batch_id = _ident(edge, "/v1/batches/")
    return _visible(app, edge, await _in_thread(app, app.process.batches.store.batch, batch_id), "batch", batch_id)


# -- files -------------------------------------------------------------------------------------
@_answers
async def upload(app: BatchApp, edge: Edge) -> None:
    """POST /v1/files: a multipart form of a `file` and its `purpose`, "batch" (rule 2)."""
    cap = app.process.config.batch_max_file_bytes
    deadline_s = body_deadline(asyncio.get_running_loop().time()) + cap / UPLOAD_BYTES_PER_S
    runner = app.process.batches
    async with runner.files_at_once:  # held until the file is stored: its copies are in memory till then
        body = await _body(app, edge, cap + FORM_OVERHEAD_BYTES, deadline_s)
        parts = await _in_thread(app, rules.form_parts, body, edge.header("content-type"))
        del body  # the file's bytes are in `parts`: one copy held, not two
        purpose = parts.get("purpose", (None, b""))[1]
        if purpose != rules.UPLOAD_PURPOSE.encode():
            raise BadRequest(f'purpose must be "{rules.UPLOAD_PURPOSE}": the router keeps files for batches only',
                             code="invalid_purpose")
        if "file" not in parts:
            raise BadRequest("the form has no `file` part", code="missing_file")
        filename, data = parts["file"]
        if len(data) > cap:
            raise BadRequest(f"file over {cap} bytes (--batch-max-file-bytes)", code="file_too_large", status_hint=413)
        row = await _in_thread(app, runner.store.put_file, _owner(edge), rules.UPLOAD_PURPOSE,
                               (filename or "file").replace("\x00", ""), data, runner.clock())
    await _json(edge, rules.file_object(row))


@_answers
async def files(app: BatchApp, edge: Edge) -> None:
    """GET /v1/files: newest first, `?purpose`, `?limit`, `?after` (the last id of a page)."""
    query, store = _query(edge), app.process.batches.store
    purpose = query.get("purpose") or None
    await _page(app, edge, query, FILES_LIMIT_DEFAULT, FILES_LIMIT_MAX, rules.file_object,
                lambda owner, limit, after: store.files(owner, purpose, limit, after))


@_answers
async def file(app: BatchApp, edge: Edge) -> None:
    """GET /v1/files/<id>."""
    await _json(edge, rules.file_object(await _file(app, edge)))


@_answers
async def file_content(app: BatchApp, edge: Edge) -> None:
    """GET /v1/files/<id>/content: the file's bytes."""
    row = await _file(app, edge)
    data = await _in_thread(app, app.process.batches.store.content, row.id)
    if data is None:  # deleted since
        raise _not_found("file", row.id)
    await edge.respond(200, [(b"content-type", b"application/octet-stream")], data)


@_answers
async def file_delete(app: BatchApp, edge: Edge) -> None:
    """DELETE /v1/files/<id>. A batch made of it runs on: its lines were taken when it was made."""
    row = await _file(app, edge)
    if not await _in_thread(app, app.process.batches.store.delete_file, row.id):
        raise _not_found("file", row.id)
    await _json(edge, {"id": row.id, "object": "file", "deleted": True})


# -- batches -----------------------------------------------------------------------------------
@_answers
async def create(app: BatchApp, edge: Edge) -> None:
    """POST /v1/batches {"input_file_id", "endpoint", "completion_window", "metadata"} (rule 3)."""
    if not access.is_json(edge.header("content-type")):
        raise BadRequest(access.NOT_JSON.message, code=access.NOT_JSON.code, status_hint=access.NOT_JSON.status)
    body = await _body(app, edge, CREATE_BODY_LIMIT, body_deadline(asyncio.get_running_loop().time()))
    try:
        doc = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError:
        raise BadRequest("the body is not valid JSON", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object", code="invalid_request")
    endpoint = rules.check_endpoint(doc.get("endpoint"))
    window = doc.get("completion_window", "24h")
    window_s = rules.window_seconds(window)
    metadata = rules.check_metadata(doc.get("metadata"))
    file_id = doc.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise BadRequest("input_file_id must be a file's id", code="invalid_input_file")
    runner = app.process.batches
    store = runner.store
    source = _visible(app, edge, await _in_thread(app, store.file, file_id), "file", file_id)
    if source.purpose != rules.UPLOAD_PURPOSE:
        raise BadRequest(f'the input file must be one uploaded with purpose "{rules.UPLOAD_PURPOSE}"',
                         code="invalid_input_file")
    config = app.process.config
    now = runner.clock()

    def made():
        """Judged first, then made and filled back to back: a router killed while it reads a large
        file leaves no batch `validating` for ever."""
        data = store.content(file_id)
        if data is None:  # deleted since it was looked up
            lines, errors = [], [{"code": "missing_file", "message": f"no file {file_id}", "param": "input_file_id",
                                  "line": None}]
        else:
            lines, errors = rules.check_lines(data, endpoint, config.batch_max_lines, config.max_body_bytes)
        del data
        row = store.create(_owner(edge), endpoint, file_id, window, window_s,
                           None if metadata is None else orjson.dumps(metadata).decode(), now)
        return store.validated(row.id, lines, orjson.dumps(errors).decode() if errors else None, now)

    async with runner.files_at_once:
        row = await _in_thread(app, made)
    if row.status == "failed":
        log.info("batch %s failed: its input file has %d bad lines", row.id, len(orjson.loads(row.errors)))
    else:
        log.info("batch %s started: %d lines to %s", row.id, row.total, row.endpoint)
    runner.wake()
    await _json(edge, rules.batch_object(row))


@_answers
async def batches(app: BatchApp, edge: Edge) -> None:
    """GET /v1/batches: newest first, `?limit`, `?after`."""
    await _page(app, edge, _query(edge), BATCHES_LIMIT_DEFAULT, BATCHES_LIMIT_MAX, rules.batch_object,
                app.process.batches.store.batches)


@_answers
async def batch(app: BatchApp, edge: Edge) -> None:
    """GET /v1/batches/<id>."""
    await _json(edge, rules.batch_object(await _batch(app, edge)))


@_answers
async def cancel(app: BatchApp, edge: Edge) -> None:
    """POST /v1/batches/<id>/cancel: `cancelling` until its running lines end (serve/batches.py
    rule 6); a batch already ended is answered as it is."""
    runner = app.process.batches
    row = await _batch(app, edge)
    row = await _in_thread(app, runner.store.cancel, row.id, runner.clock())
    if row is None:  # pruned since
        raise _not_found("batch", _ident(edge, "/v1/batches/"))
    runner.wake()
    await _json(edge, rules.batch_object(row))


EXACT: dict[tuple[str, str], Handler] = {
    ("POST", "/v1/files"): upload,
    ("GET", "/v1/files"): files,
    ("POST", "/v1/batches"): create,
    ("GET", "/v1/batches"): batches,
}
# /v1/files/<id>[/<action>] and /v1/batches/<id>[/<action>], by (method, action)
FILE_ROUTES: dict[tuple[str, str], Handler] = {
    ("GET", ""): file,
    ("DELETE", ""): file_delete,
    ("GET", "content"): file_content,
}
BATCH_ROUTES: dict[tuple[str, str], Handler] = {
    ("GET", ""): batch,
    ("POST", "cancel"): cancel,
}


def route(method: str, path: str) -> Handler | None:
    """The handler of a Files or Batch API route (rule 1: a use route), or None."""
    handler = EXACT.get((method, path))
    if handler is not None:
        return handler
    for prefix, table in (("/v1/files/", FILE_ROUTES), ("/v1/batches/", BATCH_ROUTES)):
        if path.startswith(prefix):
            ident, _, action = path.removeprefix(prefix).partition("/")
            return table.get((method, action)) if ident else None
    return None
