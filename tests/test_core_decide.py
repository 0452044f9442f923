"""Choosing a box (router/core/decide.py): one test per line of the contract
(DESIGN.md "Choosing a box", decide.py rules 1-4), then a property test against
`reference_decide` (tests/models.py) over random fleets and calls."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core import pairs
from router.core.decide import Verdicts, decide, why_not
from router.core.kinds import call_key
from router.core.types import (
    BoxFacts,
    BoxKind,
    Call,
    Decision,
    Path,
    Reason,
    ReasonCode,
    Resident,
    Tier,
)

try:
    from tests.models import GATE_ORDER, reference_decide, reference_gate
except ImportError:  # tests/ run as a rootless directory
    from models import GATE_ORDER, reference_decide, reference_gate

ALL_KINDS = frozenset(BoxKind)
OLLAMA = BoxKind.OLLAMA
HUGPY = BoxKind.HUGPY


def box(id_: str, order: int = 0, kind: BoxKind = OLLAMA, **kw) -> BoxFacts:
    """A healthy online box that can load `llama3:latest` (ollama) or `m` (other kinds)."""
    kw.setdefault("catalog", frozenset({"llama3:latest" if kind is OLLAMA else "m"}))
    return BoxFacts(id=id_, kind=kind, order=order, **kw)


def call(model: str = "llama3", kinds=ALL_KINDS, **kw) -> Call:
    return Call(model=model, kinds=frozenset(kinds), **kw)


def check_partition(decision: Decision, boxes, pin: str | None = None) -> None:
    """Every input box lands in exactly one of why / ruled_out (an unknown pin adds its name)."""
    ids = {b.id for b in boxes}
    extra = {pin} if pin is not None and pin not in ids else set()
    assert set(decision.why).isdisjoint(decision.ruled_out)
    assert set(decision.why) | set(decision.ruled_out) == ids | extra
    assert set(decision.boxes) == set(decision.why)
    assert len(decision.boxes) == len(set(decision.boxes))
    assert (decision.path is Path.REFUSED) == (not decision.boxes)


# --------------------------------------------------------------------------------------------
# 1. Gate: reasons, in precedence order
# --------------------------------------------------------------------------------------------

GATES = [code for code in GATE_ORDER]


def failing(gates: set[ReasonCode]):
    """(call, box, tried, eligible) where `box` fails exactly the named gates."""
    c = dict(model="llama3", kinds={OLLAMA}, pin=None, pool=None)
    b = dict(online=True, pool=None, blocked=False, catalog=frozenset({"llama3:latest"}))
    tried: set[str] = set()
    eligible = None
    if ReasonCode.NOT_PINNED in gates:
        c["pin"] = "other"
    if ReasonCode.KIND_NOT_SERVED in gates:
        c["kinds"] = {BoxKind.LMSTUDIO}
    if ReasonCode.BAD_MODEL_NAME in gates:
        c["model"] = "hf.co/repo"  # invalid for Ollama (namespace with a dot)
    if ReasonCode.OFFLINE in gates:
        b["online"] = False
    if ReasonCode.OTHER_POOL in gates:
        c["pool"] = "b"
    if ReasonCode.BLOCKED in gates:
        b["blocked"] = True
    if ReasonCode.BLOCKED_PAIR in gates:
        b["pairs"] = pairs.pair_view(
            [{"worker": "w", "model_key": "llama3:latest", "settings": {"blocked": "operator"}}], "w")
    if ReasonCode.ALREADY_TRIED in gates:
        tried = {"x"}
    if ReasonCode.NOT_ELIGIBLE in gates:
        eligible = frozenset({"y"})
    if ReasonCode.NO_MODEL in gates:
        b["catalog"] = frozenset({"mistral:latest"})
    if ReasonCode.DOES_NOT_FIT in gates:
        b["fits"] = {"llama3:latest": pairs.Fit.NONE}
    if ReasonCode.COOLING in gates:
        b["cooling"] = {"llama3:latest": 0}
    if ReasonCode.FULL in gates:
        b["in_flight"], b["max_inflight"] = 2, 2
    the_box = BoxFacts(id="x", kind=OLLAMA, order=0, **b)
    return call(**c), the_box, frozenset(tried), eligible


@pytest.mark.parametrize("gate", GATES, ids=[g.value for g in GATES])
def test_each_gate_alone(gate):
    c, b, tried, eligible = failing({gate})
    assert why_not(c, b, tried, eligible).code is gate
    d = decide(c, [b], tried, eligible)
    assert d.path is Path.REFUSED and d.boxes == ()
    assert d.ruled_out["x"].code is gate


@pytest.mark.parametrize(
    "box_pool, call_pool, pin, eligible",
    [
        (None, None, None, True),
        ("", None, None, True),  # an empty pool is no pool (0.0.4 boxes files write "")
        ("lab", None, None, False),  # a call without a pool never lands in a pool
        ("lab", "", None, False),
        ("lab", "lab", None, True),
        ("lab", "gpu", None, False),
        (None, "lab", None, False),  # a call with a pool never leaves it
        ("lab", None, "x", True),  # a pin without a pool reaches its box in any pool
        ("lab", "gpu", "x", False),  # a pin with another pool is refused, not rerouted
        (None, "lab", "x", False),
    ],
)
def test_pools(box_pool, call_pool, pin, eligible):
    """The seed's "eligible: ... the call's pool", each way it can go."""
    b = box("x", pool=box_pool)
    c = call(pool=call_pool, pin=pin)
    reason = why_not(c, b, frozenset())
    assert (reason is None) is eligible
    if not eligible:
        assert reason == Reason(ReasonCode.OTHER_POOL, box_pool or "")
    d = decide(c, [b, box("free", 1)], frozenset())
    if pin is None:
        assert d.boxes == (("x",) if eligible else ()) + (("free",) if not call_pool else ())


