"""The simulated Ollama and LM Studio servers speak contracts/ollama-lmstudio.md, quirks included.

The official `ollama` and `openai` clients talk to the sims directly; raw HTTP covers what the
clients smooth over (framing, Host header, exact statuses).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import httpx
import ollama
import openai
import pytest

from router.sim import Behavior, SimBox, SimFleet, SimLMStudio, SimOllama

pytestmark = pytest.mark.timeout(10)

HF = "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"
QWEN = "qwen/qwen3-14b"
NOMIC = "text-embedding-nomic-embed-text-v1.5"
CHAT = [{"role": "user", "content": "secret prompt"}]


@pytest.fixture
def boxes() -> Iterator[tuple[SimOllama, SimLMStudio]]:
    ol = SimOllama("ol", tags=["llama3", "all-minilm:latest", HF], loaded=["llama3"], chunks=3)
    lm = SimLMStudio("lm", models=[QWEN, NOMIC], loaded=[QWEN], chunks=3)
    with SimFleet([ol, lm]):
        yield ol, lm


@pytest.fixture
def ol(boxes: tuple[SimOllama, SimLMStudio]) -> SimOllama:
    return boxes[0]


@pytest.fixture
def lm(boxes: tuple[SimOllama, SimLMStudio]) -> SimLMStudio:
    return boxes[1]


def request(box: SimOllama | SimLMStudio, method: str, path: str, body: dict | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", box.port, timeout=5)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def oai(box: SimOllama | SimLMStudio, key: str = "sim") -> openai.OpenAI:
    return openai.OpenAI(base_url=box.url + "/v1", api_key=key, max_retries=0)


# -- the fleet ---------------------------------------------------------------------------------


def test_a_fleet_runs_every_kind_and_stops_one() -> None:
    hugpy = SimBox("hp", catalog=["m"])
    ol = SimOllama("ol", tags=["llama3"])
    lm = SimLMStudio("lm", models=[QWEN])
    with SimFleet([hugpy, ol, lm]) as fleet:
        assert [(b.kind, b.name) for b in fleet.boxes] == [("hugpy", "hp"), ("ollama", "ol"), ("lmstudio", "lm")]
        assert request(hugpy, "GET", "/health")[0] == 200
        assert request(ol, "GET", "/")[2] == b"Ollama is running"
        assert json.loads(request(lm, "GET", "/lmstudio-greeting")[2]) == {"lmstudio": True}
        fleet.stop_box(ol)
        with pytest.raises(ConnectionRefusedError):
            request(ol, "GET", "/")
        assert request(lm, "GET", "/lmstudio-greeting")[0] == 200


# -- Ollama through its own client -------------------------------------------------------------


def test_ollama_client_lists_shows_and_reports_residents(ol: SimOllama) -> None:
    client = ollama.Client(host=ol.url)
    assert [m.model for m in client.list().models] == ["llama3:latest", "all-minilm:latest", HF]
    (running,) = client.ps().models
    assert (running.name, running.model, running.context_length) == ("llama3:latest", "llama3:latest", 4096)
    assert running.size_vram == running.size and running.expires_at is not None
    shown = client.show("llama3")
    assert shown.modelinfo["general.architecture"] == "llama" and shown.details.format == "gguf"


def test_ollama_client_chat_generate_and_embed_echo_the_client_name(ol: SimOllama) -> None:
    client = ollama.Client(host=ol.url)
    reply = client.chat(model="Llama3", messages=CHAT)  # normalised to llama3:latest for matching
    assert reply.model == "Llama3" and reply.done and reply.message.content == "tok " * 3
    parts = list(client.chat(model="llama3", messages=CHAT, stream=True))
    assert [p.message.content for p in parts] == ["tok "] * 3 + [""]
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count == 3
    assert client.generate(model=HF.lower(), prompt="hi").response == "tok " * 3
    embedded = client.embed(model="all-minilm", input=["a", "b"])
    assert embedded.model == "all-minilm" and len(embedded.embeddings) == 2
    assert [(c.path, c.model, c.stream) for c in ol.calls] == [
        ("/api/chat", "Llama3", False), ("/api/chat", "llama3", True), ("/api/generate", HF.lower(), False),
        ("/api/embed", "all-minilm", False)]
    assert ol.calls[0].headers["user-agent"].startswith("ollama-python/")
    assert all(c.status == 200 and c.finished_at is not None for c in ol.calls)
    assert "secret" not in repr(ol.calls)


def test_ollama_client_pull_copy_delete(ol: SimOllama) -> None:
    client = ollama.Client(host=ol.url)
    progress = [p.status for p in client.pull("qwen2.5:7b", stream=True)]
    assert progress[0] == "pulling manifest" and progress[-1] == "success"
    assert client.list().models[0].model == "qwen2.5:7b"  # newest first
    client.copy("qwen2.5:7b", "mine")
    client.delete("qwen2.5:7b")
    assert {m.model for m in client.list().models} == {"llama3:latest", "all-minilm:latest", HF, "mine:latest"}
    with pytest.raises(ollama.ResponseError) as missing:
        client.delete("qwen2.5:7b")
    assert missing.value.status_code == 404 and missing.value.error == "model 'qwen2.5:7b' not found"


def test_ollama_errors_and_behaviours_reach_the_client(ol: SimOllama) -> None:
    client = ollama.Client(host=ol.url)
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="nope", messages=CHAT)
    assert (missing.value.status_code, missing.value.error) == (404, "model 'nope' not found")
    with pytest.raises(ollama.ResponseError) as not_pulled:
        client.embed(model="nope", input="x")
    assert not_pulled.value.error == 'model "nope" not found, try pulling it first'

    ol.script("llama3:latest", Behavior.busy(), Behavior.in_band(message="runner crashed"), Behavior.die_after(1))
    with pytest.raises(ollama.ResponseError) as busy:
        client.chat(model="llama3", messages=CHAT)
    assert busy.value.status_code == 503 and busy.value.error.startswith("server busy, please try again.  ")
    with pytest.raises(ollama.ResponseError, match="runner crashed"):
        list(client.chat(model="llama3", messages=CHAT, stream=True))
    with pytest.raises(httpx.RemoteProtocolError):  # one line, then the chunked body is cut
        list(client.chat(model="llama3", messages=CHAT, stream=True))


# -- Ollama on the wire ------------------------------------------------------------------------


def test_ollama_streams_by_default_and_answers_the_load_idioms(ol: SimOllama) -> None:
    status, headers, body = request(ol, "POST", "/api/chat", {"model": "llama3", "messages": CHAT})
    assert status == 200 and headers["content-type"] == "application/x-ndjson"
    assert headers["transfer-encoding"] == "chunked"
    *pieces, final = [json.loads(line) for line in body.decode().splitlines()]
    assert len(pieces) == 3 and final["done"] is True and final["model"] == "llama3"
    assert body.startswith(b'{"model":"llama3","created_at":"')  # Go's spacing

    status, headers, body = request(ol, "POST", "/api/generate", {"model": "all-minilm"})
    assert headers["content-type"] == "application/json; charset=utf-8"
    assert json.loads(body)["done_reason"] == "load" and "all-minilm:latest" in ol.loaded
    doc = json.loads(request(ol, "POST", "/api/chat", {"model": "llama3", "messages": [], "keep_alive": 0})[2])
    assert doc["done_reason"] == "unload" and doc["message"] == {"role": "assistant", "content": ""}
    assert [m["name"] for m in json.loads(request(ol, "GET", "/api/ps")[2])["models"]] == ["all-minilm:latest"]
    status, _, body = request(ol, "POST", "/api/generate", {"model": "llama3", "keep_alive": "300"})
    assert (status, json.loads(body)) == (400, {"error": 'time: missing unit in duration "300"'})


def test_ollama_paths_names_and_hosts(ol: SimOllama) -> None:
    assert request(ol, "HEAD", "/api/tags")[2] == b""
    assert json.loads(request(ol, "GET", "/api/version")[2]) == {"version": "0.12.6"}
    assert request(ol, "GET", "/nope")[:3:2] == (404, b"404 page not found")
    assert request(ol, "POST", "/api/tags")[0] == 405
    assert request(ol, "POST", "/api/chat", {"model": ""})[2] == b'{"error":"model is required"}'
    assert request(ol, "POST", "/api/generate", {"model": ""})[:3:2] == (404, b"{\"error\":\"model '' not found\"}")
    assert request(ol, "POST", "/api/chat", {"model": "hf.co/x", "messages": CHAT})[:3:2] == (
        400, b'{"error":"invalid model name"}')
    status, _, body = request(ol, "POST", "/api/show", {"name": "nope"})
    assert (status, json.loads(body)) == (404, {"error": "model 'nope:latest' not found"})

    # The DNS-rebinding guard: a router must send the box's own Host.
    for host in ("evil.example", "evil.example:11434", "203.0.113.5"):
        status, _, body = request(ol, "GET", "/api/tags", headers={"Host": host})
        assert (status, body) == (403, b"")
    for host in ("localhost:11434", "192.168.1.5", "[::1]:11434", "box.internal", ""):
        assert request(ol, "GET", "/api/tags", headers={"Host": host})[0] == 200
    assert request(ol, "POST", "/api/chat", {"model": "llama3"}, {"Host": "evil.example"})[0] == 403


def test_ollama_openai_compat(ol: SimOllama) -> None:
    client = oai(ol, "ollama")
    assert [m.id for m in client.models.list()] == ["llama3:latest", "all-minilm:latest", HF]
    reply = client.chat.completions.create(model="llama3", messages=CHAT)
    assert reply.model == "llama3" and reply.choices[0].message.content == "tok " * 3
    chunks = list(client.chat.completions.create(model="llama3", messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}))
    assert [c.choices[0].delta.content for c in chunks[:3]] == ["tok "] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    vectors = client.embeddings.create(model="all-minilm", input=["a", "b"])  # base64 on the wire
    assert [round(x, 5) for x in vectors.data[1].embedding] == [0.6, 0.8, 0.0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert missing.value.body == {"message": "model 'nope' not found", "type": "not_found_error",
                                  "param": None, "code": None}


# -- LM Studio ---------------------------------------------------------------------------------


def test_lmstudio_openai_client_and_exact_ids(lm: SimLMStudio) -> None:
    client = oai(lm, "lm-studio")
    assert [m.id for m in client.models.list()] == [QWEN, NOMIC]
    reply = client.chat.completions.create(model=QWEN, messages=CHAT)
    assert reply.model == QWEN and reply.choices[0].message.content == "tok " * 3
    chunks = list(client.chat.completions.create(model=QWEN, messages=CHAT, stream=True))
    assert [c.choices[0].delta.content for c in chunks] == ["tok "] * 3 + [None]
    vectors = client.embeddings.create(model=NOMIC, input="a")  # floats, though base64 was asked
    assert vectors.data[0].embedding == [0.6, 0.8, 0.0] and NOMIC in lm.loaded  # JIT-loaded
    for wrong in ("Qwen/qwen3-14b", "qwen3-14b", f"{QWEN}:latest"):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=wrong, messages=CHAT)
        assert bad.value.code == "model_not_found" and bad.value.body["param"] == "model"
        assert bad.value.body["message"].startswith(f'Invalid model identifier "{wrong}". ')


def test_lmstudio_answers_200_to_unknown_endpoints(lm: SimLMStudio) -> None:
    for method, path in (("GET", "/"), ("POST", "/chat/completions"), ("GET", "/api/tags")):
        status, headers, body = request(lm, method, path)
        assert status == 200 and headers["x-powered-by"] == "Express"
        assert json.loads(body) == {"error": f"Unexpected endpoint or method. ({method} {path})"}


def test_lmstudio_native_listings_and_rest_chat(lm: SimLMStudio) -> None:
    rows = json.loads(request(lm, "GET", "/api/v0/models")[2])["data"]
    assert [(r["id"], r["type"], r["state"]) for r in rows] == [(QWEN, "llm", "loaded"),
                                                              (NOMIC, "embeddings", "not-loaded")]
    assert json.loads(request(lm, "GET", "/api/v0/models/qwen%2Fqwen3-14b")[2])["id"] == QWEN
    doc = json.loads(request(lm, "POST", "/api/v0/chat/completions", {"model": QWEN, "messages": CHAT})[2])
    assert {"stats", "model_info", "runtime"} <= doc.keys()

    assert request(lm, "POST", "/api/v1/models/unload", {"instance_id": QWEN})[2] == b'{"instance_id":"qwen/qwen3-14b"}'
    status, headers, body = request(lm, "POST", "/api/v1/chat", {"model": QWEN, "input": "hi", "stream": True})
    assert status == 200 and headers["content-type"] == "text/event-stream"
    events = [block.split("\n", 1)[0].removeprefix("event: ") for block in body.decode().split("\n\n") if block]
    assert events == ["chat.start", "model_load.start", "model_load.progress", "model_load.end", "message.start",
                      "message.delta", "message.delta", "message.delta", "message.end", "chat.end"]
    (model,) = [m for m in json.loads(request(lm, "GET", "/api/v1/models")[2])["models"] if m["key"] == QWEN]
    assert model["loaded_instances"][0]["id"] == QWEN


def test_lmstudio_token_and_behaviours(lm: SimLMStudio) -> None:
    lm.token = "sk-lm-AbCdEfGh:01234567890123456789"
    status, _, body = request(lm, "GET", "/v1/models")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        oai(lm, "wrong").models.list()
    assert request(lm, "GET", "/lmstudio-greeting")[0] == 200  # the SDK probe stays open
    client = oai(lm, lm.token)

    lm.script(QWEN, Behavior.in_band("server_error", "model crashed"), Behavior.refuse(500, "server_error"))
    with pytest.raises(openai.APIError, match="model crashed"):
        list(client.chat.completions.create(model=QWEN, messages=CHAT, stream=True))
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=QWEN, messages=CHAT)
    assert [(c.model, c.stream, c.status) for c in lm.calls] == [(QWEN, True, 200), (QWEN, False, 500)]
