"""Bad input at the front door: bodies, headers and paths no client should send.

One router (and one simulated fleet: a hugpy box, an Ollama server, an LM Studio server) serves
the whole module. Over the three facades on the main port (OpenAI `/v1/chat/completions`,
Ollama `/api/chat`, LM Studio `/api/v0/chat/completions`) every answer must be:
  * never a 500, and the process stays alive (its `/health` answers);
  * an error in the facade's own shape (OpenAI and LM Studio `{"error": {"message": ...}}`,
    Ollama `{"error": "..."}`), except where the HTTP server refuses a request before the app
    sees it (431/414/400 with an empty body and `connection: close`);
  * answered by the router alone: no simulated box records a call.
Hypothesis runs a bounded number of examples per property, without an example database.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from router.core.names import hugpy_split, ollama_key
from router.sim import SimBox, SimFleet, SimLMStudio, SimOllama

from conftest import RouterProcess, write_boxes

pytestmark = pytest.mark.timeout(60)

QWEN = "qwen/qwen3-14b"
MAX_BODY = 1 << 20  # room for 100k levels of nesting; the over-limit bodies are 1 MiB+
MESSAGES = [{"role": "user", "content": "hello"}]
ERROR_LINE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) ", re.MULTILINE)


@dataclass(frozen=True)
class Route:
    facade: str
    path: str
    model: str  # a model some box serves through this route


ROUTES = (
    Route("openai", "/v1/chat/completions", "tiny"),
    Route("ollama", "/api/chat", "llama3"),
    Route("lmstudio", "/api/v0/chat/completions", QWEN),
)
ROUTE_IDS = [r.facade for r in ROUTES]

# Bounded for the suite; BAD_INPUT_EXAMPLES=2000 explores further.
BOUNDED = settings(max_examples=int(os.environ.get("BAD_INPUT_EXAMPLES", "40")), deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# The door: one router for the module


@dataclass
class Door:
    router: RouterProcess
    boxes: tuple

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.router.url.removeprefix("http://").split(":")
        return host, int(port)

    def box_calls(self) -> int:
        return sum(len(box.calls) for box in self.boxes)


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    h = SimBox("h", catalog=["tiny"], residents=["tiny"])
    ol = SimOllama("ol", tags=["llama3"], loaded=["llama3"])
    lm = SimLMStudio("lm", models=[QWEN], loaded=[QWEN])
    fleet = SimFleet([h, ol, lm])
    fleet.start()
    path = write_boxes(tmp_path_factory.mktemp("bad-input") / "boxes.json", [h, ol, lm])
    router = RouterProcess(path, "--max-body", str(MAX_BODY))
    router.fleet = fleet
    try:
        yield Door(router, (h, ol, lm))
    finally:
        router.stop()
        fleet.stop()


@pytest.fixture(autouse=True)
def still_standing(door):
    """After every test: alive, healthy, no box contacted, nothing logged at ERROR."""
    before = door.box_calls()
    yield
    assert door.router.proc.poll() is None, "the router died"
    status, _, body = send(door, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert door.box_calls() == before, "a box was contacted"
    errors = [line for line in door.router.log_text().splitlines() if ERROR_LINE.match(line)]
    assert not errors, errors


# ---------------------------------------------------------------------------------------------
# Talking to it


def send(door: Door, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 10) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(*door.address, timeout=timeout)
    try:
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the door answered early (a 413) and closed: read its answer, as curl does
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def send_raw(door: Door, data: bytes, pieces: int = 1, gap_s: float = 0.0, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Writes `data` (a whole request) in `pieces`, `gap_s` apart; reads one answer."""
    sock = socket.create_connection(door.address, timeout=timeout)
    try:
        step = max(1, -(-len(data) // pieces))
        for start in range(0, len(data), step):
            if start:
                time.sleep(gap_s)
            try:
                sock.sendall(data[start:start + step])
            except (BrokenPipeError, ConnectionResetError):
                break  # the door answered early and closed: read its answer, as curl does
        resp = http.client.HTTPResponse(sock, method="POST")
        resp.begin()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        sock.close()


def request_bytes(path: str, body: bytes, headers: dict | None = None, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: router", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def refused_at_the_server(door, route, data: bytes) -> None:
    """Raw bytes the HTTP server itself may refuse: a clean refusal in shape, or a closed
    connection (clean enough, and nothing reached a box)."""
    try:
        status, headers, answer = send_raw(door, data)
    except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
        return
    refused_in_shape(route.facade, status, headers, answer, server_level=True)


def refused_in_shape(facade: str, status: int, headers: dict, body: bytes, *, server_level: bool = False) -> None:
    """A clean refusal: 4xx (or the 502/503 of an empty owner set), never 500, in the facade's
    shape. `server_level`: the HTTP server may refuse before the app with an empty body."""
    assert status != 500 and 400 <= status < 600 and status not in (500, 504), (status, body[:300])
    if server_level and not body:
        assert status in (400, 413, 414, 431), status
        return
    assert headers.get("content-type", "").startswith("application/json"), headers
    doc = json.loads(body)
    if facade == "ollama":
        assert isinstance(doc.get("error"), str) and doc["error"], doc
    else:
        error = doc.get("error")
        assert isinstance(error, dict) and isinstance(error.get("message"), str), doc
        assert isinstance(error.get("code"), str), doc


def routable(model: str) -> bool:
    """Would some box of the door serve this name (under any kind's name rule)?"""
    return hugpy_split(model)[0] == "tiny" or ollama_key(model) == ollama_key("llama3") or model == QWEN


# ---------------------------------------------------------------------------------------------
# Bodies


@BOUNDED
@given(route=st.sampled_from(ROUTES), body=st.binary(max_size=512))
def test_arbitrary_bytes_as_a_body(door, route, body):
    status, headers, data = send(door, "POST", route.path, body)
    refused_in_shape(route.facade, status, headers, data)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                     st.text(max_size=20))
_json_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                            max_leaves=12)
_bad_models = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.sampled_from(["tiny", "llama3", QWEN]), max_size=2),
    st.dictionaries(st.sampled_from(["name", "model", "id"]), st.sampled_from(["tiny", "llama3", QWEN]), max_size=2),
    st.just(""), st.just("   "),
    st.text(max_size=60).filter(lambda m: not routable(m)),
)


