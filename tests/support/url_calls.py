"""Requests by URL, for a router started outside the fixtures (a `router serve` of the test's
own, an installed service) and for callers with or without a key from any loopback address."""

from __future__ import annotations

import http.client
import json

CANARY = "CANARY-d41c7b"  # a caller's secret: a test sends it, then looks where it must never be
ADMIN_KEY = "hpk_root_admin-secret-for-tests"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}


def request(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def chat_body(content: str = "x") -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}]}).encode()


def call(url: str, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None, *,
         source: str = "127.0.0.1", key: str | None = None, timeout: float = 30) -> tuple[int, dict, bytes]:
    """One request from `source`; a dict body goes as JSON with its Content-Type."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    host = host.strip("[]")
    headers = dict(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout, source_address=(source, 0))
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def route_rows(router, source: str = "127.0.0.1") -> list[dict]:
    """The route log through the admin API, asked with ADMIN_KEY."""
    status, _, data = call(router.url, "GET", "/v1/telemetry?since=0&limit=5000", key=ADMIN_KEY, source=source)
    assert status == 200, data
    return json.loads(data)["rows"]
