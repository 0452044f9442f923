"""Reading what routing needs from a call: the model, the pin and the pool.

Rules:
1. JSON bodies: one orjson parse; only the top-level model field(s), `alloc.worker` and
   `alloc.pool` (and the facade's settings) are read. The body must be a JSON object; the
   model must be a non-empty string; `alloc`, when present, must be an object whose `worker`
   and `pool`, when present, are non-empty strings.
2. multipart/form-data bodies: the `model` form field (a text part), found by scanning part
   headers; the file parts are never decoded.
3. The pin and the pool may come as headers (`X-Router-Box`, `X-Router-Pool`) instead; the
   body wins.
4. Every identifier read here is capped (router.core.bounds rule 1).
5. Nothing here copies or keeps the body; errors name the field, never echo the body.
"""

from __future__ import annotations

import json
import re
from typing import Callable

import orjson

from router.core.bounds import check_identifier
from router.core.errors import BadRequest
from router.core.types import Call
from router.facades.table import Body, Facade, Route

_BOUNDARY_RE = re.compile(rb'boundary="?([^";,\s]+)"?', re.IGNORECASE)
_NAME_RE = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)


def parse_json_object(body: bytes) -> dict:
    """Returns the body as a dict. Raises BadRequest when it is not a JSON object."""
    if not body:
        raise BadRequest("request body is empty; a JSON object is required")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    return doc


def reject_duplicate_fields(body: bytes, fields: tuple[str, ...]) -> None:
    """Raises BadRequest when a routing field appears twice at the top level of the body.

    orjson keeps the last of duplicate keys; a box whose parser keeps the first would run
    another model than the one routed. The full check (a stdlib parse keeping every pair) runs
    only when a field's quoted name occurs more than once in the raw bytes, which a body with
    one `model` and no nested `model` keys never does.
    """
    if not any(body.count(b'"%s"' % f.encode()) > 1 for f in fields):
        return
    try:
        pairs = json.loads(body, object_pairs_hook=lambda items: items)
    except (RecursionError, ValueError):  # nesting orjson takes but the stdlib parser does not
        raise BadRequest("request body is nested too deeply to check its fields") from None
    names = [name for name, _ in pairs]
    for field in fields:
        if names.count(field) > 1:
            raise BadRequest(f"'{field}' appears more than once in the body")


def alloc_pool(doc: dict) -> str | None:
    """The pool a call asks for (`alloc.pool`), or None. Raises BadRequest on a bad value."""
    alloc = doc.get("alloc")
    pool = alloc.get("pool") if isinstance(alloc, dict) else None
    if pool is not None and (not isinstance(pool, str) or not pool):
        raise BadRequest("'alloc.pool' must be a non-empty string")
    return pool if pool is None else check_identifier("alloc.pool", pool)


def model_and_pin(doc: dict, model_fields: tuple[str, ...] = ("model",)) -> tuple[str, str | None]:
    """(model, pinned box or None) from a parsed body; the first present model field wins.

    Raises BadRequest on a missing or bad field.
    """
    field = next((f for f in model_fields if f in doc), model_fields[0])
    model = doc.get(field)
    if not isinstance(model, str) or not model.strip():
        raise BadRequest(f"'{field}' must be a non-empty string", code="model_required")
    check_identifier(field, model)
    alloc = doc.get("alloc")
    if alloc is None:
        return model, None
    if not isinstance(alloc, dict):
        raise BadRequest("'alloc' must be an object")
    worker = alloc.get("worker")
    if worker is not None and (not isinstance(worker, str) or not worker):
        raise BadRequest("'alloc.worker' must be a non-empty string")
    return model, worker if worker is None else check_identifier("alloc.worker", worker)


def multipart_field(body: bytes, content_type: bytes, field: bytes) -> str | None:
    """The value of text form field `field` in a multipart body, or None when absent.

    Raises BadRequest when the content type has no boundary or the field is not UTF-8.
    """
    match = _BOUNDARY_RE.search(content_type)
    if match is None:
        raise BadRequest("multipart body without a boundary")
    delimiter = b"--" + match.group(1)
    start = body.find(delimiter)
    while start != -1:
        head_start = start + len(delimiter)
        if body.startswith(b"--", head_start):
            return None  # closing delimiter
        head_end = body.find(b"\r\n\r\n", head_start)
        if head_end == -1:
            return None
        next_start = body.find(b"\r\n" + delimiter, head_end + 4)
        if next_start == -1:
            return None
        headers = body[head_start:head_end]
        for line in headers.split(b"\r\n"):
            if line[:20].lower().startswith(b"content-disposition:"):
                name = _NAME_RE.search(line)
                if name is not None and name.group(1) == field and b"filename=" not in line:
                    try:
                        return body[head_end + 4 : next_start].decode("utf-8")
                    except UnicodeDecodeError:
                        raise BadRequest(f"form field '{field.decode()}' is not UTF-8") from None
        start = next_start + 2
    return None


def read_call(
    body: bytes, content_type: str, route: Route, facade: Facade, header: Callable[[str], str | None]
) -> Call:
    """The call as routing sees it, from the body and the routing headers (rules 1-4).

    Raises BadRequest.
    """
    if route.body is Body.FORM and content_type.startswith("multipart/form-data"):
        model = multipart_field(body, content_type.encode("latin-1"), b"model")
        if model is None or not model.strip():
            raise BadRequest("form field 'model' is required", code="model_required")
        check_identifier("model", model)
        pin, settings, pool = None, None, None
    else:
        doc = parse_json_object(body)
        reject_duplicate_fields(body, route.model_fields + ("alloc",))
        model, pin = model_and_pin(doc, route.model_fields)
        settings = facade.settings(doc)
        pool = alloc_pool(doc)
    if pin is None and (pin := header("x-router-box")) is not None:
        check_identifier("X-Router-Box", pin)
    if pool is None and (pool := header("x-router-pool")) is not None:
        check_identifier("X-Router-Pool", pool)
    return Call(model=model, kinds=facade.kinds, settings=settings, pin=pin, pool=pool)
