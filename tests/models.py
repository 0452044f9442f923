"""Plain models: the executable spec of the compiled hot path and of the decision.

Nothing here is collected as a test. Each model states its rules in the most obvious Python
it can (dicts, lists, a loop and a sort); the property tests run the real thing and the model
side by side and require equal answers.

1. `ReservationModel`: the reservation table of `router._fastpath.Reservations`
   (rules 1a-1d of its module docstring), as a dict token -> [box, generation, live].
2. `FrameScannerModel`: `router._fastpath.FrameScanner` (rule 2), line by line.
3. `reference_decide`: `router.core.decide` (its docstring rules 1-4), written without its
   helper functions.
4. `WaitQueueModel`: `router.core.admission.WaitQueue` (rules 2-6), a flat list with turn stamps.
5. `RelayModel`: `router._fastpath.Relay` (rule 4), the stream kept whole as bytes.
6. `KeyLimitsModel`: `router.core.limits` (its rules 1-8), one key's requests and tokens as
   lists of (when, amount) charges, each fading out linearly over a minute.
7. `prefix_chain_model`: `router._fastpath.prefix_chain` (rule 6), elements found by the stdlib
   JSON decoder and hashed with Python ints.
8. `reference_place`: `router.core.affinity.place` (rules 4-6), a filter and a min over the ranking.
9. `AffinityIndexModel`: `router._fastpath.AffinityIndex` (router.core.affinity rules 3, 7, 8): an
   OrderedDict walked and written element by element.
10. `HistogramModel`: `router._fastpath.Histogram`, bisect over the bounds.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

from router._fastpath import FIRST_CLEAN, FIRST_SUSPECT, HOLD, NDJSON, SSE, TOO_BIG
from router.core.kinds import call_key
from router.core.pairs import Fit, blocked_by, contract
from router.core.types import BoxFacts, BoxKind, Call, ReasonCode, Tier

__all__ = [
    "prefix_chain_model",
    "reference_place",
    "AffinityIndexModel",
    "ReservationModel",
    "FrameScannerModel",
    "RefDecision",
    "reference_decide",
    "reference_gate",
    "GATE_ORDER",
    "WaitQueueModel",
    "RelayModel",
    "KeyLimitsModel",
]


# --------------------------------------------------------------------------------------------
# 1. Reservations
# --------------------------------------------------------------------------------------------


class ReservationModel:
    """token -> [box, generation, live]; a reservation counts while it is live.

    a. reserve(box, g): g below the floor is a misuse (ValueError); else a new live entry.
    b. release(token): a live entry stops counting once (True); anything else is ignored (False).
    c. move(token, box, g): a live entry changes box and keeps its token and stamp; a stale or
       unknown token becomes a fresh reservation on `box` at g (a new token).
    d. supersede(g): every live entry stamped below g stops counting; the floor rises to g
       (it never falls). Returns how many stopped counting.
    """

    def __init__(self) -> None:
        self.table: dict[int, list] = {}
        self.floor = 0
        self._next = 1

    def reserve(self, box: int, generation: int) -> int:
        if box < 0:
            raise ValueError("box index must be >= 0")
        if generation < self.floor:
            raise ValueError("generation below the supersede floor")
        token = self._next
        self._next += 1
        self.table[token] = [box, generation, True]
        return token

    def release(self, token: int) -> bool:
        entry = self.table.get(token)
        if entry is None or not entry[2]:
            return False
        entry[2] = False
        return True

    def move(self, token: int, box: int, generation: int) -> int:
        entry = self.table.get(token)
        if entry is None or not entry[2]:
            return self.reserve(box, generation)
        if box < 0:
            raise ValueError("box index must be >= 0")
        entry[0] = box
        return token

    def supersede(self, generation: int) -> int:
        dropped = 0
        for entry in self.table.values():
            if entry[2] and entry[1] < generation:
                entry[2] = False
                dropped += 1
        self.floor = max(self.floor, generation)
        return dropped

    def is_live(self, token: int) -> bool:
        entry = self.table.get(token)
        return entry is not None and entry[2]

    def count(self, box: int) -> int:
        return sum(1 for b, _, live in self.table.values() if live and b == box)

    @property
    def live(self) -> int:
        return sum(1 for _, _, live in self.table.values() if live)


# --------------------------------------------------------------------------------------------
# 2. Frame scanner
# --------------------------------------------------------------------------------------------


class FrameScannerModel:
    """Line by line: a line ends at LF; its content is what precedes the LF, less one CR.

    SSE: a frame is a block of non-empty lines closed by an empty line (empty lines with no
    block open close nothing). NDJSON: every non-empty line is a frame.
    Until the first *data* frame every chunk is held. SSE: the first closed block with at least
    one `data:` line is the data frame (its value: the `data:` lines less the field name and
    one optional space, joined by LF); comment or event-only blocks close but keep holding.
    NDJSON: the first frame is the data frame (its value: the line, stripped).
    The chunk that closes it answers FIRST_SUSPECT when the value contains b"error", else
    FIRST_CLEAN; after it, `feed` is a misuse (ValueError): later chunks are `keep`'s, which only
    the relay's tail reads. A chunk that leaves the hold open with more than `hold_limit` bytes
    seen answers TOO_BIG, otherwise HOLD.
    `first_end` is the byte offset just after the LF that closed the data frame.
    """

    def __init__(self, framing: int, hold_limit: int = 1 << 20) -> None:
        if framing not in (SSE, NDJSON):
            raise ValueError("framing must be SSE or NDJSON")
        self.framing = framing
        self.hold_limit = hold_limit
        self.bytes_in = 0
        self.relaying = False
        self.first_data: bytes | None = None
        self.first_end: int | None = None
        self._line = b""  # the open line so far
        self._block: list[bytes] = []  # SSE: the non-empty lines of the open block
        self._held: list[bytes] = []

    def feed(self, chunk: bytes) -> int:
        if self.relaying:
            raise ValueError("the first frame is judged: keep() the rest")
        self._held.append(chunk)
        verdict = None
        offset = self.bytes_in
        self.bytes_in += len(chunk)
        pieces = chunk.split(b"\n")
        for piece in pieces[:-1]:
            offset += len(piece) + 1
            line = self._line + piece
            self._line = b""
            if line.endswith(b"\r"):
                line = line[:-1]
            found = self._end_of_line(line, offset)
            if found is not None and verdict is None:
                verdict = found
        self._line += pieces[-1]
        if verdict is not None:
            self.relaying = True
            return verdict
        if self.bytes_in > self.hold_limit:
            return TOO_BIG
        return HOLD

    def _end_of_line(self, line: bytes, end: int) -> int | None:
        """Handles one complete line; returns a verdict when it closes the first data frame."""
        if self.framing == NDJSON:
            if not line:
                return None
            if self.first_data is None:
                return self._first(line.strip(), end)
            return None
        if line:
            self._block.append(line)
            return None
        if not self._block:
            return None
        block, self._block = self._block, []
        if self.first_data is not None:
            return None
        values = []
        for item in block:
            if item.startswith(b"data:"):
                value = item[len(b"data:") :]
                if value.startswith(b" "):
                    value = value[1:]
                values.append(value)
        if not values:
            return None  # a comment or event-only block keeps holding
        return self._first(b"\n".join(values), end)

    def _first(self, value: bytes, end: int) -> int:
        self.first_data = value
        self.first_end = end
        return FIRST_SUSPECT if b"error" in value else FIRST_CLEAN

    def keep(self, chunk: bytes) -> None:
        """After the first frame: nothing of a chunk is scanned (the relay's tail: RelayModel)."""

    def take_held(self) -> list[bytes]:
        held, self._held = self._held, []
        return held


# --------------------------------------------------------------------------------------------
# 3. The decision
# --------------------------------------------------------------------------------------------

# The gate, in precedence order (decide.py rule 1; `eligible` is checked right after `tried`,
# which is where decide.py's why_not puts it).
GATE_ORDER = (
    ReasonCode.NOT_PINNED,
    ReasonCode.KIND_NOT_SERVED,
    ReasonCode.BAD_MODEL_NAME,
    ReasonCode.OFFLINE,
    ReasonCode.OTHER_POOL,
    ReasonCode.BLOCKED,
    ReasonCode.BLOCKED_PAIR,
    ReasonCode.ALREADY_TRIED,
    ReasonCode.NOT_ELIGIBLE,
    ReasonCode.NO_MODEL,
    ReasonCode.DOES_NOT_FIT,
    ReasonCode.COOLING,
    ReasonCode.FULL,
)


@dataclass
class RefDecision:
    path: str  # "pinned" | "ranked" | "refused"
    boxes: tuple[str, ...]
    tiers: dict[str, Tier] = field(default_factory=dict)
    ruled_out: dict[str, ReasonCode] = field(default_factory=dict)


def reference_gate(
    call: Call, box: BoxFacts, tried: frozenset[str], eligible: frozenset[str] | None
) -> ReasonCode | None:
    """Every failing gate of `box`, checked in GATE_ORDER; the first one wins."""
    named = call_key(box.kind, call.model, call.settings)
    failing = {
        ReasonCode.NOT_PINNED: call.pin is not None and call.pin != box.id,
        ReasonCode.KIND_NOT_SERVED: box.kind not in call.kinds,
        ReasonCode.BAD_MODEL_NAME: named is None,
        ReasonCode.OFFLINE: not box.online,
        # no pool only with no pool, a pool only with that pool; a pin without a pool reaches
        # its box in any pool
        ReasonCode.OTHER_POOL: (box.pool or None) != (call.pool or None)
        and not (call.pin is not None and not call.pool),
        ReasonCode.BLOCKED: box.blocked,
        # the box's own pair settings (or its blanket) block the model; a pin cannot pass it
        ReasonCode.BLOCKED_PAIR: named is not None and blocked_by(box.pairs, named[0]) is not None,
        ReasonCode.ALREADY_TRIED: box.id in tried,
        ReasonCode.NOT_ELIGIBLE: eligible is not None and box.id not in eligible,
        ReasonCode.NO_MODEL: named is None
        or (named[0] not in box.residents and named[0] not in box.catalog),
        # verdicts: fits nowhere, not resident, and never against a pin
        ReasonCode.DOES_NOT_FIT: named is not None and call.pin is None
        and box.fits.get(named[0]) is Fit.NONE and named[0] not in box.residents,
        ReasonCode.COOLING: named is not None and named[0] in box.cooling
        and box.in_flight >= box.cooling[named[0]],
        ReasonCode.FULL: box.max_inflight is not None and box.in_flight >= box.max_inflight,
    }
    for code in GATE_ORDER:
        if failing[code]:
            return code
    return None


def reference_decide(
    call: Call,
    boxes: list[BoxFacts],
    tried=(),
    eligible: frozenset[str] | None = None,
) -> RefDecision:
    """The contract, literally: gate each box, split the rest into tiers, sort each tier by
    (pending + pressure + reservations + recent refusals, pressure, tie-break, boxes-file order, id), SERVING
    first. Tie-breaks: SERVING idle before busy, then the largest last_used_s; LOAD the verdicts'
    fit (GPU, unknown or none read, RAM only), the most free GPU bytes (unknown = 0), then the
    smallest last_picked_s. A hugpy box compares load contracts (pairs.contract, the call's
    body knobs included), others the settings sent."""
    tried = frozenset(tried)
    ruled_out: dict[str, ReasonCode] = {}
    serving: list[tuple] = []
    load: list[tuple] = []
    for box in boxes:
        code = reference_gate(call, box, tried, eligible)
        if code is not None:
            ruled_out[box.id] = code
            continue
        key, settings = call_key(box.kind, call.model, call.settings)
        resident = box.residents.get(key)
        carried = box.pending + box.pressure + box.reservations + box.recent_refusals
        sent = box.contracts.get(key)  # absent = default settings (None)
        if box.kind is BoxKind.HUGPY:
            settings = contract(box.pairs, key, settings, call.knobs)
        if (
            resident is not None
            and resident.healthy
            and not resident.loading
            and sent == settings
        ):
            busy = 1 if resident.busy else 0
            serving.append(
                (carried, box.pressure, busy, -resident.last_used_s, box.order, box.id)
            )
        else:
            free = box.free_gpu_bytes if box.free_gpu_bytes is not None else 0
            fit = {Fit.GPU: 0, Fit.RAM: 2}.get(box.fits.get(key), 1)
            load.append((carried, box.pressure, fit, -free, box.last_picked_s, box.order, box.id))
    known = [box.id for box in boxes]
    if call.pin is not None and call.pin not in known:
        ruled_out[call.pin] = ReasonCode.UNKNOWN_BOX
    serving.sort()
    load.sort()
    ranked = tuple(row[-1] for row in serving) + tuple(row[-1] for row in load)
    tiers = {row[-1]: Tier.SERVING for row in serving}
    tiers.update({row[-1]: Tier.LOAD for row in load})
    if not ranked:
        return RefDecision("refused", (), {}, ruled_out)
    return RefDecision("pinned" if call.pin is not None else "ranked", ranked, tiers, ruled_out)


# --------------------------------------------------------------------------------------------
# 4. The wait queue
# --------------------------------------------------------------------------------------------


class WaitQueueModel:
    """`router.core.admission.WaitQueue` (its rules 2-6) as a flat list and turn stamps.

    A caller's turn stamp is when it joined its class (nothing of its waiting there before) or
    was last served there; the next waiter for a box is, among the waiters the box may serve:
    the lowest class value, then the caller with the oldest stamp, then the oldest arrival.
    """

    def __init__(self, capacity: int, per_caller: int) -> None:
        self.capacity = capacity
        self.per_caller = per_caller
        self.waiting: list[tuple[int, str, int, frozenset[str]]] = []  # (seq, caller, class, boxes)
        self.stamps: dict[tuple[int, str], int] = {}
        self.clock = 0
        self.seq = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def push(self, caller: str, priority: int, boxes: frozenset[str]) -> int | None:
        if len(self.waiting) >= self.capacity:
            return None
        if sum(1 for w in self.waiting if w[1] == caller) >= self.per_caller:
            return None
        if not any(w[1] == caller and w[2] == priority for w in self.waiting):
            self.stamps[(priority, caller)] = self._tick()
        seq = self.seq
        self.seq += 1
        self.waiting.append((seq, caller, priority, boxes))
        return seq

    def remove(self, seq: int) -> bool:
        for w in self.waiting:
            if w[0] == seq:
                self.waiting.remove(w)
                return True
        return False

    def next_for(self, box: str, fits) -> int | None:
        candidates = [w for w in self.waiting if box in w[3] and fits(w[0])]
        if not candidates:
            return None
        best = min(candidates, key=lambda w: (w[2], self.stamps[(w[2], w[1])], w[0]))
        self.waiting.remove(best)
        if any(w[1] == best[1] and w[2] == best[2] for w in self.waiting):
            self.stamps[(best[2], best[1])] = self._tick()
        return best[0]


# --------------------------------------------------------------------------------------------
# 5. The relay
# --------------------------------------------------------------------------------------------


class RelayModel:
    """`router._fastpath.Relay`, the stream kept whole: `framing` is its scanner's (None: no
    scanner), `seen` the bytes that scanner took before the relay (the head, `first`).

    run: `first` is written if non-empty; then each batch `next_chunks` returns (`[]` ends it)
    joins the stream and is written joined, one write per batch with any bytes in it.
    bytes_out: the bytes handed to `write` (a write that raised included).
    delivered: SSE only; set for good just before a write when the stream so far is complete.
    last, data: the last two writes, oldest first; `data` is set before its write.
    complete(): SSE only; the stream's last 32 bytes (the scanner's tail), trailing whitespace
    stripped, end with `data: [DONE]`. Any other answer is complete.
    """

    def __init__(self, framing: int | None = None, seen: bytes = b"") -> None:
        self.sse = framing == SSE
        self.stream = seen
        self.bytes_out = 0
        self.delivered = False
        self.last = b""
        self.data = b""

    def complete(self) -> bool:
        return not self.sse or self.stream[-32:].rstrip(b" \t\r\n").endswith(b"data: [DONE]")

    async def run(self, first: bytes, write, next_chunks) -> None:
        batch = [first]
        while True:
            data = b"".join(batch)
            if data:
                self.last, self.data = self.data, data
                self.bytes_out += len(data)
                self.delivered = self.delivered or (self.sse and self.complete())
                await write(data)
            batch = await next_chunks()
            if not batch:
                return
            self.stream += b"".join(batch)


# -- 6. prefix_chain ------------------------------------------------------------------------------

_M64 = (1 << 64) - 1
_P1, _P2, _MARK = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x5BD1E9955BD1E995
CHAIN_MAX, CHAIN_BLOCK, CHAIN_EDGE = 256, 1024, 256


def _fold_model(a: int, b: int) -> int:
    product = a * b
    return (product & _M64) ^ (product >> 64)


def _mix_model(h: int, data: bytes) -> int:
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]  # the last padded with 0
    whole = len(data) // 32 * 4
    a, b = h ^ _MARK, (h + _P2) & _M64
    for k in range(0, whole, 4):
        a = _fold_model(words[k] ^ a, words[k + 1] ^ _P1)
        b = _fold_model(words[k + 2] ^ b, words[k + 3] ^ _P2)
    h = _fold_model(a ^ _P2, b ^ _P1)
    rest, k = len(data) - whole * 8, whole
    if rest >= 16:
        h, rest, k = _fold_model(words[k] ^ h, words[k + 1] ^ _P1), rest - 16, k + 2
    if rest >= 8:
        h, rest, k = _fold_model(words[k] ^ h, _P2), rest - 8, k + 1
    if rest:
        h = _fold_model(words[k] ^ h, _P1)
    return _fold_model(h ^ len(data), _P2)


