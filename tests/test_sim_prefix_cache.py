"""Every simulated box kind keeps a prefix cache (router/sim/prefix_cache.py) and reports what it
served from it the way that engine does: hugpy and LM Studio in OpenAI's `usage`, llama.cpp in
`timings.cache_n`, Ollama by a smaller `prompt_eval_count`; an uncached prompt costs its prefill."""

from __future__ import annotations

import time

import httpx

from router.sim import SimFleet, SimLlamaCpp, SimLMStudio, SimOllama
from router.sim.hugpy import SimBox
from router.sim.prefix_cache import PrefixCache

FIRST = [{"role": "system", "content": "s" * 2000}, {"role": "user", "content": "u" * 4000}]
SECOND = FIRST + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "next"}]
OTHER = [{"role": "system", "content": "s" * 2000}, {"role": "user", "content": "v" * 4000}]


def test_each_kind_reports_its_cached_tokens_its_own_way():
    boxes = {"hugpy": SimBox("h", residents=["tiny"]), "llamacpp": SimLlamaCpp("l", alias="tiny"),
             "ollama": SimOllama("o", tags=["tiny:latest"], loaded=["tiny:latest"]),
             "lmstudio": SimLMStudio("s", models=["tiny"], loaded=["tiny"])}
    paths = {"hugpy": "/v1/chat/completions", "llamacpp": "/v1/chat/completions", "ollama": "/api/chat",
             "lmstudio": "/v1/chat/completions"}
    readers = {
        "hugpy": lambda doc: doc["usage"]["prompt_tokens_details"]["cached_tokens"],
        "lmstudio": lambda doc: doc["usage"]["prompt_tokens_details"]["cached_tokens"],
        "llamacpp": lambda doc: doc["timings"]["cache_n"],
        "ollama": lambda doc: -doc["prompt_eval_count"],  # evaluated: fewer when cached
    }
    with SimFleet(list(boxes.values())):
        for kind, box in boxes.items():
            def ask(messages):
                body = {"model": "tiny", "messages": messages, "stream": False}
                return httpx.post(box.url + paths[kind], json=body, timeout=10).json()
            first, second, other = ask(FIRST), ask(SECOND), ask(OTHER)
            assert readers[kind](second) > readers[kind](first), kind
            assert readers[kind](other) < readers[kind](second), kind  # only the system prompt in common
            assert box.prefix_cache.cached_tokens > 0, kind


def test_prefill_costs_per_uncached_token_and_a_load_forgets():
    cache = PrefixCache(prefill_s_per_token=0.001, prompts_per_model=2)
    assert cache.take("m", ["a" * 400, "b" * 400]).seconds == 0.2
    assert cache.take("m", ["a" * 400, "b" * 400, "c" * 40]).seconds == 0.01
    cache.forget("m")
    assert cache.take("m", ["a" * 400]).cached_tokens == 0
    box = SimBox("h", residents=["tiny"])
    box.prefix_cache.prefill_s_per_token = 0.0002
    cache = box.prefix_cache
    with SimFleet([box]):
        started = time.perf_counter()
        httpx.post(box.url + "/v1/chat/completions", json={"model": "tiny", "messages": FIRST}, timeout=10)
        cold = time.perf_counter() - started
        uncached_before = cache.prompt_tokens - cache.cached_tokens
        httpx.post(box.url + "/v1/chat/completions", json={"model": "tiny", "messages": SECOND}, timeout=10)
        warm_s = (cache.prompt_tokens - cache.cached_tokens - uncached_before) * cache.prefill_s_per_token
    # real time: the box waits out its prefill on its loop (1,500 uncached tokens × 0.2 ms); a
    # lower bound. The warm call's prefill is counted, not timed: only its two new messages.
    assert cold >= 0.3 and 0 < warm_s < 0.01


def test_a_llama_cpp_sim_counts_a_repeated_prompt_as_llama_server_does():
    """All but one token cached, not all but the last element (tests/real/test_real_sim_llamacpp.py
    holds the sim to the real engine's count)."""
    assert SimLlamaCpp("l", alias="tiny").prefix_cache.repeat_costs_one
    cache = PrefixCache(repeat_costs_one=True)
    assert cache.take("m", ["a" * 400, "b" * 400]).cached_tokens == 0
    assert cache.take("m", ["a" * 400, "b" * 400]).cached_tokens == 199
    assert cache.take("m", ["a" * 400]).cached_tokens == 99  # a prefix of a remembered prompt
    assert PrefixCache().take("m", ["a" * 400]).cached_tokens == 0
