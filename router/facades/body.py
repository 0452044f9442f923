"""Reading what routing needs from a call: the model, the pin, the pool, and what admission
needs: whether it asks for a stream and the class it asks for.

Rules:
1. JSON bodies: one compiled scan (router._fastpath.json_members) checks that the body is one
   JSON object (RFC 8259, UTF-8, nesting at most 1,024) and finds the top-level members
   routing reads: the model field(s), `alloc`, `stream`, the facade's settings fields and, where
   the facade reaches hugpy boxes, `knobs` (router.core.pairs.call_knobs). Only those
   values are parsed (orjson), so the cost of a large body is one scan at ~1 GB/s that holds
   no GIL, not a parse building every object in it. A routing member twice is a 400 (keys
   compared as JSON decodes them). The model must be a non-empty string; `alloc`, when
   present, must be an object whose `worker` and `pool`, when present, are non-empty strings.
2. multipart/form-data bodies: the `model` form field (a text part), found by a compiled,
   GIL-free scan of the part heads (router._fastpath.form_field); file parts are never read.
   More than one part named `model` is a 400, as a routing member twice is in JSON: a box's
   parser may keep the last (Starlette's FormData does). A part counts however a box may read
   its name: quoted or not, any of its `name` parameters, a file part too.
3. The pin, the pool and the class may come as headers (`X-Router-Box`, `X-Router-Pool`,
   `X-Router-Priority`) instead; the body wins. A class is `high`, `normal` or `low`. So may
   the alias opt-out: `alloc.fallback` (true or false) or `X-Router-Fallback` (`on` or `off`).
4. Every identifier read here is capped (router.core.bounds rule 1).
5. Nothing here copies or keeps the body; errors name the field, never echo the body.
6. `with_model` is the body with its model replaced (an alias's chosen model), every other byte
   as the client sent it.
7. Affinity (router.core.affinity) reads, in the same scan, the span of the prompt (`messages`,
   `input` or `prompt`, first present: never parsed, only hashed later) and the small key
   fields (`prompt_cache_key`, `user`, `previous_response_id`). They never make a call a 400:
   one that is repeated, too large or not JSON is left out.
8. The answer's bound a call states is the largest of its route's fields (`Route.answer_bound`:
   every field a box serving the route reads as one); each present must be a whole number
   within ±MAX_ANSWER_TOKENS, or null (a 400 otherwise: boxes read a float or a string each
   their own way); 0 and below state no bound (llama.cpp's, Ollama's and LM Studio's "no
   limit"). `with_answer_bound` writes one the router chose into every such field the body
   holds, and the route's first where it holds none, every other byte as the client sent it.
"""

from __future__ import annotations

import functools
import json
import re
from typing import NamedTuple

import orjson

from router._fastpath import form_field, json_members
from router.core.admission import Priority, parse_priority
from router.core.affinity import BODY_KEY_FIELDS
from router.core.bounds import check_identifier
from router.core.pairs import call_knobs
from router.core.errors import BadRequest
from router.core.limits import MAX_ANSWER_TOKENS
from router.core.types import Call, new_tuple
from router.facades.table import Body, Facade, Route


class Inspected(NamedTuple):
    call: Call
    stream: bool  # the body asks for a stream (`"stream": true`)
    priority: Priority | None  # the class it asks for (None: its key's)
    max_tokens: int | None  # the answer's bound it states (tenancy's reservation; None: none)
    fallback: bool = True  # an alias's chain may move past its first model (rule 3)
    prompt: tuple[int, int] | None = None  # the prompt's byte span (rule 6)
    key_fields: tuple = (None, None, None)  # affinity.BODY_KEY_FIELDS' values (rule 6)
    # a JSON body's scan: its members' spans in scan_names' order, for later splices without a
    # second scan (with_model, with_answer_bound; None: a form body)
    spans: tuple | None = None


# Where a prompt is, first present wins: chat and Ollama chat, the Responses API, completions.
PROMPT_FIELDS = ("messages", "input", "prompt")
_AFFINITY_FIELDS = PROMPT_FIELDS + BODY_KEY_FIELDS
KNOBS_FIELD = ("knobs",)  # a hugpy box's per-call contract (rule 1)


