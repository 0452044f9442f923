"""Choosing a box: gate → pin → tiers → rank. Pure; the same facts always give the same order.

The contract (DESIGN.md "Choosing a box"; a test pins each line):
1. Gate. `why_not` returns the first disqualifying reason, in this order: pinned elsewhere,
   kind not served by the facade, name invalid under the box kind's rule, offline, other pool,
   blocked, already tried for this call, model not advertised (neither resident nor in the
   catalog), cooling for this model (it refused to place it lately with this many calls in
   flight or fewer: admission rule 7), full (at its in-flight limit, admission rule 1). A call
   whose boxes are ruled out only for the last two waits for room. Pools (hugpy-router's seed: "eligible: ... the
   call's pool"): a call without a pool goes only to boxes without a pool, a call with a pool
   only to that pool's boxes, and a pin without a pool reaches the pinned box whatever its pool.
   An empty pool is no pool. Failover passes `eligible` (the first decision's ranked set) so
   that a retry never broadens past it. `offline` and `no_model` carry the box's `down` (why
   its link fails: connection refused, TLS, a refused key ...) when there is one.
   Blocked also covers a hugpy box's own pair settings (`blocked_pair`, router.core.pairs rule
   5), right after the operator's block; a pin cannot pass it. `does_not_fit` comes right after
   the model check: the box's verdicts say the model fits in no placement mode and it is not
   resident (a resident fits by definition); a pin never meets it (verdicts never override one).
2. Pin. A pinned call ranks only the pinned box, and only if it passes the gate; otherwise the
   decision is REFUSED with that box's reason. A pin is never rerouted (the proxy does not fail
   over a pinned call).
3. Tiers. SERVING: the model is resident, healthy, not loading, and the settings the call asks
   for equal the settings this router last sent that box for that model (unknown = default);
   on a hugpy box both sides are load contracts (blanket ⊕ pair ⊕ the call's body knobs and
   options: router.core.pairs rule 4), so a pair-settings write after the load, or a call
   whose knobs differ from those the seat was loaded under, makes it a LOAD.
   Every other eligible box is LOAD (catalog, or resident under other settings).
4. Rank inside a tier, ascending by `rank_key`'s tuple:
   load (pending + pressure + reservations + recent placement refusals), then pressure, then
   the tier's tie-break (SERVING: idle before busy, most recently used; LOAD: the verdicts' fit
   (GPU, unknown, RAM only), most free GPU memory, least recently picked), then the stable id
   (position in the boxes file, then name). SERVING before LOAD.
   Affinity (router.core.affinity) may then move one serving box to the front, within its slack.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from router.core.admission import is_full
from router.core.affinity import Steer, place
from router.core.kinds import CALL_KEYS, Capability, call_key, kinds_that
from router.core.pairs import EMPTY, Fit, blocked_by, contract
from router.core.types import (
    BoxFacts,
    Call,
    Decision,
    Path,
    Reason,
    ReasonCode,
    Tier,
    Why,
    new_tuple,
)

# Read per box or per call: module names, not their Enums' members, for speed (router.core.
# lifecycle: on Python 3.11 a member read off its Enum class takes a slow hook).
SERVING, LOAD, RANKED, PINNED = Tier.SERVING, Tier.LOAD, Path.RANKED, Path.PINNED
FITS_NOWHERE, FITS_GPU, FITS_RAM = Fit.NONE, Fit.GPU, Fit.RAM
PAIR_SETTINGS_KINDS = kinds_that(Capability.PAIR_SETTINGS)  # a set: no frame per box (`can` costs one)


def why_not(
    call: Call, box: BoxFacts, tried: frozenset[str], eligible: frozenset[str] | None = None
) -> Reason | None:
    """The first reason `box` cannot take `call`, or None when it passes the gate."""
    return _why_not(call, box, call_key(box.kind, call.model, call.settings), tried, eligible)


def _why_not(
    call: Call,
    box: BoxFacts,
    named: tuple[str, str | None] | None,
    tried: frozenset[str],
    eligible: frozenset[str] | None,
) -> Reason | None:
    """`why_not` with the call's (key, settings) under the box's kind already worked out."""
    if call.pin is not None and box.id != call.pin:
        return Reason(ReasonCode.NOT_PINNED, call.pin)
    if box.kind not in call.kinds:
        return Reason(ReasonCode.KIND_NOT_SERVED, box.kind.value)
    if named is None:
        return Reason(ReasonCode.BAD_MODEL_NAME, box.kind.value)
    if not box.online:
        return Reason(ReasonCode.OFFLINE, box.down)
    if (box.pool or None) != (call.pool or None) and (call.pin is None or call.pool):
        return Reason(ReasonCode.OTHER_POOL, box.pool or "")
    if box.blocked:
        return Reason(ReasonCode.BLOCKED)
    if box.pairs is not EMPTY and (blocker := blocked_by(box.pairs, named[0])) is not None:
        return Reason(ReasonCode.BLOCKED_PAIR, blocker)
    if box.id in tried:
        return Reason(ReasonCode.ALREADY_TRIED)
    if eligible is not None and box.id not in eligible:
        return Reason(ReasonCode.NOT_ELIGIBLE)
    key = named[0]
    if key not in box.residents and key not in box.catalog:
        return Reason(ReasonCode.NO_MODEL, f"{key} ({box.down})" if box.down else key)
    if call.pin is None and box.fits.get(key) is FITS_NOWHERE and key not in box.residents:
        return Reason(ReasonCode.DOES_NOT_FIT, key)
    ceiling = box.cooling.get(key)
    if ceiling is not None and box.in_flight >= ceiling:
        return Reason(ReasonCode.COOLING, f"{key} at {ceiling} in flight")
    if is_full(box.in_flight, box.max_inflight):
        return Reason(ReasonCode.FULL, f"{box.in_flight}/{box.max_inflight}")
    return None


def tier_of(call: Call, box: BoxFacts) -> Tier:
    """SERVING when a healthy, not-loading resident runs the call's settings."""
    return _tier_of(box, call_key(box.kind, call.model, call.settings), call.knobs)  # type: ignore[arg-type]


