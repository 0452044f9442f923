"""Aliases (router/core/aliases.py): the definition rules, the context-length judge, and the
resolution step against `reference_resolve`, a plain reading of rule 3, then the properties
the issue names over whole calls walked along a chain (`walk`): a call never returns to a model
it left, never skips a model that could answer, never falls back on a plain 4xx, and a pinned
call stays pinned."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.aliases import (
    MAX_CHAIN,
    Alias,
    Move,
    check_alias,
    context_exceeded,
    resolve,
    wait_for_any,
)
from router.core.bounds import MAX_IDENTIFIER_BYTES
from router.core.decide import decide
from router.core.types import BoxFacts, BoxKind, Call, Decision, Path, Reason, ReasonCode

NOTHING_SERVED = frozenset().__contains__
ALL_KINDS = frozenset(BoxKind)


# --------------------------------------------------------------------------------------------
# Rule 1: definitions
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "chain", "aliases", "served", "wrong"),
    [
        ("coder", ["qwen3-coder-30b", "qwen3:8b"], {}, (), None),
        ("coder", ["a"], {"coder": Alias("coder", ("b",))}, (), None),  # a redefinition
        ("coder", ["coder"], {}, (), "may not name the alias itself"),
        ("coder", ["a", "fast"], {"fast": Alias("fast", ("b",))}, (), "fast is an alias"),
        ("fast", ["a"], {"coder": Alias("coder", ("fast", "b"))}, (), "alias coder lists fast"),
        ("coder", ["a", "a"], {}, (), "appears twice"),
        ("coder", [], {}, (), "1 to 8 models"),
        ("coder", ["m"] * 0 + [f"m{i}" for i in range(MAX_CHAIN + 1)], {}, (), "1 to 8 models"),
        ("coder", "a", {}, (), "1 to 8 models"),
        ("coder", ["a b"], {}, (), "is not a model name"),
        ("coder", [""], {}, (), "is not a model name"),
        ("coder", [7], {}, (), "is not a model name"),
        ("coder", ["x" * (MAX_IDENTIFIER_BYTES + 1)], {}, (), "is not a model name"),
        ("co der", ["a"], {}, (), "alias name must be"),
        ("coder@fast", ["a"], {}, (), "alias name must be"),
        ("", ["a"], {}, (), "alias name must be"),
        ("x" * (MAX_IDENTIFIER_BYTES + 1), ["a"], {}, (), "alias name must be"),
        ("qwen3:8b", ["a"], {}, ("qwen3:8b",), "may not shadow it"),
    ],
)
def test_definitions(name, chain, aliases, served, wrong):
    got = check_alias(name, chain, aliases, frozenset(served).__contains__)
    if wrong is None:
        assert got is None
    else:
        assert got is not None and wrong in got and "\n" not in got


# --------------------------------------------------------------------------------------------
# Rule 5: which 400s say the prompt is too long
# --------------------------------------------------------------------------------------------
CONTEXT_ANSWERS = [
    {"error": {"message": "This model's maximum context length is 8192 tokens. However, your messages resulted "
               "in 9000 tokens.", "type": "invalid_request_error", "param": "messages",
               "code": "context_length_exceeded"}},  # OpenAI
    {"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it",
               "type": "exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 4096}},  # llama.cpp
    {"error": {"code": 400, "message": "request (5000 tokens) exceeds the available context size (4096 tokens), "
               "try increasing it", "type": "invalid_request_error"}},  # older llama.cpp
    {"object": "error", "message": "x", "error": {"message": "This model's maximum context length is 4096 tokens."}},
    {"error": "prompt is too long for the context"},  # a plain string error
]
PLAIN_400S = [
    {"error": {"message": "messages must be a list", "type": "invalid_request_error", "code": None}},
    {"error": "invalid JSON"},
    {"error": {"message": "max_tokens must be at most 4096", "type": "invalid_request_error"}},
    None,
    [],
]


@pytest.mark.parametrize("body", CONTEXT_ANSWERS)
def test_context_length_400s_are_recognised(body):
    assert context_exceeded(400, body)
    assert not context_exceeded(413, body) and not context_exceeded(500, body)


@pytest.mark.parametrize("body", PLAIN_400S)
def test_a_plain_400_is_not_a_context_refusal(body):
    assert not context_exceeded(400, body)


@given(st.integers(100, 599), st.text(max_size=60), st.sampled_from([None, "invalid_request_error", "x"]))
def test_never_falls_back_on_a_plain_4xx(status, message, etype):
    """Only a 400 whose error says the context is exceeded moves a chain on."""
    body = {"error": {"message": message, "type": etype}}
    phrases = ("exceeds the available context size", "maximum context length", "context length exceeded",
               "context_length_exceeded", "prompt is too long", "exceeds the context",
               "longer than the model's context length")
    said = any(p in message.lower() for p in phrases)
    assert context_exceeded(status, body) == (status == 400 and said)


# --------------------------------------------------------------------------------------------
# Rule 3: resolve against a plain model
# --------------------------------------------------------------------------------------------
RANKS, FULL, NONE = "ranks", "full", "none"


def fake_decision(state: str, pin: str | None) -> Decision:
    if state == RANKS:
        boxes = (pin,) if pin is not None else ("a", "b")
        return Decision(Path.PINNED if pin else Path.RANKED, boxes, {}, {})
    code = ReasonCode.FULL if state == FULL else ReasonCode.OFFLINE
    return Decision(Path.REFUSED, (), {}, {pin or "a": Reason(code)})


def reference_resolve(states, left, current, tried, pin, max_boxes, fallback):
    """Rule 3 as written: (position, what its decision does, the moves kept)."""
    reach = len(states) if fallback else 1
    moves, full, first = [], [], None
    for position in range(reach):
        if position in left:
            if position == current:
                moves.append((position, left[position]))
            continue
        if first is None:
            first = position
        spent = position == current and len(tried) > 0 and (pin is not None or len(tried) >= max_boxes)
        state = states[position]
        if spent or state == NONE:
            moves.append((position, Move.REFUSED if position == current and tried else Move.NO_OWNER))
        elif state == RANKS:
            return position, RANKS, moves + [(p, Move.FULL) for p in full]
        else:
            full.append(position)
    kept = sorted(moves)
    if full:  # nothing can answer now: wait on the first full model, for any of them
        return full[0], FULL, kept
    if first is None:
        return current, NONE, kept
    # the first model's own decision (a spent model's may still rank or wait: next_attempt
    # stops it, its pin or max boxes first)
    return first, states[first], kept


states_st = st.lists(st.sampled_from([RANKS, FULL, NONE]), min_size=1, max_size=5)


@settings(max_examples=400)
@given(states_st, st.data(), st.sampled_from([None, "p"]), st.booleans())
def test_resolve_matches_the_plain_model(states, data, pin, fallback):
    n = len(states)
    left = data.draw(st.dictionaries(st.integers(0, n - 1), st.sampled_from([Move.REFUSED, Move.CONTEXT_LENGTH,
                                                                              Move.NO_OWNER])))
    current = data.draw(st.integers(0, n - 1))
    tried = data.draw(st.lists(st.sampled_from(["a", "b", "p"]), max_size=3, unique=True))
    asked: list[int] = []

    def decide_model(position: int) -> Decision:
        asked.append(position)
        return fake_decision(states[position], pin)

    got = resolve(tuple(f"m{i}" for i in range(n)), decide_model, left, current, tried, pin, 3, fallback)
    want_position, want_state, want_moves = reference_resolve(states, left, current, tried, pin, 3, fallback)
    assert got.position == want_position
    assert sorted(got.passed) == sorted(want_moves)
    if want_state == RANKS:
        assert got.decision.boxes
    else:
        assert bool(got.decision.waits_for) == (want_state == FULL)
    assert len(asked) == len(set(asked)), "each model is decided at most once a step"
    assert all(p not in left for p in asked), "a model left is never decided again"


def test_a_call_waits_for_whichever_full_model_frees_first():
    a = Decision(Path.REFUSED, (), {}, {"x": Reason(ReasonCode.FULL), "y": Reason(ReasonCode.OFFLINE)})
    b = Decision(Path.REFUSED, (), {}, {"y": Reason(ReasonCode.COOLING), "x": Reason(ReasonCode.NO_MODEL)})
    assert wait_for_any([a, b]).waits_for == {"x", "y"}


# --------------------------------------------------------------------------------------------
# The properties over whole calls, on the real decide()
# --------------------------------------------------------------------------------------------
MODELS = ("m0", "m1", "m2", "m3")
BOXES = ("b0", "b1", "b2")


@st.composite
def fleets(draw):
    boxes = []
    for order, name in enumerate(BOXES):
        boxes.append(BoxFacts(
            id=name, kind=BoxKind.OPENAI, order=order, online=draw(st.booleans()),
            catalog=frozenset(draw(st.sets(st.sampled_from(MODELS)))),
            in_flight=draw(st.integers(0, 1)), max_inflight=draw(st.sampled_from([None, 1])),
        ))
    return boxes


def walk(boxes, chain, refuses, pin, fallback, max_boxes=3):
    """A call along `chain` as serve/aliases.py walks it: resolve, try the first ranked box; a
    refusal (`refuses[(box, model)]`: "refuse" before the first byte, "context", or "4xx") excludes
    the box, a context-length 400 leaves the model. Returns the (model, box) tried, in order, the
    steps' results, and how it ended."""
    left: dict[int, Move] = {}
    current, tried = 0, []
    eligible = None
    steps, trace = [], []
    for _ in range(len(chain) * (max_boxes + 1) + 2):
        def decide_model(position):
            call = Call(chain[position], ALL_KINDS, pin=pin)
            if position == current:
                return decide(call, boxes, tried, eligible)
            return decide(call, boxes)
        got = resolve(chain, decide_model, left, current, tried, pin, max_boxes, fallback)
        steps.append((dict(left), current, list(tried), got))
        for position, move in got.passed:
            if move is not Move.FULL:
                left[position] = move
        if not got.decision.boxes:
            return trace, steps, ("wait" if got.decision.waits_for else "none")
        if got.position != current:
            current, tried, eligible = got.position, [], frozenset(got.decision.boxes)
        elif eligible is None:
            eligible = frozenset(got.decision.boxes)
        box = got.decision.boxes[0]
        model = chain[current]
        if box in tried:  # next_attempt's rule: a tried box is never tried again
            return trace, steps, "stuck"
        trace.append((model, box))
        outcome = refuses.get((box, model))
        if outcome is None:
            return trace, steps, "served"
        if outcome == "4xx":
            return trace, steps, "answered"  # a plain 4xx goes back as sent
        tried.append(box)
        if outcome == "context" and fallback:
            left[current] = Move.CONTEXT_LENGTH
    raise AssertionError("the walk did not end")


