"""Tenancy at work: a call's key (or address) against its limits, from admission to settlement.

The rules are router.core.limits'; the tallies live behind router.store.counters' `Counters`.
This room:
1. Admits a call once its body is read (`admit`): its key's limits (the key the access gate
   validated, `edge.key_id`), or, for a caller without one, `--default-rpm/--default-tpm` per
   resolved address. Nothing to count (no limits): no work beyond two lookups. A refusal is
   429 `rate_limited` / 429 `budget_exceeded` with Retry-After and, as OpenAI's 429s, the
   `x-ratelimit-*` headers of the caller's limits as they stand (`refusal_headers`), or 403
   `model_not_allowed`, in the facade's shape, counted in `router_key_limited_total`. First,
   `allowed` keeps the call to the kinds of box on whose name rule its key's `models` allow its
   name (router.core.limits rule 3: `m@options` is `m` on a hugpy box only).
2. An admitted call carries a `Charge`: the tokens it reserved and the OpenAI `x-ratelimit-*`
   headers of its limits (what is left after it), which its answer's head carries. A call
   counted against token limits reserves its prompt's estimate and its answer's bound: the
   largest it states in any field a box reads as one, else the router's (`--default-max-tokens`),
   capped to what is left of the key's tpm and budget (`room`), which the proxy writes into
   every such field of the body and the route's own where it has none (`Charge.bound`;
   Route.answer_bound: `max_tokens`, `max_completion_tokens`, `max_output_tokens`, `n_predict`,
   Ollama's `options.num_predict`), so the box ends the answer there (`finish_reason` "length")
   whichever field it reads, and no call is charged past what it reserved (router.core.limits
   rule 4). A route with no such field (embeddings, speech, images) reserves the default and
   its body is left as it is; so is every body of a key without token limits.
3. `max_parallel`: the call takes its key's slot when it is dispatched (`Charge.take_slot`:
   router.core.slots' GO, WAIT or DOWN); without one it waits in the queue, full for its caller,
   and the queue hands it the slot with its box (serve/admission.py). The slot goes back when
   the call ends, and the queue is offered it at once.
4. `settle` at the end: the call's tokens (its record's `tokens()`, reported or estimated) replace
   its reservation; a call no box served settles 0 tokens. Every keyed call's tokens go to
   `router_key_tokens_total`.
5. Budgets count from the store: at start, and when a key's budget or its period changes, its
   current period's usage is read from `key_usage` off the loop (`seeds`) and installed (`seed`).
6. Metric labels: a key's id (`admin` for HUGPY_ROUTER_KEY, `none` for every caller without a
   key), never a secret or an address: the label sets are bounded by the keys in the store.
7. Several routers (--shared-url): the tallies are on the shared server (fleetwide/tallies.py),
   behind the same `Counters` (fleetwide/seam.py), chosen when the process state is built. So
   `admit` may answer with a future of the Charge or the Refused (one round trip, asked at once:
   the call asks its box's lease before it waits, and both share the round trip; a call that
   ends before reading the answer settles what it was charged, `unread`), or the Charge at once
   when the key's credit on this router covers the call (fleetwide/tallies.py rule 8); and a
   `max_parallel` slot may be a round trip too (the queue's hand-out asks it, the call's
   dispatch reads that answer). Server down: `--shared-down open` counts in this router alone,
   `closed` answers fleetwide/seam.py's SHARED_DOWN (a Refused, 503 `shared_store_down`)
   or Slot.DOWN. One router: every step answers at once.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily

from router.core import limits as rules
from router.core.limits import (
    DEFAULT_ANSWER_TOKENS, NO_LIMITS, Limits, Refused, Windows, reset_header,
)
from router.core.slots import GO, Slot
from router.core.types import Call
from router.fleetwide.seam import PENDING, SHARED_DOWN
from router.store.counters import Counters
from router.store.keys import KeyStore

if TYPE_CHECKING:
    from router.serve.admission import Admission
    from router.serve.edge import Edge
    from router.serve.record import CallRecord

NO_KEY = "none"  # the metric label of every caller without a key (rule 6)
# Keys' Accounts kept at once: past it they are all dropped and made again as calls come (a key
# deleted since is never called again, so this bounds what deleted keys leave).
MAX_ACCOUNTS = 65_536
STATUS = {rules.RATE_LIMITED: 429, rules.BUDGET_EXCEEDED: 429, rules.MODEL_NOT_ALLOWED: 403, SHARED_DOWN.reason: 503}
TOKEN_KINDS = ("prompt", "completion", "cached")


class Account:
    """What every charge of one key (or of the callers without one) shares, made once per key
    and limits (rule 2): the tally's name (None for callers without a key: theirs is by address),
    the limits, and the headers that state each limit."""

    __slots__ = ("name", "limits", "requests_limit", "tokens_limit")

    def __init__(self, name: str | None, limits: Limits) -> None:
        self.name = name
        self.limits = limits
        self.requests_limit = None if limits.rpm is None else (b"x-ratelimit-limit-requests", b"%d" % limits.rpm)
        self.tokens_limit = None if limits.tpm is None else (b"x-ratelimit-limit-tokens", b"%d" % limits.tpm)

    def rate_headers(self, windows: Windows) -> tuple[tuple[bytes, bytes], ...]:
        """OpenAI's `x-ratelimit-*` for the limits set, right after a call's admission (rule 2):
        only what is left and when it is whole again are made per call."""
        requests_left, requests_reset_s, tokens_left, tokens_reset_s = windows
        requests = () if self.requests_limit is None else (
            self.requests_limit,
            (b"x-ratelimit-remaining-requests", b"%d" % requests_left),
            (b"x-ratelimit-reset-requests", reset_header(requests_reset_s)))
        if self.tokens_limit is None:
            return requests
        return requests + (
            self.tokens_limit,
            (b"x-ratelimit-remaining-tokens", b"%d" % tokens_left),
            (b"x-ratelimit-reset-tokens", reset_header(tokens_reset_s)))


class Charge:
    """One admitted call's account with its key (rules 2-4)."""

    __slots__ = ("tenancy", "name", "limits", "reserved", "bound", "slot", "taking", "headers", "gates")

    def __init__(self, tenancy: Tenancy, name: str, limits: Limits, reserved: int, bound: int | None,
                 headers: tuple[tuple[bytes, bytes], ...]) -> None:
        self.tenancy = tenancy
        self.name = name  # the tally's name: `key:<id>` or `addr:<address>`
        self.limits = limits
        self.reserved = reserved
        self.bound = bound  # the answer's bound the router writes into the call (None: none is due, rule 2)
        self.slot = False  # holds one of its key's max_parallel slots (a key without one has none)
        self.taking: asyncio.Future | None = None  # its slot asked, the answer a round trip away (rule 7)
        self.headers = headers
        self.gates = limits.max_parallel is not None  # it has a slot to take before its call is sent

    def take_slot(self) -> Slot | asyncio.Future:
        """Rule 3: GO when the call may go to its box (its key has no max_parallel, or it holds
        one of its slots now), WAIT when its key has none free; several routers (rule 7): the
        future of that answer (or of DOWN) while the round trip is out, the same one to every
        asker (the queue's hand-out asks, the dispatch reads)."""
        if self.slot or self.limits.max_parallel is None:
            return GO
        if self.taking is not None:
            return self.taking
        taken = self.tenancy.counters.take_parallel(self.name, self.limits)
        if taken.__class__ is Slot:
            self.slot = taken is GO
            return taken  # type: ignore[return-value]
        self.taking = taken  # type: ignore[assignment]
        taken.add_done_callback(self._taken)  # type: ignore[union-attr]
        return taken  # type: ignore[return-value]

    def _taken(self, taking: asyncio.Future) -> None:
        """The slot's round trip answered (before the call reads it: added first): held on GO,
        given back by `settle` whether or not the call read it."""
        self.taking = None
        self.slot = not taking.cancelled() and taking.result() is GO

    def has_room(self) -> bool:
        return self.slot or self.tenancy.counters.has_room(self.name, self.limits)

    def settle(self, used: int) -> None:
        """Rule 4; once, at the call's end, with the tokens it used. A slot whose round trip is
        still out is given back once it answers."""
        tenancy, slot = self.tenancy, self.slot
        if self.taking is not None:
            self.taking.add_done_callback(functools.partial(_settle_taken, self, used))
            return
        tenancy.counters.settle(self.name, self.limits, self.reserved, used, tenancy.clock(), slot)
        self.slot = False
        if slot:
            tenancy.admission.offer()