def _tier_of(box: BoxFacts, named: tuple[str, str | None], knobs: str | None) -> Tier:
    key, settings = named
    resident = box.residents.get(key)
    if resident is None or not resident.healthy or resident.loading:
        return LOAD
    if box.kind in PAIR_SETTINGS_KINDS:
        settings = contract(box.pairs, key, settings, knobs)
    return SERVING if box.contracts.get(key) == settings else LOAD


def rank_key(box: BoxFacts, tier: Tier, key: str) -> tuple:
    """Rule 4's sort key for `box` in `tier` (model `key`): one flat tuple, (tier: 0 SERVING,
    1 LOAD; load; pressure; the tier's tie-break; order, id), since nested parts would cost a
    tuple each and the sort a compare per level. A placement refusal counts as load until its
    back-off ends, so a box that fails fast does not look idle and draw more calls; a serving
    seat used last is likelier to have its cache. The verdicts' fit: router.core.pairs rule 6
    (no verdicts, and "fits nowhere" for a resident or a pinned call, count as unknown)."""
    load = box.pending + box.pressure + box.reservations + box.recent_refusals
    if tier is SERVING:
        resident = box.residents[key]
        return (0, load, box.pressure, 1 if resident.busy else 0, -resident.last_used_s, box.order, box.id)
    fit = box.fits.get(key)
    return (1, load, box.pressure, 0 if fit is FITS_GPU else 2 if fit is FITS_RAM else 1,
            -(box.free_gpu_bytes or 0), box.last_picked_s, box.order, box.id)


NOTHING_TRIED: frozenset[str] = frozenset()  # a first decision's `tried`, not built per call