@BOUNDED
@given(route=st.sampled_from(ROUTES), model=_bad_models, extra=st.dictionaries(
    st.sampled_from(["messages", "stream", "options", "alloc", "temperature", "x"]), _json_values, max_size=4))
def test_a_missing_non_string_or_unknown_model_is_refused_by_the_router(door, route, model, extra):
    doc = {**extra, "model": model}
    status, headers, data = send(door, "POST", route.path, json.dumps(doc).encode())
    refused_in_shape(route.facade, status, headers, data)


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("model", [42, 4.2, True, None, [], {}, ["tiny"], {"name": "tiny"}, "", " "])
def test_a_non_string_or_empty_model_is_400(door, route, model):
    status, headers, data = send(door, "POST", route.path, json.dumps({"model": model, "messages": MESSAGES}).encode())
    assert status == 400
    refused_in_shape(route.facade, status, headers, data)


INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc0\x80", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                b"\x80", b"\xf8\x88\x80\x80\x80"]


@BOUNDED
@given(route=st.sampled_from(ROUTES), bad=st.sampled_from(INVALID_UTF8), where=st.sampled_from(["model", "content", "key"]),
       text=st.text(max_size=10))
def test_invalid_utf8_anywhere_in_a_json_body_is_400(door, route, bad, where, text):
    """Even around a model some box serves: the body is not JSON, so it goes nowhere."""
    fill = text.encode() + bad
    if where == "model":
        body = b'{"model": "' + route.model.encode() + fill + b'", "messages": []}'
    elif where == "content":
        body = b'{"model": "' + route.model.encode() + b'", "messages": [{"role": "user", "content": "' + fill + b'"}]}'
    else:
        body = b'{"model": "' + route.model.encode() + b'", "' + fill + b'": 1}'
    status, headers, data = send(door, "POST", route.path, body)
    assert status == 400, data
    refused_in_shape(route.facade, status, headers, data)


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("nesting", ["array", "object", "inside-a-valid-call"])
def test_deep_nesting_is_400(door, route, nesting):
    depth = 100_000
    if nesting == "array":
        body = b"[" * depth
    elif nesting == "object":
        body = b'{"a":' * depth + b"1" + b"}" * depth
    else:
        body = (b'{"model": "' + route.model.encode() + b'", "messages": ' + b"[" * depth + b"]" * depth + b"}")
    assert len(body) <= MAX_BODY  # the over-limit case is its own test
    status, headers, data = send(door, "POST", route.path, body)
    assert status == 400, data
    refused_in_shape(route.facade, status, headers, data)


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("number", [b"1e999", b"-1e999", b"9" * 5000, b"1" + b"0" * 400 + b".5e-99999", b"0." + b"0" * 5000 + b"1"])
def test_huge_numbers_where_the_model_goes_are_refused(door, route, number):
    for body in (b'{"model": ' + number + b', "messages": []}',
                 b'{"model": "' + route.model.encode() + b'", "alloc": {"worker": ' + number + b"}}"):
        status, headers, data = send(door, "POST", route.path, body)
        assert status == 400, data
        refused_in_shape(route.facade, status, headers, data)


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_huge_numbers_elsewhere_never_500(door, route):
    """A huge number in a field the router does not read: served or refused, never a 500."""
    boxes_before = door.box_calls()
    for number in (b"1e999", b"9" * 5000, b"-0.0e-99999"):
        body = b'{"model": "' + route.model.encode() + b'", "messages": [], "temperature": ' + number + b"}"
        status, headers, data = send(door, "POST", route.path, body)
        assert status != 500, data
        if status >= 400 and door.box_calls() == boxes_before:
            refused_in_shape(route.facade, status, headers, data)
        boxes_before = door.box_calls()
    for box in door.boxes:  # whatever was served here is not "bad input reaching a box"
        box.calls.clear()


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("key", [b"model", b"mod\\u0065l", b"\\u006dodel"])
def test_duplicate_model_keys_are_400(door, route, key):
    """Keys as JSON decodes them: an escaped `model` is the same key."""
    body = b'{"model": "ghost-model", "messages": [], "' + key + b'": "' + route.model.encode() + b'"}'
    try:
        status, headers, data = send(door, "POST", route.path, body)
        assert status == 400, (status, data[:200])
        refused_in_shape(route.facade, status, headers, data)
        assert b"more than once" in data
    finally:
        for box in door.boxes:
            box.calls.clear()  # keep the module's no-box invariant about the other tests


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_a_large_body_is_inspected_off_the_loop_alike(door, route):
    """Over 256 KiB the body is joined and scanned on a worker thread: same answers."""
    pad = "x" * (600 << 10)
    cases = [
        ({"model": route.model, "messages": MESSAGES, "pad": pad}, 200),
        ({"model": "nobody-serves-this", "messages": MESSAGES, "pad": pad}, None),  # refused by the gate
    ]
    try:
        for doc, expected in cases:
            status, headers, data = send(door, "POST", route.path, json.dumps(doc).encode())
            if expected == 200:
                assert status == 200, (status, data[:200])
            else:
                refused_in_shape(route.facade, status, headers, data)
                assert status in (404, 502, 503)  # Ollama's 404 for a model no box lists
        for bad in (b'{"model": "' + route.model.encode() + b'", "pad": "' + pad.encode() + b'\xff"}',
                    b'{"model": "' + route.model.encode() + b'", "pad": "' + pad.encode() + b'", "mod\\u0065l": "x"}',
                    b'{"model": "' + route.model.encode() + b'", "pad": [' + b"1," * (300 << 10) + b"]}"):
            status, headers, data = send(door, "POST", route.path, bad)
            assert status == 400, (status, data[:200])
            refused_in_shape(route.facade, status, headers, data)
    finally:
        for box in door.boxes:
            box.calls.clear()