@pytest.mark.parametrize("i", range(len(GATES)), ids=[g.value for g in GATES])
def test_gate_precedence(i):
    """A box failing this gate and every later one reports this gate."""
    c, b, tried, eligible = failing(set(GATES[i:]))
    assert why_not(c, b, tried, eligible).code is GATES[i]
    assert decide(c, [b], tried, eligible).ruled_out["x"].code is GATES[i]


def test_gate_passes_when_nothing_fails():
    c, b, tried, eligible = failing(set())
    assert why_not(c, b, tried, eligible) is None
    d = decide(c, [b], tried, eligible)
    assert d.path is Path.RANKED and d.boxes == ("x",)


def test_gate_order_is_the_documented_order():
    assert GATES[:8] == [
        ReasonCode.NOT_PINNED,
        ReasonCode.KIND_NOT_SERVED,
        ReasonCode.BAD_MODEL_NAME,
        ReasonCode.OFFLINE,
        ReasonCode.OTHER_POOL,
        ReasonCode.BLOCKED,
        ReasonCode.BLOCKED_PAIR,
        ReasonCode.ALREADY_TRIED,
    ]
    assert GATES[-4:] == [ReasonCode.NO_MODEL, ReasonCode.DOES_NOT_FIT, ReasonCode.COOLING, ReasonCode.FULL]


def test_gate_details():
    c, b, tried, el = failing({ReasonCode.NO_MODEL})
    assert why_not(c, b, tried, el) == Reason(ReasonCode.NO_MODEL, "llama3:latest")
    c, b, tried, el = failing({ReasonCode.KIND_NOT_SERVED})
    assert why_not(c, b, tried, el) == Reason(ReasonCode.KIND_NOT_SERVED, "ollama")
    c, b, tried, el = failing({ReasonCode.NOT_PINNED})
    assert why_not(c, b, tried, el) == Reason(ReasonCode.NOT_PINNED, "other")


def test_resident_alone_passes_the_gate():
    """The model is advertised when resident even if the catalog lacks it."""
    b = box("r", catalog=frozenset(), residents={"llama3:latest": Resident("llama3:latest")})
    assert decide(call(), [b]).boxes == ("r",)


