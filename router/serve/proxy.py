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
- no_box.py: the answers when no box takes the call.
Two things reach the call from outside its task, as events: the CallClock's time (`tick`:
a deadline, the start of the disconnect watcher, a keep-alive) and the client's leaving
(`client_left`).

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
   the CallClock's (clock.py). The body's is the one that cancels the call's task: nothing else
   interrupts an edge's read of the body.
6. No body, chunk, prompt or key is logged; per-call lines are debug level.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING

from router.boxes.state import BoxState
from router.core.admission import Priority
from router.core.affinity import Key, Steer
from router.core.limits import Refused
from router.core.decide import decide
from router.core.errors import BadRequest
from router.core.lifecycle import Event, Lifecycle, Phase, Stop, next_attempt
from router.core.types import BoxFacts, BoxKind, Decision, Path
from router.facades.body import Inspected, read_call
from router.facades.table import Facade, Route
from router.facades.usage import ask_usage
from router.serve import hops, no_box
from router.serve.admission import Seat
from router.serve.attempt import Attempt, Refusal
from router.serve.deliver import Delivery
from router.serve.edge import BodyTooLarge, ClientLeft, Edge
from router.serve.load import Load
from router.serve.record import CallRecord
from router.serve.reply import Reply
from router.serve.tenancy import STATUS, Charge

if TYPE_CHECKING:  # the app imports this module: its type only, for the signatures
    from router.serve.app import RouterApp

log = logging.getLogger("router.proxy")

MAX_BOXES_PER_CALL = 3
# A client that stalls mid-upload must not hold a connection forever; a 64 MiB upload at
# 10 Mbit/s still fits (nginx's client_body_timeout is 60 s between reads, ours is the whole).
BODY_TIMEOUT_S = 60.0
# The client-disconnect watcher (a task) starts only for calls still running after this: most
# non-stream answers are done by then, and a client that left earlier is seen the moment the
# watcher starts, so a disconnect is noticed within this delay (plus up to one CallClock tick)
# plus the box's close.
WATCH_AFTER_S = 0.05
# A body up to this size is inspected on the loop (the JSON scan runs at ~1 GB/s: ~0.25 ms);
# a larger one on a worker thread, where the scan holds no GIL, so the loop goes on serving
# (bench/body_stall.py). A thread hop costs ~0.1 ms, more than scanning a small body.
INLINE_INSPECT_BYTES = 256 << 10
# The phases in which a call is at a box: its client is watched and its exchange's deadline kept.
AT_A_BOX = frozenset({Phase.DISPATCHING, Phase.SENT, Phase.HELD, Phase.JUDGED, Phase.RELAYING})

_CALL_PREFIX = "rt-" + os.urandom(8).hex()  # this process's; the counter makes each id unique
_call_numbers = itertools.count(1)


def new_call_id() -> str:
    """Unique across processes (random prefix) and within one (counter): no syscall per call."""
    return f"{_CALL_PREFIX}{next(_call_numbers):016x}"


