"""Per-key limits: windows, reservations, settlement, budget periods. Pure, stdlib only.

A key's limits (`Limits`) are all optional: `rpm` (requests a minute), `tpm` (prompt +
completion tokens a minute), `max_parallel` (calls in flight at once), `budget_tokens` over
`budget_period`, and `models` (the model names the key may call). A key's counts are one
`Tally`, changed only by the steps below; where the tallies live (this process, or a shared
engine) is router.store.counters' business, never the rules'.

Rules (tests/test_core_limits.py pins each against the plain model in tests/models.py):
1. Periods are UTC calendar periods: a day from 00:00 UTC, a week from Monday 00:00 UTC, a month
   from the 1st 00:00 UTC (`period_bounds`).
2. A minute slides: `rpm` and `tpm` are buckets of the limit's size that empty continuously at
   limit/60 a second (OpenAI's semantics: the reset is the time until the bucket is empty again,
   so a quiet key takes a burst of the whole limit at once). A tally keeps what is drawn from
   each bucket, so a limit changed live keeps what was used.
3. `admit` checks, in this order: `models` (403 model_not_allowed: allowed on some kind of
   box, `model_allowed`; the call then reaches only the kinds that allow its name,
   `kinds_allowed`), the budget (429 budget_exceeded), `rpm`, `tpm` (429 rate_limited); all
   or nothing: a refused call takes nothing. An admitted call takes one request from `rpm` and
   reserves its token estimate from `tpm` and the budget.
4. A token limit admits a call while any of it is left (tpm: drawn < tpm; budget: used +
   reserved < budget), and the call's reservation may then take it past the limit. So however
   calls interleave, they overshoot a token limit by at most one call's reservation: when each
   call settles at most what it reserved, the tokens charged in a period never exceed the budget
   plus the largest reservation (tests/test_core_limits.py states it over any interleaving).
   A reservation (`reserve`) is the prompt's estimate plus the answer's bound: the one the call
   states, else the router's default, either capped to what is left of the key's tpm and budget,
   and the router tells the box (serve/limits.py rule 2), so no call's answer is longer than
   what it reserved, and no one call's reservation passes a limit by more than its prompt.
5. `settle` replaces the reservation by the tokens the box reported: `tpm` gets back what was
   reserved and draws what was used, the budget's reserved falls by the reservation and its used
   grows by the tokens. A call refused before any box served it settles with 0 tokens; its
   request still counts toward `rpm` (that is what a request limit means).
6. A budget counts the tokens settled in its current period: the first step after a boundary
   starts `used` at 0 (reservations in flight carry over and are charged where they settle).
7. `max_parallel` is a count taken when a call is dispatched and given back when it ends
   (`take_parallel`, `settle`); a key at its limit is full for its caller, and the call
   waits in the queue (router.core.admission), never refused for it.
8. Retry-After: rpm, the time until one request fits again; tpm, until the bucket is below its
   limit again; budget, until the period ends; whole seconds, at least 1.
9. A credit (`grant`) draws requests and tokens ahead of the calls that will spend them (several
   routers: fleetwide/tallies.py rule 8): as `admit` draws them, rpm +requests, tpm and the
   budget's reserved +tokens, so what a credit holds counts as spent. It takes at most
   1/(CREDIT_ROOM + 1) of what is left of each limit, so a key near a limit gets none and each of
   its calls is admitted by `admit` itself. A call served from a credit is the same as one `admit`
   admitted there (its settle is the same step); `refund` gives back what was not spent. Spent or
   given back, a credit charges exactly what its calls would have charged alone, at the same
   moment (tests/test_core_limits.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, NamedTuple

from router.core.errors import BadRequest
from router.core.types import BoxKind, new_tuple

PERIODS = ("day", "week", "month")
FIELDS = ("rpm", "tpm", "max_parallel", "budget_tokens", "budget_period", "models")
WINDOW_S = 60.0  # rpm and tpm: a minute
# Bounds on what a limit may say: larger is a typo, and the arithmetic stays in exact floats.
MAX_COUNT = 10**12
MAX_MODELS = 256
MAX_MODEL_CHARS = 256
# The answer's bound of a call, counted against token limits, that states none (no `max_tokens`
# or the facade's equivalent): the router tells the box, and the call reserves it (rule 4;
# `--default-max-tokens`). What a chat answer of a few paragraphs takes.
DEFAULT_ANSWER_TOKENS = 512
# The largest answer's bound a call may state: llama.cpp reads `n_predict` into an int32, where a
# larger number wraps, maybe to a negative one (no bound). A larger one is the caller's typo.
MAX_ANSWER_TOKENS = 2**31 - 1
# The stated estimates when a box reports no usage (README "Tenancy"): a prompt of ~4 bytes a
# token (English in JSON: the body's own syntax makes it an overestimate); a whole answer the
# same; a stream one token per STREAM_BYTES_PER_TOKEN bytes relayed (an OpenAI chunk frame or an
# Ollama NDJSON line carrying one token is 100-200 bytes).
BYTES_PER_TOKEN = 4
STREAM_BYTES_PER_TOKEN = 120

MODEL_NOT_ALLOWED = "model_not_allowed"
BUDGET_EXCEEDED = "budget_exceeded"
RATE_LIMITED = "rate_limited"
REASONS = (RATE_LIMITED, BUDGET_EXCEEDED, MODEL_NOT_ALLOWED)


@dataclass(frozen=True, slots=True)
class Limits:
    """One key's limits; None is no limit. `models` None: every model."""

    rpm: int | None = None
    tpm: int | None = None
    max_parallel: int | None = None
    budget_tokens: int | None = None
    budget_period: str = "day"
    models: frozenset[str] | None = None
    # a token limit is set (a field, not a property: read on every call of the key)
    counts_tokens: bool = field(init=False, compare=False, repr=False)
    # rpm and tpm as floats, the buckets' sizes (rule 2) in their arithmetic: a tally's drawn
    # counts are floats, and CPython's arithmetic mixing an int and a float takes its slow
    # generic path on every call (exact: every limit up to MAX_COUNT is a float exactly)
    requests_bucket: float | None = field(init=False, compare=False, repr=False)
    tokens_bucket: float | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts_tokens", self.tpm is not None or self.budget_tokens is not None)
        object.__setattr__(self, "requests_bucket", None if self.rpm is None else float(self.rpm))
        object.__setattr__(self, "tokens_bucket", None if self.tpm is None else float(self.tpm))

    def doc(self) -> dict[str, Any]:
        """The limits as the API and the CLI show them (`budget_period` only with a budget)."""
        return {
            "rpm": self.rpm, "tpm": self.tpm, "max_parallel": self.max_parallel,
            "budget_tokens": self.budget_tokens,
            "budget_period": self.budget_period if self.budget_tokens is not None else None,
            "models": sorted(self.models) if self.models is not None else None,
        }