def test_name_rule_is_the_box_kinds():
    """One call, three kinds: each box's own rule decides whether it advertises the model."""
    boxes = [
        box("o", 0, OLLAMA, catalog=frozenset({"llama3:latest"})),
        box("l", 1, BoxKind.LMSTUDIO, catalog=frozenset({"llama3:latest"})),
        box("h", 2, HUGPY, catalog=frozenset({"Llama3:latest"})),
    ]
    d = decide(call("Llama3:latest"), boxes)
    assert d.boxes == ("o", "h")
    assert d.ruled_out["l"].code is ReasonCode.NO_MODEL  # exact id: case differs


def test_empty_set_lists_every_reason():
    boxes = [box("a", 0, online=False), box("b", 1, blocked=True), box("c", 2, catalog=frozenset())]
    d = decide(call(), boxes)
    assert d.path is Path.REFUSED and d.boxes == () and d.why == {}
    assert {k: v.code for k, v in d.ruled_out.items()} == {
        "a": ReasonCode.OFFLINE,
        "b": ReasonCode.BLOCKED,
        "c": ReasonCode.NO_MODEL,
    }
    assert set(d.reasons_text()) == {"a", "b", "c"}


def test_every_box_lands_in_exactly_one_place():
    boxes = [box("a", 0), box("b", 1, online=False), box("c", 2, kind=BoxKind.LMSTUDIO)]
    d = decide(call(kinds={OLLAMA}), boxes)
    check_partition(d, boxes)
    assert d.boxes == ("a",)


# --------------------------------------------------------------------------------------------
# 2. Pin
# --------------------------------------------------------------------------------------------


def test_pin_is_honoured_even_when_worse():
    boxes = [box("good", 0), box("busy", 1, pending=50, pressure=3)]
    d = decide(call(pin="busy"), boxes)
    assert d.path is Path.PINNED
    assert d.boxes == ("busy",)
    assert d.ruled_out == {"good": Reason(ReasonCode.NOT_PINNED, "busy")}


@pytest.mark.parametrize(
    "facts,kw,code",
    [
        (dict(online=False), {}, ReasonCode.OFFLINE),
        (dict(blocked=True), {}, ReasonCode.BLOCKED),
        (dict(catalog=frozenset()), {}, ReasonCode.NO_MODEL),
        (dict(pool="x"), dict(pool="y"), ReasonCode.OTHER_POOL),
        (dict(kind=BoxKind.LMSTUDIO), dict(kinds={OLLAMA}), ReasonCode.KIND_NOT_SERVED),
        ({}, dict(model="mm:"), ReasonCode.BAD_MODEL_NAME),
    ],
)
def test_pin_to_an_ineligible_box_is_refused_with_its_reason(facts, kw, code):
    boxes = [box("ok", 0), box("pinned", 1, **facts), box("ok2", 2)]
    kw.setdefault("kinds", ALL_KINDS)
    d = decide(call(pin="pinned", **kw), boxes)
    assert d.path is Path.REFUSED
    assert d.boxes == ()  # never another box
    assert d.ruled_out["pinned"].code is code
    assert d.ruled_out["ok"].code is ReasonCode.NOT_PINNED
    check_partition(d, boxes, "pinned")


def test_pin_already_tried_is_refused_not_rerouted():
    boxes = [box("a", 0), box("b", 1)]
    d = decide(call(pin="a"), boxes, tried={"a"})
    assert d.boxes == () and d.ruled_out["a"].code is ReasonCode.ALREADY_TRIED


def test_unknown_pin():
    boxes = [box("a", 0), box("b", 1)]
    d = decide(call(pin="ghost"), boxes)
    assert d.path is Path.REFUSED and d.boxes == ()
    assert d.ruled_out["ghost"] == Reason(ReasonCode.UNKNOWN_BOX, "ghost")
    assert d.ruled_out["a"].code is d.ruled_out["b"].code is ReasonCode.NOT_PINNED
    check_partition(d, boxes, "ghost")


# --------------------------------------------------------------------------------------------
# 3. Tiers
# --------------------------------------------------------------------------------------------


def resident(**kw) -> dict:
    return {"llama3:latest": Resident("llama3:latest", **kw)}


