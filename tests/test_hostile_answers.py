"""A box's answer never runs as the router's own page (issue 20 item 1): every proxied, relayed or
own answer carries `nosniff` and a CSP that runs no script and allows no framing, the dashboard's
files excepted under their own CSP; and use routes refuse a browser's cross-site call."""

from __future__ import annotations

import json

import ollama
import pytest

from router.sim import SimBox, SimOllama

from support.boxes import RawBox, answer_with
from support.raw_calls import client, post_chat, request
from support.url_calls import CHAT, call

pytestmark = pytest.mark.timeout(60)

PAGE = b"<html><script>fetch('/v1/keys', {method: 'POST'})</script></html>"
HTML_ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n"
               b"Content-Security-Policy: script-src *\r\nContent-Length: %d\r\n\r\n" % len(PAGE) + PAGE)
SANDBOX = "sandbox; default-src 'none'; frame-ancestors 'none'"


def assert_inert(headers: dict, what: str) -> None:
    """The answer cannot run as a page of the router's origin (a box's own CSP may come too: a
    browser enforces every policy it gets, so ours still holds)."""
    assert headers.get("x-content-type-options") == "nosniff", what
    policies = [p.strip() for p in headers.get("content-security-policy", "").split(",")]
    assert SANDBOX in policies, (what, headers)


@pytest.mark.parametrize("interface", ["asgi", "rsgi"])
def test_every_answer_but_the_dashboards_files_is_inert(start_fleet_in_process, interface):
    hostile = RawBox("hostile", answer_with(HTML_ANSWER))
    manager = RawBox("manager", answer_with(HTML_ANSWER))
    manager.kind = "hugpy"  # its management pages are relayed (`/v1/boxes/<box>/v1/settings`)
    router = start_fleet_in_process(hostile, manager, extra_args=("--interface", interface))
    status, headers, body = post_chat(router)
    assert (status, body) == (200, PAGE)  # passed on as the box sent it, but inert
    assert headers["content-type"].startswith("text/html")
    assert_inert(headers, "proxied")
    status, headers, body = request(router, "GET", "/v1/boxes/manager/v1/settings")
    assert (status, body) == (200, PAGE)
    assert_inert(headers, "relayed")
    for method, path in (("GET", "/v1/models"), ("GET", "/nope"), ("GET", "/v1/router/state"),
                         ("GET", "/metrics"), ("GET", "/health")):
        assert_inert(request(router, method, path, b"")[1], path)  # the router's own answers too
    with client(router).chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], stream=True) as stream:
        assert_inert({k.lower(): v for k, v in stream.headers.items()}, "streamed")
    for path in ("/ui", "/ui/app.js", "/ui/style.css"):
        status, headers, _ = request(router, "GET", path, b"")
        assert status == 200 and headers["x-content-type-options"] == "nosniff"
        assert headers["content-security-policy"].startswith("default-src 'none'; script-src 'self'"), path
        assert "sandbox" not in headers["content-security-policy"]  # the dashboard runs its own script


def test_use_routes_refuse_a_cross_site_browser_call_and_no_box_hears_of_it(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    box = SimOllama("o", tags=["llama3:latest"])
    router = start_fleet_in_process(a, box, env={"HUGPY_ROUTER_ALLOWED_ORIGINS": "https://chat.example"})
    port = router.url.rsplit(":", 1)[1]
    evil = {"Origin": "https://evil.example"}
    # A cross-site form posts text/plain (no preflight): refused before the body is looked at.
    status, headers, body = call(router.url, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                                 headers={**evil, "Content-Type": "text/plain"})
    assert status == 403 and json.loads(body)["error"]["code"] == "origin_not_allowed"
    assert_inert(headers, "refusal")
    status, _, body = call(router.url, "POST", "/api/chat",
                           {"model": "llama3", "messages": CHAT["messages"], "stream": False}, headers=evil)
    assert status == 403 and "Origin" in json.loads(body)["error"]  # Ollama's shape
    for path in ("/v1/models", "/api/tags", "/metrics"):
        assert call(router.url, "GET", path, headers=evil)[0] == 403, path
    assert call(router.url, "GET", "/health", headers=evil)[0] == 200  # probes stay open
    assert not [c for c in box.calls if c.path == "/api/chat"]
    # The router's own pages, an allowed origin and clients that send no Origin are served.
    assert call(router.url, "POST", "/v1/chat/completions", CHAT,
                headers={"Origin": f"http://127.0.0.1:{port}"})[0] == 200
    assert call(router.url, "POST", "/v1/chat/completions", CHAT, headers={"Origin": "https://chat.example"})[0] == 200
    assert client(router).chat.completions.create(model="tiny", messages=CHAT["messages"]).choices
    assert ollama.Client(host=router.url).chat(model="llama3", messages=CHAT["messages"]).message is not None