def answer_bound(doc: dict, fields: tuple[str, ...]) -> int | None:
    """The answer's bound in tokens a call states: the largest of its route's `fields` present
    (Route.answer_bound, `options.num_predict` a member of `options`), or None where none states
    a positive one (rule 8).

    Raises BadRequest on a value that is not a whole number within ±MAX_ANSWER_TOKENS or null,
    or an `options` that is neither an object nor null."""
    largest = None
    for name in fields:
        outer, _, inner = name.partition(".")
        value = doc.get(outer)
        if inner and value is not None:
            if value.__class__ is not dict:
                raise BadRequest(f"'{outer}' must be an object", code=INVALID_BOUND)
            value = value.get(inner)
        if value is None:
            continue
        if value.__class__ is not int or not -MAX_ANSWER_TOKENS <= value <= MAX_ANSWER_TOKENS:
            raise BadRequest(f"'{name}' must be a whole number of tokens, at most {MAX_ANSWER_TOKENS}",
                             code=INVALID_BOUND)
        if value > 0 and (largest is None or value > largest):
            largest = value
    return largest


INVALID_BOUND = "invalid_answer_bound"  # rule 8's 400
# What every JSON call is scanned for beside its model: `alloc` (pin, pool, class, fallback), `stream`.
ROUTING_MEMBERS = ("alloc", "stream")
_BOUNDARY_RE = re.compile(rb'boundary="?([^";,\s]+)"?', re.IGNORECASE)
# A routing member's value (a model name, `alloc`, Ollama's `options`, a form field) is small;
# a larger one is refused before it is parsed, so no client can make the router build a big object.
MAX_FIELD_VALUE_BYTES = 64 << 10
# Members whose objects must not repeat a key at any depth: `alloc` routes the call (worker, pool,
# class), and a box whose parser keeps the first of two `worker`s would run where it was not
# routed, as with a duplicate `model`; so do Ollama's `options` (its runner settings and its
# answer's bound) and a hugpy call's `knobs` (its load contract).
UNIQUE_KEYS_INSIDE = frozenset({"alloc", "options", "knobs"})
BODY_FORM = Body.FORM  # read per call: a module name is cheaper than the Enum's (core/lifecycle.py)


@functools.cache
def _ascii(names: tuple[str, ...]) -> tuple[bytes, ...]:
    return tuple(name.encode("ascii") for name in names)


@functools.cache
def _unique(names: tuple[str, ...]) -> tuple[str, ...]:
    """`names` without repeats (a scan finds a member once: a route's answer bound may live in a
    member the facade reads for its settings too)."""
    return tuple(dict.fromkeys(names))


def json_fields(body: bytes, names: tuple[str, ...], found: dict | None = None) -> dict:
    """The top-level members `names` of a JSON object body, each value parsed; absent ones are
    left out (rule 1). With `found`, the same scan also finds the affinity members (rule 7) and
    puts the prompt's span under "prompt" and the key fields' values under their names, and
    every span under "spans" (`names` first, without repeats).

    Raises BadRequest when the body is not one JSON object, when one of `names` is a key more
    than once (keys as JSON decodes them: `"mod\\u0065l"` is `model`), or when its value is
    over MAX_FIELD_VALUE_BYTES or not JSON orjson takes.
    """
    names = _unique(names)
    return _scanned_fields(body, names, _ascii(names + _AFFINITY_FIELDS if found is not None else names), found)