def test_serving_beats_load():
    boxes = [
        box("load", 0, pending=0, pressure=0, free_gpu_bytes=80 << 30),
        box("serving", 1, pending=9, pressure=3, reservations=5, residents=resident()),
    ]
    d = decide(call(), boxes)
    assert d.boxes == ("serving", "load")
    assert d.why["serving"].tier is Tier.SERVING
    assert d.why["load"].tier is Tier.LOAD


@pytest.mark.parametrize(
    "model,body_settings,sent,tier",
    [
        # hugpy: settings come from model@options; unknown contract counts as default
        ("m", None, None, Tier.SERVING),
        ("m@ctx-low", None, None, Tier.LOAD),
        ("m", None, "ctx-low", Tier.LOAD),  # resident with other settings: a load
        ("m@CTX-LOW", None, "ctx-low", Tier.SERVING),
        ("m@ram-only,ctx-low", None, "ctx-low+ram-only", Tier.SERVING),
        ("m@ctx-low", None, "ctx-low+ram-only", Tier.LOAD),
    ],
)
def test_hugpy_settings_contract(model, body_settings, sent, tier):
    # a hugpy box's contracts are load contracts (pairs.contract): here, options over no settings
    contracts = {} if sent is None else {"m": pairs.contract(pairs.EMPTY, "m", sent)}
    b = box("h", 0, HUGPY, residents={"m": Resident("m")}, contracts=contracts)
    d = decide(call(model, settings=body_settings), [b])
    assert d.why["h"].tier is tier


@pytest.mark.parametrize(
    "model,knobs,loaded_options,loaded_knobs,tier",
    [
        # a hugpy call's body knobs are part of its contract (pairs rule 4), the seat's too
        ("m", None, None, None, Tier.SERVING),
        ("m", '{"max_wait_s":5}', None, None, Tier.LOAD),  # a preference knob reloads the seat
        ("m", None, None, '{"max_wait_s":5}', Tier.LOAD),
        ("m", '{"max_wait_s":5}', None, '{"max_wait_s":5.0}', Tier.SERVING),  # equal as Python compares
        ("m", '{"alloc_mode":"ram-only"}', "ram-only", None, Tier.SERVING),  # the same knob either way
        ("m@ram-only", '{"alloc_mode":"gpu-only"}', "ram-only", None, Tier.SERVING),  # options win
        ("m", '{"blocked":true}', None, None, Tier.SERVING),  # not one a call can set
        ("m", '{"max_wait_s":null}', None, None, Tier.SERVING),  # null: absent
    ],
)
def test_hugpy_knobs_contract(model, knobs, loaded_options, loaded_knobs, tier):
    contracts = {"m": pairs.contract(pairs.EMPTY, "m", loaded_options, loaded_knobs)}
    b = box("h", 0, HUGPY, residents={"m": Resident("m")}, contracts={k: v for k, v in contracts.items() if v})
    assert decide(call(model, knobs=knobs), [b]).why["h"].tier is tier


@pytest.mark.parametrize(
    "body_settings,sent,tier",
    [
        (None, None, Tier.SERVING),
        ("num_ctx=8192", None, Tier.LOAD),
        (None, "num_ctx=8192", Tier.LOAD),
        ("num_ctx=8192", "num_ctx=8192", Tier.SERVING),
        ("num_ctx=4096", "num_ctx=8192", Tier.LOAD),
    ],
)
def test_ollama_settings_contract(body_settings, sent, tier):
    contracts = {} if sent is None else {"llama3:latest": sent}
    b = box("o", 0, residents=resident(), contracts=contracts)
    assert decide(call(settings=body_settings), [b]).why["o"].tier is tier


@pytest.mark.parametrize(
    "state,tier",
    [
        (dict(), Tier.SERVING),
        (dict(busy=True), Tier.SERVING),
        (dict(healthy=False), Tier.LOAD),
        (dict(loading=True), Tier.LOAD),
    ],
)
def test_resident_state_decides_the_tier(state, tier):
    b = box("o", 0, residents=resident(**state))
    assert decide(call(), [b]).why["o"].tier is tier


