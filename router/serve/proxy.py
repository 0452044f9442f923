"""One model-bearing call, top to bottom: body → inspect → decide → (queue) → attempt → deliver.

The call's phase moves only through router.core.lifecycle's table (`self.life`): RECEIVING,
DECIDING, QUEUED, DISPATCHING, SENT, HELD, JUDGED, RELAYING, ENDED; the failover step is its
`next_attempt`. Each lifetime is a piece of its own:
- `CallRecord` (record.py): the call's route_log row and metrics, filled in as it goes;
- `Reply` (reply.py): the client's side: the router's own answers, heads, keep-alives;
- `Load` (load.py): the load the call puts on a box (reservation, in-flight count, poke);
- `Seat` (admission.py): its place in the wait queue, while it waits;
- `Attempt` (attempt.py): send to one box and judge the answer; it returns a verdict;
- `Delivery` (deliver.py): commit once, then the answer whole or relayed (_fastpath.Relay);
- no_box.py: the answers when no box takes the call;
- `ChainCall` (aliases.py): a call for an alias, along its chain of models (its decision is the
  chain's: router.core.aliases `resolve`).
Two things reach the call from outside its task: the CallClock's time (`tick`, which does the
phase's duties, router.core.lifecycle.TICK_DUTIES) and the client's leaving; the events they
bring (deadline, client_left) have one entry, `outside`.

Rules:
1. Nothing reaches the client before the box's answer is judged (attempt.py). A refusal excludes
   the box and the call is decided again among the first decision's boxes only, at most
   MAX_BOXES_PER_CALL boxes. A pinned call is never rerouted.
2. When no box is left, the client gets the last refusal's answer (no_box.py); after the first
   byte nothing is rerouted (deliver.py).
3. The call's load is taken before the first send, moved on failover, released at the end,
   whatever the end, and while it waits in the queue (load.py).
4. A client that leaves ends the call at once: the box connection is closed (never reused) and a
   hugpy box also gets `POST /v1/requests/<call id>/cancel`; a call it leaves in the queue is
   never sent to a box.
5. Its deadlines (the body's, the box's first byte, the box's silence after it, the queue's) are
   the CallClock's (clock.py). The body's (body.py) is the one that cancels the call's task:
   nothing else interrupts an edge's read of the body.
6. No body, chunk, prompt or key is logged; per-call lines are debug level.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Awaitable
from typing import Protocol

from router._fastpath import Reservations
from router.boxes.fleet import Fleet
from router.boxes.state import BoxState
from router.core.admission import Priority
from router.core.affinity import Key, Steer
from router.core.decide import decide
from router.core.errors import BadRequest
from router.core.lifecycle import TICK_DUTIES, Duty, Event, Lifecycle, Stop, next_attempt
from router.core.limits import MODEL_NOT_ALLOWED, Refused
from router.core.slots import DOWN, GO, WAIT, Slot
from router.core.types import BoxFacts, BoxKind, Decision, Path
from router.facades.body import Inspected, read_call, with_answer_bound
from router.facades.table import Facade, Route
from router.facades.usage import ask_usage
from router.fleetwide.seam import PENDING, SHARED_DOWN, Slots
from router.serve import hops, no_box
from router.serve.access import AccessGate
from router.serve.admission import Admission, Seat
from router.serve.affinity import Affinity
from router.serve.attempt import Attempt, Refusal
from router.serve.body import BodyTimeout, body_deadline, read_body, refusal
from router.serve.aliases import ChainCall
from router.serve.clock import CallClock
from router.serve.deliver import Delivery
from router.serve.edge import BodyTooLarge, ClientLeft, Edge
from router.serve.load import Load
from router.serve.limits import STATUS, UNCOUNTED, Charge, Tenancy, Uncounted
from router.serve.record import CallRecord
from router.serve.reply import Reply
from router.serve.settings import ServeConfig
from router.store.route_log import Row
from router.telemetry.scheduler import Scheduler


class CallHost(Protocol):
    """What a call reads of the app it runs in (app.py's `RouterApp`, which imports this module:
    a protocol, so that this module need not import it back): shared pieces and limits."""

    fleet: Fleet
    reservations: Reservations
    scheduler: Scheduler
    admission: Admission
    access: AccessGate
    tenancy: Tenancy
    affinity: Affinity
    clock: CallClock
    config: ServeConfig  # the settings (serve/settings.py)
    fallbacks: dict  # router_fallbacks_total's counts (serve/metrics.py)
    slots: Slots  # a box's slots: this router's alone, or across routers (fleetwide/seam.py)

    def observe(self, record: CallRecord) -> Row: ...

log = logging.getLogger("router.proxy")

MAX_BOXES_PER_CALL = 3
# The client-disconnect watcher (a task) starts only for calls still running after this: most
# non-stream answers are done by then, and a client that left earlier is seen the moment the
# watcher starts, so a disconnect is noticed within this delay (plus up to one CallClock tick)
# plus the box's close.
WATCH_AFTER_S = 0.05
# A body up to this size is inspected on the loop (the JSON scan runs at ~1 GB/s: ~0.25 ms);
# a larger one on a worker thread, where the scan holds no GIL, so the loop goes on serving
# (bench/body_stall.py). A thread hop costs ~0.1 ms, more than scanning a small body.
INLINE_INSPECT_BYTES = 256 << 10

_CALL_PREFIX = "rt-" + os.urandom(8).hex()  # this process's; the counter makes each id unique
_call_numbers = itertools.count(1)


def new_call_id() -> str:
    """Unique across processes (random prefix) and within one (counter): no syscall per call."""
    return f"{_CALL_PREFIX}{next(_call_numbers):016x}"


class ProxyCall:
    """One model-bearing call through one facade route, from its body to its route-log row."""

    __slots__ = (
        "app", "edge", "facade", "route", "call_id", "life", "record", "reply", "load", "body",
        "attempt", "delivery", "tried", "eligible", "started_s", "watch", "seat", "asked_priority",
        "affinity_key", "steer",
        "charge", "admitting", "usage_body", "chain", "queued_since",
    )
    max_boxes = MAX_BOXES_PER_CALL

    def __init__(self, app: CallHost, edge: Edge, facade: Facade, route: Route) -> None:
        self.app = app
        self.edge = edge
        self.facade = facade
        self.route = route
        self.call_id = new_call_id()
        self.life = Lifecycle()
        self.record = CallRecord(self.call_id, facade, route, edge, self.life)
        self.reply = Reply(edge, facade, self.record, self.client_left)
        self.load = Load(app.reservations, app.scheduler, app.admission, app.slots)
        self.body = b""
        self.attempt: Attempt | None = None  # the box it is at, while it is at one
        self.delivery = Delivery(self.reply, self.life)
        self.tried: list[str] = []  # boxes that refused it (failover never returns to them)
        self.eligible: frozenset[str] | None = None  # the first decision's boxes, once decided
        self.started_s = 0.0  # loop time when the call began
        self.watch: asyncio.Task | None = None  # the disconnect watcher, once started
        self.seat: Seat | None = None  # its place in the wait queue, while it waits
        self.asked_priority: Priority | None = None  # X-Router-Priority or alloc.priority
        self.affinity_key: Key | None = None  # its affinity key (serve/affinity.py), when on
        self.steer: Steer | None = None  # where that key points, for every decision of the call
        # its account with its key's limits (serve/limits.py), once admitted: UNCOUNTED for a caller without any
        self.charge: Charge | Uncounted | None = None
        # several routers: its admission on its way to the shared server, and the body's spans
        self.admitting: tuple[asyncio.Future, tuple | None] | None = None
        self.usage_body: bytes | None = None  # the body asking the box for a stream's usage
        self.chain: ChainCall | None = None  # a call for an alias: where it is on the chain
        self.queued_since: float | None = None  # loop time it first joined the wait queue

    @property
    def gone(self) -> bool:
        """The client left (the call ended by it)."""
        return self.life.ended_by is Event.CLIENT_LEFT

    # -- the call's own task -------------------------------------------------------------------
    async def run(self) -> None:
        clock = self.app.clock
        self.started_s = asyncio.get_running_loop().time()
        clock.calls.add(self)
        try:
            if hops.looped(self.edge):
                await self.reply.error(508, "loop_detected", hops.LOOP_MESSAGE)
            elif (inspected := await self.read()) is not None:
                refused = self.inspect(inspected) or self.admit(inspected)
                if refused is not None:
                    await self.turned_away(refused)
                else:
                    if (steering := self.steer_to()) is not None:
                        self.steer = await steering
                    await self.route_call()
        finally:
            clock.calls.discard(self)
            if self.watch is not None:
                self.watch.cancel()
            self.reply.stop()
            # The pieces' one reference back to the call: dropped, an ended call is freed by
            # reference counting at once instead of by the cycle collector (whose passes cost
            # the loop ~40 µs a call when every call was left to it; bench/callpath_cpu.py).
            self.reply.on_left = None  # type: ignore[assignment]
            self.load.release()
            if self.admitting is not None:  # it ended before its admission was answered
                self.app.tenancy.unread(self.admitting[0])
            self.app.tenancy.ended(self.record, self.charge)
            try:
                self.life.fire(Event.DONE)  # (an ended call stays as it ended)
            finally:
                row = self.app.observe(self.record)
                if self.record.affinity is not None:  # its key placed it (`try_box`): what its end teaches
                    self.app.affinity.ended(self.record, row.state)

    async def read(self) -> Inspected | None:
        """The body, and what it asks for as its bytes and headers say (model, pin, pool, stream,
        class: router.facades.body's scan). None when it was answered instead (400, 408, 413)."""
        reply, limit, edge = self.reply, self.app.config.max_body_bytes, self.edge
        try:
            self.body = await read_body(edge, limit, body_deadline(self.started_s), self.app.clock)
        except (BodyTooLarge, BodyTimeout, ClientLeft) as exc:
            if isinstance(exc, ClientLeft):  # answered in case it is still there
                self.outside(Event.CLIENT_LEFT)
            elif isinstance(exc, BodyTimeout):
                self.life.fire(Event.DEADLINE)
            await reply.error(*refusal(exc, limit))
            return None
        self.record.body_read(len(self.body))
        self.life.fire(Event.BODY_IN)
        args = (self.body, edge.header("content-type") or "", self.route, self.facade, edge.header("x-router-box"),
                edge.header("x-router-pool"), edge.header("x-router-priority"), edge.header("x-router-fallback"))
        try:
            # a large body's scan on a worker thread (INLINE_INSPECT_BYTES), a small one here
            inspected = (read_call(*args) if len(self.body) <= INLINE_INSPECT_BYTES
                         else await asyncio.get_running_loop().run_in_executor(None, read_call, *args))
        except BadRequest as exc:
            await reply.error(exc.status_hint, exc.code, str(exc))
            return None
        self.asked_priority = inspected.priority
        self.record.asked(inspected.call)
        return inspected

    def inspect(self, inspected: Inspected) -> Refused | None:
        """What the call asks for beyond its scan: its key's `models`, its alias, a stream's usage,
        its affinity key. The refusal to answer (403) when its key may not make it."""
        edge, call = self.edge, inspected.call
        allowed = self.app.tenancy.allowed(edge, call)  # its key's `models`, by box kind
        if allowed.__class__ is Refused:
            return allowed  # type: ignore[return-value]
        if allowed is not call:
            self.record.asked(allowed)  # type: ignore[arg-type]
        aliases = self.app.fleet.aliases
        if aliases and (alias := aliases.get(allowed.model)) is not None:  # type: ignore[union-attr]
            self.chain = ChainCall(self, alias, allowed, inspected.fallback, inspected.spans)  # type: ignore[arg-type]
            if self.chain.start is None:  # its key may call none of the chain's models (aliases.py rule 6)
                return Refused(MODEL_NOT_ALLOWED, 0, "this key may not call any model of this alias")
        if inspected.stream:
            if self.route.asks_usage:
                self.usage_body = ask_usage(self.body)
            if self.facade.sse_keepalive:
                self.reply.keepalive_s = self.app.config.stream_keepalive_s
        affinity = self.app.affinity
        if affinity.on and call.pin is None:  # its spans are the body's as sent, before any bound
            self.affinity_key = affinity.key(edge, inspected, self.body)
        return None

    def admit(self, inspected: Inspected) -> Refused | None:
        """The call against its key's limits (serve/limits.py): the refusal to answer (403, 429,
        503), else None. An answer a round trip away is read in `route_call`, once the call has
        asked its first box's slot too: one round trip carries both (fleetwide/leases.py rule
        1)."""
        charge = self.app.tenancy.admit(self.edge, self.record.call, self.record.text_bytes, inspected.max_tokens,
                                        self.route.answer_bound)
        if charge is UNCOUNTED:
            self.charge = charge
            return None
        if charge.__class__ in PENDING:
            self.admitting = (charge, inspected.spans)  # type: ignore[assignment]
            return None
        return None if self.charged(charge, inspected.spans) else charge  # type: ignore[arg-type, return-value]

    def steer_to(self) -> Awaitable[Steer] | None:
        """Where its affinity key points, for every decision of the call (`steer`), or the answer
        to await when that is a round trip away: after the admission, so that several routers'
        admission and binding share the round trip."""
        if self.affinity_key is not None:
            steer = self.app.affinity.steer(self.affinity_key)
            if steer.__class__ in PENDING:
                return steer  # type: ignore[return-value]
            self.steer = steer  # type: ignore[assignment]
        return None

    def charged(self, charge: Charge | Refused, spans: tuple | None) -> bool:
        """The call (as asked: a key's `models` name what it asks) against its key's limits
        (serve/limits.py rules 1-2); False when refused (`turned_away` answers it). The body
        then bounds its answer where the router gave it a bound."""
        if charge.__class__ is Refused:
            return False
        self.charge = charge  # type: ignore[assignment]
        self.record.limited(charge.headers)  # type: ignore[union-attr]
        if charge.bound is not None:  # type: ignore[union-attr]
            bounded = with_answer_bound(self.body, self.route, spans, charge.bound)  # type: ignore
            if bounded is not self.body:  # (most calls stating their bound already say it)
                self.body = bounded
                if self.usage_body is not None:
                    self.usage_body = ask_usage(bounded)
        return True

    async def turned_away(self, refused: Refused) -> None:
        """Answers a call its key refused, in the facade's shape: 429 or 403 with Retry-After, a
        429 also with its limits' `x-ratelimit-*` (serve/limits.py rule 1); or 503
        `shared_store_down`, the shared server down and --shared-down closed (its one site:
        fleetwide/seam.py)."""
        status = STATUS[refused.reason]
        await self.reply.error(status, refused.reason, refused.message, turned_away=status != 503,
                               retry_after_s=refused.retry_after_s or None,
                               more_headers=self.app.tenancy.refusal_headers(self.edge) if status == 429 else ())

    async def admission_answered(self, decision: Decision) -> bool:
        """The admission's answer from the shared server (serve/limits.py rule 7), with the
        slot of the box the call goes to first asked now, in the same round trip."""
        admitting, spans = self.admitting  # type: ignore[misc]
        self.admitting = None
        choice = next_attempt(decision, self.tried, self.record.call.pin, MAX_BOXES_PER_CALL)  # type: ignore[union-attr]
        if not isinstance(choice, Stop) and (box := self.app.fleet.get(choice)) is not None:
            self.app.slots.ask(self.load, box)
        charge = await admitting
        if self.charged(charge, spans):
            return True
        await self.turned_away(charge)
        return False

    async def route_call(self) -> None:
        """Tries the boxes in turn (router.core.lifecycle's next_attempt) until one takes the call,
        each once its preconditions let it go (`PRECONDITIONS`), waiting for room where it must."""
        fleet, pin, last = self.app.fleet, self.record.call.pin, None  # type: ignore[union-attr]
        decision = self.decide_now(fleet.facts())
        if self.admitting is not None and not await self.admission_answered(decision):
            return  # turned away: its row shows no decision, as with one router
        if not self.decided(decision):
            await no_box.refuse(self.reply, self.record.call, decision, fleet)  # type: ignore[arg-type]
            return
        while True:
            choice = next_attempt(decision, self.tried, pin, MAX_BOXES_PER_CALL)
            answer, on_wait = GO, None
            if choice is Stop.WAIT:  # every box it may go to is full: the queue
                answer, on_wait = WAIT, WAIT_IN_QUEUE
            elif isinstance(choice, Stop):
                break
            elif (box := fleet.get(choice)) is None:  # removed from the boxes file since the decision
                self.tried.append(choice)
            else:
                for precondition, on_wait in PRECONDITIONS[self.charge.gates, self.app.slots.gates]:  # type: ignore[union-attr]
                    answer = precondition(self, box)
                    if answer.__class__ is not Slot:  # a round trip away
                        answer = await answer
                    if answer is not GO:
                        break
                else:
                    if (last := await self.try_box(box)) is None:
                        return
                if answer is DOWN:
                    await self.turned_away(SHARED_DOWN)
                    return
            if self.gone:
                return
            waits = answer is WAIT and on_wait is WAIT_IN_QUEUE
            decision = await self.wait_turn(decision) if waits else self.decide_now(fleet.facts())  # type: ignore[assignment]
            if decision is None:
                return
        if not self.gone:
            await no_box.give_up(self.reply, last)

    def decided(self, decision: Decision) -> bool:
        """The call's first decision, recorded. False when no box may take it and none will have
        room (no_box.py answers it)."""
        self.record.decided(decision)
        if decision.path is Path.REFUSED and not decision.waits_for:
            return False
        if log.isEnabledFor(logging.DEBUG):  # the ranking is built only when it is logged
            log.debug("call %s: %s", self.call_id, [(b, decision.why[b].rank) for b in decision.boxes])
        self.eligible = frozenset(decision.boxes) if decision.boxes else None
        return True

    def decide_now(self, facts: list[BoxFacts]) -> Decision:
        """The call's decision over `facts`, never broadening past its first one (failover); an
        alias call's, its chain's."""
        if self.chain is not None:
            return self.chain.decide(self, facts)
        return decide(self.record.call, facts, self.tried, self.eligible, self.steer,  # type: ignore[arg-type]
                      self.app.fleet.verdicts)

    # -- one box -------------------------------------------------------------------------------
    async def try_box(self, box: BoxState) -> Refusal | None:
        """Sends the call to `box` and delivers its answer; the refusal when it refused."""
        self.life.fire(Event.DECIDED)
        record = self.record
        self.load.reserve(box)
        t_started = record.attempting(box)
        config, chain = self.app.config, self.chain
        # A hugpy box reports a stream's usage on its own (its final frame): it is not asked.
        asks_usage = self.usage_body is not None and box.config.kind is not BoxKind.HUGPY
        if chain is None:
            body = self.usage_body if asks_usage else self.body
            attempt = Attempt(box, self.call_id, self.life, config.first_byte_timeout_s, config.stream_idle_timeout_s)
        else:
            body = chain.body_for(self, box, asks_usage)
            first_byte_s = chain.first_byte_s(config.first_byte_timeout_s, record.t_sent, t_started)
            attempt = Attempt(box, self.call_id, self.life, first_byte_s, config.stream_idle_timeout_s)
            attempt.context_moves_on = chain.context_moves_on
        self.attempt = attempt
        refusal = None
        try:
            verdict = await attempt.send(self.edge, body)
            if isinstance(verdict, Refusal):
                refusal = verdict
                self.refused_by(box, refusal)
                if chain is not None:
                    chain.refused(refusal.code)
            elif verdict is not None:
                if self.app.affinity.on and verdict.failure is None:
                    self.app.affinity.took(self.affinity_key, self.steer, box, record)
                await self.delivery.send(box, verdict, attempt, asked_usage=asks_usage)
        finally:
            attempt.done()
            self.attempt = None
            record.attempted(box.name, t_started, refusal.status if refusal else record.status,
                                 refusal.code if refusal else None)
        return refusal

    def refused_by(self, box: BoxState, refusal: Refusal) -> None:
        self.life.fire(Event.BOX_FAILED)
        self.tried.append(box.name)
        log.debug("call %s: box %s refused (%s)", self.call_id, box.name, refusal.code)
        box.refused(self.record.call, refusal.code, asyncio.get_running_loop().time())  # type: ignore[arg-type]

    # -- the wait queue (rule 4) ---------------------------------------------------------------
    async def wait_turn(self, decision: Decision) -> Decision | None:
        """Every owner left is full or cooling, or its key is: wait for a slot, holding none (None:
        answered instead, or its client left)."""
        self.load.release()  # least of all the refusing box's
        self.app.slots.want(decision.waits_for)  # leases other routers park on a full box come back
        caller, priority = self.app.access.caller_of(self.edge, self.asked_priority)
        seat = self.seat = Seat(self.app.admission, self.reply, self.life, self.load, self.decide_now, self.charge,
                                since=self.queued_since)
        try:
            if not await seat.join(decision, caller, priority):
                return None
            self.queued_since = seat.queued_s  # a wait again is bounded from the first (admission.py rule 3)
            if self.watch is None:  # a client that leaves the queue must leave it at once
                self.watch = self.edge.watch_disconnect(self.client_left)
            decision = await seat.wait(decision)  # type: ignore[assignment]
        finally:
            self.seat = None
        if decision is None or self.gone:
            return None
        if self.eligible is None:
            self.eligible = frozenset(decision.boxes)
        return decision

    # -- events from outside the call's task ---------------------------------------------------
    def tick(self, now: float) -> None:
        """The CallClock's look at this call: the duties of its phase (TICK_DUTIES)."""
        for duty in TICK_DUTIES[self.life.phase]:
            DUTIES[duty](self, now)

    def queue_overdue(self, now: float) -> None:
        if self.seat is not None and self.seat.overdue(now):
            self.outside(Event.DEADLINE)

    def watch_client(self, now: float) -> None:
        if self.watch is None and now - self.started_s >= WATCH_AFTER_S:
            self.watch = self.edge.watch_disconnect(self.client_left)

    def box_overdue(self, now: float) -> None:
        attempt = self.attempt
        if attempt is not None and attempt.exchange is not None:
            attempt.exchange.expire(now)  # the box failing: its attempt sees the error

    def keepalive_due(self, now: float) -> None:
        if self.reply.keepalive_s:
            self.reply.keep_alive_due(now, self.started_s)

    def client_left(self) -> None:
        """The client went away (the disconnect watcher, or a write that found it gone)."""
        self.outside(Event.CLIENT_LEFT)

    def outside(self, event: Event) -> None:
        """The one entry for events from outside the call's task: the client left, or a deadline
        of the call's own passed (router.core.lifecycle rule 5). Safe to call more than once."""
        life = self.life
        if life.ended:
            return  # late: the call has ended already (lifecycle rule 2)
        if self.seat is not None and self.seat.leave(event):
            return  # out of the queue without a box; its task answers (or not: the client left)
        if event is Event.DEADLINE:
            return  # the queue's, for a call it handed a slot meanwhile: the slot won
        if self.delivery.delivered:  # the answer is whole: the call is done, a hang-up cancels nothing
            life.fire(Event.DONE)
            if self.attempt is not None:
                self.attempt.abort("client left after the end")
            return
        life.fire(Event.CLIENT_LEFT)
        attempt = self.attempt
        if attempt is not None and attempt.abort("client left"):
            attempt.cancel()


def key_slot(call: ProxyCall, box: BoxState) -> Slot | asyncio.Future:
    """Its key's `max_parallel` (serve/limits.py rule 3): WAIT, and the call waits in the queue."""
    return call.charge.take_slot()  # type: ignore[union-attr]


def box_slot(call: ProxyCall, box: BoxState) -> Slot | Awaitable[Slot]:
    """The box's `max_inflight` across routers (fleetwide/leases.py): WAIT, and the call decides
    again, over the box now full."""
    return call.app.slots.take(call.load, box)


WAIT_IN_QUEUE, DECIDE_AGAIN = "wait in queue", "decide again"
# What lets a call go to the box it chose, in order (Envoy's filter chain): each answers GO, WAIT
# or DOWN (router.core.slots), at once or a round trip later; with what the call does on WAIT.
# Only those that can gate it are asked: by whether its charge has a key's slot to take and the
# slots are counted across routers (`gates`: a call of no key through one router asks none).
KEY_SLOT, BOX_SLOT = (key_slot, WAIT_IN_QUEUE), (box_slot, DECIDE_AGAIN)
PRECONDITIONS = {(False, False): (), (True, False): (KEY_SLOT,), (False, True): (BOX_SLOT,),
                 (True, True): (KEY_SLOT, BOX_SLOT)}


DUTIES = {
    Duty.QUEUE_DEADLINE: ProxyCall.queue_overdue,
    Duty.WATCH_CLIENT: ProxyCall.watch_client,
    Duty.BOX_DEADLINE: ProxyCall.box_overdue,
    Duty.KEEPALIVE: ProxyCall.keepalive_due,
}
