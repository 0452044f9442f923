"""Reading `model` and `alloc.worker` from a call body (router/facades/body.py).

Errors are BadRequest (status 400) naming the field; they never echo the body: every bad
body below carries a canary that must not appear in the error text."""

from __future__ import annotations

import json
import math
import re

import orjson
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core import limits as rules
from router.core.bounds import CLIP_MARK, ECHO_CHARS, MAX_IDENTIFIER_BYTES, check_identifier, clip
from router.core.errors import BadRequest
from router.core.types import Reason, ReasonCode
from router.facades import mounts, ollama, openai
from router._fastpath import form_field, json_members
from router.core.admission import Priority
from router.facades.body import (
    MAX_FIELD_VALUE_BYTES, json_fields, model_and_pin, multipart_field, read_call, with_answer_bound,
)

CANARY = "CANARY-7f3a9e"


def no_echo(exc: pytest.ExceptionInfo) -> None:
    assert CANARY not in str(exc.value)
    assert CANARY.lower() not in str(exc.value).lower()
    assert all(CANARY not in str(arg) for arg in exc.value.args)
    assert exc.value.status_hint == 400


# --------------------------------------------------------------------------------------------
# json_fields (and json_members, the compiled scan under it)
# --------------------------------------------------------------------------------------------

ROUTING = ("model", "alloc")


def test_json_fields_ok():
    body = b'{"model":"m","messages":[{"model":"nested"}],"alloc":{"worker":"b1"}}'
    assert json_fields(body, ROUTING) == {"model": "m", "alloc": {"worker": "b1"}}
    assert json_fields(b' {"x": 1}\r\n', ROUTING) == {}


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b'{"model": "' + CANARY.encode() + b'"',  # truncated
        b"{'model': '" + CANARY.encode() + b"'}",  # single quotes
        b'{"model": ' + CANARY.encode() + b"}",  # bare word
        CANARY.encode(),
        b'{"model": "m"} ' + CANARY.encode(),  # trailing garbage
        b'{"model": "\xff' + CANARY.encode() + b'"}',  # not UTF-8
        b'{"model": "m", "x": "\xed\xa0\x80' + CANARY.encode() + b'"}',  # a UTF-8 surrogate, not read
        b'{"model": "m", "x": [1, 2,]}',  # bad JSON in a member not read
        b'{"model": "m", "x": "tab\there"}',  # a raw control character
        b'{"model": "m", "x": "\\q"}',  # a bad escape
        b'["' + CANARY.encode() + b'"]',  # an array
        b'"' + CANARY.encode() + b'"',  # a string
        b"42",
        b"null",
        b"   ",
        b"\xef\xbb\xbf{}",  # a byte-order mark
    ],
)
def test_json_fields_rejects(body):
    with pytest.raises(BadRequest) as exc:
        json_fields(body, ROUTING)
    no_echo(exc)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "a", "model": "b"}',
        b'{"model": "a", "mod\\u0065l": "b"}',  # escapes decoded before keys are compared
        b'{"\\u006d\\u006F\\u0064\\u0065\\u006c": "a", "x": 1, "model": "b"}',
        b'{"alloc": {}, "all\\u006fc": {"worker": "w"}, "model": "m"}',
    ],
)
def test_a_routing_member_twice_is_400(body):
    with pytest.raises(BadRequest) as exc:
        json_fields(body, ROUTING)
    assert "more than once" in str(exc.value)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "alloc": {"worker": "a", "worker": "b"}}',
        b'{"model": "m", "alloc": {"worker": "a", "w\\u006frker": "b"}}',  # as JSON decodes it
        b'{"model": "m", "alloc": {"pool": "p", "priority": "low", "pool": "q"}}',
        b'{"model": "m", "alloc": {"gpu": {"id": 0, "id": 1}}}',  # at any depth inside alloc
    ],
)
def test_a_key_twice_inside_alloc_is_400(body):
    """Issue 20 item 13: as a duplicate `model` is; a box keeping the first `worker` would run
    the call where it was not routed."""
    with pytest.raises(BadRequest) as exc:
        json_fields(body, ROUTING)
    assert "more than once" in str(exc.value)
    no_echo(exc)


def test_keys_that_only_look_alike_are_not_duplicates():
    body = b'{"model": "a", "model ": 1, "Model": 2, "mod\\u00e9l": 3, "x": {"model": "b"}}'
    assert json_fields(body, ROUTING) == {"model": "a"}


def test_nesting_up_to_1024_levels():
    def nested(depth):
        return b'{"model": "m", "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    assert json_fields(nested(1024), ROUTING) == {"model": "m"}
    with pytest.raises(BadRequest) as exc:
        json_fields(nested(1025), ROUTING)
    assert "nested too deeply" in str(exc.value)


