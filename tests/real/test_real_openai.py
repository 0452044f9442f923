"""The real tier, OpenAI kind: a `router serve` process in front of two or three real llama-servers
(tests/real/real_engine.py), called with the official `openai` client. What the engines report
(`usage`, `timings.cache_n`, their own /metrics counters) is the measure of what the router
charged and where it sent each turn."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import openai
import pytest

from conftest import RouterProcess, wait_for
from real_engine import ALIAS, LlamaServer, get, post, real_tier, route_rows, write_boxes

pytestmark = [*real_tier, pytest.mark.timeout(240)]

IGNORE_EOS = {"ignore_eos": True}  # the random model may end anywhere: llama-server's own switch for a fixed count
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in full sentences. " * 12}


@pytest.fixture
def real_fleet(tmp_path):
    """start(n, *router_args, **engine_kwargs) -> (router, engines): n llama-servers and a router
    in front that sees them all online; everything stopped by pid at the end."""
    started: list = []

    def start(n: int, *router_args: str, **engine_kwargs):
        engines = [LlamaServer(tmp_path, name, **engine_kwargs) for name in "abc"[:n]]
        started.extend(engines)
        router = RouterProcess(write_boxes(tmp_path / "boxes.json", engines), *router_args)
        started.insert(0, router)
        online = lambda: [b for b in get(router.url, "/v1/router/state")[1]["boxes"] if b["online"] and b["models"]]  # noqa: E731
        assert wait_for(lambda: len(online()) == n, 30), get(router.url, "/v1/router/state")[1]
        return router, engines

    yield start
    for proc in started:
        proc.stop()


def client(router, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(timeout=60))


def new_key(router) -> tuple[str, str]:
    status, _, body = post(router.url, "/v1/keys", {"name": "real-tier"})
    assert status == 201, body
    doc = json.loads(body)
    return doc["id"], doc["key"]


def engine_counters(engine: LlamaServer) -> dict[str, float]:
    """llama-server's own /metrics (`--metrics`): prompt tokens it processed (the cache's share not
    counted) and tokens it generated, since it started."""
    text = get(engine.url, "/metrics")[1].decode()
    return {name: float(value) for name, value in re.findall(r"^llamacpp:(\w+) (\S+)$", text, re.M)}


def test_streams_and_non_streams_are_charged_exactly_as_the_engine_reports(real_fleet):
    router, engines = real_fleet(2, extra=("--metrics",))
    key_id, key = new_key(router)
    api = client(router, key)
    messages = [SYSTEM, {"role": "user", "content": "Tell me about routers."}]
    ask = api.chat.completions.with_raw_response.create
    raw = ask(model=ALIAS, messages=messages, max_tokens=8, extra_body=IGNORE_EOS)
    whole, ids = raw.parse(), [raw.headers["x-hugpy-router-request-id"]]
    assert whole.choices[0].message.content and whole.usage.completion_tokens == 8
    reports = [(whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.model_extra["timings"]["cache_n"])]

    raw = ask(model=ALIAS, messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True},
              extra_body=IGNORE_EOS)
    asked, ids = list(raw.parse()), ids + [raw.headers["x-hugpy-router-request-id"]]
    (usage_chunk,) = [chunk for chunk in asked if chunk.usage]
    assert usage_chunk.choices == [] and "".join(c.choices[0].delta.content or "" for c in asked if c.choices)
    reports.append((usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens,
                    usage_chunk.model_extra["timings"]["cache_n"]))

    # a stream that did not ask for usage: the router asks for it, charges it, and strips it; what
    # the engine reported is read off its own counters around this one call
    before = {e.name: engine_counters(e) for e in engines}
    raw = ask(model=ALIAS, messages=messages, max_tokens=8, stream=True, extra_body=IGNORE_EOS)
    plain, ids = list(raw.parse()), ids + [raw.headers["x-hugpy-router-request-id"]]
    assert not any(chunk.usage for chunk in plain) and all(chunk.choices for chunk in plain)
    assert sum(1 for chunk in plain if chunk.choices[0].delta.content) >= 1
    after = {e.name: engine_counters(e) for e in engines}
    processed = sum(after[n]["prompt_tokens_total"] - before[n]["prompt_tokens_total"] for n in after)
    predicted = sum(after[n]["tokens_predicted_total"] - before[n]["tokens_predicted_total"] for n in after)
    assert predicted == 8
    prompt = reports[0][0]  # the same prompt, the same tokenizer: the same count
    reports.append((prompt, 8, prompt - int(processed)))

    rows = route_rows(router, *ids)
    assert [(r["key_id"], r["stream"]) for r in rows] == [(key_id, 0), (key_id, 1), (key_id, 1)]
    assert [(r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"], r["tokens_estimated"])
            for r in rows] == [(*report, 0) for report in reports]
    usage = wait_for(lambda: get(router.url, f"/v1/keys/{key_id}/usage")[1]["current"], 5)
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["cached_tokens"]) == (
        sum(r[0] for r in reports), 24, sum(r[2] for r in reports))
    assert sum(r[2] for r in reports) > 0  # later calls of the same prompt came from a slot's cache


def turn(api: openai.OpenAI, messages: list, **extra):
    """One chat turn: (box it landed on, the parsed answer, the router's id of the call)."""
    raw = api.chat.completions.with_raw_response.create(model=ALIAS, messages=messages, max_tokens=4,
                                                        extra_body=IGNORE_EOS, **extra)
    return raw.headers["x-hugpy-box"], raw.parse(), raw.headers["x-hugpy-router-request-id"]


def test_an_engine_killed_before_the_first_byte_and_mid_stream_fails_over(real_fleet):
    router, engines = real_fleet(3)
    by_name = {e.name: e for e in engines}
    api = client(router)
    messages = [SYSTEM, {"role": "user", "content": "a conversation of its own"}]
    home, _, _ = turn(api, messages)
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    # killed between two turns: the router still holds it online and sends the next turn there
    # (affinity), the connection is refused before any byte, and the turn goes to another engine
    by_name[home].kill()
    landed, answer, call_id = turn(api, messages)
    assert landed != home and answer.choices[0].message.content is not None
    (row,) = route_rows(router, call_id)
    assert [a["box"] for a in row["attempts"]] == [home, landed], row["attempts"]

    # killed mid-stream: what was relayed stays, the stream ends with an error frame, and the next
    # call goes to the engine left
    stream = api.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "go on"}],
                                         max_tokens=3000, stream=True, extra_body=IGNORE_EOS)
    with pytest.raises(openai.APIError) as ended:
        received = 0
        for chunk in stream:
            received += 1
            if received == 3:
                streaming = next(e for e in engines if e.proc.poll() is None and any(
                    s.get("is_processing") for s in e.slots() or []))
                streaming.kill()
    assert received >= 3 and "box_failed" in repr(ended.value.body) + str(ended.value)
    (survivor,) = [e.name for e in engines if e.proc.poll() is None]
    assert turn(api, [{"role": "user", "content": "still there?"}])[0] == survivor


