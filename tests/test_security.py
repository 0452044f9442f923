"""The front door against hostile callers (issue 11: probes, the caller behind proxies, browsers,
engine management, admin input, the security model), end to end against a running router.

Callers other than loopback are made on loopback: the router trusts `PROXY` (127.0.0.9) as a
proxy, and a connection from that source address names the caller in `X-Forwarded-For`. The
verdict depends on the resolved address and on whether a proxy named it, never on how the TCP
peer got its address, so a private or outside caller named this way is judged as a direct one
(tests/test_access.py pins that the two agree).
"""

from __future__ import annotations

import asyncio
import http.client
import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.parse

import ollama
import openai
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.types import BoxKind
from router.serve import admin, body
from router.serve.clock import CallClock
from router.serve.edge import AsgiEdge
from router.sim import SimBox, SimLMStudio, SimOllama

from conftest import ROOT, wait_for
from support.url_calls import ADMIN_KEY, CHAT, call, route_rows

PROXY = "127.0.0.9"
LAN, OUT = "192.168.1.9", "203.0.113.5"
LM_MODEL = "qwen/qwen3-14b"


def via(address: str) -> dict:
    """What `call` needs to come through the trusted proxy on behalf of `address`."""
    return {"source": PROXY, "headers": {"X-Forwarded-For": address}}


def mint(router, scope: str) -> str:
    status, _, data = call(router.url, "POST", "/v1/keys", {"name": f"t-{scope}", "scope": scope})
    assert status == 201, data
    return json.loads(data)["key"]


def error_code(body: bytes) -> str:
    """The code of an OpenAI-shaped error."""
    return json.loads(body)["error"]["code"]


# --- probes (item 2) -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode, interface", [("never", "asgi"), ("outside", "rsgi"), ("always", "asgi")])
def test_probes_answer_in_every_mode_and_list_nothing(start_fleet_in_process, mode, interface):
    a = SimBox("secret-box-name", catalog=["secret-model"], residents=["secret-model"])
    router = start_fleet_in_process(a, extra_args=("--interface", interface),
                         env={"HUGPY_ROUTER_REQUIRE_KEY": mode, "HUGPY_ROUTER_TRUSTED_PROXIES": PROXY})
    hostile = {"Origin": "https://evil.example", "Host": "evil.example", "X-Forwarded-For": OUT}
    for path in ("/health", "/v1/health"):
        for how in ({}, via(OUT), {"headers": hostile}, {"key": "hpk_bad_key"}):
            status, headers, body = call(router.url, "GET", path, **how)
            assert status == 200, (path, how, body)
            assert json.loads(body) == {"status": "ok", "service": "router", "version": json.loads(body)["version"]}
            assert b"secret" not in body and "access-control-allow-origin" not in headers
        status, _, body = call(router.url, "HEAD", path, **via(OUT))
        assert status == 200 and body == b""


# --- the caller (item 3) -------------------------------------------------------------------------


@pytest.mark.parametrize("interface", ["asgi", "rsgi"])
def test_an_ipv6_loopback_peer_is_loopback_on_both_interfaces(start_fleet_in_process, interface):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a, extra_args=("--host", "::1", "--interface", interface),
                         env={"HUGPY_ROUTER_KEY": ADMIN_KEY})
    assert router.url.startswith("http://[::1]:")
    status, _, body = call(router.url, "GET", "/v1/router/state", source="::1")  # Host: [::1]:port
    assert status == 200, body  # keyless admin: the peer parsed as loopback ([::1] on RSGI before)
    assert call(router.url, "POST", "/v1/chat/completions", CHAT, source="::1")[0] == 200
    rows = wait_for(lambda: route_rows(router, source="::1"), 3)
    assert [r["client"] for r in rows] == ["::1"]


