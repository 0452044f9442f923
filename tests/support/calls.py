"""A caller's JSON requests to a router (anything with a `url`), from a chosen source address on
loopback: keyless callers are told apart by it, as in production. bench/faults.py calls through
these too."""

from __future__ import annotations

import http.client
import json

MESSAGES = [{"role": "user", "content": "hello"}]


def request(router, method: str, path: str, doc: object = None, *, source: str = "127.0.0.1",
            headers: dict | None = None, timeout: float = 30) -> tuple[int, dict, bytes]:
    """One request from `source`, a JSON body when `doc` is given."""
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout, source_address=(source, 0))
    try:
        conn.request(method, path, body=None if doc is None else json.dumps(doc),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def call(router, *, source: str = "127.0.0.1", headers: dict | None = None, model: str = "tiny",
         timeout: float = 30, **extra) -> tuple[int, dict, dict]:
    status, got, body = request(router, "POST", "/v1/chat/completions",
                                {"model": model, "messages": MESSAGES, **extra},
                                source=source, headers=headers, timeout=timeout)
    return status, got, json.loads(body or b"null")


def admin(router, method: str, path: str, doc: dict | None = None) -> tuple[int, dict]:
    status, _, body = request(router, method, path, doc, timeout=10)
    return status, json.loads(body)


def get_json(router, path: str) -> dict:
    return admin(router, "GET", path)[1]


def new_key(router, **limits) -> tuple[str, str]:
    """(id, secret) of a new key with `limits`."""
    status, _, body = request(router, "POST", "/v1/keys", {"name": "team", "limits": limits or None}, timeout=10)
    assert status == 201, body
    doc = json.loads(body)
    return doc["id"], doc["key"]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}
