"""Batches on idle capacity: the runner that sends a batch's lines through the router's own call
path, in the fleet's spare slots only (docs/batches.md).

A line is a call like any other (`LineCall`, a ProxyCall: routing, the key's limits, affinity,
aliases and the route log all apply, and its row carries the batch and the line's `custom_id`),
whose client is the runner (`LineEdge`, an Edge that holds the answer in memory).

Rules:
1. Spare only. A line starts at a box only while (`Spare.room`): the box is online, not blocked,
   not at GPU pressure 3, no interactive call waits in the queue for it, and it has room for the
   line beside the interactive calls: under its `max_inflight`, less the most interactive calls
   it has held at once within INTERACTIVE_MEMORY_S and HEADROOM more, or, for a box without a
   `max_inflight`, under `--batch-per-box` lines. A line goes to the first of those boxes the
   decision ranks for it (its `eligible`), counted there from its start; refused there before its
   first byte, it fails over to any box with room then. A router stopping starts no line.
2. A line never waits in the router's queue (its places are the interactive callers'): where it
   would (the box filled meanwhile, the key at `max_parallel`) it is answered
   `no_spare_capacity` and goes back to wait. A running line is never cut for an interactive call.
3. A line's answer decides its fate (router.core.batches rule 2): output, error, back to wait
   (`waiting_on` the refusal's code, until its Retry-After), or run again.
4. Batches of different owners take turns, one line each per turn; an owner's batches go oldest
   first.
5. Durable: lines are leased from the store, LEASE_AHEAD at a time, while this router holds
   them (the lease's owner is the instance and this run), and a result is written once, only by
   the router holding the line's lease (router.store.batches). The lease lasts `--batch-lease`
   (30 s), renewed RENEWALS_PER_LEASE times within it, line by line: a line this router lost
   track of lapses. Lines held ahead go back at once when their batch ends or the router stops. A
   line running when its router died is leased again once its lease ends, or at once by the
   instance started again: a box may see a line twice, never the output. A line whose call
   raised (a box that cut a relayed answer) runs again, an attempt spent.
6. A batch past its window stops starting lines; its unrun lines are `batch_expired` (or
   `budget_exceeded`, when its key's budget is what held them), and it ends `expired` once its
   running lines are done. A cancelled batch likewise ends `cancelled`, its unrun lines
   `batch_cancelled`. A batch with every line done ends `completed`. A batch whose key was revoked
   or expired starts no line: its unrun lines are `invalid_api_key`.
7. Store work runs on a worker thread, never the loop; a store that fails is logged (once per
   outage, or per batch) and tried again next pass: one batch it fails on holds up no other.
   Nothing of a line's body or answer is logged.
8. Retention: with the store's (`--log-retention-days`), batches ended and files made longer ago
   are deleted, once every PRUNE_EVERY_S.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Callable

import orjson

from router.core.batches import INSIDE, STATE_OF_FATE, Fate, answer_line, fate
from router.core.decide import decide
from router.core.errors import BadRequest
from router.core.types import BoxFacts, Path, ReasonCode
from router.facades import mounts
from router.facades.body import read_call
from router.serve.edge import BodyTooLarge
from router.serve.proxy import INLINE_INSPECT_BYTES, CallHost, ProxyCall
from router.store.batches import BatchRow, BatchStore, Line, LineResult

log = logging.getLogger("router.batches")

# A pass: end what is due, start lines where there is room. Also run when a line ends or a
# batch is made (`wake`); this is the most a slot freed by an interactive call stays unseen.
PASS_S = 0.1
RENEWALS_PER_LEASE = 3  # a lease is renewed this often within its length (rule 5)
# Ended lines are written together, at most this late: one transaction for many lines.
FLUSH_EVERY_S = 0.05
# The store's batches are read again at least this often (another router's cancel, the CLI's),
# and at once after a batch is made or cancelled here, or when one may be over.
LOOK_EVERY_S = 1.0
# Batches and files older than the store's retention are deleted this often (rule 8).
PRUNE_EVERY_S = 3600.0
FILES_AT_ONCE = 2
HEADROOM = 1  # slots a box with a max_inflight keeps for an interactive call to come (rule 1)
INTERACTIVE_MEMORY_S = 30.0
# Lines leased at once per batch, ahead of the room to start them: one store transaction per this
# many lines started, where leasing as slots came free took one per line or two (and bench/batch.py
# measured 750 µs of router CPU a line with it). Held ahead, they are renewed like running ones.
LEASE_AHEAD = 32
JSON_TYPE = "application/json"
NO_SPARE = "no_spare_capacity"
# A line whose call ended without a whole answer (the box cut a relayed one): the fleet failed it.
CUT_ANSWER = (b'{"error": {"message": "the box cut its answer short", "type": "upstream_error", '
              b'"code": "answer_cut"}}')
# A box ruled out for these may take a line later: a line no box can take now waits for it.
BACK_LATER = frozenset({ReasonCode.OFFLINE, ReasonCode.BLOCKED})
# Codes that end an unrun line, by what held it (rule 6).
EXPIRED_CODES = {"budget_exceeded": "budget_exceeded"}


class LineEdge:
    """The client side of one line: its body and headers as a client's, its answer kept here.
    An Edge (serve/edge.py) without a socket: the call never knows it serves a batch."""

    __slots__ = ("method", "path", "query", "client", "port", "caller", "key_id", "headers", "header",
                 "body", "batch_id", "custom_id", "status", "answer", "retry_after", "gone")

    def __init__(self, batch: BatchRow, line: Line) -> None:
        self.method = "POST"
        self.path = batch.endpoint
        self.query = ""
        self.client = "batch"
        self.port = ""
        self.caller: str | None = "batch"
        self.key_id: str | None = None if batch.owner == INSIDE else batch.owner
        self.body = line.body
        self.headers = {"content-type": JSON_TYPE, "content-length": str(len(line.body))}
        self.header = self.headers.get
        self.batch_id = batch.id
        self.custom_id = line.custom_id
        self.status = 0
        self.answer: list[bytes] = []
        self.retry_after = 0.0  # a refusal's Retry-After, in seconds
        self.gone = asyncio.get_running_loop().create_future()  # set when the router stops

    def header_lines(self, name: str) -> str | None:
        return self.headers.get(name)

    async def read_body(self, limit: int) -> bytes:
        if len(self.body) > limit:
            raise BodyTooLarge()
        return self.body

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.answer.append(body)
        for name, value in headers:
            if name == b"retry-after" and value.isdigit():
                self.retry_after = float(value)

    async def respond_page(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await self.respond(status, headers, body)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status

    async def write(self, data: bytes) -> None:
        self.answer.append(data)

    async def finish(self) -> None:
        pass

    def watch_disconnect(self, callback: Callable[[], None]) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._watch(callback))

    async def _watch(self, callback: Callable[[], None]) -> None:
        await asyncio.shield(self.gone)
        callback()


class LineCall(ProxyCall):
    """A line's call: the call path whole, except that it never waits in the queue (rule 2), and
    that the runner counts its lines at each box: `expected` at the box it will most likely go
    to from its start (so that the next line's look at the spare boxes sees it) until it is at
    one (`try_box`)."""

    __slots__ = ("spare", "expected")

    def __init__(self, app: CallHost, edge: LineEdge, spare: Spare, eligible: frozenset[str] | None,
                 expected: str | None) -> None:
        facade = mounts.main(edge.path)
        route, _ = facade.route("POST", edge.path)
        super().__init__(app, edge, facade, route)  # type: ignore[arg-type]
        self.spare = spare
        self.eligible = eligible  # the boxes with room for it (rule 1); the decision stays within them
        self.expected = expected
        if expected is not None:
            spare.expecting[expected] += 1

    def arrived(self) -> None:
        if self.expected is not None:
            self.spare.expecting[self.expected] -= 1
            self.expected = None

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            self.arrived()

    async def wait_turn(self, decision):
        self.load.release()
        await self.reply.error(503, NO_SPARE, "no box has a spare slot for this batch line now")
        return None

    def refused_by(self, box, refusal) -> None:
        """Refused before its first byte: it may fail over to any box with room for a line now."""
        super().refused_by(box, refusal)
        spare = self.spare.boxes(asyncio.get_running_loop().time())
        self.eligible = frozenset(name for name in spare if name not in self.tried)

    async def try_box(self, box):
        self.arrived()
        lines_at = self.spare.lines_at
        lines_at[box.name] += 1
        try:
            return await super().try_box(box)
        finally:
            lines_at[box.name] -= 1


class Spare:
    """Which boxes have room for a line now (rule 1)."""

    def __init__(self, host: CallHost, per_box: int) -> None:
        self.host = host
        self.per_box = per_box
        self.lines_at: collections.Counter[str] = collections.Counter()  # this router's lines at each box
        self.expecting: collections.Counter[str] = collections.Counter()  # lines started, not yet at a box
        self.peaks: dict[str, tuple[float, int]] = {}  # box -> (loop time, most interactive calls seen)

    def boxes(self, now: float) -> dict[str, int]:
        """The boxes with room for a line, by name: how many more lines each may start."""
        waited: set[str] = set()
        for waiter in self.host.admission.queue.waiting():
            waited |= waiter.boxes
        found = {}
        for facts in self.host.fleet.facts():
            if (room := self.room(facts, waited, now)) > 0:
                found[facts.id] = room
        return found

    def room(self, facts: BoxFacts, waited: set[str], now: float) -> int:
        if not facts.online or facts.blocked or facts.pressure >= 3 or facts.id in waited:
            return 0
        lines, coming = self.lines_at[facts.id], self.expecting[facts.id]
        if facts.max_inflight is None:
            return self.per_box - lines - coming
        interactive = max(facts.in_flight - lines, 0)
        seen_at, peak = self.peaks.get(facts.id, (now, 0))
        if interactive >= peak or now - seen_at > INTERACTIVE_MEMORY_S:
            self.peaks[facts.id] = (now, interactive)
            peak = interactive
        return facts.max_inflight - facts.in_flight - coming - HEADROOM - max(peak - interactive, 0)

    def for_line(self, edge: LineEdge, spare: dict[str, int]) -> tuple[frozenset[str] | None, str | None] | None:
        """(the boxes this line may go to, the one it is counted at until it gets there); (None,
        None): it goes as any call (no box may ever take it: the call answers why; while a box is
        offline or blocked, it waits for it instead: a fleet that is down fails no line); an alias's
        line goes within the spare boxes, its chain deciding; None: no box has room for it now.
        A line goes to the one box it is counted at: decided later, over boxes whose counts do not
        yet hold the lines started beside it, it would crowd onto one (bench/batch.py found half
        the lines elsewhere, and boxes filled past their headroom)."""
        if len(edge.body) > INLINE_INSPECT_BYTES:  # not scanned on the loop: its call decides among them
            return frozenset(spare), None
        facade = mounts.main(edge.path)
        route, _ = facade.route("POST", edge.path)
        try:
            call = read_call(edge.body, JSON_TYPE, route, facade, None, None, None, None).call
        except BadRequest:
            return None, None  # the call answers it (400), which is the line's answer
        fleet = self.host.fleet
        if fleet.aliases and call.model in fleet.aliases:
            return frozenset(spare), None
        decision = decide(call, fleet.facts())
        if decision.path is Path.REFUSED and not decision.waits_for:
            if any(reason.code in BACK_LATER for reason in decision.ruled_out.values()):
                return None  # a box that is down or blocked may serve it when it is back: the line waits
            return None, None
        for name in decision.boxes:  # the first the decision ranks that has room: the line goes there
            if name in spare:
                return frozenset((name,)), name
        return None


class BatchRunner:
    """Runs the store's live batches' lines on this router (rules 1-7). `clock` is the wall clock
    of the batches' times (a test moves it)."""

    def __init__(self, host: CallHost, store: BatchStore, instance: str, per_box: int, lease_s: float,
                 retention_s: float | None = None, stopping: asyncio.Event | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.host = host
        self.stopping = stopping if stopping is not None else asyncio.Event()  # the process's: set at SIGTERM
        self.lease_s = lease_s
        self.retention_s = retention_s
        self.store = store
        self.instance = instance
        # its leases' owner: the instance and this run, so that a run started again under the name
        # takes back what the killed one held (`reclaim`) and never renews it as its own
        self.router = f"{instance}#{os.urandom(4).hex()}"
        self.clock = clock
        self.spare = Spare(host, per_box)
        self.woken = asyncio.Event()
        # uploads and creates read and judge whole files (up to --batch-max-file-bytes, a copy or
        # two each): a few at once, so that many cannot hold the router's memory (batch_api.py)
        self.files_at_once = asyncio.Semaphore(FILES_AT_ONCE)
        self.running: dict[tuple[str, int], asyncio.Task] = {}  # (batch, line) -> its call's task
        self.ahead: dict[str, collections.deque[Line]] = {}  # batch -> lines leased, not yet started
        self.results: list[LineResult] = []  # ended lines not yet written
        self.turn = 0  # whose turn first (rule 4)
        self.blocked_until: dict[str, float] = {}  # batch -> loop time it may start lines again
        self.held_by: dict[str, str | None] = {}  # batch -> the code its last line put back waits on
        # this router's lines by STATE_OF_FATE, and `expired`/`cancelled` (/metrics)
        self.lines_total: collections.Counter[str] = collections.Counter()
        self.store_down = False
        self.task: asyncio.Task | None = None
        self.renewed_at = self.flushed_at = self.looked_at = 0.0
        self.pruned_at = -PRUNE_EVERY_S
        self.live: list[BatchRow] = []  # the in_progress batches as last looked at
        self.look_again = True  # look at the store's batches on the next pass
        self.drained: set[str] = set()  # batches with no line left to lease: one may be over

    # -- life ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Takes back what a killed run of this instance held, then runs."""
        await self.in_thread(self.store.reclaim, self.instance)
        self.task = asyncio.get_running_loop().create_task(self.run(), name="batches")

    def wake(self) -> None:
        """A batch was made or cancelled here: look at once."""
        self.look_again = True
        self.woken.set()

    async def stop(self) -> None:
        """Stops starting lines; the running ones end as their client left (their lease runs out
        and another router, or this one restarted, runs them again); written what ended."""
        if self.task is not None:
            self.task.cancel()
        for task in list(self.running.values()):
            task.cancel()
        if self.running:
            await asyncio.gather(*self.running.values(), return_exceptions=True)
        try:
            await self.flush()
            await self.release_ahead(list(self.ahead))
        except self.store.errors as exc:  # their leases run out, and the lines run again (rule 5)
            log.warning("batches: %d ended lines not written at stop (%s)", len(self.results), type(exc).__name__)

    @property
    def inflight(self) -> int:
        return len(self.running)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.one_pass(loop)
                if self.store_down:
                    log.info("batches: the store answers again")
                self.store_down = False
            except self.store.errors as exc:
                if not self.store_down:
                    log.warning("batches: the store failed (%s); trying again", type(exc).__name__)
                self.store_down = True
            self.woken.clear()
            try:
                await asyncio.wait_for(self.woken.wait(), PASS_S)
            except asyncio.TimeoutError:
                pass

    async def in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- a pass --------------------------------------------------------------------------------
    async def one_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        """Writes what ended (at most FLUSH_EVERY_S late), looks at the live batches (at most
        LOOK_EVERY_S apart, at once when told or when one may be over) and ends those due, then
        starts lines."""
        now, t = self.clock(), loop.time()
        if self.results and (t - self.flushed_at >= FLUSH_EVERY_S or self.look_again):
            self.flushed_at = t
            await self.flush()
        if (self.running or self.results or self.ahead) and t - self.renewed_at > self.lease_s / RENEWALS_PER_LEASE:
            self.renewed_at = t
            held = [*self.running, *((result.batch_id, result.line_no) for result in self.results),
                    *((batch_id, line.line_no) for batch_id, lines in self.ahead.items() for line in lines)]
            await self.in_thread(self.store.renew, self.router, now + self.lease_s, held)
        if self.retention_s is not None and t - self.pruned_at >= PRUNE_EVERY_S:
            self.pruned_at = t
            await self.in_thread(self.store.prune, now - self.retention_s)
        if self.look_again or t - self.looked_at >= LOOK_EVERY_S:
            self.look_again, self.looked_at = False, t
            await self.look(now)
        if any(now >= batch.expires_at for batch in self.live):
            self.look_again = True  # its end is due: the next pass ends it
        startable = [batch for batch in self.live
                     if self.blocked_until.get(batch.id, 0.0) <= t and now < batch.expires_at]
        if startable and not self.stopping.is_set():  # a router stopping starts no line
            await self.start_lines(startable, loop)

    async def look(self, now: float) -> None:
        """The live batches from the store, those due ended (rule 6): `live` keeps those that
        start lines."""
        live = []
        found = await self.in_thread(self.store.live)
        kept = set(self.ahead) | set(self.blocked_until) | set(self.held_by) | self.drained
        await self.forget(kept - {batch.id for batch in found})  # ended elsewhere (another router, the CLI)
        for batch in found:
            try:  # one batch the store fails on (its output too large to write) holds up no other
                if await self.ended(batch, now):
                    continue
                if batch.owner != INSIDE and self.host.tenancy.keys.ended(batch.owner, now):
                    await self.release_ahead((batch.id,))
                    self.lines_total["failed"] += await self.in_thread(
                        self.store.end_unrun, batch.id, {}, "invalid_api_key",
                        "the key that made this batch was revoked or has expired", now)
                    continue
            except self.store.errors as exc:
                log.warning("batches: batch %s: the store failed (%s)", batch.id, type(exc).__name__)
                continue
            if batch.status == "in_progress":
                live.append(batch)
        self.live = live

    async def ended(self, batch: BatchRow, now: float) -> bool:
        """Ends `batch` where it is due (rule 6); True when it starts no line this pass."""
        status = batch.status
        if status != "in_progress" or now >= batch.expires_at:
            await self.release_ahead((batch.id,))
        if status == "in_progress" and now >= batch.expires_at:
            # what held the batch held its lines not yet tried too: a spent budget ends them all so
            held = "budget_exceeded" if self.held_by.get(batch.id) == "budget_exceeded" else "batch_expired"
            self.lines_total["expired"] += await self.in_thread(
                self.store.end_unrun, batch.id, EXPIRED_CODES, held,
                "the batch's completion window ended before this line ran", now)
            return await self.finished(batch, "expired", now)
        if status == "cancelling":
            self.lines_total["cancelled"] += await self.in_thread(
                self.store.end_unrun, batch.id, {}, "batch_cancelled", "the batch was cancelled before this line ran",
                now)
            return await self.finished(batch, "cancelled", now)
        if status == "finalizing" or (status == "in_progress" and batch.completed + batch.failed >= batch.total):
            return await self.finished(batch, "completed", now)
        return False

    async def finished(self, batch: BatchRow, status: str, now: float) -> bool:
        """Finalizes `batch` as `status` once none of its lines is pending or running anywhere."""
        pending, running = await self.in_thread(self.store.unfinished, batch.id)
        if pending or running:
            return True
        row = await self.in_thread(self.store.finalize, batch.id, status, now)
        if row is not None and row.status == status:
            log.info("batch %s %s: %d lines, %d completed, %d failed", batch.id, status, row.total,
                     row.completed, row.failed)
        await self.forget((batch.id,))
        return True

    async def start_lines(self, startable: list[BatchRow], loop: asyncio.AbstractEventLoop) -> None:
        """Lines onto the spare boxes, one per owner per turn (rule 4), until no box has room."""
        by_owner: dict[str, list[BatchRow]] = {}
        for batch in startable:
            by_owner.setdefault(batch.owner, []).append(batch)
        owners = sorted(by_owner)
        self.turn = (self.turn + 1) % len(owners)
        owners = owners[self.turn:] + owners[:self.turn]
        leased_now: set[str] = set()
        while owners:
            for owner in list(owners):
                spare = self.spare.boxes(loop.time())
                if not spare:
                    owners.clear()
                    break
                batches = by_owner[owner]
                batch = batches[0]
                queue = self.ahead.get(batch.id)
                if not queue and batch.id not in leased_now:
                    leased_now.add(batch.id)
                    now = self.clock()
                    lines = await self.in_thread(self.store.lease, batch.id, self.router, LEASE_AHEAD,
                                                 now + self.lease_s, now)
                    if not lines:
                        self.drained.add(batch.id)  # none left to lease: it may be over once its lines end
                    queue = self.ahead[batch.id] = collections.deque(lines)
                if not queue:
                    batches.pop(0)
                    if not batches:
                        owners.remove(owner)
                    continue
                line = queue[0]
                if (batch.id, line.line_no) in self.running:  # its lease lapsed while it ran here
                    queue.popleft()
                    continue
                edge = LineEdge(batch, line)
                where = self.spare.for_line(edge, spare)
                if where is None:  # no room for this batch's next line: it waits a pass
                    owners.remove(owner)
                    continue
                queue.popleft()
                self.launch(batch, line, edge, *where)

    async def forget(self, batch_ids) -> None:
        """What this router kept about batches that ended, here or elsewhere: their lines held
        ahead back to the store, their waits and marks dropped (so that none grows with the
        batches a router has seen)."""
        await self.release_ahead(batch_ids)
        for batch_id in batch_ids:
            self.blocked_until.pop(batch_id, None)
            self.held_by.pop(batch_id, None)
            self.drained.discard(batch_id)

    async def release_ahead(self, batch_ids) -> None:
        """The lines leased ahead for `batch_ids` go back to the store as they were: a batch that
        ends ends them there (rule 6), a router that stops leaves them to others at once."""
        lines = [(batch_id, line.line_no) for batch_id in batch_ids for line in self.ahead.pop(batch_id, ())]
        if lines:
            await self.in_thread(self.store.release, self.router, lines)

    def launch(self, batch: BatchRow, line: Line, edge: LineEdge, eligible: frozenset[str] | None,
               expected: str | None) -> None:
        call = LineCall(self.host, edge, self.spare, eligible, expected)
        task = asyncio.get_running_loop().create_task(self.run_line(batch, line, edge, call))
        self.running[(batch.id, line.line_no)] = task

    async def run_line(self, batch: BatchRow, line: Line, edge: LineEdge, call: LineCall) -> None:
        try:
            await call.run()
        except asyncio.CancelledError:
            edge.gone.cancel()
            return  # the router stops: the line's lease runs out, and it runs again
        except Exception:  # the box cut a relayed answer (RelayAborted), or a bug: the line runs again
            edge.status, edge.answer = 502, [CUT_ANSWER]
        finally:
            self.running.pop((batch.id, line.line_no), None)
            if batch.id in self.drained:  # maybe its last line: look whether the batch is over
                self.look_again = True
            self.woken.set()
        body = b"".join(edge.answer)
        code = None if 200 <= edge.status < 300 else error_code(body)
        line_fate = fate(edge.status, code, line.attempts)
        self.lines_total[STATE_OF_FATE[line_fate]] += 1
        if line_fate is Fate.WAIT or line_fate is Fate.RETRY:
            retry_s = 0.0 if line_fate is Fate.RETRY else edge.retry_after or PASS_S
            self.blocked_until[batch.id] = asyncio.get_running_loop().time() + retry_s
            self.held_by[batch.id] = code
            await self.put_back(batch, line, self.clock() + retry_s, code, line_fate is Fate.RETRY)
            return
        tokens = call.record.tokens
        self.results.append(LineResult(
            batch.id, line.line_no, line_fate.value, answer_line(line.custom_id, edge.status, call.call_id, body),
            tokens.prompt if tokens else 0, tokens.completion if tokens else 0, tokens.cached if tokens else 0,
        ))

    async def put_back(self, batch: BatchRow, line: Line, not_before: float, code: str | None, attempt: bool) -> None:
        try:
            await self.in_thread(self.store.put_back, self.router, batch.id, line.line_no, not_before, code, attempt)
        except self.store.errors:
            pass  # its lease runs out, and it runs again (rule 5)

    async def flush(self) -> None:
        """Writes the ended lines' results, in one transaction."""
        if self.results:
            results, self.results = self.results, []
            try:
                await self.in_thread(self.store.finish, self.router, results, self.clock())
            except self.store.errors:
                self.results[:0] = results  # written next pass, while the leases last
                raise


def error_code(body: bytes) -> str | None:
    """The `code` of an answer in OpenAI's error shape, else None."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None