LONG_ID = 257  # bytes: one past router.core.bounds.MAX_IDENTIFIER_BYTES


def too_long_in_shape(route: Route, status: int, headers: dict, data: bytes, value: str) -> None:
    assert status == 400, (status, data[:200])
    refused_in_shape(route.facade, status, headers, data)
    assert value.encode() not in data and len(data) < 1024
    if route.facade != "ollama":
        assert json.loads(data)["error"]["code"] == "identifier_too_long"


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("where", ["model", "alloc.worker", "alloc.pool", "X-Router-Box", "X-Router-Pool"])
def test_identifiers_over_the_cap_are_400_never_echoed_in_full(door, route, where):
    value = "q" * LONG_ID
    doc, headers = {"model": route.model, "messages": MESSAGES}, {}
    if where == "model":
        doc["model"] = value
    elif where.startswith("alloc."):
        doc["alloc"] = {where.removeprefix("alloc."): value}
    else:
        headers[where] = value
    status, answer_headers, data = send(door, "POST", route.path, json.dumps(doc).encode(), headers)
    too_long_in_shape(route, status, answer_headers, data, value)


@pytest.mark.parametrize("field", ["name", "model"])
def test_ollama_name_over_the_cap_is_400(door, field):
    value = "n" * LONG_ID
    status, headers, data = send(door, "POST", "/api/show", json.dumps({field: value}).encode())
    too_long_in_shape(Route("ollama", "/api/show", "llama3"), status, headers, data, value)


