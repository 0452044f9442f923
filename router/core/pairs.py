"""A hugpy box's own pair settings and verdicts, as the decision uses them. Pure.

contracts/hugpy-wrapper.md §11.2 (pair and box settings) and §11.1 (verdicts). Rules:
1. Rows. A box's `pair_settings` rows are (worker, model_key, settings). Only rows of the box's
   current worker name count (rows left under an earlier FITEVICT_WORKER stay in the table but
   are not effective). The row keyed `"*"` is the blanket.
2. Names. A model's own row is found as the box finds it (`_key_match`, db.py:664-685): the
   exact key first, else a row whose key ends in `~<key>` or whose key `<row>` the call's key
   ends in as `~<row>` (`owner~repo` in either direction), ASCII case-insensitively (SQLite's
   LIKE); among several such rows, the first.
3. Effective settings = the blanket's BLANKET_KNOBS, then the model's own row, key by key
   (`pair_knobs`, db.py:695-706). Box-only knobs in the blanket are never inherited.
4. The load contract of a call = effective settings, then the call's own knobs, the call
   winning every conflict, `false` and `0` included; keys the call does not name still apply.
   The call's knobs are its body's top-level `knobs` object (`call_knobs`; anything else, or
   none, is no knobs), then its `model@options` parsed as the box parses them
   (`option_knobs`) over them: `_resolve_variant` (front_door.py:5382-5413) lets the options
   win over the body's knobs, then `_placement` merges the result over the saved settings
   (`call_knobs.merge`). `blocked` cannot be set or cleared by a call. Only knobs the box puts
   in a seat's contract count (`NOT_CONTRACT` are the ones it does not): two calls with equal
   contracts reuse a seat, any difference reloads it (§11.2.6, §5).
5. Blocks. The box does not enforce `blocked` (§11.2.6); the router does: a model whose own row
   has a truthy `blocked`, or every model when the blanket row has one (hugpy-core's reading
   of a blocked worker), is blocked on that box. A call cannot clear a block.
6. Verdicts (§11.1.7). Rows are per (model, file); remote pairs (`on_disk: false`) are not held
   and do not count. No held row for a model, or every held row `impossible`: the model fits
   in no placement mode (Fit.NONE). Otherwise the best Auto pick over its files: one that fits
   on the GPU (Fit.GPU), else one that fits only in RAM (Fit.RAM), else unknown (Fit.UNKNOWN:
   `fits: null` means "not priced yet", never "no").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping

from router.core.errors import BadRequest

BLANKET_KEY = "*"
# constants.py:138-140: the blanket knobs every pair inherits (the box-only ones are not).
BLANKET_KNOBS = frozenset({
    "auto_preferences", "video_allow_cpu", "min_decode_tok_s", "disk_mmap", "disk_mmap_cache_gib",
    "auto_goal", "tolerance", "quality_alternatives", "allowed_placements", "wait_before_quality",
    "resident_priority", "latency_target_s", "max_wait_s", "cpu_floor_cores", "ctx_pct",
    "ctx_min_pct", "ctx_range_enabled", "ctx_yield", "ctx_restore",
})
# Knobs a pair row may hold that never reach a seat's contract (llama_cpp.set_contract reads
# none of them): `blocked` is the router's own guard, `residency` and `fit_order` act without a
# reload (§11.2.6). Any other key, unknown ones included, counts: a needless reload costs one
# cold load, a missed one sends calls to a seat that is about to be rebuilt.
NOT_CONTRACT = frozenset({"blocked", "residency", "fit_order"})
# variants.parse (variants.py:320-353): how `model@options` tokens become knobs.
MODES = frozenset({"gpu-only", "ram-only", "max-gpu", "max-ram", "explicit"})
CTX_LEVELS = frozenset({"low", "medium", "high", "xhigh"})
KV_TYPES = frozenset({"f16", "q8_0", "q4_0"})
GPU_MODES = frozenset({"gpu-only", "max-gpu", "explicit"})
RAM_MODES = frozenset({"ram-only", "max-ram"})


class Fit(int, Enum):
    """What a box's verdicts say of one model (best first)."""

    GPU = 0  # Auto's pick fits on the GPU
    UNKNOWN = 1  # not priced yet (`fits: null`), or no verdicts read
    RAM = 2  # fits only in RAM
    NONE = 3  # fits in no mode: not a load candidate