@pytest.mark.parametrize("interface", ["asgi", "rsgi"])
def test_the_route_log_records_the_resolved_caller_and_both_interfaces_agree(start_fleet_in_process, interface):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a, extra_args=("--interface", interface),
                         env={"HUGPY_ROUTER_TRUSTED_PROXIES": PROXY, "HUGPY_ROUTER_REQUIRE_KEY": "never",
                              "HUGPY_ROUTER_KEY": ADMIN_KEY})
    # A client's own XFF line, then the line the proxy appended: the proxy's line decides.
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 127.0.0.1\r\n"
           b"X-Forwarded-For: " + OUT.encode() + b"\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(json.dumps(CHAT)) + json.dumps(CHAT).encode())
    port = int(router.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), source_address=(PROXY, 0), timeout=10) as sock:
        sock.sendall(raw)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    assert call(router.url, "POST", "/v1/chat/completions", CHAT, source=PROXY,
                headers={"Forwarded": 'for="[2001:db8::7]:4711";proto=https'})[0] == 200
    assert call(router.url, "POST", "/v1/chat/completions", CHAT, source=PROXY,
                headers={"X-Real-IP": LAN})[0] == 200
    assert call(router.url, "POST", "/v1/chat/completions", CHAT, source=PROXY)[0] == 200  # names nobody
    assert call(router.url, "POST", "/v1/chat/completions", CHAT, source="127.0.0.1",
                headers={"X-Forwarded-For": OUT})[0] == 200  # spoofed from an untrusted peer
    rows = wait_for(lambda: (r := route_rows(router)) and len(r) == 5 and r, 3)
    assert [r["client"] for r in rows] == [OUT, "2001:db8::7", LAN, None, None]
    # The proxy itself is never the caller: keyless admin through it is refused.
    status, _, body = call(router.url, "GET", "/v1/router/state", source=PROXY)
    assert status == 401 and error_code(body) == "invalid_api_key"
    status, _, body = call(router.url, "GET", "/v1/router/state", source=PROXY,
                           headers={"X-Forwarded-For": "127.0.0.1"})
    assert status == 401  # a loopback address named by a proxy is not this machine


# --- browsers (item 4) ---------------------------------------------------------------------------


def test_browser_borne_requests_cannot_manage_a_keyless_loopback_router(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    box = SimOllama("o", tags=["llama3:latest"])
    router = start_fleet_in_process(a, box, env={"HUGPY_ROUTER_KEY": ADMIN_KEY,
                                      "HUGPY_ROUTER_ALLOWED_HOSTS": "router.lan",
                                      "HUGPY_ROUTER_ALLOWED_ORIGINS": "https://dash.example"})
    port = router.url.rsplit(":", 1)[1]
    own = {"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port}"}
    # Origin: the router's own or an allowed one; anything else is refused, whatever the key.
    assert call(router.url, "GET", "/v1/router/state", headers=own)[0] == 200
    assert call(router.url, "GET", "/v1/router/state", headers={"Origin": "https://dash.example"})[0] == 200
    for origin in ("https://evil.example", "null", f"http://localhost:{port}"):
        status, _, body = call(router.url, "POST", "/v1/keys", {"name": "x"}, headers={"Origin": origin})
        assert status == 403 and error_code(body) == "origin_not_allowed", origin
        status, _, body = call(router.url, "GET", "/v1/router/state", headers={"Origin": origin}, key=ADMIN_KEY)
        assert status == 403 and error_code(body) == "origin_not_allowed"
    status, _, body = call(router.url, "POST", "/api/pull", {"model": "llama3", "stream": False},
                           headers={"Origin": "https://evil.example"})
    assert status == 403 and "Origin" in json.loads(body)["error"]  # Ollama's shape
    status, _, body = call(router.url, "POST", "/v1/chat/completions", CHAT, headers={"Origin": "https://evil.example"})
    assert status == 403 and error_code(body) == "origin_not_allowed"  # use routes too (issue 20 item 1)
    # DNS rebinding: the page's own name resolves to 127.0.0.1, so Host and Origin agree.
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    status, _, body = call(router.url, "POST", "/v1/keys", {"name": "stolen"}, headers=rebound)
    assert status == 403 and error_code(body) == "host_not_allowed"
    status, _, body = call(router.url, "POST", "/api/pull", {"model": "llama3", "stream": False}, headers=rebound)
    assert status == 403
    assert call(router.url, "GET", "/v1/keys", headers={"Host": "evil.example"}, key=ADMIN_KEY)[0] == 200
    for host in ("localhost", f"localhost:{port}", "[::1]", "127.3.0.1", "router.lan:8080"):
        assert call(router.url, "GET", "/v1/keys", headers={"Host": host})[0] == 200, host
    status, _, data = call(router.url, "GET", "/v1/keys?all=1")
    assert "stolen" not in data.decode()
    # JSON admin bodies: the JSON type only (a form or text/plain POST needs no preflight).
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        status, _, body = call(router.url, "POST", "/v1/keys", b'{"name": "x"}', headers=headers)
        assert status == 415 and error_code(body) == "unsupported_media_type", content_type
        status, _, body = call(router.url, "POST", "/api/pull", b'{"model": "llama3", "stream": false}',
                               headers=headers)
        assert status == 415 and "application/json" in json.loads(body)["error"]
    assert not [c for c in box.calls if c.path == "/api/pull"]
    # No CORS: a preflight is never granted and no answer allows another origin.
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}
    for path in ("/v1/keys", "/v1/chat/completions", "/api/pull", "/api/chat", "/api/v1/models/load", "/health"):
        status, headers, _ = call(router.url, "OPTIONS", path, headers=preflight)
        assert not [h for h in headers if h.startswith("access-control-")], (path, headers)
        assert status not in (200, 204) or path.startswith("/api/v1/")  # LM Studio's 200 for unknown routes
    _, headers, _ = call(router.url, "POST", "/v1/chat/completions", CHAT, headers={"Origin": "https://x.example"})
    assert not [h for h in headers if h.startswith("access-control-")]