@settings(max_examples=300)
@given(fleets(), st.permutations(MODELS).map(lambda m: tuple(m[:3])),
       st.dictionaries(st.tuples(st.sampled_from(BOXES), st.sampled_from(MODELS)),
                       st.sampled_from(["refuse", "context", "4xx"])),
       st.sampled_from([None, "b0", "b1"]), st.booleans())
def test_a_call_along_its_chain(boxes, chain, refuses, pin, fallback):
    trace, steps, end = walk(boxes, chain, refuses, pin, fallback)
    models = [model for model, _ in trace]
    # never repeats a model: once the call moved past a model it never comes back to it
    runs = [m for i, m in enumerate(models) if i == 0 or models[i - 1] != m]
    assert len(runs) == len(set(runs)), trace
    # a pinned call stays pinned
    if pin is not None:
        assert all(box == pin for _, box in trace), trace
    # the opt-out, or a plain name: only the chain's first model
    if not fallback:
        assert set(models) <= {chain[0]}, trace
    # never falls back on a plain 4xx: the call ends at the box that sent it
    if end == "answered":
        assert refuses[trace[-1][::-1]] == "4xx"
    # never skips a model that could answer: at each step, every model before the chosen one
    # was left or could not take the call (its decision ranked no box)
    for left, current, tried, got in steps:
        if not got.decision.boxes:
            continue
        for position in range(got.position):
            if position in left:
                continue
            call = Call(chain[position], ALL_KINDS, pin=pin)
            decision = decide(call, boxes, tried if position == current else ())
            spent = position == current and tried and (pin is not None or len(tried) >= 3)
            assert not decision.boxes or spent, (position, got)
