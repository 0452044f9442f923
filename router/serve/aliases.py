"""A call for an alias: where it is on the alias's chain, and what each model's box gets.

The rules of resolution are router.core.aliases's (`resolve`); this room feeds it the call's
decisions and carries out its answer:
1. The call's decision (`decide`, the proxy's `decide_now`: the first decision, each one after a
   refusal, and the queue's look at a waiting call) is the chain's: the first model in reach
   that can answer now. Moving to another model starts its failover afresh (no box tried yet,
   its own first decision's boxes eligible) and makes the call that model's call: its box
   remembers the model's settings, a refusal cools the box for that model.
2. A model passed over for no owner, or refused by every owner it may try, is not tried again by
   this call; a full one may be, once it has room. A box's context-length 400 leaves the model
   (`refused`) where a later model is in reach (`context_moves_on`); otherwise it goes back as
   the box sent it.
3. Each box gets the body with the model in its kind's spelling (router.core.names
   `sent_name`, router.core.kinds), every other byte as the client sent it.
4. One deadline bounds the chain: from the call's first send, every attempt's first byte must
   come within the router's first-byte timeout in all (`first_byte_s`); once it has passed no
   further model is tried.
5. The answer names the model that served (`X-Router-Model`) and its place in the chain
   (`X-Router-Fallback`, 0 for the first); every move to another model counts once per model
   passed over in `router_fallbacks_total{alias,from,to,reason}`.
6. A caller's key with `models` reaches only the chain's models those name (each member as a
   call of its own name: router.core.limits `kinds_allowed`, on the kinds of box that allow it);
   the others are left before the first decision (Move.NOT_ALLOWED, never counted). The alias's
   own name in `models` grants none of its chain: a key allowed `tiny-llama` never reaches
   `secret-model` through an alias named `tiny-llama`. A chain with no model the key may call
   in reach (`start` None) is the key's 403 model_not_allowed (proxy.py).
"""

from __future__ import annotations

import functools
import time
from typing import Protocol

from router.core.affinity import Steer
from router.core.aliases import Alias, Move, reach, resolve
from router.core.decide import decide
from router.core.kinds import KINDS
from router.core.limits import kinds_allowed
from router.core.refusal import RefusalCode
from router.core.types import BoxFacts, Call, Decision, Path
from router.boxes.state import BoxState
from router.facades.body import model_span, with_model
from router.facades.table import Body, Route
from router.serve.edge import Edge
from router.serve.record import CallRecord
from router.serve.reply import Reply


class OnTheChain(Protocol):
    """What a chain reads and moves of its call (proxy.py's `ProxyCall`, which imports this
    module: a protocol, so that this module need not import it back)."""

    app: object  # its CallHost: `config.first_byte_timeout_s`, `fallbacks`, `fleet`
    edge: Edge
    route: Route
    record: CallRecord
    reply: Reply
    body: bytes
    usage_body: bytes | None
    tried: list[str]
    eligible: frozenset[str] | None
    steer: Steer | None  # where its affinity key points (serve/affinity.py), if anywhere
    max_boxes: int

NO_TIME_LEFT = Decision(Path.REFUSED, (), {}, {})


@functools.lru_cache(maxsize=4096)
def model_headers(model: str, position: int) -> tuple[tuple[bytes, bytes], ...]:
    """Rule 5's headers, built once per (model, place)."""
    return ((b"x-router-model", model.encode()), (b"x-router-fallback", b"%d" % position))


@functools.lru_cache(maxsize=4096)
def model_call(model: str, kinds: frozenset, settings: str | None, pin: str | None, pool: str | None,
               knobs: str | None) -> Call:
    """A chain's `model` called as the client asked for the alias (rule 1), built once: a frozen
    dataclass costs more to build than to look up, and an alias's calls mostly ask alike."""
    return Call(model, kinds, settings, pin, pool, knobs)