# --- engine management (item 5) ------------------------------------------------------------------

OLLAMA_MANAGEMENT = [
    ("POST", "/api/pull", {"model": "llama3", "stream": False}),
    ("POST", "/api/push", {"model": "llama3", "stream": False}),
    ("DELETE", "/api/delete", {"model": "llama3"}),
    ("POST", "/api/copy", {"source": "llama3", "destination": "llama3-copy"}),
    ("POST", "/api/create", {"model": "mine", "from": "llama3", "stream": False}),
    ("POST", "/api/blobs/sha256:" + "0" * 64, b"blob"),
    ("HEAD", "/api/blobs/sha256:" + "0" * 64, None),
]
LMSTUDIO_MANAGEMENT = [
    ("POST", "/api/v1/models/load", {"model": LM_MODEL}),
    ("POST", "/api/v1/models/unload", {"instance_id": LM_MODEL}),
    ("POST", "/api/v1/models/download", {"model": LM_MODEL}),
]


def test_engine_management_is_admin_scope_and_a_use_key_never_reaches_a_box(start_fleet_in_process):
    box = SimOllama("o", tags=["llama3:latest"])
    lm = SimLMStudio("lm", models=[LM_MODEL], loaded=[LM_MODEL])
    router = start_fleet_in_process(box, lm, extra_args=("--ollama-port", "auto", "--lmstudio-port", "auto"),
                         env={"HUGPY_ROUTER_TRUSTED_PROXIES": PROXY, "HUGPY_ROUTER_KEY": ADMIN_KEY})
    use_key = mint(router, "use")
    managed = {path for _, path, _ in OLLAMA_MANAGEMENT + LMSTUDIO_MANAGEMENT}
    before = len([c for b in (box, lm) for c in b.calls if c.path in managed])
    for url in (router.url, router.urls["ollama"], router.urls["lmstudio"]):
        rows = OLLAMA_MANAGEMENT if url == router.urls["ollama"] else LMSTUDIO_MANAGEMENT
        if url == router.url:
            rows = OLLAMA_MANAGEMENT + LMSTUDIO_MANAGEMENT
        for method, path, body in rows:
            status, _, data = call(url, method, path, body, key=use_key, **via(LAN))
            assert status == 403, (url, method, path, data)
            if method == "HEAD":
                continue
            error = json.loads(data)["error"]
            if path.startswith("/api/v1/"):  # LM Studio speaks OpenAI's shape
                assert error["code"] == "insufficient_scope"
            else:  # Ollama's: {"error": "..."}
                assert isinstance(error, str) and "scope use" in error
            status, _, _ = call(url, method, path, body, **via(LAN))
            assert status == 401  # no key from a private net: engine management is not a use route
    assert len([c for b in (box, lm) for c in b.calls if c.path in managed]) == before  # no box contacted
    # Inference stays use.
    assert call(router.url, "POST", "/api/chat", {"model": "llama3", "messages": [], "stream": False},
                key=use_key, **via(OUT))[0] == 200
    assert call(router.url, "POST", "/api/v0/chat/completions",
                {"model": LM_MODEL, "messages": [{"role": "user", "content": "x"}]}, key=use_key, **via(OUT))[0] == 200
    # An admin key manages.
    status, _, data = call(router.url, "POST", "/api/pull", {"model": "llama3", "stream": False},
                           key=ADMIN_KEY, **via(OUT))
    assert status == 200 and json.loads(data) == {"status": "success"}
    assert call(router.urls["lmstudio"], "POST", "/api/v1/models/load", {"model": LM_MODEL},
                key=ADMIN_KEY, **via(OUT))[0] == 200