@dataclass(frozen=True, slots=True)
class PairView:
    """One box's pair settings, rule 1 applied: the blanket's inherited knobs, whether the
    blanket blocks the box, and each model's own row (key as the box wrote it)."""

    blanket: Mapping[str, Any] = field(default_factory=dict)
    blanket_blocked: bool = False
    rows: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # `contract`'s memo, (model key, options, knobs) -> contract: it lives and goes with the view
    contracts: dict[tuple[str, str | None, str | None], str | None] = field(
        default_factory=dict, init=False, repr=False, compare=False)


EMPTY = PairView()


def pair_view(rows: Iterable[Mapping[str, Any]], worker: str | None) -> PairView:
    """The view of `pair_settings` rows (state long-poll or store rows) for `worker` (rule 1;
    None: the rows are already that worker's, as a store read filters them).

    Rows of another worker, without a string key or whose settings are not an object (or JSON
    text of one, as the store holds it) are skipped: a router never trusts a box's table."""
    blanket: Mapping[str, Any] = {}
    own: dict[str, Mapping[str, Any]] = {}
    for row in rows:
        if worker is not None and row.get("worker") != worker:
            continue
        key, settings = row.get("model_key"), row.get("settings")
        if isinstance(settings, str):
            try:
                settings = json.loads(settings)
            except ValueError:
                continue
        if not isinstance(key, str) or not isinstance(settings, dict):
            continue
        if key == BLANKET_KEY:
            blanket = settings
        else:
            own[key] = settings
    if not blanket and not own:
        return EMPTY
    return PairView(
        blanket={k: v for k, v in blanket.items() if k in BLANKET_KNOBS},
        blanket_blocked=bool(blanket.get("blocked")),
        rows=own,
    )


def own_row(view: PairView, key: str) -> Mapping[str, Any]:
    """The model's own row, matched as the box matches it (rule 2); {} when none."""
    rows = view.rows
    exact = rows.get(key)
    if exact is not None:
        return exact
    if not rows:
        return {}
    folded = key.lower()
    for row_key, settings in rows.items():
        other = row_key.lower()
        if other.endswith("~" + folded) or folded.endswith("~" + other):
            return settings
    return {}


def effective(view: PairView, key: str) -> dict[str, Any]:
    """What a call for `key` runs under before its own knobs (rule 3)."""
    return {**view.blanket, **own_row(view, key)}


def blocked_by(view: PairView, key: str) -> str | None:
    """`"*"` when the blanket blocks the box, `key` when its own row does, else None (rule 5)."""
    if view.blanket_blocked:
        return BLANKET_KEY
    return key if own_row(view, key).get("blocked") else None


def option_knobs(options: str | None) -> dict[str, Any]:
    """The knobs `model@options` sets, as variants.parse reads them. `options` is the call's
    normalised option string (`router.core.names.hugpy_split`). A quant token picks a file
    (`gguf_file`) the router does not resolve: it stays `@<token>`, so equal calls compare
    equal and the call still overrides the pair's `gguf_file` (a pair file that is that quant's
    file then counts as a difference: one needless load, never a wrong reuse). `fit` is
    resolved by the box against its own order, so it is kept as a token."""
    if not options:
        return {}
    knobs: dict[str, Any] = {}
    for token in options.split("+"):
        if token == "fit":
            knobs["@fit"] = True
        elif token in MODES:
            knobs["alloc_mode"] = token
        elif token in ("moe", "no-moe"):
            knobs["moe"] = token == "moe"
        elif token == "4bit":
            knobs["bnb_4bit"] = True
        elif token == "fa":
            knobs["flash_attn"] = True
        elif token == "ctx-max":
            knobs["ctx_preset"] = "xhigh"
        elif token.startswith("ctx-") and token[4:] in CTX_LEVELS:
            knobs["ctx_preset"] = token[4:]
        elif token.startswith("ctx-") and token[4:].isdigit() and 1 <= int(token[4:]) <= 100:
            knobs["ctx_pct"] = int(token[4:])
        elif token.startswith("kv-") and token[3:] in KV_TYPES:
            knobs["kv_cache_type"] = token[3:]
        else:
            knobs["gguf_file"] = "@" + token
    return knobs


# A call's knobs are a few dozen small preferences; more than this, and the router would keep
# (per call in its decision memo, per seat, per contract memo entry) what a client chose to send.
MAX_CALL_KNOBS_BYTES = 4096


