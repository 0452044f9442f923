"""router.core.limits against the plain model (tests/models.py `KeyLimitsModel`), and its rules
stated as properties: periods, the overshoot bound over any interleaving, all-or-nothing."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core import limits as rules
from router.core.errors import BadRequest
from router.core.limits import Limits, Tally, parse_limits, period_bounds
from router.core.types import BoxKind

from models import KeyLimitsModel

T0 = 1_796_000_000.0  # a Tuesday, 2026-11-30 UTC-ish: any fixed epoch does

limit_values = st.one_of(st.none(), st.integers(1, 50))
limits_strategy = st.builds(
    Limits, rpm=limit_values, tpm=st.one_of(st.none(), st.integers(1, 500)), max_parallel=limit_values,
    budget_tokens=st.one_of(st.none(), st.integers(1, 2000)), budget_period=st.sampled_from(rules.PERIODS),
    models=st.one_of(st.none(), st.just(frozenset({"a", "b"}))),
)


@settings(max_examples=300, deadline=None)
@given(limits_strategy, st.lists(st.tuples(
    st.sampled_from(["admit", "settle"]), st.sampled_from(["a", "b", "c"]), st.integers(0, 120),
    st.floats(0, 200_000), st.integers(0, 150)), max_size=60))
def test_the_rules_agree_with_the_plain_model(limits, ops):
    """Random admissions and settlements at random (non-decreasing) times, real and model side
    by side: the same verdict for every call, the same counts after every step."""
    tally, model = Tally(), KeyLimitsModel(limits)
    now, open_calls = T0, []
    for op, model_name, tokens, step_s, used in ops:
        now += step_s
        if op == "admit":
            got = rules.admit(tally, limits, model_name, tokens, now)
            assert (got.reason if got else None) == model.admit(model_name, tokens, now)
            if got is None:
                open_calls.append(tokens)
        elif open_calls:
            reserved = open_calls.pop(0)
            rules.settle(tally, limits, reserved, used, now)
            model.settle(reserved, used, now)
        assert tally.reserved == model.reserved
        if limits.budget_tokens is not None and tally.period_end > -math.inf:
            assert tally.used == model.used
        assert tally.req_drawn == pytest.approx(model.req, abs=1e-6)
        assert tally.tok_drawn == pytest.approx(model.tok, abs=1e-6)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.lists(st.tuples(st.booleans(), st.integers(1, 400), st.floats(0, 1)), max_size=200))
def test_any_interleaving_overshoots_a_budget_by_at_most_one_reservation(budget, ops):
    """Rule 4: calls admitted and settled in any order (each settling at most what it reserved)
    never charge more than the budget plus the largest single reservation, and every call is
    admitted while the budget has anything left."""
    limits = Limits(budget_tokens=budget, tpm=budget)
    tally, in_flight, largest = Tally(), [], 0
    for admit_next, tokens, fraction in ops:
        if admit_next or not in_flight:
            committed = tally.used + tally.reserved
            refused = rules.admit(tally, limits, "m", tokens, T0)
            assert (refused is None) == (committed < budget)  # refused exactly when spent
            if refused is None:
                in_flight.append(tokens)
                largest = max(largest, tokens)
        else:
            reserved = in_flight.pop(len(in_flight) // 2)  # settled out of order
            rules.settle(tally, limits, reserved, int(reserved * fraction), T0)
        assert tally.used + tally.reserved <= budget + largest
        assert tally.tok_drawn <= budget + largest  # tpm: the same bound within the minute
    for reserved in in_flight:
        rules.settle(tally, limits, reserved, reserved, T0)
    assert tally.used <= budget + largest


def room_of(tally: Tally, limits: Limits) -> int:
    """What is left of the token limits now, as serve/limits.py's `room` reads it."""
    left = rules.left(tally, limits, T0)
    return min(n for n in (left.tokens, left.budget) if n is not None)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 600), st.lists(st.tuples(
    st.booleans(), st.integers(0, 400), st.one_of(st.none(), st.integers(1, 600), st.integers(1, rules.MAX_ANSWER_TOKENS)),
    st.integers(0, 5000), st.booleans()), max_size=200))
