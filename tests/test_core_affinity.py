"""router.core.affinity against its plain model (tests/models.py), the compiled prefix chain and
index against theirs, and the serve-side pieces that feed them (box cache epochs, the answer's
facts)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import orjson
from hypothesis import given, settings, strategies as st

from router._fastpath import AffinityIndex, json_members, prefix_chain
from router.boxes.config import BoxConfig
from router.boxes.state import BoxState, Inventory
from router.core.affinity import (
    BOUND_DEPTH,
    MIN_PULL_DEPTH,
    DEFAULT_SLACK,
    KEY,
    OFF,
    PREFIX,
    RESPONSE,
    SESSION,
    USER,
    Key,
    Slack,
    Steer,
    bound_key,
    prefix_key,
    place,
    response_key,
)
from router.core.decide import decide
from router.core.types import BoxFacts, BoxKind, Call, Resident
from router.facades.usage import reported, response_id

from models import AffinityIndexModel, prefix_chain_model, reference_place


def index_of(capacity: int) -> AffinityIndex:
    """The compiled index as router.serve.affinity makes it: with router.core.affinity's depths."""
    return AffinityIndex(capacity, MIN_PULL_DEPTH, BOUND_DEPTH)


# -- place: rules 4-6 -----------------------------------------------------------------------------

entries = st.lists(
    st.tuples(st.integers(0, 1), st.integers(0, 12), st.integers(0, 3)), min_size=0, max_size=8
).map(lambda keys: sorted(
    ((tier, load, pressure, (0, 0), (i, f"b{i}")), f"b{i}", None) for i, (tier, load, pressure) in enumerate(keys)
))
def moved_first(ranked: list, index: int) -> list:
    """`ranked` as decide leaves it after place(): entry `index` first, the others in order."""
    return ranked[index:index + 1] + ranked[:index] + ranked[index + 1:]


slacks = st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0]), st.sampled_from([0.0, 0.25, 0.5, 1.0]))


@settings(max_examples=400)
@given(entries, st.one_of(st.none(), st.integers(0, 9)), st.booleans(), slacks, st.integers(0, 1 << 32))
def test_place_equals_its_model(ranked, pulled, keyed, slack, spin):
    pull = (f"b{pulled}", 3) if pulled is not None else None
    index, hit = place(list(ranked), pull, keyed, Slack(*slack), spin)
    assert 0 <= index < max(len(ranked), 1)
    got = moved_first(ranked, index)
    assert got == reference_place(list(ranked), pull, keyed, *slack, spin)
    limit = ranked[0][0][1] + slack[0] + slack[1] * ranked[0][0][1] if ranked else 0
    assert hit == (pull is not None and slack != (0.0, 0.0) and bool(ranked) and ranked[0][0][0] == 0
                   and any(e[1] == pull[0] and e[0][0] == 0 and e[0][1] <= limit for e in ranked))
    if got and got[0] is not ranked[0]:
        assert got[0][0][0] == 0  # never out of the serving tier


@given(entries, st.integers(0, 9), st.integers(0, 1 << 32))
def test_slack_zero_is_the_seeds_order(ranked, pulled, spin):
    assert place(list(ranked), (f"b{pulled}", BOUND_DEPTH), True, OFF, spin) == (0, False)


def test_a_miss_spreads_over_the_tied_boxes_by_the_spin():
    ranked = sorted(((0, 1, 1, (0, 0), (i, f"b{i}")), f"b{i}", None) for i in range(4))
    firsts = {ranked[place(ranked, None, True, DEFAULT_SLACK, spin)[0]][1] for spin in range(8)}
    assert firsts == {"b0", "b1", "b2", "b3"}
    assert place(ranked, None, False, DEFAULT_SLACK, 3) == (0, False)  # no key: the seeds' order


def test_a_pulled_box_past_the_slack_is_left():
    ranked = sorted(((0, load, 1, (0, 0), (i, f"b{i}")), f"b{i}", None) for i, load in enumerate([2, 9]))
    assert place(ranked, ("b1", 5), True, Slack(2, 0.5), 0) == (0, False)  # 9 > 2 + 2 + 1
    assert place(ranked, ("b1", 5), True, Slack(2, 3), 0)[1] is True  # 9 <= 2 + 2 + 6