def _scanned_fields(body: bytes, names: tuple[str, ...], scanned: tuple[bytes, ...], found: dict | None) -> dict:
    """json_fields with its scan's members worked out: `names` without repeats, `scanned`
    those (and with `found`, the affinity members after them) as json_members takes them."""
    try:
        spans = json_members(body, scanned)
    except ValueError as exc:  # the message says what and where, never the content
        raise BadRequest(f"request body {exc}") from None
    if found is not None:
        found["spans"] = spans
        _affinity_members(body, spans[len(names):], found)
    doc = {}
    for name, span in zip(names, spans):
        if span is None:
            continue
        start, end, count = span
        if count > 1:
            # orjson keeps the last of duplicate keys; a box whose parser keeps the first would
            # run another model than the one routed.
            raise BadRequest(f"'{name}' appears more than once in the body")
        if end - start > MAX_FIELD_VALUE_BYTES:
            raise BadRequest(f"'{name}' is over {MAX_FIELD_VALUE_BYTES} bytes")
        try:
            doc[name] = orjson.loads(body[start:end])
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"'{name}' is not valid JSON: {exc.msg}") from None
        if name in UNIQUE_KEYS_INSIDE and isinstance(doc[name], dict):
            _refuse_duplicate_keys(name, body[start:end])
    return doc


def _affinity_members(body: bytes, spans: tuple, found: dict) -> None:
    """Rule 6: the first prompt span present, and the key fields that are one small JSON value."""
    for span in spans[: len(PROMPT_FIELDS)]:
        if span is not None:
            found["prompt"] = span[:2]
            break
    for name, span in zip(BODY_KEY_FIELDS, spans[len(PROMPT_FIELDS):]):
        if span is not None and span[2] == 1 and span[1] - span[0] <= MAX_FIELD_VALUE_BYTES:
            try:
                found[name] = orjson.loads(body[span[0]:span[1]])
            except orjson.JSONDecodeError:
                pass


def _refuse_duplicate_keys(name: str, value: bytes) -> None:
    """Raises BadRequest when an object in `value` (a member's JSON, already parsed once, so
    valid) holds a key twice, keys compared as JSON decodes them. Only for UNIQUE_KEYS_INSIDE
    members, which are small and rare: orjson has no hook for the pairs, json's does."""

    def pairs(items: list[tuple[str, object]]) -> dict:
        doc = dict(items)
        if len(doc) != len(items):  # (the key itself is the body's: not echoed, rule 5)
            raise BadRequest(f"'{name}' holds a key more than once")
        return doc

    json.loads(value, object_pairs_hook=pairs)


def alloc_pool(doc: dict) -> str | None:
    """The pool a call asks for (`alloc.pool`), or None. Raises BadRequest on a bad value."""
    alloc = doc.get("alloc")
    pool = alloc.get("pool") if isinstance(alloc, dict) else None
    if pool is not None and (not isinstance(pool, str) or not pool):
        raise BadRequest("'alloc.pool' must be a non-empty string")
    if pool is not None:
        check_identifier("alloc.pool", pool)
    return pool


def model_and_pin(doc: dict, model_fields: tuple[str, ...] = ("model",)) -> tuple[str, str | None]:
    """(model, pinned box or None) from a parsed body; the first present model field wins.

    Raises BadRequest on a missing or bad field.
    """
    field = next(filter(doc.__contains__, model_fields), model_fields[0])
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
    if worker is not None:
        check_identifier("alloc.worker", worker)
    return model, worker


def multipart_field(body: bytes, content_type: bytes, field: bytes) -> str | None:
    """The value of text form field `field` in a multipart body, or None when absent (rule 2).

    Raises BadRequest when the content type has no boundary, more than one part is named
    `field`, or the value is over MAX_FIELD_VALUE_BYTES or not UTF-8.
    """
    match = _BOUNDARY_RE.search(content_type)
    if match is None:
        raise BadRequest("multipart body without a boundary")
    span, parts = form_field(body, b"--" + match.group(1), field)
    if parts > 1:
        raise BadRequest(f"form field '{field.decode()}' appears more than once in the body")
    if span is None:
        return None
    start, end = span
    if end - start > MAX_FIELD_VALUE_BYTES:
        raise BadRequest(f"form field '{field.decode()}' is over {MAX_FIELD_VALUE_BYTES} bytes")
    try:
        return body[start:end].decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(f"form field '{field.decode()}' is not UTF-8") from None