# --- admin input (item 11) -----------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False) | st.text(max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
KEY_FIELDS = st.fixed_dictionaries({}, optional={
    "name": JSON_VALUES | st.text(min_size=1, max_size=300),
    "scope": JSON_VALUES | st.sampled_from(["use", "admin", "root", ""]),
    "expires_days": JSON_VALUES | st.sampled_from([1, 0.5, 36500, 36501, 1e308, -1, 10**30]),
})


# What the router's own link to a hugpy box asks, whatever the relay does.
LINK_POLLS = {("GET", "/health"), ("GET", "/v1/telemetry/state")}


class RecordingBox(http.server.ThreadingHTTPServer):
    """A box that records each request line's target as sent and answers `{}` to anything (HEAD
    with the length and no body, as HTTP wants): what the relay sent, byte for byte."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        box = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def handle_one_request(self) -> None:
                self.raw_requestline = self.rfile.readline(65537)
                if not self.raw_requestline or not self.parse_request():
                    return
                if (self.command, self.path.partition("?")[0]) not in LINK_POLLS:
                    box.seen.append((self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.name, self.kind, self.key = "rec", "hugpy", "hpk_box_recordkey0000000000"
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def admin_router(tmp_path_factory):
    from conftest import RouterProcess, write_boxes
    from router.sim import SimFleet

    tmp = tmp_path_factory.mktemp("admin")
    a = SimBox("a", key="hpk_box_relaykey000000000000", catalog=["tiny"], residents=["tiny"])
    rec = RecordingBox()
    fleet = SimFleet([a])
    fleet.start()
    router = RouterProcess(write_boxes(tmp / "boxes.json", [a, rec]), "--max-body", "1048576")
    router.box = a
    router.recorder = rec
    yield router
    router.stop()
    fleet.stop()
    rec.shutdown()
    rec.server_close()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=KEY_FIELDS | JSON_VALUES)
def test_any_keys_body_is_201_or_a_400_never_a_500(admin_router, doc):
    status, _, body = call(admin_router.url, "POST", "/v1/keys", json.dumps(doc).encode(),
                           headers={"Content-Type": "application/json"})
    assert status in (201, 400), (status, body)
    if status == 400:
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] and len(body) < 1024


@pytest.mark.parametrize(
    "body, status, code",
    [
        (b'{"name": "x", "expires_days": 1e308}', 400, "invalid_expiry"),
        (b'{"name": "x", "expires_days": 123456789012345678901234567890}', 400, "invalid_expiry"),
        (b'{"name": "x", "expires_days": 1e400}', 400, "invalid_json"),
        (b'{"name": "x", "expires_days": "10"}', 400, "invalid_expiry"),
        (b'{"name": "x", "expires_days": true}', 400, "invalid_expiry"),
        (b'{"name": "x", "expires_days": -1}', 400, "invalid_expiry"),
        (b'{"name": 12}', 400, "invalid_request"),
        (b'{"name": "x", "scope": ["admin"]}', 400, "invalid_request"),
        (b'{"name": "' + b"n" * 300 + b'"}', 400, "invalid_name"),
        (b"[1, 2]", 400, "invalid_request"),
        (b"{bad", 400, "invalid_json"),
        (b"[" * 5000 + b"]" * 5000, 400, "invalid_json"),
        (b'{"name": "' + b"n" * (70 * 1024) + b'"}', 413, "body_too_large"),
    ],
)
def test_bad_keys_bodies_get_400_or_413_in_the_error_shape(admin_router, body, status, code):
    got, _, data = call(admin_router.url, "POST", "/v1/keys", body, headers={"Content-Type": "application/json"})
    assert (got, error_code(data)) == (status, code)


@pytest.mark.parametrize(
    "query, status",
    [("since=99999999999999999999", 400), ("since=-1", 400), ("since=" + "9" * 5000, 400), ("since=x", 400),
     ("limit=99999999999999999999", 200), ("since=9223372036854775807", 200), ("limit=-5", 200)],
)
def test_route_log_cursor_numbers_are_bounded(admin_router, query, status):
    got, _, data = call(admin_router.url, "GET", f"/v1/telemetry?{query}")
    assert got == status, data
    if status == 400:
        assert error_code(data) == "bad_query"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(since=st.text(max_size=30) | st.integers(-(10**25), 10**25).map(str),
       limit=st.text(max_size=30) | st.integers(-(10**25), 10**25).map(str))
def test_any_route_log_cursor_is_200_or_400_never_500(admin_router, since, limit):
    query = urllib.parse.urlencode({"since": since, "limit": limit})
    status, _, data = call(admin_router.url, "GET", f"/v1/telemetry?{query}")
    assert status in (200, 400), data


@given(path=st.text(max_size=40) | st.lists(st.sampled_from(["v1", "models", "telemetry", "settings", "..", ".", "",
                                                              "%3F", "?", "#", "%", "a b", "\\", "é", "storage"]),
                                             max_size=5).map("/".join),
       query=st.sampled_from(["", "a=1", "a=%3F&b=2", "x\r\ny"]))
def test_a_relay_target_is_refused_or_reaches_exactly_the_judged_segments(path, query):
    target = admin.relay_target(path, query)
    if target is None:
        return
    assert target.startswith("/") and all(0x21 <= ord(c) < 0x7F for c in target)
    sent_path, _, sent_query = target.partition("?")
    segments = [urllib.parse.unquote(s) for s in sent_path[1:].split("/")]  # the box decodes once
    assert segments == path.removesuffix("/").split("/")
    assert any(tuple(segments[:len(p)]) == p for p in admin.RELAY_PATHS)
    assert not {".", "..", ""} & set(segments) and sent_query == query


def test_a_revoke_of_any_id_is_404_or_200(admin_router):
    for key_id in ("nope", "x" * 5000, "%00", "1;DROP"):
        assert call(admin_router.url, "POST", f"/v1/keys/{key_id}/revoke", b"")[0] == 404


class SilentUpload:
    """An ASGI client that sends its headers and then never the body."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(self, message: dict) -> None:
        self.sent.append(message)