def test_unhealthy_resident_ranks_with_the_loads():
    boxes = [
        box("sick", 0, pending=0, residents=resident(healthy=False)),
        box("cold", 1, pending=0, free_gpu_bytes=1),
        box("warm", 2, pending=5, residents=resident()),
    ]
    d = decide(call(), boxes)
    assert d.boxes == ("warm", "cold", "sick")  # cold has more free GPU than sick (unknown)


# --------------------------------------------------------------------------------------------
# 4. Rank inside a tier
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("serving", [False, True])
def test_rank_by_pending_plus_pressure_plus_reservations(serving):
    res = resident() if serving else {}
    boxes = [
        box("a", 0, pending=0, pressure=3, reservations=0, residents=res),  # 3
        box("b", 1, pending=2, pressure=0, reservations=0, residents=res),  # 2
        box("c", 2, pending=0, pressure=0, reservations=1, residents=res),  # 1
    ]
    assert decide(call(), boxes).boxes == ("c", "b", "a")


@pytest.mark.parametrize("serving", [False, True])
def test_then_pressure(serving):
    res = resident() if serving else {}
    boxes = [
        box("hot", 0, pending=0, pressure=2, residents=res),
        box("cool", 1, pending=2, pressure=0, residents=res),
    ]
    assert decide(call(), boxes).boxes == ("cool", "hot")


def test_serving_idle_before_busy():
    boxes = [
        box("busy", 0, residents=resident(busy=True, last_used_s=100.0)),
        box("idle", 1, residents=resident(busy=False, last_used_s=1.0)),
    ]
    assert decide(call(), boxes).boxes == ("idle", "busy")


def test_serving_then_most_recently_used():
    boxes = [
        box("old", 0, residents=resident(last_used_s=10.0)),
        box("recent", 1, residents=resident(last_used_s=20.0)),
    ]
    assert decide(call(), boxes).boxes == ("recent", "old")


def test_load_most_free_gpu_first():
    boxes = [
        box("small", 0, free_gpu_bytes=1 << 30, last_picked_s=0.0),
        box("big", 1, free_gpu_bytes=8 << 30, last_picked_s=99.0),
        box("unknown", 2, free_gpu_bytes=None),  # unknown counts as none
    ]
    assert decide(call(), boxes).boxes == ("big", "small", "unknown")


def test_load_then_least_recently_picked():
    boxes = [
        box("recent", 0, free_gpu_bytes=4 << 30, last_picked_s=20.0),
        box("long_ago", 1, free_gpu_bytes=4 << 30, last_picked_s=10.0),
    ]
    assert decide(call(), boxes).boxes == ("long_ago", "recent")


def test_then_boxes_file_order_then_name():
    boxes = [box("z", 2), box("y", 1), box("b", 3), box("a", 3)]
    assert decide(call(), boxes).boxes == ("y", "z", "a", "b")


def test_no_snapshot_default_order_is_the_boxes_file():
    """Until a snapshot: pending 0, pressure 1 for all, so the boxes-file order decides."""
    boxes = [box(f"b{i}", order) for i, order in enumerate([3, 0, 2, 1])]
    assert decide(call(), boxes).boxes == ("b1", "b3", "b2", "b0")


def test_same_facts_same_order():
    boxes = [box("a", 0, pending=1), box("b", 1, residents=resident()), box("c", 2)]
    first = decide(call(), boxes)
    assert all(decide(call(), boxes) == first for _ in range(3))
    assert decide(call(), list(reversed(boxes))).boxes == first.boxes


# --------------------------------------------------------------------------------------------
# 5. Failover never broadens
# --------------------------------------------------------------------------------------------


def test_eligible_never_broadens():
    boxes = [box("a", 0), box("b", 1), box("c", 2, online=False)]
    first = decide(call(), boxes)
    assert first.boxes == ("a", "b")
    # "a" refused; meanwhile "c" came online and "d" appeared: neither may join the retry
    later = [box("a", 0), box("b", 1), box("c", 2), box("d", 3, pending=-5)]
    retry = decide(call(), later, tried={"a"}, eligible=frozenset(first.boxes))
    assert retry.boxes == ("b",)
    assert retry.ruled_out["a"].code is ReasonCode.ALREADY_TRIED
    assert retry.ruled_out["c"].code is ReasonCode.NOT_ELIGIBLE
    assert retry.ruled_out["d"].code is ReasonCode.NOT_ELIGIBLE
    check_partition(retry, later)
    # the eligible set does not override a gate either
    again = decide(call(), [box("b", 1, online=False)], tried={"a"}, eligible=frozenset({"b"}))
    assert again.ruled_out["b"].code is ReasonCode.OFFLINE