def prefix_chain_model(value: bytes, seed: int) -> tuple[int, ...]:
    """One hash per array element (its raw bytes, outer whitespace left out) or per CHAIN_BLOCK
    bytes of a string's raw content, an element longer than 2 * CHAIN_EDGE by its two edges and
    its length; chained from `seed`."""
    import json

    text = value.decode()
    if text[0] == "[":
        decoder = json.JSONDecoder()
        spans, i = [], 1
        while True:
            while text[i] in " \t\r\n":
                i += 1
            if text[i] == "]" or len(spans) == CHAIN_MAX:
                break
            _, end = decoder.raw_decode(text, i)
            spans.append(text[i:end].encode())
            i = end
            while text[i] in " \t\r\n":
                i += 1
            if text[i] == ",":
                i += 1
    elif text[0] == '"':
        raw = value[1:-1]
        spans = [raw[i:i + CHAIN_BLOCK] for i in range(0, len(raw), CHAIN_BLOCK)][:CHAIN_MAX]
    else:
        spans = []
    chain, h = [], seed
    for span in spans:
        if len(span) <= 2 * CHAIN_EDGE:
            h = _mix_model(h, span)
        else:  # a long element: its first and last CHAIN_EDGE bytes and its length
            h = _mix_model(_mix_model(h, span[:CHAIN_EDGE]) ^ len(span), span[-CHAIN_EDGE:])
        chain.append((h & ((1 << 62) - 1)) | 1)
    return tuple(chain)