def test_decide_applies_the_steer_inside_the_serving_tier_only():
    resident = {"m": Resident("m")}
    boxes = [BoxFacts(id=name, kind=BoxKind.OPENAI, order=i, residents=resident if name != "c" else {},
                      catalog=frozenset({"m"}), pending=load)
             for i, (name, load) in enumerate([("a", 0), ("b", 2), ("c", 0)])]
    call = Call(model="m", kinds=frozenset({BoxKind.OPENAI}))
    assert decide(call, boxes).boxes == ("a", "b", "c")
    assert decide(call, boxes, steer=Steer(("b", 4), True, DEFAULT_SLACK, 0)).boxes == ("b", "a", "c")
    assert decide(call, boxes, steer=Steer(("c", 4), True, DEFAULT_SLACK, 0)).boxes == ("a", "b", "c")
    assert decide(call, boxes, steer=Steer(("b", 4), True, OFF, 0)).boxes == ("a", "b", "c")


# -- the key: rules 1 and 2 -----------------------------------------------------------------------


def test_the_first_present_key_wins_and_is_scoped():
    session, codex, nothing = {"x-router-session": "s", "session_id": "c"}, {"session_id": "c"}, {"host": "h"}
    assert bound_key(session, ["k", "u", "r"], "addr:1", "m").kind == SESSION
    assert bound_key(codex, ["k", "u", "r"], "addr:1", "m")[:3] == (SESSION, hash(("addr:1", "m", SESSION, "c")), ())
    assert bound_key(nothing, ["k", "u", "r"], "addr:1", "m").kind == KEY
    assert bound_key(nothing, [None, "u", "r"], "addr:1", "m").kind == USER
    assert bound_key(nothing, [3, "", "r"], "addr:1", "m").kind == RESPONSE  # not strings: absent
    assert bound_key(nothing, [None, None, None], "addr:1", "m") is None  # then the prompt's
    assert prefix_key((5, 6)) == Key(PREFIX, 0, (5, 6))
    assert prefix_key(()) is None and prefix_key((5,)) is None  # one element: no key
    one = bound_key(session, [], "addr:1", "m")
    assert one != bound_key(session, [], "addr:2", "m") and one != bound_key(session, [], "addr:1", "n")
    assert bound_key(nothing, [None, None, "resp_1"], "key:a", "m").bound == response_key("key:a", "m", "resp_1")
    assert type(one) is Key and one.kind == SESSION and one.chain == ()


# -- the index: rules 3, 7, 8 ---------------------------------------------------------------------

def boxes_at(epochs: dict[str, int]) -> dict:
    """What the index is given: box name -> a state whose cache_epoch(model) is epochs[name]."""
    return {name: SimpleNamespace(cache_epoch=lambda model_key, at=at: at) for name, at in epochs.items()}


EPOCH = boxes_at({"a": 1, "b": 1})


def test_a_conversation_is_found_by_its_history_and_a_shared_preamble_never_pulls():
    index = index_of(1000)
    index.learn(Key(PREFIX, 0, (1, 10)), "a", "m", 1)  # system prompt 1, first message 10
    assert index.pull(Key(PREFIX, 0, (1, 10, 11, 12)), EPOCH) == ("a", 2)
    assert index.pull(Key(PREFIX, 0, (1, 20)), EPOCH) is None  # only the system prompt in common
    index.learn(Key(PREFIX, 0, (1, 10, 11, 12)), "a", "m", 1)
    assert index.pull(Key(PREFIX, 0, (1, 10, 11, 12, 13, 14)), EPOCH) == ("a", 4)
    # a first message shared by two conversations (a template) is a preamble from then on
    index.learn(Key(PREFIX, 0, (1, 10, 31, 32)), "b", "m", 1)
    assert index.pull(Key(PREFIX, 0, (1, 10, 41)), EPOCH) is None
    assert index.pull(Key(PREFIX, 0, (1, 10, 31, 32, 33)), EPOCH) == ("b", 4)