# --------------------------------------------------------------------------------------------
# Property: decide == reference_decide over random fleets
# --------------------------------------------------------------------------------------------

# Client strings with interesting keys under several kinds (valid, invalid, case, @options).
VALID_MODELS = ["llama3", "Llama3:LATEST", "qwen2.5:7b", "m", "m@ctx-low", "m@RAM-only+ctx-low"]
MODELS = [
    "llama3",
    "Llama3:LATEST",
    "library/llama3:latest",
    "qwen2.5:7b",
    "hf.co/repo",
    "mm:",
    "m",
    "m@ctx-low",
    "m@RAM-only+ctx-low",
    "@x",
    "qwen/qwen3-14b",
    "",
]
SETTINGS = [None, "ctx-low", "ctx-low+ram-only", "num_ctx=4096"]
IDS = [f"b{i}" for i in range(8)]


def keys_for(kind: BoxKind) -> list[str]:
    out = []
    for model in MODELS:
        named = call_key(kind, model, None)
        if named is not None and named[0] not in out:
            out.append(named[0])
    return out + ["other"]


# Strategies are built once: building them inside a draw dominates the run time.
_INDEX = {n: st.integers(0, n - 1) for n in range(1, 16)}
KINDS = list(BoxKind)
KEYS = {kind: keys_for(kind) for kind in KINDS}


def pick(draw, options):
    """One of `options` (shrinks towards the first)."""
    return options[draw(_INDEX[len(options)])]


def rarely(draw, n: int) -> bool:
    """True about one time in `n` (shrinks to False)."""
    return draw(_INDEX[n]) == n - 1


def subset(draw, options, n: int = 3) -> list:
    """Each option independently, about one time in `n`."""
    return [o for o in options if rarely(draw, n)]


@st.composite
def fleets(draw, model: str, call_settings: str | None, call_pool: str | None, call_knobs: str | None):
    """1..8 boxes, biased so that most of them pass the gate for the call's model and the
    ranking keys (load, pressure, tie-breaks, order) often tie and must be broken."""
    n = 1 + draw(_INDEX[8])
    boxes = []
    for i in range(n):
        kind = pick(draw, KINDS)
        named = call_key(kind, model, call_settings)
        keys = KEYS[kind]
        wanted = named[0] if named is not None else keys[0]
        asked = named[1] if named is not None else None  # the settings this call asks for
        catalog = set(subset(draw, keys, 4))
        if not rarely(draw, 3):
            catalog.add(wanted)
        resident_keys = set(subset(draw, keys, 6))
        if not rarely(draw, 3):
            resident_keys.add(wanted)
        residents = {
            k: Resident(
                k,
                healthy=not rarely(draw, 5),
                loading=rarely(draw, 5),
                busy=rarely(draw, 2),
                last_used_s=float(draw(_INDEX[3])),
            )
            for k in sorted(resident_keys)
        }
        contracts = {}
        for k in sorted(resident_keys | catalog):
            sent = pick(draw, [None, asked, asked, *SETTINGS])
            if sent is not None:
                contracts[k] = sent
        pool = call_pool if not rarely(draw, 6) else pick(draw, [None, "a", "b"])
        boxes.append(
            BoxFacts(
                id=IDS[i],
                kind=kind,
                order=draw(_INDEX[4]),
                online=not rarely(draw, 10),
                pool=pool,
                blocked=rarely(draw, 10),
                catalog=frozenset(catalog),
                residents=residents,
                contracts=contracts,
                free_gpu_bytes=pick(draw, [None, 0, 1 << 30, 8 << 30]),
                # narrow ranges: ties are common, so every later sort key gets exercised
                pending=pick(draw, [0, 0, 1]),
                pressure=pick(draw, [1, 1, 0, 2]),
                reservations=pick(draw, [0, 0, 1]),
                last_picked_s=float(draw(_INDEX[3])),
                in_flight=pick(draw, [0, 1, 2]),
                max_inflight=pick(draw, [None, None, 1, 2]),
                cooling={k: pick(draw, [0, 1, 2]) for k in subset(draw, sorted(resident_keys | catalog), 6)},
                recent_refusals=pick(draw, [0, 0, 0, 1]),
                **(hugpy_own(draw, wanted, keys, asked, call_knobs, contracts) if kind is HUGPY else {}),
            )
        )
    return boxes