def test_a_huge_routing_value_is_refused_unparsed():
    body = b'{"model": "m", "alloc": {"pad": "' + b"x" * MAX_FIELD_VALUE_BYTES + b'"}}'
    with pytest.raises(BadRequest) as exc:
        json_fields(body, ROUTING)
    assert "'alloc' is over" in str(exc.value)


class Pairs(list):
    """An object as the plain model sees it: its (key, value) pairs in order."""


def _no_constants(name):
    raise ValueError(name)


def model_members(body: bytes, names: tuple[str, ...]):
    """The plain model of json_members: the stdlib parser (strict UTF-8, no NaN/Infinity),
    keeping every pair. None for a body that is not one JSON object; else, per name, None or
    (first value, count)."""
    try:
        doc = json.loads(body.decode("utf-8"), object_pairs_hook=Pairs, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, Pairs):
        return None
    found = []
    for name in names:
        values = [v for k, v in doc if k == name]
        found.append((values[0], len(values)) if values else None)
    return tuple(found)


def scanned_members(body: bytes, names: tuple[str, ...]):
    try:
        spans = json_members(body, tuple(n.encode() for n in names))
    except ValueError:
        return None
    return tuple(
        None if span is None
        else (json.loads(body[span[0]:span[1]].decode(), object_pairs_hook=Pairs), span[2])
        for span in spans
    )


SHORT_ESCAPES = {"/": "\\/", '"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\b": "\\b", "\f": "\\f", "\r": "\\r"}


def escaped(text: str, draw) -> str:
    """`text` as a JSON string body, each character written plainly or escaped at random."""
    out = []
    for ch in text:
        how = draw(st.integers(0, 3))
        if how == 3 and ch in SHORT_ESCAPES:
            out.append(SHORT_ESCAPES[ch])
        elif ch in '"\\' or ord(ch) < 0x20 or how == 1:
            out.append("\\u%04x" % ord(ch) if ord(ch) < 0x10000 else json.dumps(ch)[1:-1])
        elif how == 2:
            out.append("\\u%04X" % ord(ch) if ord(ch) < 0x10000 else ch)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


KEYS = st.sampled_from(["model", "alloc", "name", "Model", "model ", "modèl", "x", "", "mo\"del", "\U0001f600",
                        "a/b\\\n\t\b\f\r"])
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
VALUES = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=3)), max_leaves=8)


@st.composite
def json_bodies(draw):
    """A JSON object written with duplicate keys, escaped keys and random whitespace, then
    sometimes damaged (a byte changed, cut short, or a byte put in)."""
    pairs = draw(st.lists(st.tuples(KEYS, VALUES), max_size=6))
    space = draw(st.sampled_from(["", " ", "\n\t", "\r\n "]))
    members = [escaped(k, draw) + space + ":" + space + json.dumps(v, ensure_ascii=draw(st.booleans()))
               for k, v in pairs]
    body = ("{" + space + ("," + space).join(members) + space + "}").encode()
    damage = draw(st.sampled_from(["none", "none", "flip", "cut", "insert"]))
    if damage != "none" and body:
        at = draw(st.integers(0, len(body) - 1))
        byte = bytes([draw(st.integers(0, 255))])
        body = {"flip": body[:at] + byte + body[at + 1:], "cut": body[:at],
                "insert": body[:at] + byte + body[at:]}[damage]
    return body


@settings(max_examples=500, deadline=None, database=None)
@given(body=json_bodies())
def test_json_members_against_the_plain_model(body):
    names = ("model", "alloc", "name")
    assert scanned_members(body, names) == model_members(body, names)


@settings(max_examples=300, deadline=None, database=None)
@given(body=st.binary(max_size=64))
def test_json_members_on_arbitrary_bytes(body):
    assert scanned_members(body, ROUTING) == model_members(body, ROUTING)


# --------------------------------------------------------------------------------------------
# model_and_pin
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc,expected",
    [
        ({"model": "llama3"}, ("llama3", None)),
        ({"model": "m@ctx-low", "alloc": {"worker": "b1"}}, ("m@ctx-low", "b1")),
        ({"model": "m", "alloc": {}}, ("m", None)),
        ({"model": "m", "alloc": None}, ("m", None)),  # JSON null: no alloc
        ({"model": "m", "alloc": {"worker": None, "other": 1}}, ("m", None)),
        ({"model": " m "}, (" m ", None)),  # the name goes on untouched
    ],
)
def test_model_and_pin_ok(doc, expected):
    assert model_and_pin(doc) == expected