@BOUNDED
@given(route=st.sampled_from(ROUTES), size=st.integers(1, 600), unit=st.sampled_from(["a", "é", "€", "😀"]),
       where=st.sampled_from(["model", "alloc.worker", "X-Router-Box"]))
def test_identifier_sizes_fuzzed(door, route, size, unit, where):
    """Any size: at most 256 bytes routes (or is refused by name), more is a 400 in shape; the
    answer stays small either way."""
    value = (unit * size)[:size]
    doc, headers = {"model": route.model, "messages": MESSAGES}, {}
    if where == "model":
        doc["model"] = value
    elif where == "alloc.worker":
        doc["alloc"] = {"worker": value}
    elif unit == "a":  # header values are Latin-1 on the wire
        headers[where] = value
    else:
        return
    status, answer_headers, data = send(door, "POST", route.path, json.dumps(doc).encode(), headers)
    refused_in_shape(route.facade, status, answer_headers, data)
    if len(value.encode()) > 256:
        too_long_in_shape(route, status, answer_headers, data, value)
    else:  # unknown name (refused by the gate, every box's reason listed) or unknown box (404)
        assert status in (400, 404, 502, 503) and len(data) < 8 * 1024, (status, len(data))


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_bodies_over_max_body_are_413_declared_or_not(door, route):
    big = b'{"model": "' + route.model.encode() + b'", "pad": "' + b"x" * MAX_BODY + b'"}'
    status, headers, data = send(door, "POST", route.path, big)
    assert status == 413
    refused_in_shape(route.facade, status, headers, data)
    # Undeclared (chunked): refused once it passes the limit.
    head = (f"POST {route.path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 8192]), big[i:i + 8192]) for i in range(0, len(big), 8192))
    status, headers, data = send_raw(door, head + chunks + b"0\r\n\r\n")
    assert status == 413
    refused_in_shape(route.facade, status, headers, data)
    # A declared length far past the limit is refused before a byte of it is read.
    status, headers, data = send_raw(door, request_bytes(route.path, b"").replace(
        b"Content-Length: 0", b"Content-Length: %d" % (1 << 40)))
    assert status == 413
    refused_in_shape(route.facade, status, headers, data)


# ---------------------------------------------------------------------------------------------
# Headers


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("name", ["X-Junk", "Accept", "X-Task", "Authorization", "Cookie", "X-Router-Box"])
def test_a_100kb_header_never_breaks_the_door(door, route, name):
    value = "a" * 100_000
    # With a bad body: the body's refusal, whatever the header.
    status, headers, data = send_raw(door, request_bytes(route.path, b'{"model": ', {name: value}))
    refused_in_shape(route.facade, status, headers, data, server_level=True)
    # A 100 KB pin: refused by name, no box contacted.
    if name == "X-Router-Box":
        body = json.dumps({"model": route.model, "messages": MESSAGES}).encode()
        status, headers, data = send_raw(door, request_bytes(route.path, body, {name: value}))
        refused_in_shape(route.facade, status, headers, data, server_level=True)


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("shape", ["one-1MB-header", "500-headers", "100KB-path"])
def test_headers_or_paths_past_the_server_limits_are_refused_cleanly(door, route, shape):
    body = json.dumps({"model": route.model, "messages": MESSAGES}).encode()
    if shape == "one-1MB-header":
        data = request_bytes(route.path, body, {"X-Junk": "a" * (1 << 20)})
    elif shape == "500-headers":
        data = request_bytes(route.path, body, {f"X-H{i}": "v" for i in range(500)})
    else:
        data = request_bytes(route.path + "/" + "a" * 100_000, body)
    refused_at_the_server(door, route, data)


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("framing", [
    b"Content-Length: -1\r\n", b"Content-Length: 2\r\nContent-Length: 3\r\n", b"Content-Length: 1e3\r\n",
    b"Content-Length: 99999999999999999999999\r\n", b"Transfer-Encoding: gzip\r\n",
], ids=["negative-length", "two-lengths", "float-length", "huge-length", "gzip-only"])
def test_broken_framing_headers_are_refused_cleanly(door, route, framing):
    data = f"POST {route.path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n".encode() + framing + b"\r\n{}"
    refused_at_the_server(door, route, data)


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("chunks", [
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}}}\r\n0\r\n\r\n",
    b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}0\r\n\r\n",
    b"Transfer-Encoding: gzip, chunked\r\nContent-Length: 2\r\n\r\n{}",
], ids=["bad-size", "data-past-size", "missing-crlf", "te-and-length"])
def test_a_malformed_chunked_body_is_refused_never_a_500(door, route, chunks):
    data = f"POST {route.path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n".encode() + chunks
    refused_at_the_server(door, route, data)


