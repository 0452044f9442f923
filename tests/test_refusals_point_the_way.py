"""Refusals that point the way (issue 38 item 4): a path that is a route under `/v1` says so, an
Ollama client on another API is told where Ollama's API is (as an error its client raises), and a
model no box has is Ollama's own 404; through the official clients."""

from __future__ import annotations

import json

import ollama
import openai
import pytest

from router.sim import SimBox, SimLMStudio, SimOllama
from support.url_calls import request

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_path_that_is_a_route_under_v1_says_did_you_mean(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]),
                                    SimOllama("o", tags=["llama3:latest"]),
                                    extra_args=("--ollama-port", "auto"))
    client = openai.OpenAI(base_url=router.url, api_key="unused", max_retries=0)  # the /v1 left off
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    error = refused.value.body
    assert error["code"] == "unknown_route" and "did you mean /v1/chat/completions" in error["message"]
    status, data = request(router.url, "GET", "/models")
    assert status == 404 and "did you mean /v1/models" in json.loads(data)["error"]["message"]
    # on the Ollama listener, in Ollama's shape
    status, data = request(router.urls["ollama"], "POST", "/chat/completions", b'{"model": "llama3"}')
    assert status == 404 and "did you mean /v1/chat/completions" in json.loads(data)["error"]
    # a path that is no route anywhere is the plain 404
    status, data = request(router.url, "POST", "/chat/nothing", b'{"model": "tiny"}')
    assert status == 404 and "did you mean" not in json.loads(data)["error"]["message"]


def test_an_ollama_client_on_another_api_is_told_the_ollama_listener(start_fleet_in_process):
    router = start_fleet_in_process(SimOllama("o", tags=["llama3:latest"]),
                                    SimLMStudio("lm", models=["qwen/qwen3-14b"]),
                                    extra_args=("--ollama-port", "auto", "--lmstudio-port", "auto"))
    ollama_url = router.urls["ollama"]
    for wrong in (router.urls["lmstudio"], router.url + "/v1", router.urls["lmstudio"] + "/v1"):
        client = ollama.Client(host=wrong)
        for call in (lambda: client.chat(model="llama3", messages=MESSAGES),
                     lambda: client.generate(model="llama3", prompt="hi"),
                     client.list):
            with pytest.raises(ollama.ResponseError) as refused:
                call()
            assert refused.value.status_code == 404, wrong
            assert ollama_url in refused.value.error and "Ollama listener" in refused.value.error, refused.value.error
    # the listener it names serves it
    assert ollama.Client(host=ollama_url).chat(model="llama3", messages=MESSAGES).message.content


def test_without_an_ollama_listener_the_hint_names_the_main_port_and_the_flag(start_fleet_in_process):
    router = start_fleet_in_process(SimOllama("o", tags=["llama3:latest"]))
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=router.url + "/v1").chat(model="llama3", messages=MESSAGES)
    assert refused.value.status_code == 404
    assert router.url in refused.value.error and "--ollama-port" in refused.value.error, refused.value.error


def test_a_model_no_box_has_is_ollamas_404_with_every_reason(start_fleet_in_process):
    o = SimOllama("o", tags=["llama3:latest", "all-minilm:latest"])
    router = start_fleet_in_process(o, SimBox("h", catalog=["nope"]))  # a hugpy box's model is no Ollama model
    client = ollama.Client(host=router.url)
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="nope", messages=MESSAGES)
    assert (refused.value.status_code, refused.value.error) == (404, "model 'nope' not found")
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model="nope", input="x")
    assert (refused.value.status_code, refused.value.error) == (404, 'model "nope" not found, try pulling it first')
    status, data = request(router.url, "POST", "/api/generate", b'{"model": "nope", "prompt": "x"}')
    body = json.loads(data)
    assert status == 404 and body["error"] == "model 'nope' not found"
    assert body["reasons"]["o"].startswith("no_model") and body["reasons"]["h"].startswith("kind_not_served")
    assert not [c for c in o.calls if c.method == "POST"]