def test_model_and_pin_other_fields():
    assert model_and_pin({"name": "llama3"}, model_fields=("name",)) == ("llama3", None)
    with pytest.raises(BadRequest) as exc:
        model_and_pin({"model": "llama3"}, model_fields=("name",))
    assert exc.value.code == "model_required"
    # the first present field wins
    fields = ("model", "name")
    assert model_and_pin({"name": "a"}, model_fields=fields) == ("a", None)
    assert model_and_pin({"model": "b", "name": "a"}, model_fields=fields) == ("b", None)
    with pytest.raises(BadRequest) as exc:
        model_and_pin({"model": 3, "name": CANARY}, model_fields=fields)
    no_echo(exc)


@pytest.mark.parametrize(
    "doc",
    [
        {},
        {"model": None},
        {"model": 7},
        {"model": ["llama3", CANARY]},
        {"model": {"name": CANARY}},
        {"model": ""},
        {"model": "   "},
        {"model": True},
    ],
)
def test_model_must_be_a_non_empty_string(doc):
    with pytest.raises(BadRequest) as exc:
        model_and_pin(doc)
    assert exc.value.code == "model_required"
    no_echo(exc)


@pytest.mark.parametrize(
    "alloc",
    [CANARY, [CANARY], 3, True, {"worker": 5}, {"worker": ""}, {"worker": [CANARY]},
     {"worker": {"id": CANARY}}, {"worker": True}],
)
def test_alloc_and_worker_types(alloc):
    with pytest.raises(BadRequest) as exc:
        model_and_pin({"model": "m", "alloc": alloc})
    no_echo(exc)
    assert "alloc" in str(exc.value)


def test_scan_then_pick():
    doc = json_fields(b'{"model":"llama3","alloc":{"worker":"gpu-2"},"messages":[]}', ROUTING)
    assert model_and_pin(doc) == ("llama3", "gpu-2")


# --------------------------------------------------------------------------------------------
# multipart_field
# --------------------------------------------------------------------------------------------

BOUNDARY = b"----router-test-boundary-42"


def multipart(parts: list[tuple[bytes, bytes]], boundary: bytes = BOUNDARY) -> bytes:
    out = bytearray()
    for headers, content in parts:
        out += b"--" + boundary + b"\r\n" + headers + b"\r\n\r\n" + content + b"\r\n"
    out += b"--" + boundary + b"--\r\n"
    return bytes(out)


FILE_PART = (
    b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
    b"Content-Type: audio/wav",
    b"RIFF\x00\x01\xff\xfe\r\n\r\nname=\"model\"\r\n" + CANARY.encode() + b"\x00" * 64,
)
CT = b"multipart/form-data; boundary=" + BOUNDARY


def field(name: bytes, value: bytes) -> tuple[bytes, bytes]:
    return (b'Content-Disposition: form-data; name="' + name + b'"', value)


def test_model_after_a_file_part():
    body = multipart([FILE_PART, field(b"language", b"en"), field(b"model", b"whisper-1")])
    assert multipart_field(body, CT, b"model") == "whisper-1"
    assert multipart_field(body, CT, b"language") == "en"


def test_model_before_a_file_part_and_quoted_boundary():
    body = multipart([field(b"model", b"whisper-large"), FILE_PART])
    ct = b'multipart/form-data; boundary="' + BOUNDARY + b'"; charset=utf-8'
    assert multipart_field(body, ct, b"model") == "whisper-large"


def test_field_absent_or_only_as_a_file():
    body = multipart([FILE_PART, field(b"language", b"en")])
    assert multipart_field(body, CT, b"model") is None
    as_file = (b'Content-Disposition: form-data; name="model"; filename="model"', b"x")
    assert multipart_field(multipart([as_file]), CT, b"model") is None
    assert multipart_field(b"", CT, b"model") is None


def test_field_value_keeps_its_text():
    body = multipart([field(b"model", "modèle@ctx-low".encode())])
    assert multipart_field(body, CT, b"model") == "modèle@ctx-low"
    body = multipart([field(b"model", b"")])
    assert multipart_field(body, CT, b"model") == ""


def test_header_case_and_extra_headers():
    part = (
        b"content-disposition: form-data; name=\"model\"\r\nContent-Type: text/plain",
        b"m1",
    )
    assert multipart_field(multipart([FILE_PART, part]), CT, b"model") == "m1"


def test_truncated_body_gives_none():
    body = multipart([FILE_PART, field(b"model", b"whisper-1")])
    cut = body[: body.index(b"whisper-1") + 4]
    assert multipart_field(cut, CT, b"model") is None


@pytest.mark.parametrize(
    "content_type",
    [b"multipart/form-data", b"multipart/form-data; charset=utf-8", b"", b"application/json"],
)
def test_missing_boundary(content_type):
    body = multipart([field(b"model", CANARY.encode())])
    with pytest.raises(BadRequest) as exc:
        multipart_field(body, content_type, b"model")
    no_echo(exc)


