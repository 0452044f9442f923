"""Tenancy end to end (docs/tenancy.md): per-key limits, budgets and exact usage, with the real
router in this process in front of simulated boxes that report usage."""

from __future__ import annotations

import concurrent.futures
import gc
import http.client
import json
import re
import time

import ollama
import openai
import pytest

from router.core.limits import period_bounds
from router.serve.limits import Tenancy
from router.sim import SimFleet, SimLMStudio, SimOllama
from router.sim.hugpy import Behavior, SimBox
from router.sim.prefix_cache import prompt_tokens

from conftest import write_boxes
from inproc import InProcessRouter
from support.boxes import max_concurrency
from support.calls import bearer, call, new_key, request

pytestmark = pytest.mark.timeout(90)

MESSAGES = [{"role": "user", "content": "hello"}]
PROMPT = prompt_tokens({"messages": MESSAGES})  # 9: the sims' own count (router/sim/prefix_cache.py)


def rows(router) -> list[dict]:
    """The route log as the admin API reads it, once the writer has flushed."""
    time.sleep(0.15)
    status, _, body = request(router, "GET", "/v1/telemetry?since=0&limit=1000", timeout=10)
    assert status == 200
    return json.loads(body)["rows"]


def tenancy_of(router) -> Tenancy:
    """The in-process router's Tenancy (its clock is what the test moves)."""
    home = router.boxes_path.parent / "home"
    (found,) = [o for o in gc.get_objects() if isinstance(o, Tenancy) and o.keys.path.parent == home]
    return found


def burst(n: int, fn) -> list:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: fn(), range(n)))