# ---------------------------------------------------------------------------------------------
# Slow uploads


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_slow_uploads_of_bad_bodies_are_refused_in_shape(door, route):
    for body in (b'{"model": ' + b" " * 400 + b"42}", b'{"model": "nobody-serves-this", "pad": "' + b"x" * 400 + b'"}'):
        status, headers, data = send_raw(door, request_bytes(route.path, body), pieces=8, gap_s=0.04)
        refused_in_shape(route.facade, status, headers, data)


# ---------------------------------------------------------------------------------------------
# Paths and methods

ADMIN_PREFIXES = ("/v1/boxes", "/v1/keys", "/v1/telemetry", "/v1/router", "/metrics")
_path_chars = st.sampled_from(list("abcxyz019-._~/:@!$&'()*+,;=") + ["%00", "%2F", "%2e", "%FF", "%E2%82%AC", "%0D%0A"])


def _facade_of(path: str) -> str:
    if path.startswith("/v1/") or path == "/health":
        return "openai"
    if path.startswith(("/api/v0/", "/api/v1/")):
        return "lmstudio"
    if path.startswith("/api/") or path == "/":
        return "ollama"
    return "openai"


@BOUNDED
@given(prefix=st.sampled_from(["/v1/", "/v1/chat/", "/api/", "/api/v0/", "/api/v1/", "/", "//", "/v1/models/"]),
       rest=st.lists(_path_chars, max_size=20).map("".join),
       query=st.one_of(st.just(""), st.lists(_path_chars, max_size=8).map(lambda q: "?" + "".join(q))),
       method=st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"]),
       body=st.sampled_from([b"", b"{", b'{"model": 7}', b'{"model": "nobody-serves-this"}']))
def test_any_path_and_method_is_answered_in_the_facade_shape(door, prefix, rest, query, method, body):
    path = prefix + rest
    assume(not path.startswith(ADMIN_PREFIXES))
    status, headers, data = send_raw(door, request_bytes(path + query, body, method=method))
    assert status != 500, (path, data[:300])
    facade = _facade_of(path)
    if status >= 400:
        refused_in_shape(facade, status, headers, data, server_level=True)
    else:  # a fleet answer (`/v1/models`, `/api/tags`, LM Studio's 200 for unknown endpoints, ...)
        assert data == b"Ollama is running" or isinstance(json.loads(data), dict), data[:300]
