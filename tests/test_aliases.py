"""Aliases end to end (issue 22): the real router (in this process, tests/inproc.py) in front of
simulated boxes, aliases defined through the admin API (the live path), calls through raw HTTP
and the official `openai` and `ollama` clients.

The fleet of most tests: box `a` serves `big`, box `b` serves `small`, and the alias
`coder -> [big, small]`.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import ollama
import openai
import pytest

from router.sim import SimLlamaCpp, SimOllama
from router.sim.hugpy import Behavior, SimBox

from conftest import wait_for
from support.calls import request

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "user", "content": "hello"}]


def call(router, model: str = "coder", *, headers: dict | None = None, **extra) -> tuple[int, dict, dict]:
    status, got, body = request(router, "POST", "/v1/chat/completions",
                                {"model": model, "messages": MESSAGES, **extra}, headers=headers)
    return status, got, json.loads(body or b"null")


def put_alias(router, name: str, *chain: str) -> tuple[int, dict]:
    status, _, body = request(router, "PUT", f"/v1/aliases/{name}", {"chain": list(chain)})
    return status, json.loads(body)


def models_seen(box) -> list[str | None]:
    """The model each chat call named in the body the box got."""
    return [r.model for r in box.calls if r.path.endswith("/chat/completions") or r.path == "/api/chat"]


def fallbacks(router) -> dict[tuple[str, str, str, str], float]:
    _, _, text = request(router, "GET", "/metrics")
    counts = {}
    for line in text.decode().splitlines():
        if line.startswith("router_fallbacks_total{"):
            labels, value = line[len("router_fallbacks_total{"):].rsplit("} ", 1)
            parts = dict(part.split("=", 1) for part in labels.split(","))
            counts[tuple(parts[k].strip('"') for k in ("alias", "from", "to", "reason"))] = float(value)
    return counts


@pytest.fixture
def fleet(start_fleet_in_process):
    """(router, a, b) with `coder -> [big, small]`; `extra_args`/`boxes_extra` go to the router."""

    def start(*, extra_args=(), boxes_extra=None):
        a = SimBox("a", residents=["big"])
        b = SimBox("b", residents=["small"])
        router = start_fleet_in_process(a, b, extra_args=extra_args, boxes_extra=boxes_extra)
        assert put_alias(router, "coder", "big", "small")[0] == 201
        return router, a, b

    return start


# --------------------------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------------------------
def test_the_first_model_serves_when_it_can(fleet):
    router, a, b = fleet()
    status, headers, body = call(router)
    assert status == 200
    assert (headers["x-router-model"], headers["x-router-fallback"], headers["x-hugpy-box"]) == ("big", "0", "a")
    assert models_seen(a) == ["big"] and models_seen(b) == []
    assert fallbacks(router) == {}


def test_a_refusal_moves_down_the_chain(fleet):
    router, a, b = fleet()
    a.script("big", Behavior.refuse(503, "insufficient_resources"))
    status, headers, _ = call(router)
    assert status == 200
    assert (headers["x-router-model"], headers["x-router-fallback"], headers["x-hugpy-box"]) == ("small", "1", "b")
    assert models_seen(b) == ["small"]  # the body's model rewritten for the box that served
    assert fallbacks(router) == {("coder", "big", "small", "refused"): 1}


def test_a_box_that_is_down_moves_down_the_chain(fleet):
    router, a, b = fleet()
    router.fleet.stop_box(a)
    status, headers, _ = call(router)  # its connection is refused: a refusal before the first byte
    assert status == 200 and headers["x-router-model"] == "small"
    status, headers, _ = call(router)  # now it is out: no owner online
    assert status == 200 and headers["x-router-model"] == "small"
    assert fallbacks(router) == {("coder", "big", "small", "refused"): 1, ("coder", "big", "small", "no_owner"): 1}


def test_a_model_no_box_serves_moves_down_the_chain(fleet):
    router, a, b = fleet()
    assert put_alias(router, "coder", "ghost", "small")[0] == 200
    status, headers, _ = call(router)
    assert status == 200 and headers["x-router-model"] == "small"
    assert fallbacks(router) == {("coder", "ghost", "small", "no_owner"): 1}
    assert put_alias(router, "coder", "ghost", "phantom")[0] == 200
    status, _, body = call(router)
    assert status == 503 and "alias 'coder'" in body["error"]["message"]


def test_a_full_model_moves_down_the_chain_and_the_call_does_not_queue(fleet):
    router, a, b = fleet(boxes_extra={"a": {"max_inflight": 1}})
    a.script("big", Behavior.hang(3))  # still busy when the call is answered, unless it queued
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(call, router, "big")
        assert wait_for(lambda: len(models_seen(a)) == 1)
        status, headers, _ = call(router)
        assert not busy.done(), "it sat in the queue while a listed model was idle"
        assert status == 200 and headers["x-router-model"] == "small"
        assert busy.result()[0] == 200
    assert fallbacks(router) == {("coder", "big", "small", "full"): 1}


def test_when_every_model_is_full_the_call_takes_whichever_frees_first(fleet):
    router, a, b = fleet(boxes_extra={"a": {"max_inflight": 1}, "b": {"max_inflight": 1}})
    a.script("big", Behavior.hang(3))
    b.script("small", Behavior.hang(0.5))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        busy_a = pool.submit(call, router, "big")
        busy_b = pool.submit(call, router, "small")
        assert wait_for(lambda: len(models_seen(a)) == 1 and len(models_seen(b)) == 1)
        status, headers, _ = call(router)
        assert status == 200 and headers["x-router-model"] == "small"  # b freed first
        assert not busy_a.done(), "it waited for the first model only"
        assert busy_a.result()[0] == 200 and busy_b.result()[0] == 200


def test_a_pinned_alias_call_stays_on_its_box(fleet):
    router, a, b = fleet()
    status, headers, _ = call(router, headers={"X-Router-Box": "b"})  # b has no big: small, on b
    assert status == 200 and (headers["x-hugpy-box"], headers["x-router-model"]) == ("b", "small")
    assert models_seen(a) == []
    a.script("big", Behavior.refuse(503, "insufficient_resources"))
    status, headers, _ = call(router, alloc={"worker": "a"})  # a refuses big and has no small
    assert status == 503 and headers["x-hugpy-box"] == "a"
    assert models_seen(b) == ["small"]


def test_a_refused_model_then_a_full_one_waits_for_it(fleet):
    router, a, b = fleet(boxes_extra={"b": {"max_inflight": 1}})
    a.script("big", Behavior.refuse(503, "insufficient_resources"))
    b.script("small", Behavior.hang(0.5))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(call, router, "small")
        assert wait_for(lambda: len(models_seen(b)) == 1)
        status, headers, _ = call(router)
        assert status == 200 and headers["x-router-model"] == "small"
        assert busy.result()[0] == 200
    assert fallbacks(router) == {("coder", "big", "small", "refused"): 1}


def test_a_plain_400_goes_back_as_sent(fleet):
    router, a, b = fleet()
    a.script("big", Behavior.refuse(400, "invalid_request_error", "max_tokens is too large"))
    status, headers, body = call(router)
    assert status == 400 and body["error"]["message"] == "max_tokens is too large"
    assert headers["x-router-model"] == "big"
    assert models_seen(b) == []


CONTEXT_MESSAGE = "the request exceeds the available context size, try increasing it"


def test_a_context_length_400_moves_down_the_chain(start_fleet_in_process):
    narrow = SimLlamaCpp("narrow", alias="big")  # llama.cpp's own answer for a long prompt
    wide = SimBox("b", residents=["small"])
    router = start_fleet_in_process(narrow, wide)
    assert put_alias(router, "coder", "big", "small")[0] == 201
    narrow.script("big", Behavior.refuse(400, "exceed_context_size_error", CONTEXT_MESSAGE))
    status, headers, _ = call(router)
    assert status == 200 and headers["x-router-model"] == "small"
    assert fallbacks(router) == {("coder", "big", "small", "context_length"): 1}
    # the last model in reach has nowhere to go: the 400 goes back as sent
    narrow.script("big", Behavior.refuse(400, "exceed_context_size_error", CONTEXT_MESSAGE))
    status, headers, body = call(router, headers={"X-Router-Fallback": "off"})
    assert status == 400 and body["error"]["type"] == "exceed_context_size_error"
    # so does it for a plain name
    narrow.script("big", Behavior.refuse(400, "exceed_context_size_error", CONTEXT_MESSAGE))
    assert call(router, "big")[0] == 400


# --------------------------------------------------------------------------------------------
# Streams and the official clients
# --------------------------------------------------------------------------------------------
def test_a_stream_falls_back_before_its_first_frame_through_the_openai_client(fleet):
    router, a, b = fleet()
    a.script("big", Behavior.in_band("insufficient_resources", "no room for big"))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="coder", messages=MESSAGES, stream=True)
    assert raw.headers["x-router-model"] == "small" and raw.headers["x-router-fallback"] == "1"
    chunks = list(raw.parse())
    assert chunks and all(not getattr(c, "error", None) for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert models_seen(b) == ["small"]


def test_a_stream_is_never_rerouted_after_its_first_frame(fleet):
    router, a, b = fleet()
    a.script("big", Behavior.die_after(2))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model="coder", messages=MESSAGES, stream=True):
            pass
    assert models_seen(b) == []


def test_the_ollama_client_through_an_alias_on_the_dedicated_port(start_fleet_in_process):
    first = SimOllama("o1", tags=["llama3"], loaded=["llama3"])
    second = SimOllama("o2", tags=["qwen3:8b"], loaded=["qwen3:8b"])
    router = start_fleet_in_process(first, second, extra_args=("--ollama-port", "auto"))
    assert put_alias(router, "fast", "llama3", "qwen3:8b")[0] == 201
    first.script("llama3", Behavior.busy())
    client = ollama.Client(host=router.urls["ollama"])
    reply = client.chat(model="fast", messages=MESSAGES)
    assert reply.message.content
    assert models_seen(second) == ["qwen3:8b"]
    reply = client.chat(model="fast", messages=MESSAGES)  # o1 cools for llama3; its next call
    assert [m for m in models_seen(first) if m] and all(m == "llama3:latest" for m in models_seen(first))
    listed = {m.model: m for m in client.list().models}
    assert "fast" in listed and "llama3:latest" in listed


def test_every_model_bearing_route_falls_back_through_the_openai_client(fleet):
    """Embeddings (JSON) and a transcription (a multipart form): the same step, the same rewrite."""
    router, a, b = fleet()
    a.script("big", Behavior.refuse(503, "insufficient_resources"), Behavior.refuse(503, "insufficient_resources"))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    raw = client.embeddings.with_raw_response.create(model="coder", input="hello")
    assert raw.headers["x-router-model"] == "small" and raw.parse().data
    raw = client.audio.transcriptions.with_raw_response.create(model="coder", file=("a.wav", b"RIFF....WAVE"))
    assert raw.headers["x-router-model"] == "small"
    assert [(r.path, r.model) for r in b.calls if r.path != "/v1/telemetry/state"][-2:] == [
        ("/v1/embeddings", "small"), ("/v1/audio/transcriptions", "small")]


def test_an_alias_on_the_lmstudio_port(start_fleet_in_process):
    from router.sim.lmstudio import SimLMStudio

    first = SimLMStudio("l1", models=["qwen/qwen3-8b"], loaded=["qwen/qwen3-8b"])
    second = SimLMStudio("l2", models=["google/gemma-3-4b"], loaded=["google/gemma-3-4b"])
    router = start_fleet_in_process(first, second, extra_args=("--lmstudio-port", "auto"))
    assert put_alias(router, "chat", "qwen/qwen3-8b", "google/gemma-3-4b")[0] == 201
    first.script("qwen/qwen3-8b", Behavior.refuse(503, None))
    client = openai.OpenAI(base_url=router.urls["lmstudio"] + "/v1", api_key="lm-studio", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)
    assert raw.headers["x-router-model"] == "google/gemma-3-4b" and raw.headers["x-router-fallback"] == "1"
    rows = json.loads(request(router, "GET", "/api/v0/models")[2])["data"]
    assert [r["id"] for r in rows if r.get("alias")] == ["chat"]


# --------------------------------------------------------------------------------------------
# Opting out, plain names, the deadline
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_out", [{"headers": {"X-Router-Fallback": "off"}}, {"alloc": {"fallback": False}}],
                         ids=["header", "alloc"])
def test_the_opt_out_keeps_the_call_on_the_first_model(fleet, opt_out):
    router, a, b = fleet()
    a.script("big", Behavior.refuse(503, "insufficient_resources"))
    status, _, body = call(router, **opt_out)
    assert status == 503
    assert models_seen(b) == []


def test_a_bad_opt_out_is_a_400(fleet):
    router, a, b = fleet()
    assert call(router, headers={"X-Router-Fallback": "maybe"})[0] == 400
    assert call(router, alloc={"fallback": "no"})[0] == 400
    assert models_seen(a) == []


def test_only_the_router_says_which_model_served(fleet):
    router, a, b = fleet()
    answer = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()
    spoof = [("Content-Type", "application/json"), ("X-Router-Model", "gpt-9"), ("X-Router-Fallback", "7")]
    a.script("big", Behavior.raw(200, spoof, answer), Behavior.raw(200, spoof, answer))
    assert call(router, "big")[1].get("x-router-model") is None
    _, headers, _ = call(router)
    assert (headers["x-router-model"], headers["x-router-fallback"]) == ("big", "0")


def test_a_plain_name_never_falls_back(fleet):
    router, a, b = fleet()
    a.script("big", Behavior.refuse(503, "insufficient_resources"))
    status, headers, _ = call(router, "big")
    assert status == 503 and "x-router-model" not in headers
    assert models_seen(b) == []


def test_one_deadline_bounds_the_whole_chain(start_fleet_in_process):
    a = SimBox("a", residents=["big"])
    b = SimBox("b", residents=["small"])
    router = start_fleet_in_process(a, b, extra_args=("--first-byte-timeout", "2"))
    assert put_alias(router, "coder", "big", "small")[0] == 201
    a.script("big", Behavior.hang(10))
    b.script("small", Behavior.hang(10))
    started = time.monotonic()
    status, _, _ = call(router)
    took = time.monotonic() - started
    # real time: a stepped clock cannot tell one deadline from two (the first attempt would use
    # none of it); 2 s for the chain, 4 s if each model had its own
    assert status in (502, 504) and took < 3.5, f"the chain took {took:.2f} s: timeouts multiplied"


# --------------------------------------------------------------------------------------------
# Definitions, listings, the log
# --------------------------------------------------------------------------------------------
def test_bad_alias_definitions_are_refused_with_one_line_and_change_nothing(fleet):
    router, a, b = fleet()
    before = json.loads(request(router, "GET", "/v1/aliases")[2])
    for name, chain, says in [
        ("coder", ["coder"], "may not name the alias itself"),
        ("other", ["coder", "big"], "coder is an alias"),
        ("bad@name", ["big"], "alias name must be"),
        ("many", [f"m{i}" for i in range(9)], "1 to 8 models"),
    ]:
        status, body = put_alias(router, name, *chain)
        assert status == 400 and says in body["error"]["message"], body
    status, body = put_alias(router, "small", "big")  # a box serves `small`: the name is taken
    assert (status, body["error"]["code"]) == (409, "alias_shadows_model") and "may not shadow it" in body["error"]["message"]
    assert request(router, "PUT", "/v1/aliases/x", {"models": ["big"]})[0] == 400
    assert request(router, "DELETE", "/v1/aliases/nothing")[0] == 404
    assert json.loads(request(router, "GET", "/v1/aliases")[2]) == before
    assert request(router, "DELETE", "/v1/aliases/coder")[0] == 200
    assert call(router)[0] == 503  # gone: now a model name no box serves


def test_aliases_are_listed_marked_as_aliases(fleet):
    router, a, b = fleet()
    doc = json.loads(request(router, "GET", "/v1/aliases")[2])
    assert doc == {"aliases": [{"name": "coder", "chain": ["big", "small"], "first_available": "big",
                                "shadowed_by": [], "unlisted": []}]}
    models = openai.OpenAI(base_url=router.url + "/v1", api_key="x").models.list().data
    row = next(m for m in models if m.id == "coder")
    assert row.model_extra["alias"] is True and row.model_extra["chain"] == ["big", "small"]
    assert not any(m.model_extra.get("alias") for m in models if m.id != "coder")
    tags = json.loads(request(router, "GET", "/api/tags")[2])["models"]
    assert [t["name"] for t in tags if t.get("alias")] == ["coder"]
    for path, member, field in (("/api/v0/models", "data", "id"), ("/api/v1/models", "models", "key")):
        rows = json.loads(request(router, "GET", path)[2])[member]
        assert [r[field] for r in rows if r.get("alias")] == ["coder"]
    state = json.loads(request(router, "GET", "/v1/router/state")[2])
    assert state["aliases"][0]["first_available"] == "big"
    router.fleet.stop_box(a)
    call(router)  # the refusal marks a unreachable
    state = json.loads(request(router, "GET", "/v1/router/state")[2])
    assert state["aliases"][0]["first_available"] == "small"


def test_the_route_log_keeps_the_name_asked_and_the_model_served(fleet):
    router, a, b = fleet()
    a.script("big", Behavior.refuse(503, "insufficient_resources"))
    status, headers, _ = call(router)
    call_id = headers["x-hugpy-router-request-id"]

    def row():
        rows = json.loads(request(router, "GET", "/v1/telemetry")[2])["rows"]
        return next((r for r in rows if r["request_id"] == call_id), None)

    logged = wait_for(row)
    assert logged["model"] == "small" and logged["box"] == "b"
    assert logged["decision"]["alias"] == "coder" and logged["decision"]["fallback"] == 1
    assert [a["box"] for a in logged["attempts"]] == ["a", "b"]


def test_the_cli_sets_lists_and_removes_aliases(tmp_path):
    boxes = tmp_path / "boxes.json"

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "router", "aliases", "--boxes-file", str(boxes), *args],
                              capture_output=True, text=True, timeout=30)

    done = cli("set", "coder", "qwen3-coder-30b", "qwen3:8b")
    assert done.returncode == 0, done.stderr
    assert cli("list").stdout == "coder\tqwen3-coder-30b -> qwen3:8b\n"
    refused = cli("set", "loop", "loop")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0
    assert "may not name the alias itself" in refused.stderr
    assert cli("set", "two", "coder").returncode == 2
    assert cli("remove", "nothing").returncode == 1
    assert cli("remove", "coder").returncode == 0
    assert cli("list").stdout == ""


def test_a_chain_model_no_box_lists_is_warned_of_listed_and_marked(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", residents=["big"]), SimOllama("o", tags=["small:latest"]))
    boxes = router.boxes_path

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "router", "aliases", "--boxes-file", str(boxes), *args],
                              capture_output=True, text=True, timeout=30)

    done = cli("set", "coder", "big", "bgi", "small")  # asks the running router (the listeners record)
    assert done.returncode == 0 and done.stdout == "alias coder added: big -> bgi -> small\n", done.stderr
    assert "warning: no box lists bgi now" in done.stderr and "small" not in done.stderr, done.stderr
    assert cli("list").stdout == "coder\tbig -> bgi (no box lists it) -> small\n"
    (view,) = json.loads(request(router, "GET", "/v1/aliases")[2])["aliases"]
    assert view["unlisted"] == ["bgi"]
    assert put_alias(router, "coder", "big", "small")[1]["unlisted"] == []
    assert cli("set", "coder", "big").stderr == ""
    assert call(router)[0] == 200  # the call path is the same


# --------------------------------------------------------------------------------------------
# The body each box gets
# --------------------------------------------------------------------------------------------
def test_the_body_keeps_every_byte_but_the_model():
    from router.facades import ollama as ollama_facade
    from router.facades import openai as openai_facade
    from router.facades.body import read_call, with_model

    chat = next(r for r in openai_facade.FACADE.routes if r.path == "/v1/chat/completions")
    body = b'{"messages": [{"role": "user", "content": "say \\"coder\\""}], "mod\\u0065l" : "coder", "n": 1}'
    rewritten = with_model(body, "application/json", chat, "qwen3:8b")
    assert rewritten == body.replace(b'"coder", "n"', b'"qwen3:8b", "n"')
    assert read_call(rewritten, "application/json", chat, openai_facade.FACADE, None, None).call.model == "qwen3:8b"

    show = next(r for r in ollama_facade.FACADE.routes if r.path == "/api/show")
    assert json.loads(with_model(b'{"name": "fast"}', "application/json", show, "llama3:latest")) == {
        "name": "llama3:latest"}

    transcribe = next(r for r in openai_facade.FACADE.routes if r.path == "/v1/audio/transcriptions")
    boundary = b"xyz"
    form = (b'--xyz\r\nContent-Disposition: form-data; name="model"\r\n\r\ncoder\r\n'
            b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF coder\r\n--xyz--\r\n')
    content_type = "multipart/form-data; boundary=" + boundary.decode()
    assert with_model(form, content_type, transcribe, "whisper-1") == form.replace(b"\r\n\r\ncoder", b"\r\n\r\nwhisper-1")


def test_a_stream_the_router_asks_usage_for_gets_the_model_too(start_fleet_in_process):
    """An OpenAI stream to a box that reports usage only when asked (tenancy's usage body): the
    body with the question is the one rewritten for each model."""
    from router.sim.lmstudio import SimLMStudio

    first = SimLMStudio("l1", models=["qwen/qwen3-8b"], loaded=["qwen/qwen3-8b"])
    second = SimLMStudio("l2", models=["google/gemma-3-4b"], loaded=["google/gemma-3-4b"])
    router = start_fleet_in_process(first, second)
    assert put_alias(router, "chat", "qwen/qwen3-8b", "google/gemma-3-4b")[0] == 201
    first.script("qwen/qwen3-8b", Behavior.refuse(503, None))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(model="chat", messages=MESSAGES, stream=True))
    assert chunks and all(c.usage is None for c in chunks)  # asked by the router, kept from the client
    assert [r.model for r in second.calls if r.path == "/v1/chat/completions"] == ["google/gemma-3-4b"]
    assert [r.model for r in first.calls if r.path == "/v1/chat/completions"] == ["qwen/qwen3-8b"]


def test_a_keys_models_name_what_it_asks_for(fleet):
    router, a, b = fleet()

    def key_for(*models):
        status, _, body = request(router, "POST", "/v1/keys", {"name": "team", "limits": {"models": list(models)}})
        assert status == 201, body
        return {"Authorization": "Bearer " + json.loads(body)["key"]}

    assert call(router, headers=key_for("coder", "big", "small"))[0] == 200
    status, _, body = call(router, headers=key_for("big", "small"))
    assert status == 403 and body["error"]["code"] == "model_not_allowed"


def test_an_alias_reaches_only_the_models_the_key_names(fleet):
    """chain.py rule 6: the alias's own name grants none of its chain."""
    router, a, b = fleet()

    def key_for(*models):
        status, _, body = request(router, "POST", "/v1/keys", {"name": "team", "limits": {"models": list(models)}})
        assert status == 201, body
        return {"Authorization": "Bearer " + json.loads(body)["key"]}

    status, _, body = call(router, headers=key_for("coder"))
    assert status == 403 and body["error"]["code"] == "model_not_allowed"
    status, headers, _ = call(router, headers=key_for("coder", "small"))  # `big` passed over, never sent
    assert (status, headers["x-router-model"]) == (200, "small")
    assert models_seen(a) == [] and models_seen(b) == ["small"]
    assert not fallbacks(router)  # a model the key may not call is no fallback
    status, _, body = call(router, headers=key_for("coder", "small"), alloc={"fallback": False})
    assert status == 403 and body["error"]["code"] == "model_not_allowed"  # only `big` in reach


def test_an_alias_never_takes_a_served_models_name_from_a_key(start_fleet_in_process):
    """Issue 36 item 12: `aliases set tiny-llama secret-model` must not hand a key allowed
    `[tiny-llama]` the model `secret-model`."""
    a, b = SimBox("a", residents=["tiny-llama"]), SimBox("b", residents=["secret-model"])
    router = start_fleet_in_process(a, b)
    boxes = router.boxes_path

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "router", "aliases", "--boxes-file", str(boxes), *args],
                              capture_output=True, text=True, timeout=30)

    done = cli("set", "tiny-llama", "secret-model")  # asks the running router (the listeners record)
    assert done.returncode == 2 and "409" in done.stderr and "may not shadow it" in done.stderr, done.stderr
    assert "aliases" not in json.loads(boxes.read_text())
    # written behind the router's back (a hand edit, or the CLI while no router ran)
    doc = json.loads(boxes.read_text())
    boxes.write_text(json.dumps({**doc, "aliases": {"tiny-llama": ["secret-model"]}}))
    assert wait_for(lambda: json.loads(request(router, "GET", "/v1/aliases")[2])["aliases"], 5)
    status, _, body = request(router, "POST", "/v1/keys", {"name": "team", "limits": {"models": ["tiny-llama"]}})
    key = {"Authorization": "Bearer " + json.loads(body)["key"]}
    status, _, body = call(router, "tiny-llama", headers=key)
    assert status == 403 and body["error"]["code"] == "model_not_allowed"
    assert models_seen(b) == []