# -- 7. place -------------------------------------------------------------------------------------


def reference_place(ranked: list, pull, keyed: bool, absolute: float, relative: float, spin: int) -> list:
    """Affinity's rules 4-6 literally: nothing when off or when the best box is not serving; else
    the pulled box first if it serves within best + absolute + relative * best; else, with a key,
    the spin-th of the serving boxes tied with the best on (load, pressure)."""
    if (absolute <= 0 and relative <= 0) or not ranked or ranked[0][0][0] != 0:
        return ranked
    serving = [entry for entry in ranked if entry[0][0] == 0]
    best = serving[0][0][1]
    if pull is not None:
        for entry in serving:
            if entry[1] == pull[0] and entry[0][1] <= best + absolute + relative * best:
                return [entry] + [e for e in ranked if e is not entry]
    if not keyed:
        return ranked
    tied = [entry for entry in serving if entry[0][1:3] == serving[0][0][1:3]]
    chosen = tied[spin % len(tied)]
    return [chosen] + [e for e in ranked if e is not chosen]


# -- 8. the affinity index ------------------------------------------------------------------------


class AffinityIndexModel:
    """One OrderedDict of at most `capacity` entries, oldest first: a key's hash -> box (a binding),
    a chain hash -> (box, model key, epoch, state) (a node; state: the next element's hash, 0 for
    none yet, -1 once two prompts continued it differently). `pull` walks the chain from its
    deepest element: the first node found decides (depth >= 2, not shared, of the box's current
    epoch); `learn` writes the nodes from depth max(2, known) on; every read that finds and every
    write makes its entry the newest."""

    SHARED = -1
    MIN_DEPTH = 2
    BOUND = 1 << 30

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self.entries: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def pull(self, key, boxes):
        bound, chain = key[1], key[2]
        if not chain:
            if bound not in self.entries:
                return None
            self.entries.move_to_end(bound)
            return (self.entries[bound], self.BOUND)
        for depth in range(len(chain), self.MIN_DEPTH - 1, -1):
            node = self.entries.get(chain[depth - 1])
            if node is None:
                continue
            box, model_key, at, state = node
            if state == self.SHARED or box not in boxes or boxes[box].cache_epoch(model_key) != at:
                return None
            self.entries.move_to_end(chain[depth - 1])
            return (box, depth)
        return None

    def learn(self, key, box, model_key, epoch, known=0) -> None:
        bound, chain = key[1], key[2]
        if not chain:
            self.bind(bound, box)
            return
        for index in range(max(self.MIN_DEPTH, known) - 1, len(chain)):
            following = chain[index + 1] if index + 1 < len(chain) else 0
            old = self.entries.get(chain[index])
            state = following
            if old is not None:
                seen = old[3]
                if seen == self.SHARED or (seen and following and seen != following):
                    state = self.SHARED
                elif not following:
                    state = seen
            self.entries[chain[index]] = (box, model_key, epoch, state)
            self.entries.move_to_end(chain[index])
        self._trim()

    def bind(self, bound, box) -> None:
        self.entries[bound] = box
        self.entries.move_to_end(bound)
        self._trim()

    def _trim(self) -> None:
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
# --------------------------------------------------------------------------------------------
# 6. Key limits
# --------------------------------------------------------------------------------------------