@pytest.mark.parametrize("handler, path", [(admin.keys, "/v1/keys"), (admin.relay, "/v1/boxes/a/v1/settings/box")])
def test_admin_uploads_have_the_proxied_routes_body_timeout(handler, path):
    """One read_body and one deadline for every route (serve/body.py); the clock's sweep is the
    test's, with time injected, so the deadline is checked to the instant."""
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "client": ("127.0.0.1", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"10")]}
    hugpy = types.SimpleNamespace(config=types.SimpleNamespace(kind=BoxKind.HUGPY))
    clock = CallClock()  # it keeps every body's deadline, the admin's too; never started: ticked here
    settings = types.SimpleNamespace(max_body_bytes=1 << 20)
    app = types.SimpleNamespace(process=types.SimpleNamespace(fleet=types.SimpleNamespace(get=lambda name: hugpy),
                                                             keys=None, config=settings, clock=clock))
    client = SilentUpload()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        handling = loop.create_task(handler(app, AsgiEdge(scope, client.receive, client.send)))
        while not clock.calls:  # the body's read has begun
            await asyncio.sleep(0)
        clock.tick_all(started_s + body.BODY_TIMEOUT_S - 0.5)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not handling.done() and not client.sent  # not yet
        clock.tick_all(loop.time() + body.BODY_TIMEOUT_S + 0.001)
        await asyncio.wait_for(handling, 5)
        assert not clock.calls

    uvloop.run(main())
    assert client.sent[0]["status"] == 408 and error_code(client.sent[1]["body"]) == "body_timeout"