def test_field_not_utf8():
    body = multipart([field(b"model", b"\xff\xfe" + CANARY.encode())])
    with pytest.raises(BadRequest) as exc:
        multipart_field(body, CT, b"model")
    no_echo(exc)
    assert "model" in str(exc.value)


# --------------------------------------------------------------------------------------------
# identifier caps (router.core.bounds rule 1) and the whole read (read_call)
# --------------------------------------------------------------------------------------------

CHAT = openai.FACADE.route("POST", "/v1/chat/completions")[0]
TRANSCRIBE = openai.FACADE.route("POST", "/v1/audio/transcriptions")[0]
SHOW = ollama.FACADE.route("POST", "/api/show")[0]


def too_long(exc: pytest.ExceptionInfo, field: str, value: str) -> None:
    assert exc.value.status_hint == 400 and exc.value.code == "identifier_too_long"
    text = str(exc.value)
    assert f"'{field}'" in text and value not in text and len(text) < 200
    assert clip(value, ECHO_CHARS) in text


@settings(max_examples=200, deadline=None, database=None)
@given(value=st.text(min_size=1, max_size=400))
def test_identifier_sizes_fuzzed(value):
    """At most MAX_IDENTIFIER_BYTES of UTF-8 passes, whatever the characters; more is refused
    without the value in full."""
    if len(value.encode("utf-8", "surrogatepass")) <= MAX_IDENTIFIER_BYTES:
        assert check_identifier("model", value) is value
    else:
        with pytest.raises(BadRequest) as exc:
            check_identifier("model", value)
        too_long(exc, "model", value)


