"""Facts in, values out: the types the decision works on.

Invariants:
1. Every type here is immutable once built; the I/O rooms build fresh facts, the core never
   mutates them.
2. Times are plain floats handed in by the caller (`now`, `last_used_s`); the core never reads
   a clock.
3. Reason codes are an Enum with stable string values: they appear in logs, the store and the
   admin API, so a value is never renamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Mapping, NamedTuple

from router.core.bounds import clip
from router.core.pairs import EMPTY, Fit, PairView

# Builds a NamedTuple on the call path without its Python-level __new__ (a frame: half the
# cost): `new_tuple(Call, (...))`, every field given, in the class's order.
new_tuple = tuple.__new__


class BoxKind(str, Enum):
    HUGPY = "hugpy"
    OLLAMA = "ollama"
    LMSTUDIO = "lmstudio"
    OPENAI = "openai"


class ReasonCode(str, Enum):
    """Why a box is not a candidate for a call, in the order `why_not` checks them."""

    NOT_PINNED = "not_pinned"  # the call is pinned to another box
    KIND_NOT_SERVED = "kind_not_served"  # the facade does not serve this box kind
    BAD_MODEL_NAME = "bad_model_name"  # the name is invalid under this box kind's rule
    OFFLINE = "offline"
    OTHER_POOL = "other_pool"
    BLOCKED = "blocked"
    BLOCKED_PAIR = "blocked_pair"  # the box's own pair settings block the model (or the blanket)
    ALREADY_TRIED = "already_tried"
    NOT_ELIGIBLE = "not_eligible"  # failover never broadens past the first decision's set
    NO_MODEL = "no_model"  # the box's inventory does not advertise the model
    DOES_NOT_FIT = "does_not_fit"  # not resident, and its verdicts say it fits in no mode
    COOLING = "cooling"  # it refused this model lately: full for it at that load, a while
    FULL = "full"  # at its in-flight limit (router.core.admission rule 1)
    UNKNOWN_BOX = "unknown_box"  # the pin names no box in the boxes file (not a gate check)


# A box ruled out for one of these can take the call later: the call waits for it (admission).
WAIT_REASONS = frozenset({ReasonCode.COOLING, ReasonCode.FULL})


class Reason(NamedTuple):
    """Why a box is out (a NamedTuple: built per box per decision, so cheap to make)."""

    code: ReasonCode
    detail: str = ""

    def text(self) -> str:
        """The reason as a refusal body and the route log show it: bounded (bounds rule 2)."""
        return f"{self.code.value}: {clip(self.detail)}" if self.detail else self.code.value


class Tier(str, Enum):
    SERVING = "serving"  # resident, healthy, not loading, same settings
    LOAD = "load"  # can load it (catalog), or resident under other settings


class Path(str, Enum):
    PINNED = "pinned"
    RANKED = "ranked"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Resident:
    """A model loaded on a box, under the box's own key for it."""

    key: str
    healthy: bool = True
    loading: bool = False
    busy: bool = False
    last_used_s: float = 0.0


# BoxFacts' empty mappings by default: one, shared, so read-only.
NO_ENTRIES: Mapping = MappingProxyType({})


class BoxFacts(NamedTuple):
    """What the decision may know of one box at one moment.

    `contracts` maps a model key to the settings this router last sent the box for it
    (absent = default settings). `order` is the box's position in the boxes file, its stable
    identity for tie-breaks. `pending` and `pressure` come from the scheduler snapshot (until
    one exists: 0 and the neutral pressure 1); `reservations` is the router's own live count.
    `in_flight` is every call the router has on the box now and `max_inflight` its limit (None:
    none); `cooling` maps each model key it refused to place lately to the calls it had in
    flight then (its learned ceiling for that model while the back-off lasts), and
    `recent_refusals` counts those refusals (they count as load: a box that fails fast never
    looks idle). `down` says why an offline box is offline ("" when unknown). `pairs` is a hugpy
    box's own pair settings and `fits` what its verdicts say per catalog key (absent: unknown)
    (router.core.pairs); for a hugpy box `contracts` holds the load contract each seat was
    loaded under (`pairs.contract`).

    A NamedTuple, not a frozen dataclass: the facts of the box that took the last call are
    built anew for the next decision, once a call, and a frozen dataclass sets each of its 22
    fields through object.__setattr__ (~1,200 instructions a field on CPython 3.11).
    """

    id: str
    kind: BoxKind
    order: int
    online: bool = True
    pool: str | None = None
    blocked: bool = False
    catalog: frozenset[str] = frozenset()
    residents: Mapping[str, Resident] = NO_ENTRIES
    contracts: Mapping[str, str] = NO_ENTRIES
    free_gpu_bytes: int | None = None
    pending: int = 0
    pressure: int = 1
    reservations: int = 0
    last_picked_s: float = 0.0
    in_flight: int = 0
    max_inflight: int | None = None
    cooling: Mapping[str, int] = NO_ENTRIES
    recent_refusals: int = 0
    down: str = ""
    pairs: PairView = EMPTY
    fits: Mapping[str, Fit] = NO_ENTRIES


class Call(NamedTuple):
    """One client call as the decision sees it.

    `model` is the client's string, untouched; each box kind derives its own key and settings
    from it (`router.core.names`). `settings` is what the facade read from the body beyond the
    name (Ollama runner options, normalised); None means default. `knobs` is the body's `knobs`
    object, a hugpy box's per-call contract (`router.core.pairs.call_knobs`: canonical JSON;
    None for none); only a hugpy box's tiers read it.

    A NamedTuple, not a frozen dataclass: one is built per call, and a frozen dataclass sets
    each field through object.__setattr__ (BoxFacts).
    """

    model: str
    kinds: frozenset[BoxKind]
    settings: str | None = None
    pin: str | None = None
    pool: str | None = None
    knobs: str | None = None


class Why(NamedTuple):
    tier: Tier
    rank: tuple


class Decision(NamedTuple):
    """The ranked boxes to try, and why every other box is out.

    Every input box lands in exactly one of `why` (ranked, in `boxes` order) or `ruled_out` (the
    gate's reason). Three words, three things: the gate rules a box out (a `Reason`), a box
    refuses a call (router.core.refusal), the router turns a call away (the row's `refused`).

    A NamedTuple, not a frozen dataclass: one is built per call (BoxFacts).
    """

    path: Path
    boxes: tuple[str, ...]
    why: Mapping[str, Why]
    ruled_out: Mapping[str, Reason]

    @property
    def waits_for(self) -> frozenset[str]:
        """When nothing is ranked: the boxes that could take the call once they have room."""
        return frozenset(box for box, reason in self.ruled_out.items() if reason.code in WAIT_REASONS)

    def reasons_text(self) -> dict[str, str]:
        return {box: reason.text() for box, reason in self.ruled_out.items()}

    def log_doc(self) -> dict:
        """What the route log keeps, in hugpy-router 0.0.4's shape: the ranked `boxes`, `why`
        each is there (its tier), and the boxes ruled out with their reasons (0.0.4's key:
        `refused`). (The rank keys would double a row's size, and a row's size is most of its
        cost.)"""
        why = self.why
        return {"boxes": list(self.boxes), "why": {box: why[box].tier for box in self.boxes},
                "refused": self.reasons_text()}