def asked_priority(doc: dict, header: str | None) -> Priority | None:
    """The class a call asks for (`alloc.priority`, else `X-Router-Priority`), or None."""
    alloc = doc.get("alloc")
    asked = alloc.get("priority") if isinstance(alloc, dict) else None
    if asked is None:
        asked = header
    if asked is None:
        return None
    priority = parse_priority(asked) if isinstance(asked, str) else None
    if priority is None:
        raise BadRequest("the priority must be 'high', 'normal' or 'low'", code="invalid_priority")
    return priority


def asked_fallback(doc: dict, header: str | None) -> bool:
    """Whether an alias call may fall back (`alloc.fallback`, else `X-Router-Fallback`; rule 3).
    Raises BadRequest on a value that is neither."""
    alloc = doc.get("alloc")
    asked = alloc.get("fallback") if isinstance(alloc, dict) else None
    if asked is not None:
        if not isinstance(asked, bool):
            raise BadRequest("'alloc.fallback' must be true or false", code="invalid_fallback")
        return asked
    if header is None:
        return True
    value = header.strip().lower()
    if value not in ("on", "off"):
        raise BadRequest("X-Router-Fallback must be 'on' or 'off'", code="invalid_fallback")
    return value == "on"


def model_span(route: Route, spans: tuple | None) -> tuple[int, int] | None:
    """Where the model's value is in a JSON body (`Inspected.spans`: the first present of the
    route's model fields), or None (a form body)."""
    if spans is not None:
        for span in spans[: len(route.model_fields)]:
            if span is not None:
                return span[0], span[1]
    return None


def with_model(body: bytes, content_type: str, route: Route, model: str,
               span: tuple[int, int] | None = None) -> bytes:
    """`body` with its model (the route's first present model field, or the form field) set to
    `model` (rule 6). The body was read by `read_call` already, so its model is there; `span`,
    where it is when known (`model_span`), spares a scan of the body."""
    if span is not None:
        return b"".join((body[: span[0]], orjson.dumps(model), body[span[1] :]))
    if route.body is BODY_FORM and content_type.startswith("multipart/form-data"):
        match = _BOUNDARY_RE.search(content_type.encode("latin-1"))
        (start, end), _ = form_field(body, b"--" + match.group(1), b"model")  # type: ignore[union-attr,misc]
        return b"".join((body[:start], model.encode(), body[end:]))
    found = model_span(route, json_members(body, _ascii(route.model_fields)))
    return body if found is None else with_model(body, content_type, route, model, found)


def with_answer_bound(body: bytes, route: Route, spans: tuple, tokens: int) -> bytes:
    """`body` (a JSON object `read_call` read, `spans` its scan) bounding its answer at `tokens`
    (rule 8): every bound field of the route it holds set to `tokens`, and the route's first
    added after the opening `{` where it holds none of them, so a box reads `tokens` whichever
    of them it reads first; Ollama's `options.num_predict` set inside `options` (kept, else
    added). The body itself where it already says `tokens` in the first field alone (the usual
    call that states its bound). No second scan: read_call's found the members, or found them
    absent; a route's bound fields are all top-level, or `options.num_predict` alone."""
    field = route.answer_bound[0]
    first = len(route.model_fields) + len(ROUTING_MEMBERS)  # scan_names' order: the bound's members next
    found = spans[first : first + len(route.bound_members)]
    outer, _, inner = field.partition(".")
    if inner:
        span = found[0]
        if span is None:
            return body.replace(b"{", _opened_with_bound(field, tokens), 1)
        options = orjson.loads(body[span[0]:span[1]])  # an object or null (read_call checked)
        return b"".join((body[: span[0]], orjson.dumps({**(options or {}), inner: tokens}), body[span[1] :]))
    value = b"%d" % tokens
    present = [span for span in found if span is not None]
    if not present:  # the common case: a call that says nothing of its answer's length
        return body.replace(b"{", _opened_with_bound(field, tokens), 1)
    if len(present) == 1 and found[0] is not None and body[found[0][0] : found[0][1]] == value:
        return body
    parts, at = [], 0
    for start, end, _ in sorted(present):
        parts += (body[at:start], value)
        at = end
    parts.append(body[at:])
    rewritten = b"".join(parts)
    return rewritten if found[0] is not None else rewritten.replace(b"{", _opened_with_bound(field, tokens), 1)