def test_a_node_of_another_epoch_is_dropped_and_a_binding_moves():
    index = index_of(1000)
    index.learn(Key(PREFIX, 0, (1, 10)), "a", "m", 1)
    assert index.pull(Key(PREFIX, 0, (1, 10, 11)), boxes_at({"a": 2})) is None
    assert index.pull(Key(PREFIX, 0, (1, 10, 11)), boxes_at({"b": 1})) is None  # a box gone
    assert index.pull(Key(PREFIX, 0, (1, 10, 11)), EPOCH) == ("a", 2)
    index.learn(Key(SESSION, 77), "a", "m", 1)
    index.learn(Key(SESSION, 77), "b", "m", 1)
    assert index.pull(Key(SESSION, 77), EPOCH) == ("b", BOUND_DEPTH)


@given(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=6), max_size=60), st.integers(1, 40))
def test_the_index_never_holds_more_than_its_capacity(chains, capacity):
    index = index_of(capacity)
    for chain in chains:
        index.learn(Key(PREFIX, 0, tuple(chain)), "a", "m", 1)
        assert len(index) <= capacity


# Operations on an index: learn a chain (kind 0) or a binding (1), bind (2), pull (3); a chain is
# a few small hashes (so chains share prefixes and continue them differently), a binding one.
operations = st.lists(st.tuples(
    st.integers(0, 3), st.lists(st.integers(1, 12), min_size=0, max_size=6), st.sampled_from("abc"),
    st.integers(0, 7), st.integers(1, 2)), max_size=50)


@settings(max_examples=300)
@given(operations, st.integers(1, 30))
def test_the_compiled_index_equals_its_model(steps, capacity):
    """router._fastpath.AffinityIndex against tests/models.py AffinityIndexModel: the same pulls,
    and the same entries in the same LRU order after every step (epochs: box c's moves on)."""
    index, model = index_of(capacity), AffinityIndexModel(capacity)
    epochs = {"a": 1, "b": 1, "c": 1}
    for kind, chain, box, known, epoch in steps:
        key = Key(PREFIX, 0, tuple(chain)) if kind == 0 and chain else Key(SESSION, -len(chain) - 1)
        if kind in (0, 1):
            index.learn(key, box, "m", epoch, known)
            model.learn(key, box, "m", epoch, known)
        elif kind == 2:
            index.bind(key.bound, box)
            model.bind(key.bound, box)
        else:
            epochs["c"] += 1
            at = boxes_at(epochs)
            assert index.pull(key, at) == model.pull(key, at)
        assert list(index.entries.items()) == list(model.entries.items())
        assert len(index) == len(model) <= capacity


def test_box_cache_epochs_change_on_unload_reload_other_settings_and_restart():
    box = BoxState(BoxConfig(name="a", url="http://127.0.0.1:1", kind=BoxKind.HUGPY), 0, 0)
    box.set_inventory(Inventory(residents={"m": Resident("m"), "n": Resident("n")}))
    seen = [box.cache_epoch("m")]
    box.record_dispatch("m", None, 1.0)
    box.set_inventory(Inventory(residents={"m": Resident("m", last_used_s=5), "n": Resident("n")}))
    assert box.cache_epoch("m") == seen[-1]  # a new call, a use: nothing lost
    for change in (lambda: box.record_dispatch("m", "q4", 2.0),  # other settings: a reload
                   lambda: box.set_inventory(Inventory(residents={"n": Resident("n")})),  # unloaded
                   lambda: box.forget_contracts(),  # restarted
                   lambda: box.mark_unreachable()):
        n_before = box.cache_epoch("n")
        change()
        assert box.cache_epoch("m") not in seen
        seen.append(box.cache_epoch("m"))
    assert box.cache_epoch("n") != n_before  # a restart or loss drops every model