def test_every_call_stated_bound_or_not_keeps_the_overshoot_to_one_prompt(budget, default_answer, ops):
    """Rule 4 for the calls as they come: some state an answer's bound, up to a billion tokens,
    some do not (the router then gives them `default_answer`); either is capped to what is left
    of the limits, and the box is told it. Whatever answer each would give unbounded, and whether
    its box counts the prompt at the estimate or below, each is charged at most what it reserved,
    so any interleaving overshoots the budget (and the minute) by at most one call's prompt
    estimate, never by the burst, nor by one call's stated bound (issue 36 item 2)."""
    limits = Limits(budget_tokens=budget, tpm=budget)
    tally, in_flight, largest_prompt = Tally(), [], 0
    for admit_next, body_bytes, stated, unbounded_answer, prompt_below in ops:
        if admit_next or not in_flight:
            room = room_of(tally, limits)
            tokens, bound = rules.reserve(body_bytes, stated, default_answer, room)
            assert 1 <= bound <= max(room, 1) and bound <= (default_answer if stated is None else stated)
            if rules.admit(tally, limits, "m", tokens, T0) is None:
                answer = min(unbounded_answer, bound)  # what the box answers, told the bound
                prompt = rules.prompt_estimate(body_bytes) // (2 if prompt_below else 1)
                in_flight.append((tokens, prompt + answer))
                largest_prompt = max(largest_prompt, rules.prompt_estimate(body_bytes))
        else:
            reserved, used = in_flight.pop(len(in_flight) // 2)  # settled out of order
            assert used <= reserved
            rules.settle(tally, limits, reserved, used, T0)
        assert tally.used + tally.reserved <= budget + largest_prompt
        assert tally.tok_drawn <= budget + largest_prompt
    for reserved, used in in_flight:
        rules.settle(tally, limits, reserved, used, T0)
    assert tally.used <= budget + largest_prompt


@settings(deadline=None)  # a loaded machine must not fail a rule
@given(st.integers(1, 200))
def test_rpm_is_exact_in_a_burst(rpm):
    tally, limits = Tally(), Limits(rpm=rpm)
    verdicts = [rules.admit(tally, limits, "m", 0, T0) for _ in range(rpm + 3)]
    assert verdicts[:rpm] == [None] * rpm
    assert all(v.reason == rules.RATE_LIMITED and v.retry_after_s >= 1 for v in verdicts[rpm:])
    # a request's worth drains in 60/rpm s: one more fits then, not before
    assert rules.admit(tally, limits, "m", 0, T0 + 60 / rpm * 0.9) is not None
    assert rules.admit(tally, limits, "m", 0, T0 + 60 / rpm * 1.01) is None


credit_limits = st.builds(
    Limits, rpm=st.one_of(st.none(), st.integers(1, 5000)), tpm=st.one_of(st.none(), st.integers(1, 500_000)),
    budget_tokens=st.one_of(st.none(), st.integers(1, 500_000)), budget_period=st.sampled_from(rules.PERIODS),
)


def _fields(tally: Tally) -> tuple:
    return tuple(getattr(tally, name) for name in Tally.__slots__)


@settings(max_examples=300, deadline=None)
@given(credit_limits, st.lists(st.integers(0, 300), max_size=30), st.integers(1, 300), st.integers(0, 300),
       st.lists(st.integers(0, 300), max_size=300))
def test_a_credit_charges_exactly_what_its_calls_would_have_charged_alone(limits, before, calls, call_tokens,
                                                                          spent):
    """Rule 9: a credit granted, some calls served from it (each while what is left covers it),
    the rest given back: the tally is the one those calls admitted by `admit` leave, at the same
    moment; each of them `admit` would have admitted; and the credit left each limit at least
    CREDIT_ROOM times what it took."""
    credited, alone = Tally(), Tally()
    for tokens in before:  # some use already, the same on both
        rules.admit(credited, limits, "m", tokens, T0)
        rules.admit(alone, limits, "m", tokens, T0)
    call_tokens = call_tokens if limits.counts_tokens else 0
    requests, tokens = rules.grant(credited, limits, calls, call_tokens, T0)
    assert 0 <= requests <= calls and tokens == (requests * call_tokens if requests else 0)
    if requests:
        share = rules.CREDIT_ROOM
        if limits.rpm is not None:
            assert limits.rpm - credited.req_drawn >= share * requests - 1e-9
        if limits.tpm is not None:
            assert limits.tpm - credited.tok_drawn >= share * tokens - 1e-9
        if limits.budget_tokens is not None:
            assert limits.budget_tokens - credited.used - credited.reserved >= share * tokens
    for wanted in spent:
        wanted = wanted if limits.counts_tokens else 0
        if requests < 1 or wanted > tokens:
            break
        requests, tokens = requests - 1, tokens - wanted
        assert rules.admit(alone, limits, "m", wanted, T0) is None
    rules.refund(credited, limits, requests, tokens, T0)
    rules.refund(alone, limits, 0, 0, T0)  # caught up to T0, as the grant caught `credited` up
    assert _fields(credited) == pytest.approx(_fields(alone))


def test_a_key_near_a_limit_gets_no_credit():
    """Rule 9: what is left of rpm is under CREDIT_ROOM + 1 requests: no credit, nothing drawn."""
    tally, limits = Tally(), Limits(rpm=100)
    for _ in range(84):
        assert rules.admit(tally, limits, "m", 0, T0) is None
    assert rules.grant(tally, limits, 50, 0, T0) == (0, 0) and tally.req_drawn == 84
    assert rules.grant(Tally(), limits, 50, 0, T0) == (5, 0)  # 100 // 17


def test_a_refused_call_takes_nothing_and_a_settled_refusal_keeps_its_request():
    tally, limits = Tally(), Limits(rpm=2, tpm=100, budget_tokens=1000)
    assert rules.admit(tally, limits, "m", 150, T0) is None  # tpm left: admitted, overdrawn
    refused = rules.admit(tally, limits, "m", 1, T0)
    assert refused.reason == rules.RATE_LIMITED and (tally.req_drawn, tally.reserved) == (1, 150)
    rules.settle(tally, limits, 150, 0, T0)  # no box served it: tokens back, the request stays
    assert (tally.req_drawn, tally.tok_drawn, tally.reserved, tally.used) == (1, 0, 0, 0)


@settings(deadline=None)  # a loaded machine must not fail a rule
@given(st.floats(0, 4_000_000_000), st.sampled_from(rules.PERIODS))
def test_periods_are_utc_calendar_periods(now, period):
    start, end = period_bounds(period, now)
    assert start <= now < end
    first = datetime.fromtimestamp(start, timezone.utc)
    assert (first.hour, first.minute, first.second, first.microsecond) == (0, 0, 0, 0)
    if period == "week":
        assert first.weekday() == 0 and end - start == 7 * 86400
    elif period == "month":
        assert first.day == 1 and datetime.fromtimestamp(end, timezone.utc).day == 1
    else:
        assert end - start == 86400
    assert period_bounds(period, end)[0] == end  # the next one starts where this one ends
    assert rules.previous_period(period, now)[1] == start


def test_the_budget_is_refused_at_the_right_call_and_resets_at_the_boundary():
    limits = Limits(budget_tokens=100, budget_period="day")
    start, end = period_bounds("day", T0)
    tally, now = Tally(), end - 10
    for _ in range(4):  # 0, 30, 60, 90 used: each is admitted
        assert rules.admit(tally, limits, "m", 30, now) is None
        rules.settle(tally, limits, 30, 30, now)
    refused = rules.admit(tally, limits, "m", 30, now)
    assert refused.reason == rules.BUDGET_EXCEEDED and refused.retry_after_s == 10
    assert rules.admit(tally, limits, "m", 30, end) is None  # a new day
    assert tally.used == 0


def test_models_allow_the_names_as_called():
    allowed = frozenset({"llama3.2", "qwen"})
    assert rules.model_allowed(allowed, "llama3.2:latest") and rules.model_allowed(allowed, "qwen@ctx=8192")
    assert not rules.model_allowed(allowed, "mistral")
    assert rules.model_allowed(None, "anything")


def test_a_names_options_and_latest_are_allowed_only_on_the_kinds_that_read_them():
    """Issue 36 item 7: `qwen3-8b@q8_0` is `qwen3-8b` with options on a hugpy box, and another
    model on LM Studio or an OpenAI-compatible server; `:latest` is Ollama's."""
    allowed, every = frozenset({"qwen3-8b", "llama3.2"}), frozenset(BoxKind)
    assert rules.kinds_allowed(allowed, "qwen3-8b@q8_0", every) == {BoxKind.HUGPY}
    assert rules.kinds_allowed(allowed, "llama3.2:latest", every) == {BoxKind.OLLAMA}
    assert rules.kinds_allowed(allowed, "qwen3-8b", every) is every
    assert rules.kinds_allowed(allowed, "qwen3-8b@q8_0", frozenset({BoxKind.LMSTUDIO})) == frozenset()
    assert rules.kinds_allowed(None, "anything@x", every) is every
    assert rules.kinds_allowed(frozenset({"qwen3-8b@q8_0"}), "qwen3-8b@q8_0", every) is every


@pytest.mark.parametrize("doc, message", [
    ({"rpm": -1}, "rpm must be a whole number"),
    ({"tpm": 1.5}, "tpm must be a whole number"),
    ({"max_parallel": True}, "max_parallel must be a whole number"),
    ({"budget_period": "year"}, "budget_period must be one of"),
    ({"colour": 1}, "unknown limit 'colour'"),
    ({"models": []}, "models must be a list"),
    ([1], "limits must be a JSON object"),
])
def test_bad_limits_are_one_clear_line(doc, message):
    with pytest.raises(BadRequest) as caught:
        parse_limits(doc)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_change_keeps_what_it_does_not_name_and_null_removes():
    base = parse_limits({"rpm": 5, "tpm": 100, "models": ["a"]})
    changed = parse_limits({"rpm": None, "budget_tokens": 10, "budget_period": "week"}, base)
    assert changed == Limits(rpm=None, tpm=100, budget_tokens=10, budget_period="week", models=frozenset({"a"}))


def test_reset_headers_are_written_as_openai_writes_them():
    assert [rules.reset_header(s) for s in (0.0, 0.0204, 0.9999, 1.0001, 1.5, 6.0, 59.95, 59.999, 61.2, 360.0)] == [
        b"0ms", b"21ms", b"1s", b"1.1s", b"1.5s", b"6s", b"60s", b"60s", b"1m2s", b"6m0s"]


def test_the_local_counters_apply_the_rules_and_seed_from_the_store():
    from router.store import counters as counters_module
    from router.store.counters import LocalCounters

    counters, limits = LocalCounters(), Limits(budget_tokens=100, rpm=10)
    period = period_bounds("day", T0)
    counters.seed("key:a", 90, period)  # what the store says this period used
    assert counters.admit("key:a", limits, "m", 20, T0)[0] == 9  # admitted: the windows after it
    assert counters.admit("key:a", limits, "m", 1, T0).reason == rules.BUDGET_EXCEEDED
    counters.settle("key:a", limits, 20, 5, T0, slot=False)
    counters.seed("key:a", 90, period)  # the store a flush behind: never lowers what was counted
    assert counters.left("key:a", limits, T0).budget == 5
    counters.tallies.update({f"addr:{n}": Tally() for n in range(3)})
    counters_module.MAX_ADDRESS_TALLIES, saved = 4, counters_module.MAX_ADDRESS_TALLIES
    try:
        counters.admit("addr:new", Limits(rpm=1), "m", 0, T0)
    finally:
        counters_module.MAX_ADDRESS_TALLIES = saved
    assert set(counters.tallies) == {"key:a", "addr:new"}  # idle addresses forgotten, keys kept
