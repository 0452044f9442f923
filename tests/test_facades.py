"""The Ollama and LM Studio facades end to end, with the official `ollama` and `openai` clients,
over simulated Ollama, LM Studio and hugpy boxes (issue: facades in the same process)."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request

import ollama
import openai
import pytest

from router.sim import Behavior, SimBox, SimLMStudio, SimOllama

LM_TOKEN = "sk-lm-Abcd1234:abcdefghij0123456789"


def calls(box) -> list:
    return [c for c in box.calls if c.path.startswith(("/api/", "/v1/")) and c.method == "POST"]


def http(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def test_ollama_client_chat_generate_embed_list_ps_show(start_fleet_in_process):
    box = SimOllama("o1", tags=["llama3:latest", "all-minilm"], loaded=["llama3:latest"])
    router = start_fleet_in_process(box)
    client = ollama.Client(host=router.url)
    reply = client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert reply.message.content and reply.model == "llama3"  # the client's string, untouched
    parts = list(client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert parts[-1].done and len(parts) > 2
    assert client.generate(model="llama3", prompt="hi").response
    assert client.embed(model="all-minilm", input="hi").embeddings
    assert {m.model for m in client.list().models} == {"llama3:latest", "all-minilm:latest"}
    assert [m.model for m in client.ps().models] == ["llama3:latest"]
    assert client.show("llama3").modelinfo is not None
    # the router sent the box its own Host (a foreign Host would have been a 403)
    assert all(c.headers["host"] == box.url.removeprefix("http://") for c in calls(box))


def test_llama3_reaches_a_box_that_lists_llama3_latest_and_the_root_answers(start_fleet_in_process):
    other = SimOllama("other", tags=["mistral:latest"])
    owner = SimOllama("owner", tags=["llama3:latest"])
    router = start_fleet_in_process(other, owner)
    status, _, body = http(router.url + "/api/generate", "POST", {"model": "llama3", "prompt": "x", "stream": False})
    assert status == 200 and json.loads(body)["model"] == "llama3"
    assert len(calls(owner)) == 1 and not calls(other)
    assert http(router.url + "/")[2] == b"Ollama is running"
    assert json.loads(http(router.url + "/api/version")[2]) == {"version": "0.12.6"}


def test_empty_owner_set_is_a_local_502_and_no_box_sees_a_request(start_fleet_in_process):
    # its only owner blocked (a model no box lists is Ollama's 404: test_refusals_point_the_way.py)
    a = SimOllama("a", tags=["llama3:latest"])
    router = start_fleet_in_process(a, boxes_extra={"a": {"blocked": True}})
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=router.url).chat(model="llama3", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 502
    status, _, body = http(router.url + "/api/chat", "POST", {"model": "llama3", "messages": []})
    assert status == 502
    error = json.loads(body)
    assert isinstance(error["error"], str) and error["reasons"]["a"].startswith("blocked")
    assert not calls(a)


def test_stale_inventory_404_fails_over_only_to_advertised_owners(start_fleet_in_process):
    stale = SimOllama("stale", tags=["llama3:latest"])
    good = SimOllama("good", tags=["llama3:latest"])
    bystander = SimOllama("bystander", tags=["mistral:latest"])
    stale.script("llama3", Behavior.refuse(404, None, "model 'llama3' not found"))
    router = start_fleet_in_process(stale, good, bystander)
    status, headers, _ = http(router.url + "/api/chat", "POST",
                              {"model": "llama3", "messages": [{"role": "user", "content": "x"}], "stream": False})
    assert status == 200 and headers["x-hugpy-box"] == "good"
    assert len(calls(stale)) == 1 and len(calls(good)) == 1 and not calls(bystander)


def test_ollama_server_busy_and_first_line_error_fail_over(start_fleet_in_process):
    busy = SimOllama("busy", tags=["llama3:latest"])
    broken = SimOllama("broken", tags=["llama3:latest"])
    good = SimOllama("good", tags=["llama3:latest"])
    busy.script("llama3", Behavior.busy())
    broken.script("llama3", Behavior.in_band(message="an error was encountered while running the model"))
    router = start_fleet_in_process(busy, broken, good)
    parts = list(ollama.Client(host=router.url).chat(model="llama3", messages=[{"role": "user", "content": "x"}], stream=True))
    assert parts[-1].done
    assert [len(calls(b)) for b in (busy, broken, good)] == [1, 1, 1]


def test_openai_client_on_both_dedicated_listeners(start_fleet_in_process):
    o = SimOllama("o", tags=["llama3:latest"])
    lm = SimLMStudio("lm", models=["qwen/qwen3-14b"], token=LM_TOKEN)
    router = start_fleet_in_process(o, lm, extra_args=("--ollama-port", "auto", "--lmstudio-port", "auto"))
    over_ollama = openai.OpenAI(base_url=router.urls["ollama"] + "/v1", api_key="ollama", max_retries=0)
    over_lm = openai.OpenAI(base_url=router.urls["lmstudio"] + "/v1", api_key="lm-studio", max_retries=0)
    assert over_ollama.chat.completions.create(model="llama3", messages=[{"role": "user", "content": "x"}]).choices
    assert over_lm.chat.completions.create(model="qwen/qwen3-14b", messages=[{"role": "user", "content": "x"}]).choices
    # Each dedicated listener serves its own engine's boxes only.
    with pytest.raises(openai.APIStatusError) as info:
        over_ollama.chat.completions.create(model="qwen/qwen3-14b", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 502
    # The LM Studio box got its own bearer token, never the client's.
    assert calls(lm)[0].headers["authorization"] == f"Bearer {LM_TOKEN}"
    # Every path of the Ollama listener is Ollama's.
    assert http(router.urls["ollama"] + "/")[2] == b"Ollama is running"
    status, _, body = http(router.urls["lmstudio"] + "/")
    assert status == 200 and b"Unexpected endpoint or method. (GET /)" in body


def test_lmstudio_ids_match_exactly(start_fleet_in_process):
    lm = SimLMStudio("lm", models=["qwen/qwen3-14b"])
    router = start_fleet_in_process(lm)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="qwen/qwen3-14B", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 503 and not calls(lm)
    status, _, _ = http(router.url + "/api/v0/chat/completions", "POST",
                        {"model": "qwen/qwen3-14c", "messages": [{"role": "user", "content": "x"}]})
    assert status == 502 and not calls(lm)
    status, _, _ = http(router.url + "/api/v0/chat/completions", "POST",
                        {"model": "qwen/qwen3-14b", "messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and len(calls(lm)) == 1


def test_fleet_answers_unions(start_fleet_in_process):
    o1 = SimOllama("o1", tags=["llama3:latest", "mistral:latest"], loaded=["llama3:latest"])
    o2 = SimOllama("o2", tags=["llama3:latest"], loaded=["llama3:latest"])
    lm1 = SimLMStudio("lm1", models=["qwen/qwen3-14b", "nomic-embed"], loaded=["qwen/qwen3-14b"])
    lm2 = SimLMStudio("lm2", models=["qwen/qwen3-14b"])
    router = start_fleet_in_process(o1, o2, lm1, lm2)
    tags = json.loads(http(router.url + "/api/tags")[2])["models"]
    assert sorted(t["name"] for t in tags) == ["llama3:latest", "mistral:latest"]
    ps = json.loads(http(router.url + "/api/ps")[2])["models"]
    assert [p["name"] for p in ps] == ["llama3:latest"]
    v0 = {row["id"]: row for row in json.loads(http(router.url + "/api/v0/models")[2])["data"]}
    assert v0["qwen/qwen3-14b"]["state"] == "loaded" and v0["nomic-embed"]["state"] == "not-loaded"
    status, _, row = http(router.url + "/api/v0/models/qwen/qwen3-14b")
    assert status == 200 and json.loads(row)["id"] == "qwen/qwen3-14b"
    ids = {m["id"] for m in json.loads(http(router.url + "/v1/models")[2])["data"]}
    assert {"llama3:latest", "qwen/qwen3-14b", "nomic-embed"} <= ids


def test_both_facade_listeners_bursting_share_one_count(start_fleet_in_process):
    boxes = [SimOllama(f"o{i}", tags=["llama3:latest"]) for i in range(4)]
    for box in boxes:
        box.script("llama3", *[Behavior.hang(1.5)] * 64)
    router = start_fleet_in_process(*boxes, extra_args=("--ollama-port", "auto"))
    body = {"model": "llama3", "messages": [{"role": "user", "content": "x"}], "stream": False}
    urls = [router.url + "/v1/chat/completions", router.urls["ollama"] + "/api/chat"]

    def one(i: int) -> str:
        return http(urls[i % 2], "POST", body)[1]["x-hugpy-box"]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        landed = list(pool.map(one, range(64)))
    counts = {box.name: landed.count(box.name) for box in boxes}
    assert all(abs(n - 16) <= 2 for n in counts.values()), counts


def test_openai_facade_over_mixed_kinds_uses_each_kinds_name_rule(start_fleet_in_process):
    hug = SimBox("hug", catalog=["tiny"], residents=["tiny"])
    o = SimOllama("o", tags=["llama3:latest"])
    router = start_fleet_in_process(hug, o)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="llama3", messages=[{"role": "user", "content": "x"}])
    assert raw.headers["x-hugpy-box"] == "o"
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert raw.headers["x-hugpy-box"] == "hug"


def test_openai_model_by_id_including_a_slash(start_fleet_in_process):
    lm = SimLMStudio("lm", models=["qwen/qwen3-14b"])
    router = start_fleet_in_process(lm)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    assert client.models.retrieve("qwen/qwen3-14b").id == "qwen/qwen3-14b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("qwen/nope")