@functools.lru_cache(maxsize=256)
def _opened_with_bound(field: str, tokens: int) -> bytes:
    """The body's opening `{` with the member `with_answer_bound` adds after it
    (`{"max_tokens":512,`, `{"options":{"num_predict":512},`), built once per pair: a few
    routes' fields, mostly the one default bound. One replace of the first `{` then splices it."""
    outer, _, inner = field.partition(".")
    value = orjson.dumps({inner: tokens}) if inner else b"%d" % tokens
    return b'{"%s":%s,' % (outer.encode(), value)


# read_call's scan per facade and route: (facade, route, scan_names without repeats, those and the
# affinity members in bytes), worked out on a route's first call. Keyed by identity: facades and
# routes are made at start and live as long as the process, and a Facade's own hash would hash
# every route it has. The entry holds both, so their ids cannot be reused by others.
_SCANS: dict[tuple[int, int], tuple[Facade, Route, tuple[str, ...], tuple[bytes, ...]]] = {}


def _scan_of(route: Route, facade: Facade) -> tuple[Facade, Route, tuple[str, ...], tuple[bytes, ...]]:
    scan = _SCANS.get((id(facade), id(route)))
    if scan is None:
        names = _unique(scan_names(route, facade))
        scan = _SCANS[(id(facade), id(route))] = (facade, route, names, _ascii(names + _AFFINITY_FIELDS))
    return scan


def scan_names(route: Route, facade: Facade) -> tuple[str, ...]:
    """The top-level members read_call's scan finds (rule 1), in this order (with_answer_bound
    and model_span read their spans by place): the model fields, ROUTING_MEMBERS, the route's
    answer bound's members (`bound_members[0]` is where the router writes one), the facade's
    settings fields, and `knobs` where the facade reaches hugpy boxes. None of the model fields
    or routing members is a bound's member."""
    names = route.model_fields + ROUTING_MEMBERS + route.bound_members + facade.settings_fields
    return names + KNOBS_FIELD if facade.reads_knobs else names


def read_call(
    body: bytes, content_type: str, route: Route, facade: Facade, header_pin: str | None, header_pool: str | None,
    header_priority: str | None = None, header_fallback: str | None = None,
) -> Inspected:
    """The call as routing sees it, from the body and the routing headers' values (`X-Router-Box`,
    `X-Router-Pool`, `X-Router-Priority`) (rules 1-4). Safe on any thread.

    Raises BadRequest.
    """
    doc: dict = {}
    found: dict = {}
    if route.body is BODY_FORM and content_type.startswith("multipart/form-data"):
        model = multipart_field(body, content_type.encode("latin-1"), b"model")
        if model is None or not model.strip():
            raise BadRequest("form field 'model' is required", code="model_required")
        check_identifier("model", model)
        pin, settings, pool, knobs = None, None, None, None
    else:
        _, _, names, scanned = _scan_of(route, facade)
        doc = _scanned_fields(body, names, scanned, found)
        model, pin = model_and_pin(doc, route.model_fields)
        settings = facade.settings(doc)
        # Most calls name no `alloc` and no `knobs`: their defaults then, without a frame each.
        pool = alloc_pool(doc) if "alloc" in doc else None
        knobs = call_knobs(doc["knobs"]) if "knobs" in doc else None
    if pin is None and header_pin is not None:
        pin = check_identifier("X-Router-Box", header_pin)
    if pool is None and header_pool is not None:
        pool = check_identifier("X-Router-Pool", header_pool)
    call = new_tuple(Call, (model, facade.kinds, settings, pin, pool, knobs))
    asked_alloc = "alloc" in doc  # else a class and the fallback are the headers' (or the defaults)
    priority = asked_priority(doc, header_priority) if asked_alloc or header_priority is not None else None
    fallback = asked_fallback(doc, header_fallback) if asked_alloc or header_fallback is not None else True
    return new_tuple(Inspected, (call, doc.get("stream") is True, priority, answer_bound(doc, route.answer_bound),
                                 fallback, found.get("prompt"), tuple(map(found.get, BODY_KEY_FIELDS)),
                                 found.get("spans")))
