"""A real hugpy-wrapper 0.1.182 box behind the router (issue 26): its verdicts and pair settings, read
and written through the router's one address. The box runs as contracts/hugpy-wrapper.md §9a
describes (no GPU, no model weights): it sizes a synthetic GGUF file whose header it cannot
parse, which gives a verdict row with `fits: null` (§11.1.3), and never loads it."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, wait_for
from inproc import InProcessRouter

SERVE = ROOT / ".venv-wrapper" / "bin" / "fitevict-serve"
KEY = "hpk_box_realwrapper0123456789"
MODEL = "junk-llama"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request(url: str, method: str, path: str, doc=None, headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=None if doc is None else json.dumps(doc),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    except (ConnectionError, OSError, ValueError):
        return None, None
    finally:
        conn.close()


@pytest.fixture
def wrapper(tmp_path):
    """A hugpy-wrapper box on a free loopback port, worker `realbox`, holding one model."""
    assert SERVE.exists(), "hugpy-wrapper 0.1.182 is missing: run scripts/setup (it makes .venv-wrapper)"
    run = tmp_path / "wrapper"
    env = {"PATH": os.environ["PATH"], "HOME": str(run / "home"), "HUGPY_DATA_DIR": str(run / "data"),
           "HUGPY_CONFIG_DIR": str(run / "config"), "HUGPY_CACHE_DIR": str(run / "cache"),
           "FITEVICT_HOME": str(run / "store"), "MODELS_HOME": str(run / "models"),
           "FITEVICT_MODEL_PATHS_ONLY": "1", "FITEVICT_WORKER": "realbox", "FITEVICT_TOKEN": KEY,
           "PYTHONUNBUFFERED": "1"}
    for name in ("HOME", "HUGPY_DATA_DIR", "HUGPY_CONFIG_DIR", "HUGPY_CACHE_DIR", "FITEVICT_HOME"):
        Path(env[name]).mkdir(parents=True)
    model_dir = run / "models" / "gguf" / "testorg" / MODEL
    model_dir.mkdir(parents=True)
    (model_dir / f"{MODEL}-F16.gguf").write_bytes(b"GGUF" + os.urandom(64 * 1024))
    port = free_port()
    log = open(tmp_path / "wrapper.log", "w")
    proc = subprocess.Popen([str(SERVE), "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: request(url, "GET", "/health")[0] == 200, timeout=30), \
            (tmp_path / "wrapper.log").read_text()[-2000:]
        yield url
    finally:
        proc.terminate()  # its SIGTERM handler evicts any engine it started (none here)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_verdicts_and_pair_settings_of_a_real_box_through_the_router(wrapper, tmp_path):
    boxes = tmp_path / "boxes.json"
    boxes.write_text(json.dumps({"boxes": [{"name": "realbox", "url": wrapper, "kind": "hugpy", "key": KEY}]}))
    os.chmod(boxes, 0o600)
    router = InProcessRouter(boxes)
    try:
        url = router.url
        # the verdicts the router read with the box key (the box prices ~1 s after discovery)
        def verdicts():
            doc = request(url, "GET", f"/v1/fleet/verdicts?model={MODEL}")[1]
            return doc if doc and doc["verdicts"] else None
        doc = wait_for(verdicts, timeout=30)
        assert doc, request(url, "GET", "/v1/router/state")[1]
        row = doc["verdicts"][0]
        assert (row["box"], row["model_key"], row["feasibility"]["status"]) == ("realbox", MODEL, "candidate")
        assert row["auto"]["standard"]["fits"] is None and doc["unanswered"] == []
        state = {b["name"]: b for b in request(url, "GET", "/v1/router/state")[1]["boxes"]}["realbox"]
        assert state["worker"] == "realbox" and state["verdicts"]["fits"] == {MODEL: "unknown"}

        # a pair-settings write through the relay: the box's POST, then its read-back
        status, answer = request(url, "POST", "/v1/boxes/realbox/v1/settings/pair",
                                 {"model_key": MODEL, "settings": {"max_wait_s": 30, "blocked": "operator"}})
        assert status == 200 and answer == {"model_key": MODEL, "settings": {"max_wait_s": 30, "blocked": "operator"}}
        status, read = request(url, "GET", f"/v1/boxes/realbox/v1/settings/pair?model_key={MODEL}")
        assert status == 200 and read["effective"] == {"max_wait_s": 30, "blocked": "operator"}
        status, box_write = request(url, "POST", "/v1/boxes/realbox/v1/settings/box",
                                    {"settings": {"tolerance": "slowest"}})
        assert status == 200 and box_write["settings"] == {"tolerance": "slowest"}

        # the state long-poll brings both rows; the router merges them as the box does
        def settings():
            rows = request(url, "GET", f"/v1/fleet/settings?model={MODEL}")[1]["settings"]
            pair = next(r for r in rows if r["model_key"] == MODEL)
            return rows if pair["blocked"] and pair["effective"].get("tolerance") else None
        rows = wait_for(settings, timeout=15)
        assert rows, request(url, "GET", f"/v1/fleet/settings?model={MODEL}")[1]
        assert {r["model_key"]: r["effective"] for r in rows} == {
            "*": {"tolerance": "slowest"},
            MODEL: {"tolerance": "slowest", "max_wait_s": 30, "blocked": "operator"},
        }
        # and enforces the block the box itself does not
        status, refused = request(url, "POST", "/v1/chat/completions",
                                  {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert status == 503 and refused["error"]["reasons"] == {"realbox": f"blocked_pair: {MODEL}"}
        assert request(url, "GET", "/v1/boxes/realbox/v1/keys")[0] == 403  # never relayed
        # the box has no PUT (§11): its own 501 comes back through the relay
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("PUT", "/v1/boxes/realbox/v1/settings/pair", body=b"{}",
                     headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        assert answer.status == 501 and b"Unsupported method ('PUT')" in answer.read()
        conn.close()
        assert request(url, "GET", "/v1/fleet/residents")[1] == {"residents": [], "unanswered": []}
    finally:
        router.stop()