# A later turn's share of its prompt that the engine prefilled from a slot's cache (its own
# `timings.cache_n` / `usage.prompt_tokens`), over 6 conversations x 4 turns on 3 engines of 2
# slots. Measured on a loaded 2-core machine: 0.957 twice (not 1: the engine re-evaluates a
# prompt's last token, and an answer sent back as text can tokenize apart from how it was
# generated); the same run with `--affinity off` gave 0.66 and 0.70 (only the shared system prompt
# is cached on a box a conversation was not on before). The floor sits between the two.
CACHED_SHARE_FLOOR = 0.85


def test_cache_aware_routing_prefills_later_turns_from_the_engines_cache(real_fleet):
    router, engines = real_fleet(3)
    api = client(router)

    def converse(n: int) -> list[tuple[str, int, int]]:
        messages = [SYSTEM, {"role": "user", "content": f"conversation {n}: here is my document. " * 30}]
        turns = []
        for t in range(4):
            box, answer, _ = turn(api, messages)
            turns.append((box, answer.usage.prompt_tokens, answer.model_extra["timings"]["cache_n"]))
            messages = messages + [{"role": "assistant", "content": answer.choices[0].message.content},
                                   {"role": "user", "content": f"question {t + 1} of {n}"}]
        return turns

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(converse, range(6)))
    later = [t for run in runs for t in run[1:]]
    share = sum(cached for _, _, cached in later) / sum(prompt for _, prompt, _ in later)
    assert share >= CACHED_SHARE_FLOOR, runs
    assert all(box == run[0][0] for run in runs for box, _, _ in run), runs  # each stuck to its engine
    assert len({run[0][0] for run in runs}) >= 2, runs  # first turns spread