def call_knobs(value: Any) -> str | None:
    """The body's `knobs` member as the contract reads it (rule 4): an object, as canonical JSON
    (sorted keys, so equal objects are equal strings); None for anything else (the box takes
    no knobs from null, false or {}, and refuses a call whose knobs are another value).
    A null inside is kept: it clears that saved knob for the call, as the box merges it.

    Raises BadRequest (`knobs_too_large`) when the JSON is over MAX_CALL_KNOBS_BYTES."""
    if not isinstance(value, dict) or not value:
        return None
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))  # ASCII: a character is a byte
    if len(text) > MAX_CALL_KNOBS_BYTES:
        raise BadRequest(f"'knobs' is over {MAX_CALL_KNOBS_BYTES} bytes", code="knobs_too_large")
    return text


def merge(saved: Mapping[str, Any], call: Mapping[str, Any]) -> dict[str, Any]:
    """call_knobs.merge: the call wins every conflict except `blocked`, which it cannot touch
    (rule 4)."""
    return {**saved, **{k: v for k, v in call.items() if k != "blocked"}}


# The decision asks for a contract per box per call whenever a box's facts moved (every call's
# start and end), and a box's view lives until its settings change: each (model, options, knobs)
# is worked out once per view (~4 µs: a merge and a JSON dump), then looked up in the view's
# own memo (`PairView.contracts`). Bounded: past CONTRACT_MEMO entries a view's memo starts over.
CONTRACT_MEMO = 1024
_UNSEEN = object()


def contract(view: PairView, key: str, options: str | None, knobs: str | None = None) -> str | None:
    """The load contract a call for `key@options` with body knobs `knobs` (`call_knobs`) gets on
    the box, as a canonical string (the knobs as sorted JSON; None for no knobs). Two calls
    reuse one seat exactly when their contracts are equal (rule 4). A knob set to null counts
    as absent, as the box reads it."""
    if view is EMPTY and not options and not knobs:
        return None
    memo, memo_key = view.contracts, (key, options, knobs)
    seen = memo.get(memo_key, _UNSEEN)
    if seen is not _UNSEEN:
        return seen  # type: ignore[return-value]
    asked = {**json.loads(knobs), **option_knobs(options)} if knobs else option_knobs(options)
    merged = merge(effective(view, key), asked)
    kept = {k: _equal_as_python(v) for k, v in merged.items() if k not in NOT_CONTRACT and v is not None}
    result = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str) if kept else None
    if len(memo) >= CONTRACT_MEMO:
        memo.clear()
    memo[memo_key] = result
    return result


def _equal_as_python(value: Any) -> Any:
    """`value` in the form whose JSON is equal exactly when Python's `==` is: the box compares
    seat contracts as Python dicts (`_same_contract`), where False == 0, True == 1, 1.0 == 1."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _equal_as_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_equal_as_python(v) for v in value]
    return value


def fit_of(rows: Iterable[Mapping[str, Any]]) -> Fit:
    """What one model's verdict rows say (rule 6). An empty `rows` is Fit.NONE: call it only
    for a model the box's verdicts were read for."""
    best = Fit.NONE
    for row in rows:
        if row.get("on_disk") is False:
            continue
        feasibility = row.get("feasibility")
        if isinstance(feasibility, dict) and feasibility.get("status") == "impossible":
            continue
        auto = row.get("auto")
        pick = auto.get("standard") if isinstance(auto, dict) else None
        fit = Fit.UNKNOWN
        if isinstance(pick, dict) and pick.get("fits") is True:
            mode = pick.get("mode")
            fit = Fit.GPU if mode in GPU_MODES else Fit.RAM if mode in RAM_MODES else Fit.UNKNOWN
        if fit < best:
            best = fit
    return best


def fits_by_model(verdict_rows: Iterable[Mapping[str, Any]], models: Iterable[str]) -> dict[str, Fit]:
    """Fit per model key in `models` (the box's catalog) from a `GET /v1/verdicts` answer's rows.
    Verdict keys match exactly (verdicts.py:629-631)."""
    by_key: dict[str, list[Mapping[str, Any]]] = {}
    for row in verdict_rows:
        key = row.get("model_key")
        if isinstance(key, str):
            by_key.setdefault(key, []).append(row)
    return {key: fit_of(by_key.get(key, ())) for key in models}