def test_rpm_is_exact_in_a_burst_and_served_calls_carry_openais_headers(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    router = start_fleet_in_process(box)
    key_id, key = new_key(router, rpm=5, tpm=100_000)
    results = burst(12, lambda: call(router, headers=bearer(key)))
    assert sorted(status for status, _, _ in results) == [200] * 5 + [429] * 7
    served = [headers for status, headers, _ in results if status == 200]
    assert {h["x-ratelimit-limit-requests"] for h in served} == {"5"}
    assert sorted(int(h["x-ratelimit-remaining-requests"]) for h in served) == [0, 1, 2, 3, 4]
    assert all(h["x-ratelimit-limit-tokens"] == "100000" and "x-ratelimit-reset-tokens" in h for h in served)
    refused = [(headers, body) for status, headers, body in results if status == 429]
    assert all(int(h["retry-after"]) >= 1 and b["error"]["code"] == "rate_limited" for h, b in refused)
    metrics = request(router, "GET", "/metrics")[2].decode()
    assert f'router_key_limited_total{{key="{key_id}",reason="rate_limited"}} 7.0' in metrics
    secret = key.split("_", 2)[2]
    assert key not in metrics and secret not in metrics
    logged = rows(router)
    assert {r["key_id"] for r in logged} == {key_id}  # the route log names the key by its id only
    assert secret not in json.dumps(logged) and secret not in router.log_text()


def test_tpm_overshoots_by_at_most_one_call(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"], chunks=200)  # reports 8 + 200 tokens a call
    router = start_fleet_in_process(box)
    _, key = new_key(router, tpm=500)
    results = burst(16, lambda: call(router, headers=bearer(key), max_tokens=200))
    served = [body for status, _, body in results if status == 200]
    reservation = 25 + 200  # its prompt by size (~100 bytes / 4) and its max_tokens
    drained = 500 / 60 * 5  # what the minute gives back over the burst's few seconds at most
    assert len(served) >= 2 and all(status in (200, 429) for status, _, _ in results)
    assert sum(b["usage"]["total_tokens"] for b in served) <= 500 + reservation + drained


def test_calls_without_max_tokens_get_the_routers_bound_so_a_burst_overshoots_by_at_most_one_call(
        start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"], chunks=400)  # 400 tokens unless the call bounds it
    router = start_fleet_in_process(box, extra_args=("--default-max-tokens", "40"))
    _, key = new_key(router, budget_tokens=300)
    results = burst(12, lambda: call(router, headers=bearer(key)))  # none states max_tokens
    served = [body for status, _, body in results if status == 200]
    assert len(served) >= 2 and all(status in (200, 429) for status, _, _ in results)
    # the router's bound, or less where less is left of the budget (the last calls' bound is capped)
    assert all(b["choices"][0]["finish_reason"] == "length" and b["usage"]["completion_tokens"] <= 40 for b in served)
    assert max(b["usage"]["completion_tokens"] for b in served) == 40
    body_bytes = len(json.dumps({"model": "tiny", "messages": MESSAGES}))
    prompt = -(-body_bytes // 4)  # its prompt by size: what one call may take past the budget
    assert sum(b["usage"]["total_tokens"] for b in served) <= 300 + prompt  # unbounded: 409 a call

    _, key = new_key(router, tpm=100_000)  # the bound on every API: a stream, Ollama's own, a stated one
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
    chunks = [c for c in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True) if c.choices]
    assert len([c for c in chunks if c.choices[0].delta.content]) == 40 and chunks[-1].choices[0].finish_reason == "length"
    native = ollama.Client(host=router.url, headers=bearer(key)).chat("tiny", MESSAGES, stream=False,
                                                                       options={"num_ctx": 4096})
    assert native.eval_count == 40 and native.done_reason == "length"
    assert call(router, headers=bearer(key), max_tokens=100)[2]["usage"]["completion_tokens"] == 100

    _, key = new_key(router, rpm=100)  # no token limits: the body goes to the box as it came
    status, _, body = call(router, headers=bearer(key))
    assert status == 200 and body["usage"]["completion_tokens"] == 400 and body["choices"][0]["finish_reason"] == "stop"


def test_an_alias_call_gets_the_bound_and_its_model_in_a_body_rewritten_before_it(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"], chunks=400)
    router = start_fleet_in_process(box, extra_args=("--default-max-tokens", "40"))
    assert request(router, "PUT", "/v1/aliases/fast", {"chain": ["tiny"]})[0] == 201
    _, key = new_key(router, tpm=100_000)
    # `options` before `model`: the bound rewrites it, so the model is found anew where it now is
    status, _, raw = request(router, "POST", "/api/chat", {"options": {"num_ctx": 4096}, "model": "fast",
                                                          "messages": MESSAGES, "stream": False}, headers=bearer(key))
    answer = json.loads(raw)
    assert status == 200 and answer["eval_count"] == 40 and answer["done_reason"] == "length"
    status, _, body = call(router, headers=bearer(key), model="fast")
    assert status == 200 and body["usage"]["completion_tokens"] == 40
    assert [r.model for r in box.calls if r.path in ("/api/chat", "/v1/chat/completions")] == ["tiny:latest"] * 2


def test_a_box_that_ignores_the_bound_is_charged_what_it_reports(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"], chunks=300)
    box.honours_bound = False
    router = start_fleet_in_process(box, extra_args=("--default-max-tokens", "40"))
    key_id, key = new_key(router, budget_tokens=100)
    assert call(router, headers=bearer(key))[2]["usage"]["completion_tokens"] == 300
    assert call(router, headers=bearer(key))[2]["error"]["code"] == "budget_exceeded"
    (row,) = [r for r in rows(router) if r["key_id"] == key_id and r["http_status"] == 200]
    assert (row["prompt_tokens"], row["completion_tokens"], row["tokens_estimated"]) == (PROMPT, 300, 0)


class ReadsLikeVllm(SimOllama):
    """A box reading the answer's bound on `/v1` as vLLM and SGLang do (`max_completion_tokens
    or max_tokens`), or, with `first="n_predict"`, as llama.cpp does (`n_predict`, then
    `max_tokens`): what the router writes must hold whichever field a box reads."""

    first = "max_completion_tokens"
    seen: list  # (that field, max_tokens) per call, as the box read them

    def _length(self, body, openai):
        if openai:
            self.seen.append((body.get(self.first), body.get("max_tokens")))
            body = {**body, "max_tokens": body.get(self.first) or body.get("max_tokens")}
        return super()._length(body, openai)


@pytest.mark.parametrize("first", ["max_completion_tokens", "n_predict"])
def test_no_bound_field_spends_more_than_the_keys_budget(start_fleet_in_process, first):
    """Issue 36 item 2: a call stepping around the bound (a small `max_tokens` and a huge other
    field a box reads first, or a huge one alone) is bounded by what is left of its key's budget
    in every field; 40 such calls at once are charged the budget plus one call's prompt at most;
    a bound written as a float or a string is a 400 that reaches no box."""
    box = ReadsLikeVllm("o", tags=["tiny"], loaded=["tiny"], chunks=5000)  # 5000 tokens unless bounded
    box.first, box.seen = first, []
    router = start_fleet_in_process(box)
    key_id, key = new_key(router, budget_tokens=300)
    status, _, body = call(router, headers=bearer(key), max_tokens=1, **{first: 100_000})
    assert status == 200 and body["usage"]["completion_tokens"] <= 300, body["usage"]
    (read,) = box.seen
    assert read[0] == read[1] <= 300, read

    _, key = new_key(router, budget_tokens=5000)
    prompt = -(-len(json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 10**9})) // 4)
    results = burst(40, lambda: call(router, headers=bearer(key), max_tokens=10**9))
    served = [b for status, _, b in results if status == 200]
    assert served and all(status in (200, 429) for status, _, _ in results)
    assert sum(b["usage"]["total_tokens"] for b in served) <= 5000 + prompt

    calls = len(box.calls)
    for value in ("1e5", '"100000"', "100000.0", "2147483648"):
        raw = b'{"model":"tiny","messages":[],"%s":%s}' % (first.encode(), value.encode())
        status, _, answer = request_raw(router, "/v1/chat/completions", raw, bearer(key))
        assert status == 400 and json.loads(answer)["error"]["code"] == "invalid_answer_bound", answer
    assert len(box.calls) == calls


def test_a_form_naming_its_model_twice_is_400_before_any_box(start_fleet_in_process):
    """Issue 36 item 3: a box's form parser may keep the last `model` part (Starlette's does), so
    a form naming it twice, in any spelling a parser reads, would run a model the key may not
    call where the router checked and routed the first."""
    box = SimBox("h", residents=["vmodel", "vsecret"])
    router = start_fleet_in_process(box)
    _, key = new_key(router, models=["vmodel"])
    boundary = "b0undary"

    def form(*parts: tuple[str, str]) -> tuple[int, dict, bytes]:
        raw = "".join(f"--{boundary}\r\nContent-Disposition: form-data; {head}\r\n\r\n{value}\r\n"
                      for head, value in parts) + f"--{boundary}--\r\n"
        return request_raw(router, "/v1/audio/transcriptions", raw.encode(),
                           {**bearer(key), "Content-Type": f"multipart/form-data; boundary={boundary}"})

    audio = ('name="file"; filename="a.wav"', "RIFF")
    for second in ('name="model"', "name=model", 'name="file"; name = "model"', 'name="model"; filename="m"'):
        status, _, answer = form(('name="model"', "vmodel"), audio, (second, "vsecret"))
        assert status == 400 and "more than once" in json.loads(answer)["error"]["message"], answer
    assert box.calls == []
    assert form(('name="model"', "vsecret"), audio)[0] == 403
    assert form(('name="model"', "vmodel"), audio)[0] == 200


def request_raw(router, path: str, raw: bytes, headers: dict) -> tuple[int, dict, bytes]:
    """`request` with the body's bytes as given (a number JSON writes only one way otherwise)."""
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_max_parallel_is_never_exceeded_at_the_box_and_every_call_is_served(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", *[Behavior.hang(0.15)] * 8)
    router = start_fleet_in_process(box)
    _, key = new_key(router, max_parallel=2)
    results = burst(8, lambda: call(router, headers=bearer(key)))
    assert [status for status, _, _ in results] == [200] * 8
    assert max_concurrency(box) == 2


def test_the_budget_is_refused_at_the_right_call_and_resets_at_the_period_boundary(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    router = start_fleet_in_process(box)
    _, key = new_key(router, budget_tokens=30, budget_period="day")
    tenancy = tenancy_of(router)
    _, end = period_bounds("day", time.time())
    tenancy.clock = lambda: end - 5.0
    statuses = [call(router, headers=bearer(key))[0] for _ in range(4)]
    assert statuses == [200, 200, 200, 429]  # 14 + 14 + 14 tokens (9 + 5): the third spends it
    status, headers, body = call(router, headers=bearer(key))
    assert body["error"]["code"] == "budget_exceeded" and headers["retry-after"] == "5"
    tenancy.clock = lambda: end + 1.0  # the next UTC day
    assert call(router, headers=bearer(key))[0] == 200


def test_models_outside_the_list_are_403_in_each_facades_shape(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny", "other"], loaded=["tiny"])
    router = start_fleet_in_process(box)
    _, key = new_key(router, models=["tiny"])
    assert call(router, headers=bearer(key), model="tiny")[0] == 200
    status, _, body = call(router, headers=bearer(key), model="other")
    assert status == 403 and body["error"]["code"] == "model_not_allowed"
    status, _, raw = request(router, "POST", "/api/chat", {"model": "other", "messages": MESSAGES, "stream": False},
                             headers=bearer(key))
    assert status == 403 and json.loads(raw) == {"error": "this key may not call this model"}
    status, _, _ = request(router, "POST", "/api/chat", {"model": "tiny", "messages": MESSAGES, "stream": False},
                           headers=bearer(key))
    assert status == 200


def test_a_keys_model_with_options_reaches_hugpy_boxes_only(start_fleet_in_process):
    """Issue 36 item 7: a key allowed `qwen3-8b` may call `qwen3-8b@ctx-low` on a hugpy box (the
    same model, with options), never the LM Studio model of that exact id."""
    hugpy = SimBox("h", catalog=["qwen3-8b"])
    lms = SimLMStudio("l", models=["qwen3-8b@ctx-low"], loaded=["qwen3-8b@ctx-low"])
    router = start_fleet_in_process(hugpy, lms)
    _, key = new_key(router, models=["qwen3-8b"])
    for _ in range(3):
        status, headers, body = call(router, headers=bearer(key), model="qwen3-8b@ctx-low")
        assert (status, headers["x-hugpy-box"]) == (200, "h"), body
    status, _, body = call(router, headers={**bearer(key), "X-Router-Box": "l"}, model="qwen3-8b@ctx-low")
    assert status == 503 and body["error"]["reasons"]["l"].startswith("kind_not_served"), body
    status, _, raw = request(router, "POST", "/api/v0/chat/completions",
                             {"model": "qwen3-8b@ctx-low", "messages": MESSAGES}, headers=bearer(key))
    assert status == 403 and json.loads(raw)["error"]["code"] == "model_not_allowed"
    assert lms.calls == []
    _, other = new_key(router, models=["qwen3-8b@ctx-low"])  # the LM Studio model by its own name
    status, _, _ = request(router, "POST", "/api/v0/chat/completions",
                           {"model": "qwen3-8b@ctx-low", "messages": MESSAGES}, headers=bearer(other))
    assert status == 200


def _frames(raw: bytes) -> bytes:
    """A stream with its per-answer values (id, created) made constant."""
    return re.sub(rb'"created":\d+', b'"created":0', re.sub(rb'"id":"[^"]*"', b'"id":"x"', raw))


def test_streams_are_charged_like_non_streams_and_the_clients_stream_is_unchanged(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    router = start_fleet_in_process(box)
    key_id, key = new_key(router)
    doc = {"model": "tiny", "messages": MESSAGES, "stream": True}
    status, _, via_router = request(router, "POST", "/v1/chat/completions", doc, headers=bearer(key))
    assert status == 200
    host, port = box.url.removeprefix("http://").split(":")
    import http.client
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps(doc), {"Content-Type": "application/json"})
    direct = conn.getresponse().read()
    conn.close()
    assert b'"usage"' not in via_router and _frames(via_router) == _frames(direct)
    asked = request(router, "POST", "/v1/chat/completions", {**doc, "stream_options": {"include_usage": True}},
                    headers=bearer(key))[2]
    assert b'"usage"' in asked  # a client that asked keeps its usage chunk
    call(router, headers=bearer(key))
    logged = [r for r in rows(router) if r["key_id"] == key_id]
    assert [(r["stream"], r["prompt_tokens"], r["completion_tokens"], r["tokens_estimated"]) for r in logged] == [
        (1, PROMPT, 5, 0), (1, PROMPT, 5, 0), (0, PROMPT, 5, 0)]


def test_ollamas_counts_and_lm_studios_stats_are_read(start_fleet_in_process):
    oll = SimOllama("o", tags=["tiny"], loaded=["tiny"], chunks=4)
    lms = SimLMStudio("l", models=["qwen"], loaded=["qwen"])
    router = start_fleet_in_process(oll, lms)
    key_id, key = new_key(router)
    client = ollama.Client(host=router.url, headers=bearer(key))
    assert "".join(part.message.content for part in client.chat("tiny", MESSAGES, stream=True))
    client.chat("tiny", MESSAGES, stream=False)
    status, _, _ = request(router, "POST", "/api/v1/chat", {"model": "qwen", "input": "hi"}, headers=bearer(key))
    assert status == 200
    logged = [(r["route"], r["prompt_tokens"], r["completion_tokens"], r["tokens_estimated"])
              for r in rows(router) if r["key_id"] == key_id]
    prompt = prompt_tokens({"messages": MESSAGES})  # the sims' own count (router/sim/prefix_cache.py)
    assert logged[:2] == [("/api/chat", prompt, 4, 0), ("/api/chat", prompt, 4, 0)]
    assert logged[2][0] == "/api/v1/chat" and logged[2][1] == 8 and logged[2][3] == 0


def test_a_cut_stream_is_charged_an_estimate_never_zero(start_fleet_in_process):
    box = SimBox("a", residents=["tiny"])
    box.script("tiny", Behavior.die_after(3))
    router = start_fleet_in_process(box)
    key_id, key = new_key(router, tpm=100_000)
    request(router, "POST", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "stream": True},
            headers=bearer(key))
    (row,) = [r for r in rows(router) if r["key_id"] == key_id]
    assert row["tokens_estimated"] == 1 and row["completion_tokens"] >= 1 and row["prompt_tokens"] >= 1


def test_limit_changes_are_live_and_bad_input_changes_nothing(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    router = start_fleet_in_process(box)
    key_id, key = new_key(router)
    assert call(router, headers=bearer(key))[0] == 200
    status, _, body = request(router, "PUT", f"/v1/keys/{key_id}/limits", {"rpm": 1})
    assert status == 200 and json.loads(body)["limits"]["rpm"] == 1
    assert call(router, headers=bearer(key))[0] == 200
    assert call(router, headers=bearer(key))[0] == 429
    for bad in ({"rpm": -3}, {"rpm": "5"}, {"colour": 1}, {"budget_period": "year"}, {"models": "x"}):
        status, _, body = request(router, "PUT", f"/v1/keys/{key_id}/limits", bad)
        error = json.loads(body)["error"]
        assert status == 400 and error["code"] == "invalid_limits" and "\n" not in error["message"], bad
    status, _, body = request(router, "PUT", f"/v1/keys/{key_id}/limits", {"rpm": None})
    assert status == 200 and json.loads(body)["limits"]["rpm"] is None
    assert call(router, headers=bearer(key))[0] == 200
    assert request(router, "PUT", "/v1/keys/nokey/limits", {"rpm": 1})[0] == 404
    listed = json.loads(request(router, "GET", "/v1/keys")[2])["keys"]
    assert listed[0]["limits"]["rpm"] is None


def test_usage_survives_a_restart_and_keeps_the_budget(tmp_path):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    fleet = SimFleet([box])
    fleet.start()
    path = write_boxes(tmp_path / "boxes.json", [box])
    router = InProcessRouter(path)
    try:
        key_id, key = new_key(router, budget_tokens=3 * (PROMPT + 5) + 1)  # (5: the sim's answer) one token left after 3 calls
        assert [call(router, headers=bearer(key))[0] for _ in range(3)] == [200] * 3
        time.sleep(0.2)  # the route-log writer's flush window: usage is read from the store
        usage = json.loads(request(router, "GET", f"/v1/keys/{key_id}/usage")[2])
    finally:
        router.stop()
    assert usage["current"]["prompt_tokens"] == 3 * PROMPT and usage["left"]["budget_tokens"] == 1
    router = InProcessRouter(path)
    try:
        again = json.loads(request(router, "GET", f"/v1/keys/{key_id}/usage")[2])
        assert again["current"] == usage["current"]
        assert call(router, headers=bearer(key))[0] == 200  # all but one token used: one more call fits
        assert call(router, headers=bearer(key))[0] == 429
    finally:
        router.stop()
        fleet.stop()


def test_the_official_openai_client_sees_429_with_retry_after(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    router = start_fleet_in_process(box)
    _, key = new_key(router, rpm=1)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert caught.value.code == "rate_limited"


def test_a_429_carries_the_x_ratelimit_headers_of_the_callers_limits(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    router = start_fleet_in_process(box, extra_args=("--default-rpm", "1"))
    _, key = new_key(router, rpm=1, tpm=100_000)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    headers = caught.value.response.headers
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert headers["x-ratelimit-limit-tokens"] == "100000"
    assert 0 < int(headers["x-ratelimit-remaining-tokens"]) <= 100_000  # (the minute refills as it goes)
    assert re.fullmatch(r"[\d.]+(ms|s)|\d+m\d+s", headers["x-ratelimit-reset-requests"]), headers
    assert "x-ratelimit-reset-tokens" in headers
    # a caller without a key: its address's limits (rpm only)
    assert call(router, source="127.0.0.2")[0] == 200
    status, headers, _ = call(router, source="127.0.0.2")
    assert status == 429 and headers["x-ratelimit-limit-requests"] == "1" and "x-ratelimit-limit-tokens" not in headers


def test_callers_without_a_key_get_the_default_limits_per_address(start_fleet_in_process):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    router = start_fleet_in_process(box, extra_args=("--default-rpm", "2"))
    assert [call(router, source="127.0.0.2")[0] for _ in range(3)] == [200, 200, 429]
    assert call(router, source="127.0.0.3")[0] == 200  # another address: its own minute
    _, key = new_key(router)
    assert call(router, source="127.0.0.2", headers=bearer(key))[0] == 200  # a key: its own limits