class ChainCall:
    """One call's walk along one alias's chain. It keeps no reference to its ProxyCall (which
    holds it): an ended call is freed by reference counting (tests/test_no_cycles.py)."""

    __slots__ = ("alias", "asked", "kinds", "start", "denied", "first", "current", "left", "fallback", "scanned")

    def __init__(self, proxy: OnTheChain, alias: Alias, asked: Call, fallback: bool, spans: tuple | None) -> None:
        self.alias = alias
        self.asked = asked  # the call as the client made it, for the alias's name
        key_id = proxy.edge.key_id
        models = None if key_id is None else proxy.app.tenancy.keys.limits_of(key_id).models  # type: ignore[attr-defined]
        # per place, the kinds of box the call may reach with that model (rule 6; empty: none)
        self.kinds = tuple(asked.kinds if models is None else kinds_allowed(models, model, asked.kinds)
                           for model in alias.chain)
        self.left: dict[int, Move] = {p: Move.NOT_ALLOWED for p, kinds in enumerate(self.kinds) if not kinds}
        self.denied = len(self.left)
        self.fallback = fallback
        self.start = next((p for p in range(reach(alias.chain, fallback)) if p not in self.left), None)
        self.current = start = self.start or 0
        self.first = self.call_at(start)
        # the body as read and where its model is (read_call's scan, `spans`): a body that is still
        # that one gets its model without a second scan (rule 3)
        self.scanned = (proxy.body, model_span(proxy.route, spans))
        proxy.record.aliased(alias.name, start, self.first)
        proxy.reply.model_headers = model_headers(alias.chain[start], start)

    def call_at(self, position: int) -> Call:
        asked = self.asked
        return model_call(self.alias.chain[position], self.kinds[position], asked.settings, asked.pin, asked.pool,
                          asked.knobs)

    # -- rule 1 --------------------------------------------------------------------------------
    def decide(self, proxy: OnTheChain, facts: list[BoxFacts]) -> Decision:
        t_sent = proxy.record.t_sent  # (perf_counter) the first attempt's send, once there was one
        if t_sent and time.perf_counter() - t_sent >= proxy.app.config.first_byte_timeout_s:
            return NO_TIME_LEFT  # rule 4
        current, tried, eligible = self.current, proxy.tried, proxy.eligible
        if current == self.start and not tried and len(self.left) == self.denied:  # the common case: the first model
            decision = decide(self.first, facts, tried, eligible, proxy.steer, proxy.app.fleet.verdicts)
            if decision.boxes:
                return decision  # resolve's answer too: the first model in reach ranks a box

        def decide_model(position: int) -> Decision:
            if position == current:
                return decide(self.call_at(position), facts, tried, eligible, proxy.steer)
            return decide(self.call_at(position), facts)

        resolved = resolve(self.alias.chain, decide_model, self.left, current, tried,
                           self.asked.pin, proxy.max_boxes, self.fallback)
        for position, move in resolved.passed:
            if move is not Move.FULL:
                self.left[position] = move
        if resolved.position != current and (resolved.decision.boxes or resolved.decision.waits_for):
            self.move_to(proxy, resolved.position, resolved.decision, resolved.passed)
        return resolved.decision

    def move_to(self, proxy: OnTheChain, position: int, decision: Decision,
                passed: tuple[tuple[int, Move], ...]) -> None:
        chain, counts = self.alias.chain, proxy.app.fallbacks
        for was, move in passed:
            counts[(self.alias.name, chain[was], chain[position], move.value)] += 1
        self.current = position
        proxy.tried.clear()
        proxy.eligible = frozenset(decision.boxes) if decision.boxes else None  # (a wait: once handed out)
        proxy.record.aliased(self.alias.name, position, self.call_at(position))
        proxy.reply.model_headers = model_headers(chain[position], position)

    # -- rules 2-4, per attempt ----------------------------------------------------------------
    def body_for(self, proxy: OnTheChain, box: BoxState, asks_usage: bool) -> bytes:
        """The body `box` gets (rule 3): the call's (the client's, perhaps with the answer's bound
        tenancy gave it), or the one that asks for a stream's usage (`asks_usage`, serve/limits.py's),
        with the model in the box's spelling."""
        name = KINDS[box.config.kind].sent_name(self.alias.chain[self.current], box.inventory.catalog)
        route = proxy.route
        base = proxy.usage_body if asks_usage else proxy.body
        scanned, span = self.scanned
        if base is not scanned:  # rewritten since (tenancy's answer bound, a stream's usage): scanned anew
            span = None
        content_type = (proxy.edge.header("content-type") or "") if route.body is Body.FORM else ""
        return with_model(base, content_type, route, name, span)  # type: ignore[arg-type]

    @staticmethod
    def first_byte_s(timeout_s: float, t_sent: float, t_now: float) -> float:
        """The attempt's first-byte timeout: what is left of the chain's one deadline, the
        router's first-byte timeout `timeout_s` from the first attempt's send `t_sent` (rule 4;
        perf_counter times, the record's, so that no clock is read for it)."""
        return max(timeout_s - (t_now - t_sent), 0.0)

    @property
    def context_moves_on(self) -> bool:
        """A later model is in reach: a context-length 400 moves the call to it (rule 2). (When
        every later model was left already, the 400 still goes back as the box sent it: the
        call finds no model and answers with the last refusal.)"""
        return self.fallback and self.current + 1 < len(self.alias.chain)

    def refused(self, code: RefusalCode) -> None:
        if code is RefusalCode.CONTEXT_LENGTH:
            self.left[self.current] = Move.CONTEXT_LENGTH