@pytest.mark.parametrize("unit", ["a", "é", "€", "😀"])
def test_the_cap_is_in_bytes_at_the_edge(unit):
    fits = unit * (MAX_IDENTIFIER_BYTES // len(unit.encode()))
    assert check_identifier("model", fits) is fits
    over = fits + "a" * (MAX_IDENTIFIER_BYTES - len(fits.encode()) + 1)
    with pytest.raises(BadRequest) as exc:
        check_identifier("model", over)
    too_long(exc, "model", over)


LONG = "x" * (MAX_IDENTIFIER_BYTES + 1)


@pytest.mark.parametrize(
    "route,doc,field",
    [
        (CHAT, {"model": LONG}, "model"),
        (CHAT, {"model": "m", "alloc": {"worker": LONG}}, "alloc.worker"),
        (CHAT, {"model": "m", "alloc": {"pool": LONG}}, "alloc.pool"),
        (SHOW, {"name": LONG}, "name"),
        (SHOW, {"model": LONG, "name": "m"}, "model"),
    ],
)
def test_over_the_cap_in_the_body(route, doc, field):
    facade = ollama.FACADE if route is SHOW else openai.FACADE
    with pytest.raises(BadRequest) as exc:
        read_call(orjson.dumps(doc), "application/json", route, facade, None, None)
    too_long(exc, field, LONG)


@pytest.mark.parametrize("header", ["x-router-box", "x-router-pool"])
def test_over_the_cap_in_a_header(header):
    values = (LONG, None) if header == "x-router-box" else (None, LONG)
    with pytest.raises(BadRequest) as exc:
        read_call(b'{"model": "m"}', "application/json", CHAT, openai.FACADE, *values)
    too_long(exc, {"x-router-box": "X-Router-Box", "x-router-pool": "X-Router-Pool"}[header], LONG)
    at_cap = tuple(v and v[1:] for v in values)
    call = read_call(b'{"model": "m"}', "application/json", CHAT, openai.FACADE, *at_cap).call
    assert (call.pin, call.pool) == at_cap


def test_over_the_cap_in_a_form_field():
    body = multipart([FILE_PART, field(b"model", LONG.encode())])
    with pytest.raises(BadRequest) as exc:
        read_call(body, CT.decode(), TRANSCRIBE, openai.FACADE, None, None)
    too_long(exc, "model", LONG)


def test_read_call_body_wins_over_headers():
    headers = ("h-box", "h-pool")
    body = b'{"model": "m", "alloc": {"worker": "b-box", "pool": "b-pool"}}'
    call = read_call(body, "application/json", CHAT, openai.FACADE, *headers).call
    assert (call.model, call.pin, call.pool) == ("m", "b-box", "b-pool")
    call = read_call(b'{"model": "m"}', "application/json", CHAT, openai.FACADE, *headers).call
    assert (call.pin, call.pool) == ("h-box", "h-pool")


def test_read_call_reads_the_stream_flag_and_the_class_asked_for():
    read = read_call(b'{"model": "m", "stream": true, "alloc": {"priority": "low"}}', "application/json",
                     CHAT, openai.FACADE, None, None, "high")
    assert (read.stream, read.priority) == (True, Priority.LOW)  # the body wins over the header
    read = read_call(b'{"model": "m", "stream": "yes"}', "application/json", CHAT, openai.FACADE, None, None, "High")
    assert (read.stream, read.priority) == (False, Priority.HIGH)
    for bad in ('{"model": "m", "alloc": {"priority": "urgent"}}', '{"model": "m", "alloc": {"priority": 1}}'):
        with pytest.raises(BadRequest) as exc:
            read_call(bad.encode(), "application/json", CHAT, openai.FACADE, None, None)
        assert exc.value.code == "invalid_priority"
    with pytest.raises(BadRequest):
        read_call(b'{"model": "m"}', "application/json", CHAT, openai.FACADE, None, None, "urgent")


def test_read_call_reads_a_hugpy_calls_knobs_where_a_hugpy_box_can_take_it():
    """rule 1: `knobs` (router.core.pairs.call_knobs) is a routing member of the facades that
    reach hugpy boxes: one spelling per object, read once, capped."""
    body = b'{"knobs": {"tolerance": "slowest", "max_wait_s": 5}, "model": "m@ram-only"}'
    call = read_call(body, "application/json", CHAT, openai.FACADE, None, None).call
    assert (call.model, call.knobs) == ("m@ram-only", '{"max_wait_s":5,"tolerance":"slowest"}')
    assert read_call(b'{"model": "m", "knobs": null}', "application/json", CHAT, openai.FACADE,
                     None, None).call.knobs is None
    # the OpenAI routes mounted over Ollama boxes only, and Ollama's own API: no hugpy box there
    assert not mounts.OPENAI_OVER_OLLAMA.reads_knobs
    assert read_call(body, "application/json", CHAT, mounts.OPENAI_OVER_OLLAMA, None, None).call.knobs is None
    for bad, code in ((b'{"model": "m", "knobs": {}, "knobs": {"max_wait_s": 5}}', "invalid_request"),
                      (orjson.dumps({"model": "m", "knobs": {"quants": ["x" * 100] * 50}}), "knobs_too_large")):
        with pytest.raises(BadRequest) as exc:
            read_call(bad, "application/json", CHAT, openai.FACADE, None, None)
        assert exc.value.code == code


def test_clip():
    assert clip("abc", 3) == "abc"
    assert clip("abcd", 3) == "abc" + CLIP_MARK % 1
    assert len(clip("y" * 10**6)) < 1100
    # a refusal reason's detail (a pin, a model key, a box's word) is clipped the same way
    reason = Reason(ReasonCode.NO_MODEL, "k" * 10**6)
    assert reason.text() == "no_model: " + clip("k" * 10**6)


# --------------------------------------------------------------------------------------------
# form_field (compiled) against its plain model: the Python scan it replaced
# --------------------------------------------------------------------------------------------

_NAME_RE = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)
# every `name` parameter a box's parser may read, overlapping: `name*` (RFC 2231), or `=` with
# spaces around it and a value quoted (to the next quote, or the line's end) or bare
_ANY_NAME_RE = re.compile(rb'\bname(?=(\*)|[ \t]*=[ \t]*(?:"([^"]*)|([^ \t;"]*)))', re.IGNORECASE)


def model_form_field(body: bytes, delimiter: bytes, field: bytes) -> tuple[tuple[int, int] | None, int]:
    """Part by part: a part's head runs to the first blank line, its content to the next
    CRLF + delimiter. A `Content-Disposition:` head line (any case) whose first `name="..."`
    is `field`, without `filename=`, is the field's text part (the first one's span); one with
    any `name` parameter whose value is `field`, or any `name*`, counts (the scan stops at 2)."""
    span, count = None, 0
    start = body.find(delimiter)
    while start != -1:
        head_start = start + len(delimiter)
        if body.startswith(b"--", head_start):
            return span, count  # closing delimiter
        head_end = body.find(b"\r\n\r\n", head_start)
        if head_end == -1:
            return span, count
        next_start = body.find(b"\r\n" + delimiter, head_end + 4)
        if next_start == -1:
            return span, count
        for line in body[head_start:head_end].split(b"\r\n"):
            if line[:20].lower().startswith(b"content-disposition:"):
                if any(m.group(1) or field in (m.group(2), m.group(3)) for m in _ANY_NAME_RE.finditer(line)):
                    count += 1
                    if count == 2:
                        return span, count
                name = _NAME_RE.search(line)
                if span is None and name is not None and name.group(1) == field and b"filename=" not in line:
                    span = head_end + 4, next_start
        start = next_start + 2
    return span, count