def _settle_taken(charge: Charge, used: int, taking: asyncio.Future) -> None:
    charge.settle(used)


class Uncounted:
    """The charge of a call whose caller has no limits: nothing is counted, nothing is settled
    (`ended` settles a Charge only)."""

    __slots__ = ()
    bound = None
    headers: tuple = ()
    gates = False  # no slot to take

    @staticmethod
    def take_slot() -> Slot:
        return GO

    @staticmethod
    def has_room() -> bool:
        return True


UNCOUNTED = Uncounted()


class Tenancy:
    def __init__(self, keys: KeyStore, counters: Counters, admission: Admission, *,
                 default_rpm: int | None = None, default_tpm: int | None = None,
                 default_max_tokens: int = DEFAULT_ANSWER_TOKENS) -> None:
        self.keys = keys
        self.default_max_tokens = default_max_tokens  # rule 2
        self.counters = counters  # this router's (store/counters.py) or the routers' (fleetwide/tallies.py)
        self.admission = admission  # where max_parallel waiters wait: offered a slot as it is freed
        self.defaults = Account(None, Limits(rpm=default_rpm, tpm=default_tpm) if default_rpm or default_tpm
                                else NO_LIMITS)
        self.accounts: dict[str, Account] = {}  # key id -> its Account, while its limits are the same
        self.tokens: Counter[tuple[str, str]] = Counter()  # (key label, kind) -> tokens
        self.limited: Counter[tuple[str, str]] = Counter()  # (key label, reason) -> calls
        self.seeded: dict[str, tuple[int, str]] = {}  # key id -> (budget, period) seeded (rule 5)
        self.clock = time.time  # epoch seconds: budget periods are UTC calendar periods (tests set it)

    # -- the call path -------------------------------------------------------------------------
    def admit(self, edge: Edge, call: Call, body_bytes: int, stated: int | None,
              bound_fields: tuple[str, ...]) -> Charge | Uncounted | Refused | asyncio.Future:
        """Rule 1: a Charge or a refusal (UNCOUNTED when nothing of the caller's is counted);
        several routers: maybe the future of either (rule 7). `stated` is the answer's bound the
        call states; `bound_fields` its route's (rule 2)."""
        key_id = edge.key_id
        if key_id is not None:
            limits = self.keys.limits_of(key_id)
            if limits is NO_LIMITS:
                return UNCOUNTED
            account = self.accounts.get(key_id)
            if account is None or account.limits is not limits:
                account = self.account(key_id, limits)
            name = account.name
        else:
            account = self.defaults
            limits = account.limits
            if limits is NO_LIMITS:
                return UNCOUNTED
            name = "addr:" + (edge.caller or "unknown")
        now = self.clock()
        if limits.counts_tokens:
            tokens, bound = rules.reserve(body_bytes, stated, self.default_max_tokens, self.room(name, limits, now))
        else:
            tokens, bound = 0, None
        bound = bound if bound_fields else None
        admitted = self.counters.admit(name, limits, call.model, tokens, now)
        if admitted.__class__ in PENDING:  # several routers: a round trip, the caller awaits it (rule 7)
            charging = asyncio.get_running_loop().create_future()
            admitted.add_done_callback(  # type: ignore[union-attr]
                functools.partial(self._charged, charging, key_id, name, account, tokens, bound))
            return charging
        return self.charged(admitted, key_id, name, account, tokens, bound)  # type: ignore[arg-type]

    def allowed(self, edge: Edge, call: Call) -> Call | Refused:
        """Rule 1's `models`, by box kind (router.core.limits rule 3): the call as it may go, to
        the kinds of box on which its key's `models` allow its name (a hugpy box reads
        `qwen3-8b@q8_0` as `qwen3-8b`, an LM Studio box as another model), or the 403 when its
        facade serves none of them."""
        key_id = edge.key_id
        if key_id is None:  # an address's limits name no models
            return call
        models = self.keys.limits_of(key_id).models
        if models is None or call.model in models:
            return call
        kinds = rules.kinds_allowed(models, call.model, call.kinds)
        if kinds:
            return call if kinds == call.kinds else call._replace(kinds=kinds)
        self.limited[(key_id, rules.MODEL_NOT_ALLOWED)] += 1
        return Refused(rules.MODEL_NOT_ALLOWED, 0, "this key may not call this model")

    def refusal_headers(self, edge: Edge) -> tuple[tuple[bytes, bytes], ...]:
        """Rule 1: the `x-ratelimit-*` headers of the limits of the caller `admit` just refused, as
        they stand now (what is left, when each is whole again): () when it has no rpm or tpm."""
        key_id = edge.key_id
        account = self.defaults if key_id is None else self.accounts.get(key_id)
        if account is None:  # (the accounts were dropped since its admission: MAX_ACCOUNTS)
            return ()
        name = account.name or "addr:" + (edge.caller or "unknown")
        left = self.counters.left(name, account.limits, self.clock())
        windows = (left.requests or 0, left.requests_reset_s, left.tokens or 0, left.tokens_reset_s)
        return account.rate_headers(windows)

    def room(self, name: str, limits: Limits, now: float) -> int:
        """Rule 2: what is left now of the token limits of `limits` (one is set) on tally `name`:
        an answer's bound is capped to it. Several routers: as this router last saw the tally."""
        left = self.counters.left(name, limits, now)
        tokens, budget = left.tokens, left.budget
        if tokens is None:
            return budget  # type: ignore[return-value]
        return tokens if budget is None or tokens < budget else budget

    def account(self, key_id: str, limits: Limits) -> Account:
        """A key's Account, made for its limits now (its first call, or its limits changed)."""
        if len(self.accounts) >= MAX_ACCOUNTS:
            self.accounts.clear()
        account = self.accounts[key_id] = Account("key:" + key_id, limits)
        return account

    def charged(self, admitted: Refused | Windows, key_id: str | None, name: str, account: Account,
                tokens: int, bound: int | None) -> Charge | Refused:
        if admitted.__class__ is Refused:
            if admitted is not SHARED_DOWN:  # (the shared server's outage is no limit of the key's)
                self.limited[(key_id or NO_KEY, admitted.reason)] += 1  # type: ignore[union-attr]
            return admitted  # type: ignore[return-value]
        return Charge(self, name, account.limits, tokens, bound, account.rate_headers(admitted))  # type: ignore[arg-type]

    def _charged(self, charging: asyncio.Future, key_id: str | None, name: str, account: Account, tokens: int,
                 bound: int | None, admitted: asyncio.Future) -> None:
        """Rule 7: `charged`, once the shared server has answered, into the future the call reads."""
        if charging.cancelled():
            return
        answer = SHARED_DOWN if admitted.cancelled() or admitted.exception() is not None else admitted.result()
        charging.set_result(self.charged(answer, key_id, name, account, tokens, bound))

    @staticmethod
    def unread(charging: asyncio.Future) -> None:
        """Rule 7: a call that ended before reading its admission's answer; what that charged goes
        back once it comes."""
        charging.add_done_callback(_settle_unread)

    def ended(self, record: CallRecord, charge: Charge | Uncounted | None) -> None:
        """A call ended: its tokens counted, its charge settled (rule 4; None: it ended before
        its admission)."""
        tokens = record.count_tokens()
        used = 0 if tokens is None else tokens.prompt + tokens.completion
        if charge.__class__ is Charge:
            charge.settle(used)  # type: ignore[union-attr]
        if used:
            label = record.edge.key_id or NO_KEY
            self.tokens[(label, "prompt")] += tokens.prompt
            self.tokens[(label, "completion")] += tokens.completion
            if tokens.cached:
                self.tokens[(label, "cached")] += tokens.cached

    # -- budgets from the store (rule 5) -------------------------------------------------------
    def seeds(self) -> list[tuple[str, int, tuple[float, float], tuple[int, str]]]:
        """Off the loop: the keys whose budget is not counted from the store yet, with their
        current period's tokens there."""
        now = self.clock()
        found = []
        for key_id, limits in self.keys.budgets().items():
            wanted = (limits.budget_tokens, limits.budget_period)
            if self.seeded.get(key_id) == wanted:
                continue
            period = rules.period_bounds(limits.budget_period, now)
            usage = self.keys.usage(key_id, *period)
            found.append((key_id, usage["prompt_tokens"] + usage["completion_tokens"], period, wanted))
        return found

    def seed(self, seeds: list[tuple[str, int, tuple[float, float], tuple[int, str]]]) -> None:
        """On the loop: installs `seeds()`."""
        for key_id, used, period, wanted in seeds:
            self.counters.seed("key:" + key_id, used, period)
            self.seeded[key_id] = wanted

    # -- reading -------------------------------------------------------------------------------
    def with_left(self, doc: dict) -> dict:
        """On the loop: `doc` (KeyStore.usage_report's) with what is left of each limit now and when it
        is whole again (seconds)."""
        limits = self.keys.limits_of(doc["id"])
        left = self.counters.left("key:" + doc["id"], limits, self.clock())
        doc["left"] = {
            "requests": left.requests, "requests_reset_s": round(left.requests_reset_s, 3),
            "tokens": left.tokens, "tokens_reset_s": round(left.tokens_reset_s, 3),
            "budget_tokens": left.budget,
            "budget_reset_s": round(left.budget_reset_s, 3) if left.budget is not None else None,
            "parallel": left.parallel,
        }
        return doc


def _settle_unread(charging: asyncio.Future) -> None:
    if not charging.cancelled() and charging.result().__class__ is Charge:
        charging.result().settle(0)


class KeyCollector:
    """`router_key_tokens_total{key,kind}` and `router_key_limited_total{key,reason}` at scrape
    time, from the Tenancy's dicts (rule 6: `key` is a key's id, `admin` or `none`; `kind` one of
    TOKEN_KINDS; `reason` one of router.core.limits.REASONS)."""

    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy

    def collect(self):
        tokens = CounterMetricFamily("router_key_tokens", "Tokens by key and kind (prompt, completion, cached).",
                                     labels=["key", "kind"])
        for (key, kind), count in sorted(self.tenancy.tokens.items()):
            tokens.add_metric([key, kind], count)
        yield tokens
        limited = CounterMetricFamily(
            "router_key_limited", "Calls refused for a key's limits, by reason (rate_limited, budget_exceeded, "
            "model_not_allowed).", labels=["key", "reason"])
        for (key, reason), count in sorted(self.tenancy.limited.items()):
            limited.add_metric([key, reason], count)
        yield limited
