"""Model names per box kind (router/core/names.py), against the contracts:
contracts/ollama-lmstudio.md §2 (Ollama normalisation, its example table row by row) and §3.5
(LM Studio exact ids), contracts/hugpy-wrapper.md §5 (`model@options`)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.core.kinds import call_key, inventory_key
from router.core.names import hugpy_split, ollama_key
from router.core.types import BoxKind

# --------------------------------------------------------------------------------------------
# Ollama: the contract's example table (§2), then its numbered rules
# --------------------------------------------------------------------------------------------

OLLAMA_TABLE = [
    ("llama3", "llama3:latest"),
    ("library/llama3", "llama3:latest"),
    ("registry.ollama.ai/library/llama3:8b", "llama3:8b"),
    ("myuser/mymodel", "myuser/mymodel:latest"),
    (
        "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
        "hf.co/bartowski/llama-3.2-1b-instruct-gguf:q4_k_m",  # same string; the key folds case
    ),
    ("hf.co/user/repo", "hf.co/user/repo:latest"),
    ("localhost:5000/ns/model", "localhost:5000/ns/model:latest"),
    ("qwen2.5:7b", "qwen2.5:7b"),
    ("gpt-oss:20b-cloud", "gpt-oss:20b"),
    ("Llama3:LATEST", "llama3:latest"),
]

OLLAMA_INVALID = ["hf.co/repo", "mm:", "n/m:", "host/name:space/model:tag", "/m", "", "   "]


@pytest.mark.parametrize("sent,key", OLLAMA_TABLE)
def test_ollama_contract_table(sent, key):
    assert ollama_key(sent) == key


@pytest.mark.parametrize("sent", OLLAMA_INVALID)
def test_ollama_invalid_names(sent):
    assert ollama_key(sent) is None
    assert call_key(BoxKind.OLLAMA, sent, None) is None


def test_ollama_installed_name_matches_any_casing():
    """`Llama3:LATEST` matches an installed `llama3:latest` (getExistingName, EqualFold)."""
    installed = inventory_key(BoxKind.OLLAMA, "llama3:latest")
    assert call_key(BoxKind.OLLAMA, "Llama3:LATEST", None) == (installed, None)
    assert inventory_key(BoxKind.OLLAMA, "LLAMA3") == installed


@pytest.mark.parametrize(
    "sent,key",
    [
        # rule 1: trim, then the source suffix goes
        ("  llama3  ", "llama3:latest"),
        ("glm-4.6:cloud", "glm-4.6:latest"),
        ("glm-4.6:CLOUD", "glm-4.6:latest"),
        ("llama3:local", "llama3:latest"),
        ("qwen3-coder:480b-cloud", "qwen3-coder:480b"),
        # rule 1 then rule 2: after `:cloud` goes, the rest is parsed for its tag
        ("qwen3:8b:cloud", "qwen3:8b"),
        ("ns/qwen3:8b:local", "ns/qwen3:8b"),
        # rule 3: a scheme on the host part is removed, any scheme; a present host keeps its namespace
        ("https://registry.ollama.ai/library/llama3", "llama3:latest"),
        ("http://example.com/library/m:t", "example.com/library/m:t"),
        ("ftp://example.com/library/m:t", "example.com/library/m:t"),
        # rule 6: host and namespace defaults compare case-insensitively
        ("REGISTRY.OLLAMA.AI/Library/Llama3:8B", "llama3:8b"),
        ("registry.ollama.ai/user/m", "user/m:latest"),
    ],
)
def test_ollama_rules(sent, key):
    assert ollama_key(sent) == key


@pytest.mark.parametrize(
    "sent",
    [
        "a/b/c/d",  # more than host/namespace/model
        "ns.x/model",  # `.` not in a namespace
        "model@sha",  # `@` is never valid
        "-model",  # a part starts with [A-Za-z0-9_]
        "m:-tag",
        "m:" + "t" * 81,  # a tag is at most 80 long
        "m" * 81,
        "ho st/ns/m",
        "m:cloud-cloud",  # two source suffixes: Ollama's ParseRef refuses a conflicting source
        "m:8b-cloud-cloud",
        "http://model",  # a scheme is cut off a host only: here `http:` is a namespace, `/` a model
        "https://ns/model",
    ],
)
def test_ollama_invalid_parts(sent):
    assert ollama_key(sent) is None


# Names built from parts, so that hypothesis reaches the interesting joints (source suffixes,
# default host/namespace in any case, colons in hosts, empty parts) often.
_part = st.text(alphabet="abAB09_.-", min_size=1, max_size=6)
_host = st.one_of(
    st.sampled_from(["registry.ollama.ai", "REGISTRY.ollama.AI", "hf.co", "localhost:5000", "h"]),
    _part,
)
_ns = st.one_of(st.sampled_from(["library", "Library", "user", "", "a.b"]), _part)
_model = st.one_of(st.sampled_from(["llama3", "qwen2.5", "gpt-oss", "M"]), _part)
_tag = st.one_of(
    st.sampled_from(
        ["latest", "LATEST", "8b", "cloud", "local", "20b-cloud", "x-cloud-cloud", "Q4_K_M", ""]
    ),
    _part,
)
_suffix = st.sampled_from(["", ":cloud", ":local", ":CLOUD"])


@st.composite
def ollama_names(draw):
    parts = [draw(_model)]
    if draw(st.booleans()):
        parts.insert(0, draw(_ns))
        if draw(st.booleans()):
            parts.insert(0, draw(_host))
    name = "/".join(parts)
    if draw(st.booleans()):
        name += ":" + draw(_tag)
    name += draw(_suffix)
    if draw(st.booleans()):
        name = draw(st.sampled_from(["https://", "http://", " ", "\t"])) + name
    return name


names_any = st.one_of(ollama_names(), st.text(max_size=20))


@settings(max_examples=400, deadline=None)
@given(name=names_any)
@example(name="m:x-cloud-cloud")
@example(name="m:cloud-cloud")
def test_ollama_key_is_idempotent(name):
    key = ollama_key(name)
    if key is not None:
        assert ollama_key(key) == key
        assert key == key.lower()
        assert key.rfind(":") > key.rfind("/")  # the tag is always shown


@settings(max_examples=400, deadline=None)
@given(name=names_any)
def test_ollama_key_ignores_case(name):
    key = ollama_key(name)
    if key is not None:  # a valid name is ASCII, so changing its case keeps it valid
        assert ollama_key(name.upper()) == key
        assert ollama_key(name.lower()) == key
        assert ollama_key(name.swapcase()) == key


@settings(max_examples=300, deadline=None)
@given(name=ollama_names())
def test_ollama_implicit_latest(name):
    """`x` and `x:latest` are one model, for any x without a tag."""
    stripped = name.strip()
    has_tag = stripped.rfind(":") > stripped.rfind("/")
    if not has_tag:
        assert ollama_key(name) == ollama_key(stripped + ":latest")


@settings(max_examples=300, deadline=None)
@given(name=ollama_names())
def test_ollama_default_namespace_and_host(name):
    """Adding the default namespace (and host) in front of a bare model changes nothing."""
    stripped = name.strip()
    if "/" not in stripped and "://" not in stripped:
        key = ollama_key(stripped)
        assert ollama_key("library/" + stripped) == key
        assert ollama_key("registry.ollama.ai/library/" + stripped) == key


# --------------------------------------------------------------------------------------------
# hugpy: base@options (hugpy-wrapper §5)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sent,base,settings_",
    [
        ("tiny-llama", "tiny-llama", None),
        ("tiny-llama@ram-only", "tiny-llama", "ram-only"),
        ("tiny-llama@ctx-low+RAM-only", "tiny-llama", "ctx-low+ram-only"),
        ("tiny-llama@ram-only,ctx-low", "tiny-llama", "ctx-low+ram-only"),
        ("  tiny-llama @ fa ", "tiny-llama", "fa"),
        ("tiny-llama@", "tiny-llama", None),  # no tokens: default
        ("tiny-llama@+,", "tiny-llama", None),
        ("org/Model-7B@Q4_K_M", "org/Model-7B", "q4_k_m"),  # the base keeps its case
        ("m@a@b", "m", "a@b"),  # only the first @ splits
    ],
)
def test_hugpy_split_table(sent, base, settings_):
    assert hugpy_split(sent) == (base, settings_)
    assert call_key(BoxKind.HUGPY, sent, "ignored body settings") == (base, settings_)


def test_hugpy_empty_base_is_invalid():
    assert call_key(BoxKind.HUGPY, "@ram-only", None) is None
    assert call_key(BoxKind.HUGPY, "   ", None) is None


_token = st.sampled_from(
    ["ctx-low", "RAM-only", "gpu-only", "fa", "4bit", "MoE", "kv-q8_0", "q4_k_m", "ctx-40", "fit"]
)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(_token, min_size=1, max_size=5),
    seps=st.lists(st.sampled_from(["+", ","]), min_size=5, max_size=5),
    perm=st.randoms(use_true_random=False),
    recase=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_hugpy_option_order_and_case_do_not_matter(tokens, seps, perm, recase):
    def render(toks):
        out = toks[0]
        for i, tok in enumerate(toks[1:]):
            out += seps[i] + tok
        return "base@" + out

    shuffled = list(tokens)
    perm.shuffle(shuffled)
    shuffled = [t.upper() if recase[i] else t.lower() for i, t in enumerate(shuffled)]
    base, settings_ = hugpy_split(render(tokens))
    assert base == "base"
    assert hugpy_split(render(shuffled)) == (base, settings_)
    assert settings_ == "+".join(sorted({t.lower() for t in tokens}))


@settings(max_examples=200, deadline=None)
@given(base=st.text(alphabet="abcXYZ09-_./ ", min_size=1, max_size=12))
def test_hugpy_no_options_means_default(base):
    assert hugpy_split(base) == (base.strip(), None)


# --------------------------------------------------------------------------------------------
# LM Studio and openai: exact, byte for byte (ollama-lmstudio §3.5)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [BoxKind.LMSTUDIO, BoxKind.OPENAI])
@pytest.mark.parametrize(
    "sent",
    ["qwen/qwen3-14b@q6_k", "qwen3-14b", "gemma-3-1b-it-qat:2", "Meta-Llama-3.1-8B", "llama3"],
)
def test_exact_kinds_keep_the_id(kind, sent):
    assert call_key(kind, sent, "num_ctx=4096") == (sent, None)
    assert inventory_key(kind, sent) == sent


@pytest.mark.parametrize("kind", [BoxKind.LMSTUDIO, BoxKind.OPENAI])
def test_exact_kinds_no_implicit_latest_or_case(kind):
    assert call_key(kind, "llama3", None) != call_key(kind, "llama3:latest", None)
    assert call_key(kind, "Qwen3-14b", None) != call_key(kind, "qwen3-14b", None)
    assert call_key(kind, "", None) is None


@settings(max_examples=300, deadline=None)
@given(
    name=st.text(min_size=1, max_size=20),
    at=st.integers(min_value=0),
    char=st.characters(),
    kind=st.sampled_from([BoxKind.LMSTUDIO, BoxKind.OPENAI]),
)
def test_exact_kinds_one_character_matters(name, at, char, kind):
    i = at % len(name)
    other = name[:i] + char + name[i + 1 :]
    same = other == name
    assert (call_key(kind, other, None) == call_key(kind, name, None)) == same
    assert call_key(kind, name, None) == (name, None)