HEAD_LINES = st.sampled_from([
    b'Content-Disposition: form-data; name="model"', b'content-disposition: form-data; NAME="model"',
    b'Content-Disposition: form-data; name="model"; filename="m.wav"', b'Content-Disposition: form-data; filename="x"; name="model"',
    b'Content-Disposition: form-data; xname="model"', b'Content-Disposition: form-data; name="file"; name="model"',
    b'Content-Disposition: form-data; name="model', b'Content-Disposition:name="model"', b'Content-Type: text/plain',
    b'X-Name: name="model"', b'Content-Disposition: form-data; name="mode"', b'Content-Disposition: form-data; name=""',
    b"", b"\r", b'Content-Disposition: form-data; name="model"\n',
    b"Content-Disposition: form-data; name=model", b'Content-Disposition: form-data; NAME = "model"; x=1',
    b"Content-Disposition: form-data; name*=utf-8''model", b'Content-Disposition: form-data; name="x"; name=model;',
    b'Content-Disposition: form-data; x-name="model"', b'Content-Disposition: form-data; name=name="model"',
    b"Content-Disposition: form-data; name\t=\tmodel", b'Content-Disposition: form-data; name="model"; name="x"',
])


@st.composite
def multipart_bodies(draw):
    """Parts with heads picked to be near misses, contents that may hold the delimiter's bytes,
    then sometimes damaged (a byte changed, cut short, or bytes put in)."""
    boundary = draw(st.sampled_from([b"b", b"----x-42", b"--"]))
    out = bytearray(draw(st.sampled_from([b"", b"preamble\r\n"])))
    for _ in range(draw(st.integers(0, 4))):
        head = b"\r\n".join(draw(st.lists(HEAD_LINES, min_size=1, max_size=3)))
        content = draw(st.sampled_from([b"whisper-1", b"", b"a\r\n--", b"--" + boundary, b"\r\n\r\n", b"x\r\n--" + boundary]))
        out += b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + content + b"\r\n"
    if draw(st.booleans()):
        out += b"--" + boundary + b"--\r\n"
    body = bytes(out)
    damage = draw(st.sampled_from(["none", "none", "flip", "cut", "insert"]))
    if damage != "none" and body:
        at = draw(st.integers(0, len(body) - 1))
        extra = draw(st.sampled_from([b"\r\n", b"-", b'"', b"\r\n\r\n", bytes([draw(st.integers(0, 255))])]))
        body = {"flip": body[:at] + extra + body[at + 1:], "cut": body[:at], "insert": body[:at] + extra + body[at:]}[damage]
    return boundary, body


@settings(max_examples=600, deadline=None, database=None)
@given(case=multipart_bodies(), field=st.sampled_from([b"model", b"file", b"", b"mode"]))
def test_form_field_against_the_plain_model(case, field):
    boundary, body = case
    assert form_field(body, b"--" + boundary, field) == model_form_field(body, b"--" + boundary, field)


@settings(max_examples=300, deadline=None, database=None)
@given(body=st.binary(max_size=80), field=st.sampled_from([b"model", b""]))
def test_form_field_on_arbitrary_bytes(body, field):
    assert form_field(body, b"--b", field) == model_form_field(body, b"--b", field)


def test_a_huge_form_field_is_refused_undecoded():
    body = multipart([field(b"model", b"m" * (MAX_FIELD_VALUE_BYTES + 1))])
    with pytest.raises(BadRequest) as exc:
        multipart_field(body, CT, b"model")
    assert "over" in str(exc.value)


@pytest.mark.parametrize("route, body, field, bound", [
    (openai.ROUTES[0], b'{"model":"m","messages":[]}', "max_tokens", None),
    (openai.ROUTES[0], b'{"model":"m","max_completion_tokens":7}', "max_tokens", 7),
    (openai.ROUTES[0], b'{"model":"m","max_tokens":1,"max_completion_tokens":100000}', "max_tokens", 100000),
    (openai.ROUTES[0], b'{"model":"m","max_tokens":9,"n_predict":-1,"max_output_tokens":null}', "max_tokens", 9),
    (openai.ROUTES[1], b'{"model":"m","prompt":"p","n_predict":70}', "max_tokens", 70),  # llama.cpp's
    (openai.ROUTES[2], b'{"model":"m","max_tokens":7}', "max_tokens", None),  # embeddings: no bound read
    (openai.ROUTES[3], b'{"model":"m","max_tokens":7}', "max_output_tokens", 7),  # a box may read it there too
    (ollama.ROUTES[8], b'{"model":"m","options":{"num_predict":-1}}', "options.num_predict", None),
    (ollama.ROUTES[8], b'{"model":"m","options":null,"max_tokens":7}', "options.num_predict", None),
    (ollama.ROUTES[8], b'{"model":"m","options":{"num_predict":9}}', "options.num_predict", 9),
])
def test_the_answers_bound_is_read_from_the_routes_own_fields(route, body, field, bound):
    facade = ollama.FACADE if route in ollama.ROUTES else openai.FACADE
    assert read_call(body, "application/json", route, facade, None, None).max_tokens == bound
    assert not route.answer_bound or route.answer_bound[0] == field