NO_LIMITS = Limits()


def _count(name: str, value: Any, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        raise BadRequest(f"{name} must be a whole number from {minimum} to {MAX_COUNT}, or null", code="invalid_limits")
    return value


def _models(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or len(value) > MAX_MODELS or not all(
        isinstance(m, str) and 0 < len(m.strip()) <= MAX_MODEL_CHARS for m in value
    ):
        raise BadRequest(f"models must be a list of 1-{MAX_MODELS} model names, or null", code="invalid_limits")
    return frozenset(m.strip() for m in value)


def parse_limits(doc: Any, base: Limits = NO_LIMITS) -> Limits:
    """`base` changed by `doc` (the API's JSON, the CLI's flags): a field absent keeps its value,
    `null` removes the limit. Returns the new Limits.

    Raises BadRequest (code `invalid_limits`, one line) for anything but an object of FIELDS with
    whole numbers (rpm, tpm, max_parallel, budget_tokens >= 1), a known period, a model list.
    """
    if not isinstance(doc, dict):
        raise BadRequest(f"limits must be a JSON object of {', '.join(FIELDS)}", code="invalid_limits")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown limit {unknown[0]!r}: the limits are {', '.join(FIELDS)}", code="invalid_limits")
    fields = base.doc()
    fields["budget_period"] = base.budget_period
    fields["models"] = base.models
    for name in ("rpm", "tpm", "max_parallel", "budget_tokens"):
        if name in doc:
            fields[name] = _count(name, doc[name], 1)
    if "budget_period" in doc:
        period = doc["budget_period"]
        if period is not None and period not in PERIODS:
            raise BadRequest(f"budget_period must be one of {', '.join(PERIODS)}", code="invalid_limits")
        fields["budget_period"] = period or "day"
    if "models" in doc:
        fields["models"] = _models(doc["models"])
    return Limits(**fields)


# --- periods ---------------------------------------------------------------------------------


def period_bounds(period: str, now: float) -> tuple[float, float]:
    """(start, end) in epoch seconds of the UTC calendar `period` holding `now` (rule 1)."""
    moment = datetime.fromtimestamp(now, timezone.utc)
    day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        start, end = day, day + timedelta(days=1)
    elif period == "week":
        start = day - timedelta(days=day.weekday())
        end = start + timedelta(days=7)
    else:
        start = day.replace(day=1)
        end = (start + timedelta(days=32)).replace(day=1)
    return start.timestamp(), end.timestamp()


def previous_period(period: str, now: float) -> tuple[float, float]:
    """(start, end) of the period before the one holding `now`."""
    start, _ = period_bounds(period, now)
    return period_bounds(period, start - 1.0)[0], start


# --- tallies and their steps -----------------------------------------------------------------


class Tally:
    """One key's counts (rules 2-7): what is drawn from the rpm and tpm buckets as of `stamp`,
    the budget period it counts (`period_start`), the tokens settled in it (`used`), those
    reserved by calls in flight (`reserved`), and its calls in flight (`parallel`)."""

    __slots__ = ("req_drawn", "tok_drawn", "stamp", "period_start", "period_end", "used", "reserved", "parallel")

    def __init__(self, used: int = 0, period_start: float = -math.inf, period_end: float = -math.inf) -> None:
        self.req_drawn = 0.0
        self.tok_drawn = 0.0
        self.stamp = -math.inf
        self.period_start = period_start
        self.period_end = period_end
        self.used = used
        self.reserved = 0
        self.parallel = 0


class Refused(NamedTuple):
    """A call `admit` refused: its reason (REASONS) and Retry-After in whole seconds (0 for a 403)."""

    reason: str
    retry_after_s: int
    message: str


# Besides its exact name, the spelling under which a key's `models` allow a call's model on a box
# of each kind, by that kind's name rule (router.core.names): hugpy reads `base@options` as the
# model `base` with options; Ollama adds `:latest` to a name without a tag. LM Studio and
# OpenAI-compatible servers take the id as sent: there `qwen3-8b@q8_0` is another model.
def _hugpy_base(model: str) -> str:
    return model.partition("@")[0]


def _ollama_latest(model: str) -> str:
    return model[: -len(":latest")] if model.endswith(":latest") else model + ":latest"


ALSO_ALLOWED_AS: dict[BoxKind, Callable[[str], str]] = {BoxKind.HUGPY: _hugpy_base, BoxKind.OLLAMA: _ollama_latest}
ALL_KINDS = frozenset(BoxKind)


def kinds_allowed(models: frozenset[str] | None, model: str, kinds: frozenset[BoxKind]) -> frozenset[BoxKind]:
    """The kinds among `kinds` on whose boxes `models` allow `model` as the call names it: all
    of them when it is named exactly, else those whose name rule makes it an allowed name
    (ALSO_ALLOWED_AS). The gate then rules out the boxes of the other kinds (serve/limits.py)."""
    if models is None or model in models:
        return kinds
    return frozenset(kind for kind in kinds if (also := ALSO_ALLOWED_AS.get(kind)) is not None
                     and also(model) in models)


def model_allowed(models: frozenset[str] | None, model: str) -> bool:
    """`models` allow `model` on some kind of box (rule 3's check, before a box is chosen)."""
    return bool(kinds_allowed(models, model, ALL_KINDS))


def _catch_up(tally: Tally, limits: Limits, now: float) -> None:
    """Drains the buckets to `now` (rule 2) and starts a new budget period when one began (rule 6)."""
    elapsed = now - tally.stamp
    if elapsed > 0:
        if tally.req_drawn and limits.requests_bucket is not None:
            drawn = tally.req_drawn - elapsed * limits.requests_bucket / WINDOW_S
            tally.req_drawn = drawn if drawn > 0.0 else 0.0
        if tally.tok_drawn and limits.tokens_bucket is not None:
            drawn = tally.tok_drawn - elapsed * limits.tokens_bucket / WINDOW_S
            tally.tok_drawn = drawn if drawn > 0.0 else 0.0
        tally.stamp = now
    if now >= tally.period_end and limits.budget_tokens is not None:
        tally.period_start, tally.period_end = period_bounds(limits.budget_period, now)
        tally.used = 0


def _wait_s(seconds: float) -> int:
    return max(1, math.ceil(seconds))


def admit(tally: Tally, limits: Limits, model: str, tokens: int, now: float) -> Refused | None:
    """Rule 3: None when the call for `model` is admitted (its request and its estimate of
    `tokens` are then reserved on `tally`), else why not. Never raises."""
    models = limits.models
    if models is not None and model not in models and not model_allowed(models, model):
        return Refused(MODEL_NOT_ALLOWED, 0, "this key may not call this model")
    _catch_up(tally, limits, now)
    budget = limits.budget_tokens
    if budget is not None and tally.used + tally.reserved >= budget:
        return Refused(BUDGET_EXCEEDED, _wait_s(tally.period_end - now),
                       f"this key's {limits.budget_period} budget of {budget} tokens is spent")
    rpm = limits.requests_bucket
    if rpm is not None and tally.req_drawn + 1.0 > rpm:
        return Refused(RATE_LIMITED, _wait_s((tally.req_drawn + 1.0 - rpm) * WINDOW_S / rpm),
                       f"this key's limit of {limits.rpm} requests a minute is reached")
    tpm = limits.tokens_bucket
    if tpm is not None and tally.tok_drawn >= tpm:
        return Refused(RATE_LIMITED, _wait_s((tally.tok_drawn - tpm) * WINDOW_S / tpm + 0.001),
                       f"this key's limit of {limits.tpm} tokens a minute is reached")
    tally.req_drawn += 1.0
    tally.tok_drawn += tokens
    tally.reserved += tokens
    return None


def settle(tally: Tally, limits: Limits, reserved: int, used: int, now: float, slot: bool = False) -> None:
    """Rule 5: a call that reserved `reserved` tokens ended having used `used`; with `slot`, it
    gives back its max_parallel slot too (rule 7, in the same step)."""
    _catch_up(tally, limits, now)
    drawn = tally.tok_drawn + used - reserved
    tally.tok_drawn = drawn if drawn > 0.0 else 0.0
    tally.reserved -= reserved
    tally.used += used
    if slot and tally.parallel > 0:
        tally.parallel -= 1


def take_parallel(tally: Tally, limits: Limits) -> bool:
    """Rule 7: one more call in flight, if the key has room (True)."""
    if limits.max_parallel is not None and tally.parallel >= limits.max_parallel:
        return False
    tally.parallel += 1
    return True


def has_room(tally: Tally, limits: Limits) -> bool:
    return limits.max_parallel is None or tally.parallel < limits.max_parallel


class Left(NamedTuple):
    """What is left of each limit now, and when each is whole again (seconds from now)."""

    requests: int | None
    requests_reset_s: float
    tokens: int | None
    tokens_reset_s: float
    budget: int | None
    budget_reset_s: float
    parallel: int | None


# What is left of rpm and tpm right after an admission, and when each bucket is empty:
# (requests, requests_reset_s, tokens, tokens_reset_s). A plain tuple: one is made per served
# call of a limited key, and only the headers read it.
Windows = tuple[int, float, int, float]


def windows_after(tally: Tally, limits: Limits) -> Windows:
    """Right after `admit` (the tally is caught up to now): (requests left, seconds until the
    rpm bucket is empty, tokens left, seconds until the tpm bucket is empty); 0s for a limit
    not set. The served call's headers, at a few subtractions."""
    rpm, tpm = limits.requests_bucket, limits.tokens_bucket
    requests = tokens = 0
    requests_reset = tokens_reset = 0.0
    if rpm is not None:  # (math.floor: int() of a float is a type call, twice its cost)
        drawn = tally.req_drawn
        requests = math.floor(rpm - drawn) if drawn < rpm else 0
        requests_reset = drawn * WINDOW_S / rpm
    if tpm is not None:
        drawn = tally.tok_drawn
        tokens = math.floor(tpm - drawn) if drawn < tpm else 0
        tokens_reset = drawn * WINDOW_S / tpm
    return (requests, requests_reset, tokens, tokens_reset)


def left(tally: Tally, limits: Limits, now: float) -> Left:
    """The headers' and the usage API's view of `tally` (reads, never changes, what counts).
    Right after a step (`tally.stamp == now`, the call path's case) it is a few subtractions."""
    requests = tokens = budget = parallel = None
    requests_reset = tokens_reset = budget_reset = 0.0
    elapsed = now - tally.stamp if now > tally.stamp else 0.0
    rpm, tpm = limits.rpm, limits.tpm
    if rpm is not None:
        drawn = tally.req_drawn - elapsed * rpm / WINDOW_S if elapsed else tally.req_drawn
        drawn = drawn if drawn > 0.0 else 0.0
        requests, requests_reset = max(0, math.floor(rpm - drawn)), drawn * WINDOW_S / rpm
    if tpm is not None:
        drawn = tally.tok_drawn - elapsed * tpm / WINDOW_S if elapsed else tally.tok_drawn
        drawn = drawn if drawn > 0.0 else 0.0
        tokens, tokens_reset = max(0, math.floor(tpm - drawn)), drawn * WINDOW_S / tpm
    if limits.budget_tokens is not None:
        if tally.period_start <= now < tally.period_end:
            used, end = tally.used, tally.period_end
        else:
            used, end = 0, period_bounds(limits.budget_period, now)[1]
        budget, budget_reset = max(0, limits.budget_tokens - used - tally.reserved), end - now
    if limits.max_parallel is not None:
        parallel = max(0, limits.max_parallel - tally.parallel)
    return Left(requests, requests_reset, tokens, tokens_reset, budget, budget_reset, parallel)


# A credit leaves each limit at least this many times what it takes (rule 9): what a credit holds
# unspent is never more than 1/17 of what was left, and none is given near a limit.
CREDIT_ROOM = 16


def grant(tally: Tally, limits: Limits, calls: int, call_tokens: int, now: float) -> tuple[int, int]:
    """Rule 9: a credit for up to `calls` calls of `call_tokens` tokens each, drawn ahead: its
    (requests, tokens), fewer calls where a limit has less room, (0, 0) where it has no room
    for one."""
    _catch_up(tally, limits, now)
    share = CREDIT_ROOM + 1
    rpm = limits.requests_bucket
    if rpm is not None:
        calls = min(calls, math.floor((rpm - tally.req_drawn) / share))
    if limits.counts_tokens:
        room = math.inf
        if limits.tokens_bucket is not None:
            room = limits.tokens_bucket - tally.tok_drawn
        if limits.budget_tokens is not None:
            room = min(room, limits.budget_tokens - tally.used - tally.reserved)
        calls = min(calls, math.floor(room / share / max(call_tokens, 1)))
    if calls < 1:
        return 0, 0
    tokens = calls * call_tokens if limits.counts_tokens else 0
    tally.req_drawn += calls
    tally.tok_drawn += tokens
    tally.reserved += tokens
    return calls, tokens


def draw(tally: Tally, limits: Limits, requests: float, tokens: float, now: float) -> None:
    """Rule 2: `requests` and `tokens` drawn from the rpm and tpm buckets as of `now`, with no
    check: what calls admitted elsewhere drew (several routers: those a router admitted alone
    while the shared server was down, drawn there once it is back)."""
    _catch_up(tally, limits, now)
    tally.req_drawn += requests
    tally.tok_drawn += tokens


def refund(tally: Tally, limits: Limits, requests: int, tokens: int, now: float) -> None:
    """Rule 9: what a credit did not spend, given back."""
    _catch_up(tally, limits, now)
    drawn = tally.req_drawn - requests
    tally.req_drawn = drawn if drawn > 0.0 else 0.0
    drawn = tally.tok_drawn - tokens
    tally.tok_drawn = drawn if drawn > 0.0 else 0.0
    tally.reserved -= tokens


# --- estimates -------------------------------------------------------------------------------


def reserve(body_bytes: int, stated: int | None, default_answer: int, room: int | None) -> tuple[int, int]:
    """Rule 4: (the tokens a call reserves, the answer's bound the router gives it). The bound is
    `stated`, the one the call states, else `default_answer`, capped to `room`, what is left of
    the key's token limits (None: none is set), and at least 1 (a key with nothing left is
    refused by `admit`); the tokens are the call's prompt by size plus that bound."""
    bound = default_answer if stated is None else stated
    if room is not None and bound > room:
        bound = room if room > 0 else 1
    return prompt_estimate(body_bytes) + bound, bound


def prompt_estimate(body_bytes: int) -> int:
    return -(-body_bytes // BYTES_PER_TOKEN)


def answer_estimate(answer_bytes: int, stream: bool) -> int:
    """Tokens in an answer no box counted: never 0 for an answer that had a body."""
    if answer_bytes <= 0:
        return 0
    return -(-answer_bytes // (STREAM_BYTES_PER_TOKEN if stream else BYTES_PER_TOKEN))


def reset_header(seconds: float) -> bytes:
    """A duration as OpenAI's `x-ratelimit-reset-*` headers write it: `20ms`, `1.5s`, `6m0s`,
    rounded up to the unit it is written in: ms below a second, tenths below a minute, else whole
    seconds. It runs twice for every served call of a limited key, so the texts below a minute
    are made once, at import (_MS_TEXTS, _TENTHS_TEXTS), and the longer ones once each."""
    ms = math.ceil(seconds * 1000.0) if seconds > 0.0 else 0
    if ms < 1000:
        return _MS_TEXTS[ms]
    if ms < 60_000:
        return _TENTHS_TEXTS[(ms + 99) // 100 - 10]
    return _minutes_text((ms + 999) // 1000)


def _tenths_text(tenths: int) -> bytes:
    return b"%ds" % (tenths // 10) if tenths % 10 == 0 else b"%d.%ds" % divmod(tenths, 10)


_MS_TEXTS = tuple(b"%dms" % ms for ms in range(1000))
_TENTHS_TEXTS = tuple(_tenths_text(tenths) for tenths in range(10, 601))  # 1s to 60s


@functools.lru_cache(maxsize=4096)
def _minutes_text(seconds: int) -> bytes:
    return b"%dm%ds" % divmod(seconds, 60)


class Tokens(NamedTuple):
    """A call's tokens: as its box reported them, or estimated (`estimated`) where it did not."""

    prompt: int
    completion: int
    cached: int
    estimated: bool


def tokens_of(report: tuple[int | None, int | None, int | None] | None, body_bytes: int,
              answer_bytes: int, stream: bool) -> Tokens:
    """The tokens of a call a box served (README "Tenancy": usage): the box's `report` (prompt,
    completion, cached; any may be None), a missing count estimated from the request's and the
    answer's size (`prompt_estimate`, `answer_estimate`) and the result marked `estimated`. A
    report with prompt tokens but no completion (an embedding) has no completion to estimate."""
    if report is None:
        return new_tuple(Tokens, (prompt_estimate(body_bytes), answer_estimate(answer_bytes, stream), 0, True))
    prompt, completion, cached = report
    estimated = prompt is None
    if prompt is None:
        prompt = prompt_estimate(body_bytes)
    if completion is None:
        completion = 0
    return new_tuple(Tokens, (prompt, completion, cached or 0, estimated))