# -- the compiled chain against its model (module rule 6) ------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.text(min_size=300, max_size=1200),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300)
@given(st.lists(json_values, max_size=12), st.sampled_from(["", " ", "\n  "]), st.integers(0, (1 << 64) - 1))
def test_prefix_chain_equals_its_model(elements, space, seed):
    value = ("[" + space + ("," + space).join(json.dumps(e, indent=None) for e in elements) + space + "]").encode()
    body = b'{"model": "m", "messages": ' + value + b"}"
    start, end, _ = json_members(body, (b"messages",))[0]
    assert prefix_chain(body, start, end, seed) == prefix_chain_model(value, seed)


@given(st.text(max_size=5000), st.integers(0, (1 << 64) - 1))
def test_prefix_chain_of_a_string_equals_its_model(text, seed):
    value = json.dumps(text).encode()
    body = b'{"prompt": ' + value + b"}"
    start, end, _ = json_members(body, (b"prompt",))[0]
    assert prefix_chain(body, start, end, seed) == prefix_chain_model(value, seed)


def test_a_resent_history_makes_the_same_chain_and_a_longer_one_extends_it():
    turn = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    longer = turn + [{"role": "assistant", "content": "a"}]

    def chain(messages, seed=7):
        body = orjson.dumps({"model": "m", "messages": messages})
        start, end, _ = json_members(body, (b"messages",))[0]
        return prefix_chain(body, start, end, seed)

    assert chain(longer)[:2] == chain(turn) and len(chain(longer)) == 3
    assert chain(turn, 8) != chain(turn, 7)  # the seed (salt, caller, model) changes every hash
    assert all(0 < h < 1 << 62 for h in chain(longer))
    assert len(chain([{"role": "user", "content": "x"}] * 300)) == 256  # at most 256 elements
    # a long element counts by its edges and its length: each of them changes its hash
    long = "".join(f"line {i}\n" for i in range(400))
    same = chain([turn[0], {"role": "user", "content": long}])
    for other in (long.replace("line 1\n", "line X\n", 1), long[:-2] + "Y\n", long + "!"):
        assert chain([turn[0], {"role": "user", "content": other}])[1] != same[1]


# -- the answer's facts (genai rule 3) -----------------------------------------------------------


def test_cached_tokens_and_response_ids_are_read_the_engines_way():
    openai_body = orjson.dumps({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}})
    assert reported(openai_body).cached == 7
    llama = orjson.dumps({"usage": {"prompt_tokens": 9}, "timings": {"cache_n": 5, "prompt_n": 4}})
    assert reported(llama).cached == 5
    completed = b'event: response.completed\ndata: ' + orjson.dumps({"type": "response.completed", "response": {
        "id": "resp_1", "output": [{"id": "msg_2"}],
        "usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 3}}}}) + b"\n\n"
    assert (reported(completed).cached, response_id(completed)) == (3, "resp_1")
    whole = orjson.dumps({"id": "resp_9", "output": [{"id": "msg_1", "content": [{"text": '"id": "resp_fake"'}]}]})
    assert response_id(whole) == "resp_9"  # a quote inside a text is escaped: never an id
    assert reported(orjson.dumps({"prompt_eval_count": 3, "done": True})).cached is None  # Ollama: none


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3), st.sampled_from("ab")), max_size=40))
def test_learning_only_a_turns_new_nodes_finds_what_learning_everything_finds(turns):
    """Rule 7's shortcut (`known`) against writing the whole chain on every call: equal pulls."""
    whole, shortcut = index_of(10_000), index_of(10_000)
    histories: dict[int, tuple[int, ...]] = {}
    for conversation, grow, box in turns:
        chain = histories.get(conversation, (1,)) + tuple(1000 * conversation + len(histories.get(conversation, ())) + k
                                                          for k in range(grow))
        histories[conversation] = chain
        key = Key(PREFIX, 0, chain)
        pulled = whole.pull(key, EPOCH)
        assert shortcut.pull(key, EPOCH) == pulled
        whole.learn(key, box, "m", 1)
        shortcut.learn(key, box, "m", 1, pulled[1] if pulled is not None and pulled[0] == box else 0)