def test_the_relay_matches_whole_segments_decodes_once_and_limits_methods(admin_router):
    url, rec = admin_router.url, admin_router.recorder

    def relayed(method: str, path: str) -> tuple[str, str]:
        """What the box saw for one call: (method, request target)."""
        rec.seen.clear()
        assert call(url, method, "/v1/boxes/rec" + path, timeout=10)[0] == 200, path
        return rec.seen[-1]

    assert call(url, "GET", "/v1/boxes/a/v1/telemetry/state")[0] == 200  # a hugpy sim box, for real
    for path in ("/v1/telemetryX", "/v1/modelsfoo", "/storagex/y", "/v1/keys", "/v1/%2e%2e/v1/keys",
                 "/v1/models/%2e", "/v1/models/..", "/v1/models/a%5Cb", "/v1//models", "/v1/models/%C3%A9",
                 "/v1/models%0D%0AX:%20y", "/v1/models%3Fscope=admin", "/v1%2Fkeys"):
        status, _, body = call(url, "GET", "/v1/boxes/rec" + path)
        assert status == 403 and error_code(body) == "not_relayed", path
    assert not rec.seen
    # %3F stays in the path (the box gets no query); %25 is decoded once, never twice.
    assert relayed("GET", "/v1/models/x%3Fscope=admin") == ("GET", "/v1/models/x%3Fscope=admin")
    assert relayed("GET", "/v1/models/%252e%252e") == ("GET", "/v1/models/%252e%252e")
    assert relayed("GET", "/v1/models/x?since=1&a=%3F") == ("GET", "/v1/models/x?since=1&a=%3F")
    assert relayed("GET", "/v1/telemetry/") == ("GET", "/v1/telemetry")  # one trailing slash, as hugpy
    assert relayed("GET", "/v1/%6Dodels") == ("GET", "/v1/models")
    for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
        assert relayed(method, "/v1/settings/box") == (method, "/v1/settings/box")
    rec.seen.clear()
    for method in ("OPTIONS", "TRACE", "PROPFIND"):
        status, _, body = call(url, method, "/v1/boxes/rec/v1/telemetry/state")
        assert status == 405 and error_code(body) == "method_not_allowed", method
    assert not rec.seen
    # HEAD answers as soon as the box's head arrives (a Content-Length and no body).
    started = time.monotonic()
    status, _, body = call(url, "HEAD", "/v1/boxes/rec/v1/telemetry/state", timeout=20)
    # real time: a relay across the router and a box; waiting for a body that never comes would
    # run into the client's 20 s timeout
    assert status == 200 and body == b"" and time.monotonic() - started < 10
    assert rec.seen == [("HEAD", "/v1/telemetry/state")]


# --- the security model (item 15) ----------------------------------------------------------------

# One request per README row, answered `ok` with this status.
ROW_REQUESTS = {
    "probes": ("GET", "/health", None, 200),
    "inference": ("POST", "/v1/chat/completions", CHAT, 200),
    "batches and files": ("GET", "/v1/batches", None, 200),
    "model listing": ("GET", "/v1/models", None, 200),
    "engine management": ("POST", "/api/pull", {"model": "llama3", "stream": False}, 200),
    "admin and keys": ("GET", "/v1/keys", None, 200),
    "limits and usage": ("GET", "/v1/keys/usage", None, 200),
    "box relay": ("GET", "/v1/boxes/a/v1/telemetry/state", None, 200),
    "metrics": ("GET", "/metrics", None, 200),
    "dashboard page": ("GET", "/ui", None, 200),
}
USE_ROWS = ("inference", "batches and files", "model listing", "metrics")
BAD_KEY_ROW = "a bad key"  # its cell: what a presented key that is not valid gets on every row it names
PUBLIC_ROWS = ("probes", "dashboard page")
CALLERS = {  # README column -> how the test makes that caller
    "loopback": {},
    "private net": via(LAN),
    "outside": via(OUT),
    "via trusted proxy": via("127.0.0.1"),
    "foreign Host": {"headers": {"Host": "evil.example"}},  # a rebound page (issue 20 item 2)
    "cross-site page": {"headers": {"Origin": "https://evil.example"}},  # issue 20 item 1
}


