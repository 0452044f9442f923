"""Refusals that say what is wrong (issue 27.3): a pin to a box that does not exist, a box that
is down (and why), an empty fleet, a mistyped flag; through the official clients, the admin
state and the command line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import ollama
import openai
import pytest

from conftest import ROOT, wait_for
from router.sim import SimBox, SimFleet, SimOllama
from support.url_calls import chat_body, request

KEY = "hpk_box_refusalsboxkey0123456789abcd"
MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_pin_to_an_unknown_box_is_404_naming_it_in_each_facades_shape(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]),
                                    SimOllama("o", tags=["llama3:latest"]))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"alloc": {"worker": "gpu9"}})
    error = refused.value.body
    assert error["code"] == "unknown_box" and "gpu9" in error["message"] and "a, o" in error["message"]
    assert "can serve" not in error["message"]
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=router.url, headers={"X-Router-Box": "gpu9"}).chat(model="llama3", messages=MESSAGES)
    assert refused.value.status_code == 404 and "no box named 'gpu9'" in refused.value.error
    # a known box that cannot serve the model is still the no-box answer
    status, data = request(router.url, "POST", "/v1/chat/completions", chat_body(), {"X-Router-Box": "o"})
    error = json.loads(data)["error"]
    assert status == 503 and error["code"] == "no_box"
    assert error["message"] == "box o cannot serve model 'tiny': no_model: tiny:latest"


def test_a_box_that_is_down_says_why_in_the_state_the_refusal_and_the_log(start_fleet_in_process):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts, never answers: a timeout
    keyed = SimBox("keyed", key=KEY, catalog=["tiny"])
    plain = SimBox("plain", catalog=["tiny"])
    fleet = SimFleet([keyed, plain])
    fleet.start()
    try:
        boxes = [
            {"name": "dead", "url": f"http://127.0.0.1:{dead.getsockname()[1]}"},
            {"name": "silent", "url": f"http://127.0.0.1:{silent.getsockname()[1]}"},
            {"name": "tls", "url": plain.url.replace("http://", "https://")},  # TLS to a plain box
            {"name": "keyed", "url": keyed.url, "key": "hpk_box_not_the_right_key"},  # 401 from the box
            {"name": "kind", "url": plain.url, "kind": "ollama"},  # a hugpy box entered as ollama
        ]
        router = start_fleet_in_process()
        router.boxes_path.write_text(json.dumps({"boxes": boxes}))
        expected = {
            "dead": "connection refused",
            "silent": "timeout: no answer to GET /health",
            "tls": "TLS: handshake failed",
            "keyed": "401 from the box on GET /v1/telemetry/state: it refuses the router's key",
            "kind": "wrong kind? GET / did not answer as Ollama does",
        }

        def downs() -> dict:
            state = json.loads(request(router.url, "GET", "/v1/router/state")[1])
            return {box["name"]: box["down"] or "" for box in state["boxes"]}

        def all_said() -> bool:
            seen = downs()
            return all(seen.get(name, "").startswith(why) for name, why in expected.items())

        assert wait_for(all_said, 20, 0.2), downs()
        status, data = request(router.url, "POST", "/v1/chat/completions", chat_body())
        reasons = json.loads(data)["error"]["reasons"]
        assert status == 503
        assert reasons["dead"] == "offline: connection refused"
        assert reasons["tls"].startswith("offline: TLS: handshake failed")
        assert reasons["keyed"].startswith("no_model: tiny (401 from the box")  # online, but blind
        log = router.log_text()
        assert "box dead is offline (connection refused)" in log and "box tls is offline (TLS: handshake" in log
        assert "ConnectFailed" not in router.log_text()
    finally:
        fleet.stop()
        dead.close()
        silent.close()


def test_an_empty_fleet_says_so_and_names_the_boxes_file(start_fleet_in_process):
    router = start_fleet_in_process()
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert refused.value.status_code == 503
    assert f"the fleet is empty (no boxes in {router.boxes_path})" in refused.value.body["message"]
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=router.url).chat(model="llama3", messages=MESSAGES)
    assert "the fleet is empty" in refused.value.error and str(router.boxes_path) in refused.value.error


def router_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=30,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})


def test_a_mistyped_flag_is_named_and_no_internal_name_leaks():
    done = router_cli("serve", "--prot", "8080")
    assert done.returncode == 2
    assert "unrecognized arguments: --prot" in done.stderr and "required" not in done.stderr
    done = router_cli("serve", "--prot=8080", "--ollama-port", "auto")
    assert "unrecognized arguments: --prot" in done.stderr
    for argv in (["serve", "--port", "abc"], ["serve", "--port", "8080", "--max-body", "x"]):
        done = router_cli(*argv)
        assert done.returncode == 2 and "invalid value" in done.stderr
        assert "_" not in done.stderr.splitlines()[-1], done.stderr  # no `_port`, `_size`, `__main__.py`
    done = router_cli("serve")  # a flag that is really missing is still said so
    assert done.returncode == 2 and "--port" in done.stderr and "required" in done.stderr