class Verdicts:
    """What first decisions (nothing tried yet) remember of each box's verdict per call: a
    verdict (the box's reason, or its rank key and Why) depends only on the call and the box's
    facts, which are immutable, and under load every box but the one that took the last call
    keeps its facts object from one call to the next. So the verdict is reused while `facts is`
    the remembered object: a decision over 8 boxes then works out one box instead of eight.
    Bounded: past `max_calls` distinct calls (model, settings, kinds, pin, pool, knobs) it starts
    over. The owner (the fleet) clears it whenever the fleet or its configuration changes, so a box
    that left is never remembered past its going."""

    __slots__ = ("_by_call", "max_calls")

    def __init__(self, max_calls: int = 256) -> None:
        self._by_call: dict[Call, dict[str, tuple]] = {}
        self.max_calls = max_calls

    def of(self, call: Call) -> dict[str, tuple]:
        """The remembered verdicts of `call`, box id → (facts, reason, ranking entry)."""
        memo = self._by_call.get(call)
        if memo is None:
            if len(self._by_call) >= self.max_calls:
                self._by_call.clear()
            memo = self._by_call[call] = {}
        return memo

    def clear(self) -> None:
        self._by_call.clear()

    def __len__(self) -> int:
        return len(self._by_call)


def decide(
    call: Call,
    boxes: Sequence[BoxFacts],
    tried: Iterable[str] = (),
    eligible: frozenset[str] | None = None,
    steer: Steer | None = None,
    verdicts: Verdicts | None = None,
) -> Decision:
    """Returns the Decision for `call` over `boxes`.

    Cost: about 1.3 µs per box whose facts changed since the last decision for the same call,
    ~0.3 µs per box whose facts did not, given the owner's `verdicts` (see Verdicts); a failover
    decision works out every box (bench/micro.py measures both). Every box is gated and ranked so that it can explain
    itself (the reasons of the boxes ruled out go into the 503 body and the route log). The call's name is
    parsed once per box kind (router.core.kinds.CALL_KEYS remembers it).

    Never raises for a refusal: an empty ranking comes back as `path=REFUSED` with a reason for
    every box (and for an unknown pin, under the pin's name). `steer`: the call's affinity,
    applied to the sorted ranking (router.core.affinity.place); None: the seeds' order.
    """
    tried = frozenset(tried) if tried else NOTHING_TRIED
    memo = verdicts.of(call) if verdicts is not None and not tried and eligible is None else None
    ruled_out: dict[str, Reason] = {}
    ranked: list[tuple[tuple, str, Why]] = []
    for box in boxes:
        # (facts, reason, ranking entry): the entry, (rank key, box id, Why), made once per verdict
        seen = memo.get(box.id) if memo is not None else None
        if seen is None or seen[0] is not box:
            named = CALL_KEYS[(box.kind, call.model, call.settings)]  # call_key, remembered
            reason = _why_not(call, box, named, tried, eligible)
            entry = None
            if reason is None:
                tier = _tier_of(box, named, call.knobs)  # type: ignore[arg-type]
                key = rank_key(box, tier, named[0])  # type: ignore[index]
                entry = (key, box.id, new_tuple(Why, (tier, key)))
            seen = (box, reason, entry)
            if memo is not None:
                memo[box.id] = seen
        if seen[1] is not None:
            ruled_out[box.id] = seen[1]
        else:
            ranked.append(seen[2])
    if call.pin is not None and call.pin not in {box.id for box in boxes}:
        ruled_out[call.pin] = Reason(ReasonCode.UNKNOWN_BOX, call.pin)
    if not ranked:
        return Decision(Path.REFUSED, (), {}, ruled_out)
    # A rank key ends with the box's unique id, so keys never tie and the plain tuple sort
    # never compares past them.
    ranked.sort()
    if steer is not None and call.pin is None:
        first, _ = place(ranked, steer.pull, steer.keyed, steer.slack, steer.spin)
        if first:
            ranked.insert(0, ranked.pop(first))
    path = PINNED if call.pin is not None else RANKED
    why_of: dict[str, Why] = {}
    for _, box_id, why in ranked:  # a loop: a comprehension is a function and a frame more
        why_of[box_id] = why
    return new_tuple(Decision, (path, tuple(why_of), why_of, ruled_out))  # (a dict keeps the ranking's order)