class ProxyCall:
    """One model-bearing call through one facade route, from its body to its route-log row."""

    __slots__ = (
        "app", "edge", "facade", "route", "call_id", "life", "record", "reply", "load", "body",
        "attempt", "delivery", "tried", "eligible", "task", "started_s", "watch", "seat", "asked_priority",
        "affinity_key", "steer",
        "charge", "usage_body",
    )

    def __init__(self, app: RouterApp, edge: Edge, facade: Facade, route: Route) -> None:
        self.app = app
        self.edge = edge
        self.facade = facade
        self.route = route
        self.call_id = new_call_id()
        self.life = Lifecycle()
        self.record = CallRecord(self.call_id, facade, route, edge)
        self.reply = Reply(edge, facade, self.record, self.client_left)
        self.load = Load(app.reservations, app.scheduler, app.admission)
        self.body = b""
        self.attempt: Attempt | None = None  # the box it is at, while it is at one
        self.delivery = Delivery(self.reply, self.life)
        self.tried: list[str] = []  # boxes that refused it (failover never returns to them)
        self.eligible: frozenset[str] | None = None  # the first decision's boxes, once decided
        self.task: asyncio.Task | None = None
        self.started_s = 0.0  # loop time when the call began
        self.watch: asyncio.Task | None = None  # the disconnect watcher, once started
        self.seat: Seat | None = None  # its place in the wait queue, while it waits
        self.asked_priority: Priority | None = None  # X-Router-Priority or alloc.priority
        self.affinity_key: Key | None = None  # its affinity key (serve/affinity.py), when on
        self.steer: Steer | None = None  # where that key points, for every decision of the call
        self.charge: Charge | None = None  # its account with its key's limits (serve/tenancy.py)
        self.usage_body: bytes | None = None  # the body asking the box for a stream's usage

    @property
    def gone(self) -> bool:
        """The client left (the call ended by it)."""
        return self.life.ended_by is Event.CLIENT_LEFT

    # -- the call's own task -------------------------------------------------------------------
    async def run(self) -> None:
        clock = self.app.clock
        self.task = asyncio.current_task()
        self.started_s = asyncio.get_running_loop().time()
        clock.calls.add(self)
        try:
            if hops.looped(self.edge):
                await self.reply.error(508, "loop_detected", hops.LOOP_MESSAGE)
            elif await self.read():
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
            self.app.tenancy.ended(self.record, self.charge)
            try:
                if self.life.phase is not Phase.ENDED:
                    self.life.fire(Event.DONE)
            finally:
                self.app.observe(self.record)

    async def read(self) -> bool:
        """The body, then what the call asks for. False when it was answered instead (400,
        408, 413)."""
        reply = self.reply
        try:
            self.body = await self.edge.read_body(self.app.max_body_bytes)
        except asyncio.CancelledError:
            if self.life.ended_by is not Event.DEADLINE:
                raise
            self.task.uncancel()  # type: ignore[union-attr]
            await reply.error(408, "body_timeout", f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s")
            return False
        except BodyTooLarge:
            await reply.error(413, "body_too_large", f"body over {self.app.max_body_bytes} bytes")
            return False
        except ClientLeft:
            # The client left mid-upload, or sent a body the server could not frame (a bad
            # chunked encoding reads as a disconnect): answer in case it is still there.
            await reply.error(400, "bad_body", "the request body could not be read", state="cancelled")
            self.record.failure = "client_left"
            return False
        record = self.record
        record.t_body = time.perf_counter()
        record.bytes_in = len(self.body)
        self.life.fire(Event.BODY_IN)
        try:
            inspected = await self.inspect()
        except BadRequest as exc:
            await reply.error(exc.status_hint, exc.code, str(exc))
            return False
        record.call, stream, self.asked_priority = inspected.call, inspected.stream, inspected.priority
        max_tokens = inspected.max_tokens
        affinity = self.app.affinity
        if affinity.on and record.call.pin is None:
            self.affinity_key = affinity.key(self.edge, inspected, self.body)
            self.steer = affinity.steer(self.affinity_key)
        if stream and self.facade.sse_keepalive:
            reply.keepalive_s = self.app.stream_keepalive_s
        if stream and self.route.asks_usage:
            self.usage_body = ask_usage(self.body)
        return await self.admitted(max_tokens)

    async def admitted(self, max_tokens: int | None) -> bool:
        """The call against its key's limits (serve/tenancy.py rule 1); False when refused."""
        charge = self.app.tenancy.admit(self.edge, self.record.call, self.record.text_bytes, max_tokens)  # type: ignore[arg-type]
        if isinstance(charge, Refused):
            await self.reply.error(STATUS[charge.reason], charge.reason, charge.message, state="refused",
                                   retry_after_s=charge.retry_after_s or None)
            return False
        if charge is not None:
            self.charge = charge
            self.record.limit_headers = charge.headers
        return True

    async def inspect(self) -> Inspected:
        """Reads model, pin, pool, stream and class from the body and headers; a large body on a
        worker thread (INLINE_INSPECT_BYTES). Raises BadRequest."""
        edge = self.edge
        args = (self.body, edge.header("content-type") or "", self.route, self.facade,
                edge.header("x-router-box"), edge.header("x-router-pool"), edge.header("x-router-priority"))
        if len(self.body) <= INLINE_INSPECT_BYTES:
            return read_call(*args)
        return await asyncio.get_running_loop().run_in_executor(None, read_call, *args)

    async def route_call(self) -> None:
        """Decides, waits for room if it must, then tries the decision's boxes in turn (the
        failover step: router.core.lifecycle's next_attempt) until one takes the call."""
        fleet, record, pin = self.app.fleet, self.record, self.record.call.pin  # type: ignore[union-attr]
        record.decision = decision = self.decide_now(fleet.facts())
        if decision.path is Path.REFUSED and not decision.waits_for:
            await no_box.refuse(self.reply, self.record.call, decision, fleet.path)  # type: ignore[arg-type]
            return
        if log.isEnabledFor(logging.DEBUG):  # the ranking is built only when it is logged
            log.debug("call %s: %s", self.call_id, [(b, decision.why[b].rank) for b in decision.boxes])
        self.eligible = frozenset(decision.boxes) if decision.boxes else None
        last: Refusal | None = None
        while True:
            choice = next_attempt(decision, self.tried, pin, MAX_BOXES_PER_CALL)
            if choice is Stop.WAIT:
                self.load.release()  # it waits holding no slot, least of all the refusing box's
                decision = await self.wait_turn(decision)
                if decision is None or self.gone:
                    return
                if self.eligible is None:
                    self.eligible = frozenset(decision.boxes)
                continue
            if isinstance(choice, Stop):
                break
            box = fleet.get(choice)
            if box is None:  # removed from the boxes file since the decision
                self.tried.append(choice)
            elif self.charge is not None and not self.charge.take_slot():  # full for its caller
                decision = await self.wait_turn(decision)
                if decision is None or self.gone:
                    return
                continue
            elif (refusal := await self.try_box(box)) is None:
                return
            else:
                last = refusal
            if self.gone:
                return
            decision = self.decide_now(fleet.facts())
        if not self.gone:
            await no_box.give_up(self.reply, last)

    def decide_now(self, facts: list[BoxFacts]) -> Decision:
        """The call's decision over `facts`, never broadening past its first one (failover)."""
        return decide(self.record.call, facts, self.tried, self.eligible, self.steer)  # type: ignore[arg-type]

    # -- one box -------------------------------------------------------------------------------
    async def try_box(self, box: BoxState) -> Refusal | None:
        """Sends the call to `box` and delivers its answer; the refusal when it refused."""
        if self.life.phase is Phase.DECIDING:  # (a call the queue admitted is dispatched)
            self.life.fire(Event.DECIDED)
        record = self.record
        record.box = box
        self.load.reserve(box)
        t_started = time.perf_counter()
        if not record.attempts:
            record.t_sent = t_started
        app = self.app
        attempt = self.attempt = Attempt(box, self.call_id, self.life, app.first_byte_timeout_s,
                                         app.stream_idle_timeout_s)
        refusal = None
        try:
            # A hugpy box reports a stream's usage on its own (its final frame): it is not asked.
            body = self.usage_body if self.usage_body is not None and box.config.kind is not BoxKind.HUGPY else self.body
            verdict = await attempt.send(self.edge, body)
            if isinstance(verdict, Refusal):
                refusal = verdict
                self.refused_by(box, refusal)
            elif verdict is not None:
                if self.app.affinity.on and verdict.failure is None:
                    self.app.affinity.took(self.affinity_key, self.steer, box, record)
                await self.delivery.send(box, verdict, attempt, asked_usage=body is not self.body)
        finally:
            attempt.done()
            self.attempt = None
            record.attempt_ended(box.name, t_started, refusal.status if refusal else record.status,
                                 refusal.code if refusal else None)
        return refusal

    def refused_by(self, box: BoxState, refusal: Refusal) -> None:
        self.life.fire(Event.BOX_FAILED)
        self.tried.append(box.name)
        log.debug("call %s: box %s refused (%s)", self.call_id, box.name, refusal.code)
        box.refused(self.record.call, refusal.code, asyncio.get_running_loop().time())  # type: ignore[arg-type]

    # -- the wait queue (rule 4) ---------------------------------------------------------------
    async def wait_turn(self, decision: Decision) -> Decision | None:
        """Every owner left is full or cooling: wait for a slot (None: answered instead)."""
        caller, priority = self.app.access.caller_of(self.edge, self.asked_priority)
        seat = self.seat = Seat(self.app.admission, self.reply, self.life, self.load, self.decide_now, self.charge)
        try:
            if not await seat.join(decision, caller, priority):
                return None
            if self.watch is None:  # a client that leaves the queue must leave it at once
                self.watch = self.edge.watch_disconnect(self.client_left)
            return await seat.wait(decision)
        finally:
            self.seat = None

    # -- events from outside the call's task ---------------------------------------------------
    def tick(self, now: float) -> None:
        """The CallClock's look at this call: a deadline passed, or time to watch the client."""
        phase = self.life.phase
        if phase is Phase.RECEIVING:
            if now - self.started_s > BODY_TIMEOUT_S:
                self.life.fire(Event.DEADLINE)
                self.task.cancel()  # type: ignore[union-attr]  # (rule 5)
        elif phase is Phase.QUEUED:
            self.seat.expire(now)  # type: ignore[union-attr]
        elif phase in AT_A_BOX:
            # Only once the body is in: until then receive() belongs to the body.
            if self.watch is None and now - self.started_s >= WATCH_AFTER_S:
                self.watch = self.edge.watch_disconnect(self.client_left)
            attempt = self.attempt
            if attempt is not None and attempt.exchange is not None:
                attempt.exchange.expire(now)
        if self.reply.keepalive_s:
            self.reply.keep_alive_due(now, self.started_s)

    def client_left(self) -> None:
        """The client went away: end the box's work now. Safe to call more than once."""
        if not self.life.can(Event.CLIENT_LEFT):
            return  # the call has ended already
        if self.seat is not None and self.seat.leave(Event.CLIENT_LEFT, "left"):
            self.record.ended("cancelled", "client_left")
            return
        self.life.fire(Event.CLIENT_LEFT)
        if self.delivery.delivered:  # the answer is whole: a hang-up now cancels nothing
            if self.attempt is not None:
                self.attempt.abort("client left after the end")
            return
        self.record.ended("cancelled", "client_left")
        attempt = self.attempt
        if attempt is not None and attempt.abort("client left"):
            attempt.cancel()