def security_table() -> dict[tuple[str, str], list[str]]:
    """(row, column) -> [no key, use key, admin key] cells of the security table (docs/security.md)."""
    text = (ROOT / "docs" / "security.md").read_text()
    section = text.split("## Who may call what", 1)[1].split("\n#", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    table = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        row = cells[0].split(":", 1)[0]
        for column, cell in zip(columns, cells[1:]):
            table[(row, column)] = [part.strip() for part in cell.split("/")]
    return table


def expected_in(mode: str, row: str, column: str, cells: list[str]) -> list[str]:
    """The README's `outside` cells under another mode, by its "Other modes" rule."""
    if row not in USE_ROWS or mode == "outside" or column == "cross-site page":
        return cells
    if mode == "never":
        return ["403" if column == "foreign Host" else "ok", "ok", "ok"]
    return ["401", "ok", "ok"]  # always


def test_the_readme_table_covers_every_row_and_caller():
    table = security_table()
    assert {row for row, _ in table} == set(ROW_REQUESTS) | {BAD_KEY_ROW}
    assert {column for _, column in table} == set(CALLERS)
    assert all(len(cells) == (1 if row == BAD_KEY_ROW else 3) for (row, _), cells in table.items())


def bad_keys(router) -> dict[str, str]:
    """A presented key of each kind that is not valid (issue 38 item 2)."""
    revoked = mint(router, "use")
    assert call(router.url, "POST", f"/v1/keys/{revoked.split('_')[1]}/revoke")[0] == 200
    status, _, data = call(router.url, "POST", "/v1/keys", {"name": "old", "expires_days": 1e-7})  # 9 ms
    assert status == 201, data
    expired = json.loads(data)["key"]
    time.sleep(0.05)
    return {"unknown": "hpk_nobody_secret", "revoked": revoked, "expired": expired,
            "mistyped": mint(router, "admin")[:-1] + "-", "malformed": "hpk_noseparator", "empty": ""}


@pytest.mark.parametrize("mode", ["outside", "never", "always"])
def test_every_cell_of_the_security_table_is_what_the_router_does(start_fleet_in_process, mode):
    a = SimBox("a", key="hpk_box_relaykey000000000000", catalog=["tiny"], residents=["tiny"])
    box = SimOllama("o", tags=["llama3:latest"])
    router = start_fleet_in_process(a, box, env={"HUGPY_ROUTER_REQUIRE_KEY": mode, "HUGPY_ROUTER_TRUSTED_PROXIES": PROXY,
                                      "HUGPY_ROUTER_KEY": ADMIN_KEY})
    use_key = mint(router, "use")  # loopback manages in every mode
    bad = bad_keys(router)
    got, want = {}, {}
    for (row, column), cells in security_table().items():
        if row == BAD_KEY_ROW:
            for named in set(ROW_REQUESTS) - set(PUBLIC_ROWS):
                method, path, body, ok_status = ROW_REQUESTS[named]
                for kind, key in bad.items():
                    status, _, _ = call(router.url, method, path, body, key=key, **CALLERS[column])
                    got[(named, column, kind)] = "ok" if status == ok_status else str(status)
                    want[(named, column, kind)] = cells[0]
            continue
        method, path, body, ok_status = ROW_REQUESTS[row]
        for key, cell in zip((None, use_key, ADMIN_KEY), expected_in(mode, row, column, cells)):
            status, _, _ = call(router.url, method, path, body, key=key, **CALLERS[column])
            got[(row, column, key)] = "ok" if status == ok_status else str(status)
            want[(row, column, key)] = cell
    assert got == want


def test_a_bad_key_from_loopback_is_refused_in_each_facades_shape_and_a_placeholder_is_no_key(
        start_fleet_in_process, monkeypatch):
    """Issue 38 item 2, under the default mode from loopback, with the clients' own ways of
    sending a key: the openai client's `api_key`, the ollama client's `OLLAMA_API_KEY`."""
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    o = SimOllama("o", tags=["llama3:latest"])
    lm = SimLMStudio("lm", models=[LM_MODEL])
    router = start_fleet_in_process(a, o, lm)
    revoked = mint(router, "use")
    assert call(router.url, "POST", f"/v1/keys/{revoked.split('_')[1]}/revoke")[0] == 200
    for path in ("/v1/models", "/api/v1/models"):  # OpenAI's shape, and LM Studio's (the same)
        status, _, data = call(router.url, "GET", path, key=revoked)
        assert status == 401 and error_code(data) == "invalid_api_key", path
    status, _, data = call(router.url, "GET", "/api/tags", key=revoked)
    assert status == 401 and json.loads(data)["error"] == "invalid, expired or revoked API key"  # Ollama's
    status, _, data = call(router.url, "GET", "/v1/keys", key=revoked)
    assert status == 401 and error_code(data) == "invalid_api_key"  # admin: loopback does not lift it
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=router.url + "/v1", api_key=revoked, max_retries=0).models.list()
    monkeypatch.setenv("OLLAMA_API_KEY", revoked)
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=router.url).list()
    assert info.value.status_code == 401
    # A placeholder is no key: a keyless local client works as it did.
    monkeypatch.setenv("OLLAMA_API_KEY", "ollama")
    assert ollama.Client(host=router.url).list().models
    assert openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0).models.list().data
    assert call(router.url, "GET", "/v1/models", headers={"Authorization": "Basic dTpw"})[0] == 200


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/keys/{key_id}/priority", {"priority": "high"}),
    ("POST", "/v1/keys/{key_id}/revoke", None),
    ("PUT", "/v1/keys/{key_id}/limits", {"rpm": 5}),
    ("GET", "/v1/keys/{key_id}/usage", None),
    ("PUT", "/v1/boxes/a", {"max_inflight": 1}),
    ("POST", "/v1/boxes", {"name": "x", "url": "http://127.0.0.1:1"}),
    ("GET", "/v1/router/events", None),
    ("GET", "/v1/aliases", None),
    ("PUT", "/v1/aliases/fast", {"chain": ["tiny", "small"]}),
    ("GET", "/v1/fleet/verdicts", None),
    ("GET", "/v1/fleet/settings", None),
    ("GET", "/v1/fleet/residents", None),
])
def test_the_admin_edits_refuse_every_caller_but_an_admin(start_fleet_in_process, method, path, body):
    """Each admin route added beside the table's examples keeps the admin row's rule: from
    outside, no key is 401 and a use key 403; an admin key is served."""
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a, env={"HUGPY_ROUTER_TRUSTED_PROXIES": PROXY, "HUGPY_ROUTER_KEY": ADMIN_KEY})
    use_key = mint(router, "use")
    path = path.format(key_id=use_key.split("_")[1])
    assert call(router.url, method, path, body, **via(OUT))[0] == 401
    assert call(router.url, method, path, body, key=use_key, **via(OUT))[0] == 403
    if path != "/v1/router/events":  # a stream: served, it would not end
        assert call(router.url, method, path, body, key=ADMIN_KEY, **via(OUT))[0] in (200, 201)


@pytest.mark.parametrize("instance", ["r1\nX-Forged: 1", "r1\x1b[2J", "r 1", "", "x" * 65, ".r1"])
def test_an_instance_name_outside_its_charset_is_refused_with_one_line(instance):
    """Issue 36 item 13: --instance goes into log lines, rows and the shared server's keys."""
    done = subprocess.run([sys.executable, "-m", "router", "serve", "--port", "auto", "--instance", instance],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 2 and "is not an instance name" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