PAIR_ROWS = [{}, {"max_wait_s": 30}, {"kv_cache_type": "q8_0"}, {"blocked": "operator"},
             {"residency": "static"}, {"alloc_mode": "ram-only"}]
# A call's body knobs (pairs.call_knobs), as read_call hands them on
CALL_KNOBS = [None, None, '{"max_wait_s":5}', '{"kv_cache_type":"q8_0"}', '{"blocked":false,"max_wait_s":null}']
BLANKETS = [{}, {"tolerance": "slowest"}, {"max_wait_s": 90}, {"blocked": True}, {"model_paths": ["/m"]}]


def hugpy_own(draw, wanted: str, keys: list[str], asked: str | None, knobs: str | None, contracts: dict) -> dict:
    """A hugpy box's own pair settings and verdicts (sometimes), and seats loaded under the
    contract this call would get (so the serving tier stays reachable)."""
    if rarely(draw, 2):
        return {}
    rows = [{"worker": "w", "model_key": "*", "settings": pick(draw, BLANKETS)}] if rarely(draw, 2) else []
    rows += [{"worker": pick(draw, ["w", "w", "old"]), "model_key": k, "settings": pick(draw, PAIR_ROWS)}
             for k in subset(draw, keys, 3)]
    view = pairs.pair_view(rows, "w")
    for k in list(contracts):
        if not rarely(draw, 3):
            contracts[k] = pairs.contract(view, k, asked, pick(draw, [knobs, knobs, *CALL_KNOBS]))
    fits = {k: pick(draw, list(pairs.Fit)) for k in subset(draw, [wanted, *keys], 2)}
    return {"pairs": view, "fits": fits}


@st.composite
def scenarios(draw):
    model = pick(draw, MODELS if rarely(draw, 4) else VALID_MODELS)
    call_settings = pick(draw, SETTINGS)
    call_pool = pick(draw, [None, None, "a", "b"])
    knobs = pick(draw, CALL_KNOBS)
    boxes = draw(fleets(model, call_settings, call_pool, knobs))
    ids = [b.id for b in boxes]
    kinds = set(subset(draw, KINDS, 2)) if rarely(draw, 6) else set(KINDS)
    pin = pick(draw, ids + ["ghost"]) if rarely(draw, 8) else None
    c = Call(model=model, kinds=frozenset(kinds), settings=call_settings, pin=pin, pool=call_pool, knobs=knobs)
    tried = frozenset(subset(draw, ids, 5)) if rarely(draw, 3) else frozenset()
    eligible = frozenset(subset(draw, ids, 2)) if rarely(draw, 3) else None
    return c, boxes, tried, eligible


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios())
def test_decide_matches_reference(scenario):
    c, boxes, tried, eligible = scenario
    d = decide(c, boxes, tried, eligible)
    ref = reference_decide(c, boxes, tried, eligible)

    assert d.boxes == ref.boxes
    assert d.path.value == ref.path
    assert {b: w.tier for b, w in d.why.items()} == ref.tiers
    assert {b: r.code for b, r in d.ruled_out.items()} == ref.ruled_out
    check_partition(d, boxes, c.pin)

    by_id = {b.id: b for b in boxes}
    for box_id, reason in d.ruled_out.items():
        if box_id not in by_id:
            assert reason.code is ReasonCode.UNKNOWN_BOX and box_id == c.pin
            continue
        b = by_id[box_id]
        # re-derivable from that box alone
        assert why_not(c, b, tried, eligible) == reason
        assert decide(c, [b], tried, eligible).ruled_out[box_id] == reason
        assert reference_gate(c, b, tried, eligible) is reason.code
    for box_id in d.boxes:
        assert why_not(c, by_id[box_id], tried, eligible) is None
    if c.pin is not None:
        assert set(d.boxes) <= {c.pin}
        assert d.path in (Path.PINNED, Path.REFUSED)
    if eligible is not None:
        assert set(d.boxes) <= eligible
    assert not set(d.boxes) & tried


