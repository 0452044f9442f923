"""A hugpy box's pair settings and verdicts (router/core/pairs.py) against contracts/hugpy-wrapper.md
§11.1-11.2: the merge order property-tested against a plain model of the box's own code
(db.pair_knobs, call_knobs.merge), and the contract's [run] examples as table rows."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core import pairs
from router.core.errors import BadRequest
from router.core.pairs import BLANKET_KNOBS, EMPTY, Fit

KNOBS = ["max_wait_s", "tolerance", "kv_cache_type", "alloc_mode", "blocked", "resident_priority",
         "model_paths", "frobnicate", "ctx_pct", "residency"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-1, 3), st.sampled_from([1.0, 0.5, "q8_0", "slowest", "ram-only"]),
                   st.lists(st.sampled_from([0, 1, True, "gpu-only"]), max_size=2))
knob_dicts = st.dictionaries(st.sampled_from(KNOBS), VALUES, max_size=5)


def model_merge(blanket: dict, pair: dict, call: dict) -> dict:
    """The box, literally: pair_knobs = {**blanket ∩ BLANKET_KNOBS, **pair}; call_knobs.merge lets
    every call key but `blocked` win."""
    saved = {k: v for k, v in blanket.items() if k in BLANKET_KNOBS}
    saved.update(pair)
    for k, v in call.items():
        if k != "blocked":
            saved[k] = v
    return saved


@settings(max_examples=300, deadline=None)
@given(blanket=knob_dicts, pair=knob_dicts, call=knob_dicts)
def test_merge_matches_the_boxs_order(blanket, pair, call):
    view = pairs.pair_view([{"worker": "w", "model_key": "*", "settings": blanket},
                            {"worker": "w", "model_key": "m", "settings": pair}], "w")
    merged = pairs.merge(pairs.effective(view, "m"), call)
    assert merged == model_merge(blanket, pair, call)
    for k, v in call.items():  # the call wins every conflict, false and 0 included
        if k != "blocked":
            assert merged[k] == v
    for k, v in pair.items():  # keys the call does not name still apply
        if k not in call or k == "blocked":
            assert merged[k] == v
    # a call can neither set nor clear `blocked`
    assert ("blocked" in merged) is ("blocked" in pair)
    assert merged.get("blocked") == pair.get("blocked")


@settings(max_examples=500, deadline=None)
@given(blanket=knob_dicts, pair=knob_dicts, other=knob_dicts)
def test_contracts_are_equal_exactly_when_the_merged_knobs_are(blanket, pair, other):
    rows = [{"worker": "w", "model_key": "*", "settings": blanket}, {"worker": "w", "model_key": "m", "settings": pair}]
    edited = [rows[0], {"worker": "w", "model_key": "m", "settings": other}]
    a = pairs.contract(pairs.pair_view(rows, "w"), "m", "ram-only")
    b = pairs.contract(pairs.pair_view(edited, "w"), "m", "ram-only")

    def reloads(knobs):  # the box compares seat contracts as Python dicts: False == 0, 1.0 == 1
        return {k: v for k, v in model_merge(blanket, knobs, {"alloc_mode": "ram-only"}).items()
                if k not in pairs.NOT_CONTRACT and v is not None}

    assert (a == b) is (reloads(pair) == reloads(other))


OPTIONS = [None, "ram-only", "kv-q8_0", "kv-f16+ram-only", "ctx-50+fa"]


def box_contract(blanket: dict, pair: dict, body_knobs: dict, options: str | None) -> dict:
    """The box, literally: `_resolve_variant` puts the options' knobs over `body.knobs`,
    `_placement` merges that over pair_knobs (call_knobs.merge), and the seat keeps what its
    contract holds (`_same_contract` compares dicts)."""
    call = {**body_knobs, **pairs.option_knobs(options)}
    return {k: v for k, v in model_merge(blanket, pair, call).items()
            if k not in pairs.NOT_CONTRACT and v is not None}


def read_contract(text: str | None) -> dict:
    return json.loads(text) if text else {}


@settings(max_examples=500, deadline=None)
@given(blanket=knob_dicts, pair=knob_dicts, knobs=knob_dicts, options=st.sampled_from(OPTIONS),
       other_knobs=knob_dicts, other_options=st.sampled_from(OPTIONS))
def test_a_calls_body_knobs_enter_the_contract_as_the_box_merges_them(blanket, pair, knobs, options,
                                                                       other_knobs, other_options):
    view = pairs.pair_view([{"worker": "w", "model_key": "*", "settings": blanket},
                            {"worker": "w", "model_key": "m", "settings": pair}], "w")
    got = pairs.contract(view, "m", options, pairs.call_knobs(knobs))
    merged = box_contract(blanket, pair, knobs, options)
    assert read_contract(got) == merged  # Python's ==: the box's own comparison
    option_keys = pairs.option_knobs(options).keys()
    for k, v in knobs.items():  # the call wins every conflict, false and 0 included ...
        if k not in pairs.NOT_CONTRACT and k not in option_keys:  # ... its options over its knobs
            assert read_contract(got).get(k) == v
    assert "blocked" not in read_contract(got)  # a call can neither set nor clear `blocked`
    saved = pairs.effective(view, "m")
    for k, v in saved.items():  # keys the call does not name still apply
        if k not in knobs and k not in option_keys and k not in pairs.NOT_CONTRACT and v is not None:
            assert read_contract(got)[k] == v
    # two calls reuse one seat exactly when the box would
    other = pairs.contract(view, "m", other_options, pairs.call_knobs(other_knobs))
    assert (got == other) is (merged == box_contract(blanket, pair, other_knobs, other_options))


def test_call_knobs_are_the_bodys_object_in_one_spelling():
    assert pairs.call_knobs({"tolerance": "slowest", "max_wait_s": 5}) == pairs.call_knobs(
        {"max_wait_s": 5, "tolerance": "slowest"}) == '{"max_wait_s":5,"tolerance":"slowest"}'
    assert pairs.call_knobs({"max_wait_s": None}) == '{"max_wait_s":null}'  # clears the saved one
    # the box takes no knobs from these (and refuses a call whose knobs are a list or a string)
    for nothing in (None, False, 0, {}, [], "", ["max_wait_s"], "max_wait_s=5"):
        assert pairs.call_knobs(nothing) is None
    big = {"quants": ["x" * 100] * 40}
    with pytest.raises(BadRequest) as exc:
        pairs.call_knobs(big)
    assert exc.value.code == "knobs_too_large" and "x" * 10 not in str(exc.value)


def test_a_null_body_knob_clears_a_saved_one_and_options_win_over_knobs():
    """§5, §11.2.6: `{**body.knobs, **options}` then merge(pair, …)."""
    view = pairs.pair_view([{"worker": "w", "model_key": "*", "settings": {"max_wait_s": 90}},
                            {"worker": "w", "model_key": "m", "settings": {"kv_cache_type": "q8_0"}}], "w")
    assert pairs.contract(view, "m", None, None) == '{"kv_cache_type":"q8_0","max_wait_s":90}'
    assert pairs.contract(view, "m", None, '{"max_wait_s":null}') == '{"kv_cache_type":"q8_0"}'
    assert pairs.contract(view, "m", "kv-f16", '{"kv_cache_type":"q4_0","max_wait_s":5}') == (
        '{"kv_cache_type":"f16","max_wait_s":5}')
    assert pairs.contract(view, "m", None, '{"blocked":true}') == pairs.contract(view, "m", None, None)


def test_option_over_pair_settings_as_the_box_merges_them():
    """§11.2.6: pair `kv_cache_type: q8_0` + `model@ram-only` is a ram-only load with q8_0 KV."""
    view = pairs.pair_view([{"worker": "w", "model_key": "m", "settings": {"kv_cache_type": "q8_0"}}], "w")
    assert pairs.contract(view, "m", "ram-only") == '{"alloc_mode":"ram-only","kv_cache_type":"q8_0"}'
    # the call's own kv type wins over the pair's
    assert pairs.contract(view, "m", "kv-f16+ram-only") == '{"alloc_mode":"ram-only","kv_cache_type":"f16"}'
    # without settings or options there is no contract: what a box without settings always compared
    assert pairs.contract(EMPTY, "m", "ram-only") == '{"alloc_mode":"ram-only"}'
    assert pairs.contract(view, "other", None) is None


def test_a_views_contracts_are_remembered_by_the_view_and_bounded():
    """The memo belongs to the view (no module-level memo keyed on id()): a view with equal
    settings starts empty, an absent contract is remembered too, and a full memo starts over."""
    rows = [{"worker": "w", "model_key": "m", "settings": {"kv_cache_type": "q8_0"}}]
    view = pairs.pair_view(rows, "w")
    first = pairs.contract(view, "m", "ram-only")
    assert pairs.contract(view, "other", None) is None
    assert view.contracts == {("m", "ram-only", None): first, ("other", None, None): None}
    assert pairs.contract(view, "m", "ram-only") is first  # looked up, not worked out again
    equal = pairs.pair_view(rows, "w")
    assert equal == view and equal.contracts == {}  # the memo is no part of the view's value
    for n in range(pairs.CONTRACT_MEMO):
        pairs.contract(view, f"m{n}", None)
    assert 0 < len(view.contracts) <= pairs.CONTRACT_MEMO


def test_option_tokens_become_the_boxs_knobs():
    assert pairs.option_knobs("ctx-low+fa+kv-q4_0+no-moe") == {
        "ctx_preset": "low", "flash_attn": True, "kv_cache_type": "q4_0", "moe": False}
    assert pairs.option_knobs("ctx-50+ctx-max") == {"ctx_pct": 50, "ctx_preset": "xhigh"}
    assert pairs.option_knobs("4bit+explicit+fit+q4_k_m") == {
        "bnb_4bit": True, "alloc_mode": "explicit", "@fit": True, "gguf_file": "@q4_k_m"}


def test_rows_of_another_worker_and_box_only_knobs_do_not_count():
    """§11.2.7's [run] rows: the blanket's box-only keys are not inherited; rows under an old
    worker name are not effective."""
    rows = [
        {"worker": "contractbox", "model_key": "tiny-llama",
         "settings": {"max_wait_s": 30, "ctx_range_enabled": True, "frobnicate": 7, "blocked": "operator"}},
        {"worker": "contractbox", "model_key": "*", "settings": {"tolerance": "slowest", "max_wait_s": 90,
                                                                 "model_paths": ["/m"]}},
        {"worker": "oldname", "model_key": "ghost-model", "settings": {"blocked": True}},
    ]
    view = pairs.pair_view(rows, "contractbox")
    assert pairs.effective(view, "tiny-llama") == {
        "tolerance": "slowest", "max_wait_s": 30, "ctx_range_enabled": True, "frobnicate": 7, "blocked": "operator"}
    assert pairs.effective(view, "ghost-model") == {"tolerance": "slowest", "max_wait_s": 90}
    assert pairs.blocked_by(view, "tiny-llama") == "tiny-llama"
    assert pairs.blocked_by(view, "ghost-model") is None
    assert pairs.pair_view(rows, "nobody") is EMPTY


def test_names_match_as_the_box_matches_them():
    """_key_match: exact first, else `owner~repo` in either direction, case-insensitively."""
    rows = [{"worker": "w", "model_key": "Org~Tiny", "settings": {"blocked": True}},
            {"worker": "w", "model_key": "big", "settings": {"max_wait_s": 1}},
            {"worker": "w", "model_key": "org~big", "settings": {"max_wait_s": 2}}]
    view = pairs.pair_view(rows, "w")
    assert pairs.blocked_by(view, "tiny") == "tiny"
    assert pairs.blocked_by(view, "other~tiny") is None  # a different owner is a different model
    assert pairs.own_row(view, "big") == {"max_wait_s": 1}  # exact wins
    assert pairs.own_row(view, "x~big") == {"max_wait_s": 1}  # `big` is the suffix of x~big
    assert pairs.own_row(view, "org~big") == {"max_wait_s": 2}


def test_a_blanket_block_covers_every_model():
    view = pairs.pair_view([{"worker": "w", "model_key": "*", "settings": {"blocked": "maintenance"}}], "w")
    assert view.blanket == {}  # `blocked` is no blanket knob: not inherited, yet it blocks the box
    assert pairs.blocked_by(view, "anything") == "*"


def row(key="m", mode="gpu-only", fits=True, status="candidate", on_disk=True):
    return {"model_key": key, "on_disk": on_disk, "feasibility": {"status": status},
            "auto": {"standard": {"mode": mode, "ctx": 2048, "fits": fits}}}


def test_verdicts_per_model():
    """§11.1.2-11.1.7: no row or every row impossible fits nowhere; `fits: null` is unknown;
    a remote pair (`on_disk: false`) is not held."""
    assert pairs.fit_of([]) is Fit.NONE
    assert pairs.fit_of([row(status="impossible", fits=False)]) is Fit.NONE
    assert pairs.fit_of([row(on_disk=False)]) is Fit.NONE
    assert pairs.fit_of([row(fits=None)]) is Fit.UNKNOWN
    assert pairs.fit_of([row(mode="ram-only")]) is Fit.RAM
    assert pairs.fit_of([row(mode="ram-only"), row(mode="max-gpu")]) is Fit.GPU
    assert pairs.fit_of([{"model_key": "m", "auto": {}}]) is Fit.UNKNOWN  # no facts: `auto` is {}
    fits = pairs.fits_by_model([row("a"), row("b", mode="ram-only")], ["a", "b", "c"])
    assert fits == {"a": Fit.GPU, "b": Fit.RAM, "c": Fit.NONE}
