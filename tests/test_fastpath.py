"""The compiled hot path against its plain models (tests/models.py).

Reservations: random operation sequences, counts and answers equal after every step.
FrameScanner: split invariance (whole, one byte at a time, random split points) and equality
with the model for the same chunking.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

import router._fastpath as fastpath
from router._fastpath import (
    FIRST_CLEAN,
    FIRST_SUSPECT,
    HOLD,
    NDJSON,
    SSE,
    TOO_BIG,
    FrameScanner,
    Relay,
    Reservations,
)

try:
    from tests.models import FrameScannerModel, HistogramModel, ReservationModel
except ImportError:  # tests/ run as a rootless directory
    from models import FrameScannerModel, HistogramModel, ReservationModel

BOXES = range(8)


def test_compiled_module_loaded():
    assert fastpath.IMPL == "cython"
    assert fastpath.__file__.endswith(".so")


# --------------------------------------------------------------------------------------------
# Reservations
# --------------------------------------------------------------------------------------------


class ReservationMachine(RuleBasedStateMachine):
    """The compiled table and the model take the same operations; a scheduler publishes
    non-decreasing generations and calls reserve at the newest one (or a recent one still at
    or above the floor)."""

    tokens = Bundle("tokens")  # (compiled token, model token); stale ones stay in the bundle

    @initialize()
    def start(self):
        self.real = Reservations()
        self.model = ReservationModel()
        self.published = 0  # the newest snapshot generation

    def _stamp(self, back: int) -> int:
        return max(self.model.floor, self.published - back)

    @rule(target=tokens, box=st.sampled_from(BOXES), back=st.integers(0, 2))
    def reserve(self, box, back):
        g = self._stamp(back)  # the dispatcher may have seen a snapshot the table has not
        real = self.real.reserve(box, g)
        assert real > 0
        return (real, self.model.reserve(box, g))

    @rule(pair=tokens)
    def release(self, pair):
        real, model = pair
        assert self.real.release(real) == self.model.release(model)

    @rule(pair=consumes(tokens))
    def release_twice(self, pair):
        real, model = pair
        assert self.real.release(real) == self.model.release(model)
        assert self.real.release(real) is False
        assert self.model.release(model) is False

    @rule(bogus=st.sampled_from([0, -1, -(1 << 40), 1, 2, (1 << 62) + 3]))
    def release_bogus(self, bogus):
        assert self.real.release(bogus) is False

    @rule(target=tokens, pair=tokens, box=st.sampled_from(BOXES))
    def move(self, pair, box):
        real, model = pair
        was_live = self.model.is_live(model)
        new_real = self.real.move(real, box, self.published)
        new_model = self.model.move(model, box, self.published)
        if was_live:
            assert new_real == real, "a live reservation keeps its token"
            assert new_model == model
            return multiple()
        assert new_real != real, "a stale reservation becomes a new one"
        return (new_real, new_model)

    @rule(step=st.integers(1, 2))
    def publish(self, step):
        """A new snapshot exists; the table hears of it later (supersede)."""
        self.published += step

    @rule(back=st.integers(0, 2))
    def supersede(self, back):
        g = max(self.model.floor, self.published - back)
        assert self.real.supersede(g) == self.model.supersede(g)

    @rule(back=st.integers(1, 3))
    def late_snapshot(self, back):
        """A snapshot older than the floor changes nothing."""
        g = self.model.floor - back
        assert self.real.supersede(g) == 0
        assert self.model.supersede(g) == 0

    @precondition(lambda self: self.model.floor > 0)
    @rule(box=st.sampled_from(BOXES))
    def reserve_below_floor(self, box):
        with pytest.raises(ValueError):
            self.real.reserve(box, self.model.floor - 1)
        with pytest.raises(ValueError):
            self.model.reserve(box, self.model.floor - 1)

    @invariant()
    def same_counts(self):
        for box in BOXES:
            count = self.real.count(box)
            assert count >= 0
            assert count == self.model.count(box)
        assert self.real.live == self.model.live
        assert self.real.floor == self.model.floor
        assert self.real.count(99) == 0 and self.real.count(-1) == 0


ReservationMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestReservations = ReservationMachine.TestCase


def test_reservations_random_long_sequences():
    """Long seeded sequences: past the initial 256 slots and 16 boxes (the tables grow)."""
    for seed in range(6):
        rnd = random.Random(seed)
        real, model = Reservations(), ReservationModel()
        pairs: list[tuple[int, int]] = []
        published = 0
        n_boxes = 40
        for _ in range(3000):
            op = rnd.random()
            if op < 0.45 or not pairs:
                box = rnd.randrange(n_boxes)
                g = max(model.floor, published - rnd.randrange(3))
                pairs.append((real.reserve(box, g), model.reserve(box, g)))
            elif op < 0.75:
                r, m = rnd.choice(pairs)
                assert real.release(r) == model.release(m)
            elif op < 0.9:
                r, m = rnd.choice(pairs)
                box = rnd.randrange(n_boxes)
                live = model.is_live(m)
                nr, nm = real.move(r, box, published), model.move(m, box, published)
                assert (nr == r) == live
                pairs.append((nr, nm))
            elif op < 0.95:
                g = max(model.floor, published - rnd.randrange(3))
                assert real.supersede(g) == model.supersede(g)
            else:
                published += 1  # a new snapshot; the table hears of it later
            if rnd.random() < 0.05:
                for box in range(n_boxes):
                    assert real.count(box) == model.count(box) >= 0
        for box in range(n_boxes):
            assert real.count(box) == model.count(box) >= 0
        assert real.live == model.live


def test_reserve_below_floor_is_a_misuse():
    table = Reservations()
    token = table.reserve(0, 5)
    assert table.supersede(7) == 1
    assert table.floor == 7
    with pytest.raises(ValueError):
        table.reserve(0, 6)
    assert table.count(0) == 0
    # a stale reservation moved at a generation below the floor is a new reserve: also a misuse
    with pytest.raises(ValueError):
        table.move(token, 1, 6)
    assert table.reserve(0, 7) > 0
    with pytest.raises(ValueError):
        table.reserve(-1, 7)


def test_release_after_supersede_is_ignored():
    table = Reservations()
    token = table.reserve(3, 1)
    assert table.count(3) == 1
    assert table.supersede(2) == 1  # the snapshot's pending now counts it
    assert table.count(3) == 0
    assert table.release(token) is False
    assert table.count(3) == 0
    assert table.live == 0


def test_move_keeps_the_stamp():
    table = Reservations()
    token = table.reserve(0, 1)
    assert table.move(token, 2, 5) == token
    assert (table.count(0), table.count(2)) == (0, 1)
    # stamped at 1, not 5: the snapshot of generation 2 supersedes it
    assert table.supersede(2) == 1
    assert table.count(2) == 0


# --------------------------------------------------------------------------------------------
# FrameScanner
# --------------------------------------------------------------------------------------------

HUGPY_ERROR_FRAME = (
    b'data: {"id": "fe-7b81", "object": "chat.completion.chunk", "created": 1795958114, '
    b'"model": "nope", "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}], '
    b'"error": {"message": "model not found on this box: nope", "type": "not_found_error", '
    b'"code": 404}, "hugpy": {"request_id": "fe-7b81"}}'
)
ROLE_FRAME = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'

_text = st.text(alphabet="abcxyz {}\":,.01-", max_size=24).map(str.encode)


@st.composite
def sse_streams(draw):
    """A realistic SSE stream (no stray CR): comment blocks, event/id lines, data frames,
    maybe an error first frame, CRLF or LF (or mixed), maybe cut off mid-frame."""
    eol_choice = draw(st.sampled_from(["lf", "crlf", "mixed"]))

    def eol():
        if eol_choice == "mixed":
            return draw(st.sampled_from([b"\n", b"\r\n"]))
        return b"\n" if eol_choice == "lf" else b"\r\n"

    out = bytearray()
    for _ in range(draw(st.integers(0, 3))):  # comment-only blocks before anything
        out += b": ping" + eol() + eol()
    for _ in range(draw(st.integers(0, 2))):  # empty lines between blocks close nothing
        out += eol()
    first = draw(st.sampled_from(["role", "error", "event", "random", "multi", "none"]))
    if first == "role":
        out += ROLE_FRAME + eol() + eol()
    elif first == "error":
        out += HUGPY_ERROR_FRAME + eol() + eol()
    elif first == "event":
        kind = draw(st.sampled_from([b"error", b"message", b"model_load.start"]))
        out += b"event: " + kind + eol() + b"data:" + draw(_text) + eol() + eol()
    elif first == "random":
        out += b"data: " + draw(_text) + eol() + eol()
    elif first == "multi":
        out += b": note" + eol() + b"id: 7" + eol()
        out += b"data:" + draw(_text) + eol() + b"data:  " + draw(_text) + eol() + eol()
    for _ in range(draw(st.integers(0, 5))):
        block = draw(st.sampled_from(["data", "ping", "event", "blank"]))
        if block == "data":
            out += b"data: " + draw(_text) + eol() + eol()
        elif block == "ping":
            out += b": ping" + eol() + eol()
        elif block == "event":
            out += b"event: delta" + eol() + b"data: " + draw(_text) + eol() + eol()
        else:
            out += eol()
    if draw(st.booleans()):
        out += b"data: [DONE]" + eol() + eol()
    if draw(st.booleans()):
        out += b"data: cut off" + (eol() if draw(st.booleans()) else b"")
    return bytes(out)


@st.composite
def ndjson_streams(draw):
    eol_choice = draw(st.sampled_from([b"\n", b"\r\n"]))
    out = bytearray()
    for _ in range(draw(st.integers(0, 2))):
        out += eol_choice  # blank lines are not frames
    first = draw(st.sampled_from(["ok", "error", "random", "none"]))
    if first == "ok":
        out += b'{"model":"llama3","message":{"role":"assistant","content":"Hi"},"done":false}'
        out += eol_choice
    elif first == "error":
        out += b'{"error":"an error was encountered while running the model"}' + eol_choice
    elif first == "random":
        out += b" " + draw(_text) + b"x " + eol_choice
    for _ in range(draw(st.integers(0, 5))):
        line = json.dumps({"response": draw(_text).decode(), "done": False}).encode()
        out += line + eol_choice
        if draw(st.booleans()):
            out += eol_choice
    if draw(st.booleans()):
        out += b'{"done":true}'  # maybe unterminated
        if draw(st.booleans()):
            out += eol_choice
    return bytes(out)


streams = st.one_of(
    st.tuples(st.just(SSE), sse_streams()), st.tuples(st.just(NDJSON), ndjson_streams())
)


def split_at(data: bytes, cuts) -> list[bytes]:
    points = sorted({0, len(data), *(c for c in cuts if 0 <= c <= len(data))})
    return [data[a:b] for a, b in zip(points, points[1:])] or [data]


def run(scanner, chunks: list[bytes]) -> dict:
    """Feeds every chunk until the first frame's verdict and keeps the rest, as the relay does;
    returns what must not depend on where the chunks were cut."""
    verdicts = []
    first = None  # (verdict, start, end) of the chunk that ended the hold
    after: list[bytes] = []
    offset = 0
    for chunk in chunks:
        if first is not None:
            with pytest.raises(ValueError):
                scanner.feed(chunk)  # a misuse once the first frame is judged
            scanner.keep(chunk)
            after.append(chunk)
            offset += len(chunk)
            continue
        verdict = scanner.feed(chunk)
        verdicts.append(verdict)
        if verdict in (FIRST_CLEAN, FIRST_SUSPECT):
            first = (verdict, offset, offset + len(chunk))
        else:
            assert verdict in (HOLD, TOO_BIG)
        offset += len(chunk)
    held = scanner.take_held()
    assert scanner.take_held() == []
    # held chunks are the chunks themselves, unchanged, up to the one that ended the hold
    n_held = len(held)
    assert all(h is c for h, c in zip(held, chunks[:n_held]))
    assert b"".join(held) + b"".join(after) == b"".join(chunks)
    return {
        "first": first,
        "first_data": scanner.first_data,
        "verdicts": verdicts,
    }


def check_against_model(framing: int, data: bytes, chunks: list[bytes], hold_limit=1 << 20):
    real = run(FrameScanner(framing, hold_limit), chunks)
    model_scanner = FrameScannerModel(framing, hold_limit)
    model = run(model_scanner, chunks)
    assert real["verdicts"] == model["verdicts"]
    assert real["first_data"] == model["first_data"]
    if model_scanner.first_end is None:
        assert real["first"] is None
    else:
        verdict, start, end = real["first"]
        # the chunk that answered holds the byte that closed the first data frame
        assert start < model_scanner.first_end <= end
    return real, model_scanner.first_end


@settings(max_examples=200, deadline=None)
@given(case=streams, data=st.data())
def test_frame_scanner_split_invariance(case, data):
    framing, stream = case
    whole, first_end = check_against_model(framing, stream, [stream])
    bytewise = [stream[i : i + 1] for i in range(len(stream))]
    one_by_one, _ = check_against_model(framing, stream, bytewise)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    random_split, _ = check_against_model(framing, stream, split_at(stream, cuts))
    with_empty = split_at(stream, cuts)
    with_empty.insert(data.draw(st.integers(0, len(with_empty))), b"")
    check_against_model(framing, stream, with_empty)

    for run_ in (one_by_one, random_split):
        assert run_["first_data"] == whole["first_data"]
        assert (run_["first"] is None) == (whole["first"] is None)
        if whole["first"] is not None:
            assert run_["first"][0] == whole["first"][0]
    if first_end is not None:
        # one byte at a time, the verdict arrives with exactly the closing byte
        assert one_by_one["first"][2] == first_end
        assert whole["first"][0] in (FIRST_CLEAN, FIRST_SUSPECT)


@settings(max_examples=150, deadline=None)
@given(case=streams, limit=st.integers(0, 300), data=st.data())
def test_frame_scanner_matches_model_with_small_hold_limit(case, limit, data):
    """Same chunking, any hold limit: the same verdict for every chunk (TOO_BIG included)."""
    framing, stream = case
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    check_against_model(framing, stream, split_at(stream, cuts), hold_limit=limit)


@settings(max_examples=300, deadline=None)
@given(
    framing=st.sampled_from([SSE, NDJSON]),
    pieces=st.lists(
        st.sampled_from([b"\n", b"\r", b"\r\n", b"a", b" ", b":", b"data:", b"data: x", b"error"]),
        max_size=24,
    ),
    data=st.data(),
)
def test_frame_scanner_split_invariance_any_bytes(framing, pieces, data):
    """Fuzz: any bytes at all (stray CRs included), cut anywhere, judge the same."""
    stream = b"".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    bytewise = [stream[i : i + 1] for i in range(len(stream))]
    results = [
        run(FrameScanner(framing), c) for c in ([stream], bytewise, split_at(stream, cuts))
    ]
    whole = results[0]
    for other in results[1:]:
        assert other["first_data"] == whole["first_data"], stream
        assert (other["first"] is None) == (whole["first"] is None), stream


def test_frame_scanner_examples():
    sse = FrameScanner(SSE)
    assert sse.feed(b": ping\n\n") == HOLD
    assert sse.feed(b"event: x\n\n") == HOLD  # event-only block: still holding
    assert sse.feed(ROLE_FRAME + b"\n\ndata: a\n\n") == FIRST_CLEAN
    assert sse.first_data == ROLE_FRAME[len(b"data: ") :]
    with pytest.raises(ValueError):
        sse.feed(b"data: b\n\n")  # the rest is keep's

    err = FrameScanner(SSE)
    assert err.feed(HUGPY_ERROR_FRAME + b"\r\n\r") == HOLD
    assert err.feed(b"\n") == FIRST_SUSPECT
    assert b"not_found_error" in err.first_data

    nd = FrameScanner(NDJSON)
    assert nd.feed(b"\n\r\n") == HOLD
    assert nd.feed(b'{"error":"boom"}\n{"a":1}') == FIRST_SUSPECT
    assert nd.first_data == b'{"error":"boom"}'

    with pytest.raises(ValueError):
        FrameScanner(3)


@pytest.mark.parametrize(
    "framing,unit",
    [
        (SSE, b": ping\n\n"),  # frames, but none with data
        (SSE, b"data: no end"),  # a frame that never closes
        (SSE, b"event: x\r\n\r\n"),
        (NDJSON, b"x" * 7),  # one endless line
        (NDJSON, b"\r\n"),  # blank lines only
    ],
)
def test_frame_scanner_too_big(framing, unit):
    limit = 64
    stream = unit * (limit // len(unit) + 3)
    scanner, model = FrameScanner(framing, limit), FrameScannerModel(framing, limit)
    seen = 0
    for i in range(len(stream)):
        verdict = scanner.feed(stream[i : i + 1])
        assert verdict == model.feed(stream[i : i + 1])
        seen += 1
        assert verdict == (TOO_BIG if seen > limit else HOLD)
    assert scanner.relaying is False
    # whole, in one chunk: TOO_BIG at once
    assert FrameScanner(framing, limit).feed(stream) == TOO_BIG


def test_frame_scanner_first_frame_wins_over_too_big():
    """The chunk that closes the first data frame answers FIRST_*, even past the limit."""
    stream = b": " + b"p" * 100 + b"\n\ndata: ok\n\n"
    assert FrameScanner(SSE, 10).feed(stream) == FIRST_CLEAN
    assert FrameScannerModel(SSE, 10).feed(stream) == FIRST_CLEAN


@pytest.mark.parametrize(
    "framing,stream",
    [
        (NDJSON, b"\r\r\n"),  # a line whose content is one CR: a frame, however it is cut
        (SSE, b"data: x\n\r\r\n"),  # a non-empty line: the block stays open
    ],
)
def test_frame_scanner_cr_at_chunk_end_is_not_always_crlf(framing, stream):
    """A CR that ends a chunk is only a line ending if the next byte is LF."""
    whole = FrameScanner(framing)
    whole_verdicts = [whole.feed(stream)]
    cut = FrameScanner(framing)
    at = stream.index(b"\r") + 1  # cut between the two CRs
    cut_verdicts = [cut.feed(stream[:at]), cut.feed(stream[at:])]
    assert cut.first_data == whole.first_data

    def first(verdicts):
        return next((v for v in verdicts if v != HOLD), HOLD)

    assert first(cut_verdicts) == first(whole_verdicts)


def feed_or_keep(scanner, chunk: bytes) -> None:
    """What the attempt and the relay do with a chunk: feed it until the verdict, then keep it."""
    if scanner.relaying:
        scanner.keep(chunk)
    else:
        scanner.feed(chunk)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=40) | st.sampled_from([b"data: [DONE]", b"\n\n", b" \r\n", b"\t", b"data: [DO", b"NE]"]),
                max_size=12))
def test_a_stream_is_complete_by_its_kept_tail_as_the_plain_model_says(chunks):
    """The relay's `complete` (the scanner's tail, read in place) against its plain model: the
    stream's last TAIL bytes, trailing whitespace stripped, end with `data: [DONE]`; wherever the
    chunks were cut."""
    scanner = FrameScanner(SSE)
    for chunk in chunks:
        feed_or_keep(scanner, chunk)
    stream = b"".join(chunks)
    assert Relay(scanner).complete() == stream[-32:].rstrip(b" \t\r\n").endswith(b"data: [DONE]")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40) | st.sampled_from([b"data: [DONE]", b"\n\n", b" \r\n"]), max_size=12),
       st.integers(0, 12))
def test_keep_tracks_the_tail_as_feed_does(chunks, switch):
    """The relay's `keep` (no frame scan) leaves the same tail as `feed`, whenever it takes over."""
    fed, kept = FrameScanner(SSE), FrameScanner(SSE)
    for i, chunk in enumerate(chunks):
        feed_or_keep(fed, chunk)
        if i < switch:
            feed_or_keep(kept, chunk)
        else:
            kept.keep(chunk)
    assert Relay(kept).complete() == Relay(fed).complete()



# --------------------------------------------------------------------------------------------
# Histogram
# --------------------------------------------------------------------------------------------


@given(st.lists(st.floats(0, 400, allow_nan=False), unique=True, max_size=20).map(lambda b: tuple(sorted(b))),
       st.lists(st.one_of(st.floats(-1, 500, allow_nan=False), st.integers(0, 400).map(float)), max_size=50))
def test_the_compiled_histogram_counts_as_its_model(buckets, values):
    compiled, model = fastpath.Histogram(buckets), HistogramModel(buckets)
    for value in values + list(buckets):  # a value on a bound too (rule 1: bisect_left)
        compiled.observe(value)
        model.observe(value)
    assert (compiled.counts, compiled.total, compiled.count) == (model.counts, model.total, model.count)