@settings(max_examples=150, deadline=None)
@given(scenario=scenarios())
def test_failover_retry_stays_inside_the_first_ranking(scenario):
    """Refuse the first box, decide again with `eligible`: the rest of the first ranking, in
    the same order when the facts did not move, never a box from outside it."""
    c, boxes, _, _ = scenario
    first = decide(c, boxes)
    if not first.boxes:
        return
    tried = {first.boxes[0]}
    retry = decide(c, boxes, tried, frozenset(first.boxes))
    assert retry.boxes == first.boxes[1:]
    if c.pin is not None:
        assert retry.boxes == ()  # a pin is never rerouted


@settings(max_examples=150, deadline=None)
@given(scenario=scenarios(), data=st.data())
def test_remembered_verdicts_follow_every_change_of_facts(scenario, data):
    """decide() reuses a box's verdict while the box's facts are the same object (Verdicts):
    across a run of decisions for one call, where each step swaps some boxes' facts for other
    facts under the same name and keeps the rest, every decision still equals the reference."""
    c, boxes, _, _ = scenario
    other = data.draw(fleets(c.model, c.settings, c.pool, c.knobs))
    verdicts = Verdicts()
    for _ in range(data.draw(st.integers(1, 6))):
        swap = data.draw(st.lists(st.booleans(), min_size=len(boxes), max_size=len(boxes)))
        boxes = [other[i] if flip and i < len(other) else b for i, (flip, b) in enumerate(zip(swap, boxes))]
        d = decide(c, boxes, verdicts=verdicts)
        ref = reference_decide(c, boxes, frozenset(), None)
        assert d.boxes == ref.boxes
        assert {b: w.tier for b, w in d.why.items()} == ref.tiers
        assert {b: r.code for b, r in d.ruled_out.items()} == ref.ruled_out
        other, boxes = boxes, other  # the next step swaps back and forth between both


def test_a_box_whose_facts_changed_is_judged_again():
    c, verdicts = call(), Verdicts()
    a, b = box("a", 0), box("b", 1)
    assert decide(c, [a, b], verdicts=verdicts).boxes == ("a", "b")
    second = decide(c, [a, b._replace(online=False)], verdicts=verdicts)
    assert second.boxes == ("a",) and second.ruled_out["b"].code is ReasonCode.OFFLINE
    # a's load moved (a new facts object): a is ranked again, b's first verdict is reused
    assert decide(c, [a._replace(pending=5), b], verdicts=verdicts).boxes == ("b", "a")


def test_verdicts_remember_first_decisions_only_and_stay_bounded():
    verdicts = Verdicts(max_calls=2)
    a = box("a", 0)
    decide(call(), [a], ("b",), verdicts=verdicts)  # a failover: nothing remembered
    decide(call(), [a], eligible=frozenset("a"), verdicts=verdicts)
    assert len(verdicts) == 0
    decide(call("m1"), [a], verdicts=verdicts)
    assert verdicts.of(call("m1"))["a"][0] is a
    decide(call("m2"), [a], verdicts=verdicts)
    decide(call("m3"), [a], verdicts=verdicts)  # past max_calls: starts over
    assert len(verdicts) == 1
    verdicts.clear()
    assert len(verdicts) == 0


def test_the_fleet_owns_its_verdicts_and_forgets_them_when_it_changes(tmp_path):
    from router._fastpath import Reservations
    from router.boxes.fleet import Fleet

    fleet = Fleet(tmp_path / "boxes.json", Reservations())
    decide(call(), [box("a", 0)], verdicts=fleet.verdicts)
    assert len(fleet.verdicts) == 1
    fleet._apply([])  # the boxes file changed (a reload or an edit)
    assert len(fleet.verdicts) == 0