@pytest.mark.parametrize("route, body, expected", [
    (openai.ROUTES[0], b'{"model":"m", "x":1}', b'{"max_tokens":40,"model":"m", "x":1}'),
    (openai.ROUTES[0], b' { "model":"m","max_tokens":null }', b' { "model":"m","max_tokens":40 }'),
    (openai.ROUTES[3], b'{"max_output_tokens":0,"model":"m"}', b'{"max_output_tokens":40,"model":"m"}'),
    (ollama.ROUTES[8], b'{"options":{"num_ctx":8192,"num_predict":-1},"model":"m"}',
     b'{"options":{"num_ctx":8192,"num_predict":40},"model":"m"}'),
    (ollama.ROUTES[8], b'{"model":"m","options":null}', b'{"model":"m","options":{"num_predict":40}}'),
    (ollama.ROUTES[8], b'{"model":"m"}', b'{"options":{"num_predict":40},"model":"m"}'),
    # every bound field the body holds, whichever a box reads first (issue 36 item 2)
    (openai.ROUTES[0], b'{"model":"m","max_tokens":1,"max_completion_tokens":100000}',
     b'{"model":"m","max_tokens":40,"max_completion_tokens":40}'),
    (openai.ROUTES[1], b'{"n_predict":-1,"model":"m","prompt":"p"}', b'{"max_tokens":40,"n_predict":40,"model":"m","prompt":"p"}'),
    (openai.ROUTES[3], b'{"model":"m","max_tokens":5,"max_output_tokens":9 }', b'{"model":"m","max_tokens":40,"max_output_tokens":40 }'),
])
def test_with_answer_bound_sets_the_bound_once_and_keeps_every_other_byte(route, body, expected):
    facade = ollama.FACADE if route in ollama.ROUTES else openai.FACADE
    spans = read_call(body, "application/json", route, facade, None, None).spans  # the scan it reuses
    assert with_answer_bound(body, route, spans, 40) == expected


def test_a_body_already_saying_the_bound_is_the_same_body():
    """A call stating the bound it is given, in the route's first field alone, goes as it came:
    no copy, so no second scan for a stream's usage either (serve/proxy.py)."""
    body = b'{"model":"m","max_tokens":40}'
    spans = read_call(body, "application/json", CHAT, openai.FACADE, None, None).spans
    assert with_answer_bound(body, CHAT, spans, 40) is body
    assert with_answer_bound(body, CHAT, spans, 39) == b'{"model":"m","max_tokens":39}'


@pytest.mark.parametrize("route, member, value", [
    (openai.ROUTES[0], "max_completion_tokens", b"1e5"),
    (openai.ROUTES[0], "max_completion_tokens", b'"100000"'),
    (openai.ROUTES[0], "max_tokens", b"100000.0"),
    (openai.ROUTES[0], "max_tokens", b"true"),
    (openai.ROUTES[0], "n_predict", b"2147483648"),  # wraps in llama.cpp's int32
    (openai.ROUTES[0], "max_tokens", b"-2147483648"),
    (openai.ROUTES[0], "max_tokens", b"[1]"),
    (openai.ROUTES[3], "max_output_tokens", b'{"n":1}'),
    (ollama.ROUTES[8], "options", b'{"num_predict":1.5}'),
    (ollama.ROUTES[8], "options", b'{"num_predict":"9"}'),
    (ollama.ROUTES[8], "options", b"[1]"),
    (ollama.ROUTES[8], "options", b'{"num_predict":9,"num_predict":99999}'),  # a key twice inside
])
def test_a_bound_that_is_not_a_whole_number_in_range_is_400(route, member, value):
    """Issue 36 item 2: boxes read a float, a string or a huge number each their own way
    (pydantic takes `1e5` and `"100000"` as 100000), so the router takes none of them."""
    facade = ollama.FACADE if route in ollama.ROUTES else openai.FACADE
    body = b'{"model":"m","messages":[],"%s":%s}' % (member.encode(), value)
    with pytest.raises(BadRequest) as exc:
        read_call(body, "application/json", route, facade, None, None)
    assert exc.value.status_hint == 400 and member in str(exc.value)


# --------------------------------------------------------------------------------------------
# the answer's bound, whichever field a box reads (issue 36 item 2)
# --------------------------------------------------------------------------------------------

UNBOUNDED = float("inf")  # a box with no bound it honours: its own default, up to the context