class KeyLimitsModel:
    """One key's limits, kept as plainly as possible.

    - rpm and tpm: what is drawn is the sum of the charges, each charge fading out linearly at
      limit/60 a second (the whole sum drains at that rate and never below zero; a charge can be
      negative: a settlement giving back part of a reservation).
    - admit: models, then budget (used + reserved < budget), then rpm (drawn + 1 <= rpm), then
      tpm (drawn < tpm); refused: nothing changes. Admitted: rpm +1, tpm +tokens, reserved +tokens.
    - settle: tpm + (used - reserved) (never below zero), reserved - r, used + u in the period.
    - a budget period is the UTC day, Monday-start week or month holding `now`; used restarts at 0
      in a new one.
    """

    def __init__(self, limits) -> None:
        self.limits = limits
        self.req = 0.0
        self.tok = 0.0
        self.at = None
        self.period = None
        self.used = 0
        self.reserved = 0

    def _drain(self, now: float) -> None:
        import datetime as dt

        if self.at is not None and now > self.at:
            if self.limits.rpm:
                self.req = max(0.0, self.req - (now - self.at) * self.limits.rpm / 60)
            if self.limits.tpm:
                self.tok = max(0.0, self.tok - (now - self.at) * self.limits.tpm / 60)
        if self.at is None or now > self.at:
            self.at = now
        if self.limits.budget_tokens is not None:
            day = dt.datetime.fromtimestamp(now, dt.timezone.utc).date()
            period = {"day": day, "week": day - dt.timedelta(days=day.weekday()),
                      "month": day.replace(day=1)}[self.limits.budget_period]
            if period != self.period:
                self.period, self.used = period, 0

    def admit(self, model: str, tokens: int, now: float) -> str | None:
        lim = self.limits
        if lim.models is not None and model not in lim.models:
            return "model_not_allowed"
        self._drain(now)
        if lim.budget_tokens is not None and self.used + self.reserved >= lim.budget_tokens:
            return "budget_exceeded"
        if lim.rpm is not None and self.req + 1 > lim.rpm:
            return "rate_limited"
        if lim.tpm is not None and self.tok >= lim.tpm:
            return "rate_limited"
        self.req += 1
        self.tok += tokens
        self.reserved += tokens
        return None

    def settle(self, reserved: int, used: int, now: float) -> None:
        self._drain(now)
        self.tok = max(0.0, self.tok + used - reserved)
        self.reserved -= reserved
        self.used += used


class HistogramModel:
    """A metric's bucket counts (router/_fastpath_histogram.pxi): an observation counts in the
    first bucket whose bound it does not pass (bisect_left), else in the last, +Inf one."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1
