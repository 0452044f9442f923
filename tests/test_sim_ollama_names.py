"""The simulated Ollama's names (router/sim/ollama_names.py) against the router's
(router/core/names.py): two independent readings of Ollama's code, which must agree on every name
contracts/ollama-lmstudio.md §2 lists, and on the §2 rules' own cases."""

from __future__ import annotations

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.names import ollama_key
from router.sim.ollama_names import fold_key, parse

# §2's example table: what the client sends, Ollama's DisplayShortest
CONTRACT_TABLE = [
    ("llama3", "llama3:latest"),
    ("library/llama3", "llama3:latest"),
    ("registry.ollama.ai/library/llama3:8b", "llama3:8b"),
    ("myuser/mymodel", "myuser/mymodel:latest"),
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"),
    ("hf.co/user/repo", "hf.co/user/repo:latest"),
    ("localhost:5000/ns/model", "localhost:5000/ns/model:latest"),
    ("qwen2.5:7b", "qwen2.5:7b"),
    ("gpt-oss:20b-cloud", "gpt-oss:20b"),
    ("Llama3:LATEST", "Llama3:LATEST"),
]
CONTRACT_INVALID = ["hf.co/repo", "mm:", "n/m:", "host/name:space/model:tag", "", "   "]
# §2's numbered rules, one case or more each
RULE_CASES = [
    "  llama3  ", "glm-4.6:cloud", "glm-4.6:CLOUD", "llama3:local", "qwen3-coder:480b-cloud",
    "qwen3:8b:cloud", "ns/qwen3:8b:local", "m:cloud-cloud", "m:8b-cloud-cloud",
    "https://registry.ollama.ai/library/llama3", "http://example.com/library/m:t",
    "REGISTRY.OLLAMA.AI/Library/Llama3:8B", "registry.ollama.ai/user/m",
    "/m", "a/b/c/d", "ns.x/model", "model@sha", "-model", "m:-tag", "m:" + "t" * 80,
    "m:" + "t" * 81, "m" * 80, "m" * 81, "ho st/ns/m", "_m", "m.", "h:1/n/m", "n/m:t:u",
    # a scheme is cut off the host part only, and any scheme is (ParseNameBare's strings.Cut)
    "http://model", "https://ns/model", "ftp://example.com/library/m:t", "HTTP://Example.com/ns/m",
    "git+ssh://h:22/ns/m", "http://http://h/n/m", "://h/n/m", "h://", "https://m:cloud",
    "http:///ns/m", "/ns/m",
]


@pytest.mark.parametrize("sent,shown", CONTRACT_TABLE)
def test_sim_reads_the_contract_table_as_ollama_does(sent, shown):
    assert parse(sent).display_shortest() == shown


@pytest.mark.parametrize("sent", CONTRACT_INVALID)
def test_sim_refuses_the_contract_invalid_names(sent):
    assert parse(sent) is None


@pytest.mark.parametrize("sent", [s for s, _ in CONTRACT_TABLE] + CONTRACT_INVALID + RULE_CASES)
def test_sim_and_router_agree(sent):
    assert fold_key(sent) == ollama_key(sent)


_piece = st.text(alphabet="aZ9_.-:", min_size=0, max_size=6)


@st.composite
def names_with_schemes(draw):
    """Names of one to four `/`-parts, a scheme anywhere, tags and source suffixes: the shapes
    where a reading of Ollama's parse can go wrong."""
    parts = draw(st.lists(_piece, min_size=1, max_size=4))
    if draw(st.booleans()):
        at = draw(st.integers(0, len(parts) - 1))
        parts[at] = draw(st.sampled_from(["http://", "https://", "ftp://", "x+y://", "://"])) + parts[at]
    name = "/".join(parts)
    return name + draw(st.sampled_from(["", ":t", ":cloud", ":8b-cloud", ":local", ":"]))


@settings(max_examples=600, deadline=None)
@given(sent=st.one_of(names_with_schemes(), st.text(max_size=16)))
def test_sim_and_router_agree_on_any_name(sent):
    assert fold_key(sent) == ollama_key(sent)