def lenient(value) -> float | None:
    """A bound as the most lenient box reads it (pydantic's lax mode: a bool, a whole float, a
    number in a string), or None where it reads none."""
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float):
        return math.ceil(value)
    if isinstance(value, str):
        try:
            return math.ceil(float(value))
        except ValueError:
            return None
    return None


def box_reads(doc: dict, order: tuple[str, ...], falls_through: bool) -> float:
    """The answer's tokens a box reading `order` can produce: the first field present (with
    `falls_through`, the first true one: vLLM's and SGLang's `max_completion_tokens or
    max_tokens`); 0 and below are llama.cpp's, Ollama's and LM Studio's "no bound"."""
    for name in order:
        outer, _, inner = name.partition(".")
        value = doc.get(outer)
        value = lenient(value.get(inner) if inner and isinstance(value, dict) else None if inner else value)
        if value is None or (falls_through and not value):
            continue
        return value if value > 0 else UNBOUNDED
    return UNBOUNDED


def read_orders(route) -> list[tuple[tuple[str, ...], bool]]:
    """Every order a box serving `route` may read its bound fields in: the route's first field
    (every such box reads it) alone, or after or before any other, falling through or not."""
    first, others = route.answer_bound[0], route.answer_bound[1:]
    orders = [(first,)] + [(other, first) for other in others] + [(first, other) for other in others]
    return [(order, falls) for order in orders for falls in (False, True)]


BOUND_ROUTES = [r for r in (*openai.ROUTES, *ollama.ROUTES) if r.answer_bound]
BOUND_VALUES = st.one_of(
    st.integers(-(2**40), 2**40).map(lambda n: b"%d" % n), st.integers(1, 5000).map(lambda n: b"%d" % n),
    st.sampled_from([b"null", b"0", b"-1", b"1e5", b"100000.0", b'"100000"', b"true", b"[1]", b'{"a":1}']),
)


@settings(max_examples=500, deadline=None, database=None)
@given(route=st.sampled_from(BOUND_ROUTES), fields=st.lists(st.tuples(
    st.sampled_from(["max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict", "num_predict"]),
    BOUND_VALUES, st.booleans()), max_size=6), room=st.integers(0, 100_000), default=st.integers(1, 4096))
def test_no_box_answers_more_than_the_call_reserved_whatever_bound_fields_it_sends(route, fields, room, default):
    """Any mix of bound fields, values and places (top level, or inside Ollama's `options`), for
    a key with token limits: refused with a 400, or the router reserves a bound and writes it so
    that a box reading any of them in any order produces at most that many tokens."""
    facade = ollama.FACADE if route in ollama.ROUTES else openai.FACADE
    top = [b'"%s":%s' % (name.encode(), value) for name, value, inside in fields if not inside]
    inner = [b'"%s":%s' % (name.encode(), value) for name, value, inside in fields if inside]
    options = [b'"options":{%s}' % b",".join(inner)] if inner else []
    body = b"{" + b",".join([b'"model":"m"', *top, *options, b'"messages":[]']) + b"}"
    try:
        inspected = read_call(body, "application/json", route, facade, None, None)
    except BadRequest as exc:
        assert exc.status_hint == 400
        return  # refused: nothing reaches a box
    tokens, bound = rules.reserve(len(body), inspected.max_tokens, default, room)
    answer_reserved = tokens - rules.prompt_estimate(len(body))
    sent = with_answer_bound(body, route, inspected.spans, bound)
    for pairs in (lambda items: dict(reversed(items)), dict):  # a box keeping the first of a key twice, or the last
        doc = json.loads(sent, object_pairs_hook=pairs)
        for order, falls_through in read_orders(route):
            assert box_reads(doc, order, falls_through) <= answer_reserved, (order, sent)
    assert {k: v for k, v in orjson.loads(sent).items() if k not in route.bound_members} == {
        k: v for k, v in orjson.loads(body).items() if k not in route.bound_members}


@pytest.mark.parametrize("second", [
    b'name="model"', b"name=model", b'NAME = "model"', b'name="file"; name="model"', b"name*=utf-8''model",
    b'name="model"; filename="m.txt"',
])
def test_a_form_naming_model_twice_is_400(second):
    """Issue 36 item 3: a box's parser may keep the last `model` part (Starlette's FormData does),
    and read its name however it is written: quoted or not, any of a head's `name`s, a file part."""
    body = multipart([field(b"model", b"vmodel"), FILE_PART, (b"Content-Disposition: form-data; " + second, b"vsecret")])
    with pytest.raises(BadRequest) as exc:
        multipart_field(body, CT, b"model")
    assert "more than once" in str(exc.value)
    assert multipart_field(multipart([field(b"model", b"vmodel"), FILE_PART]), CT, b"model") == "vmodel"
