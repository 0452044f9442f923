"""Admission rules (router/core/admission.py), against the plain model in tests/models.py."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from models import WaitQueueModel
from router.core.admission import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    Priority,
    Waiter,
    QUEUE_FULL,
    QUEUE_SHARE_FULL,
    WaitQueue,
    backoff_s,
    fair_share,
    effective_priority,
    is_full,
    parse_priority,
)

BOXES = ("a", "b", "c")
CALLERS = ("k1", "k2", "k3", "10.0.0.9")

box_sets = st.frozensets(st.sampled_from(BOXES), min_size=1)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(CALLERS), st.sampled_from(list(Priority)), box_sets),
        st.tuples(st.just("remove"), st.integers(0, 60)),
        st.tuples(st.just("next"), st.sampled_from(BOXES), st.integers(0, 3)),
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(ops, st.integers(1, 12), st.integers(1, 12))
def test_queue_matches_the_model(operations, capacity, per_caller):
    """Same answers as the model for any interleaving of arrivals, quits and freed slots; no
    waiter lost, handed out twice, or handed out after it quit; never over capacity, nor a
    caller over its share."""
    queue, model = WaitQueue(capacity, per_caller), WaitQueueModel(capacity, per_caller)
    by_seq: dict[int, Waiter] = {}
    gone: set[int] = set()  # handed out or removed
    for op in operations:
        if op[0] == "push":
            _, caller, priority, boxes = op
            waiter = Waiter(caller, priority, boxes)
            ok = queue.push(waiter)
            seq = model.push(caller, int(priority), boxes)
            assert ok == (seq is not None)
            if ok:
                assert waiter.seq == seq
                by_seq[seq] = waiter
        elif op[0] == "remove":
            seq = op[1]
            if seq in by_seq:
                assert queue.remove(by_seq[seq]) == model.remove(seq)
                gone.add(seq)
        else:
            _, box, modulus = op
            # `fits` stands for the serve layer's decision: refuse some waiters, deterministically
            fits_seq = (lambda s: s % (modulus + 1) != 1) if modulus else (lambda s: True)
            got = queue.next_for(box, lambda w: fits_seq(w.seq))
            want = model.next_for(box, fits_seq)
            assert (got.seq if got else None) == want
            if got is not None:
                assert got.seq not in gone
                assert box in got.boxes
                gone.add(got.seq)
        assert len(queue) == len(model.waiting) <= capacity
        held = Counter(w.caller for w in queue.waiting())
        assert all(count <= per_caller for count in held.values())
        assert sorted(w.seq for w in queue.waiting()) == sorted(w[0] for w in model.waiting)


def drain(queue: WaitQueue, box: str) -> list[Waiter]:
    out = []
    while (w := queue.next_for(box)) is not None:
        out.append(w)
    return out


def test_classes_are_strict():
    q = WaitQueue(100)
    for i in range(3):
        q.push(Waiter(f"low{i}", Priority.LOW, frozenset("a")))
        q.push(Waiter(f"norm{i}", Priority.NORMAL, frozenset("a")))
    q.push(Waiter("late-high", Priority.HIGH, frozenset("a")))
    order = [w.priority for w in drain(q, "a")]
    assert order == sorted(order) and order[0] is Priority.HIGH


def test_a_heavy_caller_delays_a_light_one_by_one_turn():
    q = WaitQueue(1000)
    for _ in range(100):
        q.push(Waiter("heavy", Priority.NORMAL, frozenset("a")))
    q.push(Waiter("light", Priority.NORMAL, frozenset("a")))
    served = drain(q, "a")
    assert [w.caller for w in served].index("light") == 1  # one heavy turn, then the light call


def test_fifo_inside_a_caller_among_what_the_box_can_serve():
    q = WaitQueue(10)
    first_b = Waiter("k", Priority.NORMAL, frozenset("b"))
    first_a = Waiter("k", Priority.NORMAL, frozenset("a"))
    second_a = Waiter("k", Priority.NORMAL, frozenset({"a", "b"}))
    for w in (first_b, first_a, second_a):
        q.push(w)
    assert q.next_for("a") is first_a  # the call for b does not block the box a
    assert q.next_for("b") is first_b
    assert q.next_for("a") is second_a


def test_a_waiter_that_quit_is_never_handed_out():
    q = WaitQueue(10)
    w = Waiter("k", Priority.NORMAL, frozenset("a"))
    q.push(w)
    assert q.remove(w) and not q.remove(w)
    assert q.next_for("a") is None and len(q) == 0


def test_full_queue_refuses():
    q = WaitQueue(2, per_caller=2)
    assert q.push(Waiter("k", Priority.NORMAL, frozenset("a")))
    assert q.push(Waiter("k", Priority.NORMAL, frozenset("a")))
    assert not q.push(Waiter("k", Priority.HIGH, frozenset("a")))
    assert q.refusal_for("other") == q.refusal_for("k") == QUEUE_FULL


def test_one_caller_holds_at_most_its_share_and_only_its_excess_is_refused():
    """Issue 20 item 4: a burst of 30 from one caller into `--queue-size 20` takes 5 places (a
    quarter); the 25 others are refused, and a second caller still gets in."""
    q = WaitQueue(20)
    assert q.per_caller == fair_share(20) == 5
    burst = [q.push(Waiter("addr:10.0.0.1", Priority.NORMAL, frozenset("a"))) for _ in range(30)]
    assert burst.count(True) == 5 and burst[:5] == [True] * 5
    assert q.refusal_for("addr:10.0.0.1") == QUEUE_SHARE_FULL
    assert q.refusal_for("key:k2") is None
    assert q.push(Waiter("key:k2", Priority.LOW, frozenset("a")))
    # A place its caller gives back (handed out or left) can be taken again.
    assert q.next_for("a").caller == "addr:10.0.0.1"
    assert q.push(Waiter("addr:10.0.0.1", Priority.HIGH, frozenset("a")))
    assert [fair_share(n) for n in (0, 1, 4, 5, 20, 1024)] == [1, 1, 1, 2, 5, 256]


def test_priority_can_only_be_lowered():
    assert effective_priority(Priority.NORMAL, Priority.HIGH) is Priority.NORMAL
    assert effective_priority(Priority.NORMAL, Priority.LOW) is Priority.LOW
    assert effective_priority(Priority.HIGH, None) is Priority.HIGH
    assert parse_priority(" High ") is Priority.HIGH
    assert parse_priority("urgent") is None and parse_priority(None) is None


def test_capacity_and_backoff():
    assert not is_full(100, None)
    assert not is_full(1, 2) and is_full(2, 2) and is_full(3, 2)
    assert backoff_s(1) == BACKOFF_BASE_S
    assert backoff_s(2) == 2 * BACKOFF_BASE_S
    assert backoff_s(10_000) == BACKOFF_CAP_S  # capped, no overflow
    steps = [backoff_s(n) for n in range(1, 40)]
    assert steps == sorted(steps)


# -- the decision's side: full and cooling boxes wait, refusals count as load -----------------

from router.core.decide import decide  # noqa: E402
from router.core.types import BoxFacts, BoxKind, Call, Path, ReasonCode  # noqa: E402

HUGPY = BoxKind.HUGPY


def box(name: str, order: int, **kw) -> BoxFacts:
    return BoxFacts(id=name, kind=HUGPY, order=order, catalog=frozenset({"m"}), **kw)


def test_full_and_cooling_boxes_are_waited_for_others_are_not():
    call = Call(model="m", kinds=frozenset({HUGPY}))
    boxes = [
        box("full", 0, in_flight=2, max_inflight=2),
        box("cool", 1, cooling={"m": 0}),
        box("busy", 4, cooling={"m": 2}, in_flight=2),
        box("blocked", 2, blocked=True),
    ]
    d = decide(call, boxes)
    assert d.path is Path.REFUSED
    assert d.ruled_out["full"].code is ReasonCode.FULL and d.ruled_out["full"].detail == "2/2"
    assert d.waits_for == frozenset({"full", "cool", "busy"})
    boxes.append(box("free", 3, in_flight=5, max_inflight=6))
    boxes.append(box("below-its-ceiling", 5, cooling={"m": 2}, in_flight=1))
    assert set(decide(call, boxes).boxes) == {"below-its-ceiling", "free"}


def test_a_box_that_fails_fast_does_not_look_idle():
    call = Call(model="m", kinds=frozenset({HUGPY}))
    failing, steady = box("failing", 0, recent_refusals=2), box("steady", 1, pending=1)
    assert decide(call, [failing, steady]).boxes == ("steady", "failing")

