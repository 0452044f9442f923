"""The compiled Relay against its plain model (tests/models.py: RelayModel).

An answer is a head frame (framed answers), then known frames and arbitrary bytes, cut into
chunks (empty ones too) grouped into batches; the head is taken as serve/attempt.py takes it.
The relay and the model get the same batches and the same failing write or read.
"""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from router._fastpath import HOLD, NDJSON, SSE, FrameScanner, Relay
from router.serve.edge import ClientLeft
from router.upstream.pool import ConnectionLost

try:
    from tests.models import RelayModel
except ImportError:  # tests/ run as a rootless directory
    from models import RelayModel

FRAMINGS = [SSE, NDJSON, None]
IDS = ["sse", "ndjson", "raw"]
DONE = b"data: [DONE]"
HEAD = {
    SSE: b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n',
    NDJSON: b'{"message":{"role":"assistant"},"done":false}\n',
    None: b"",
}
PIECES = [b'data: {"x":1}\n\n', b": ping\n\n", b"event: e\r\ndata: y\r\n\r\n", b'{"done":true}\n',
          DONE, DONE + b"\n\n", b"\n\n", b" \r\n", b"data: [DO", b"NE]"]
# how a stream may end; past 20 bytes of whitespace `data: [DONE]` is out of the kept tail
ENDS = [b"", DONE, DONE + b"\r\n\r\n", DONE + b"\n" * 20, DONE + b"\n" * 21, b"data: [DO"]


def answers(framing):
    pieces = st.lists(st.sampled_from(PIECES) | st.binary(max_size=12), max_size=10)
    ends = st.sampled_from(ENDS)
    return st.tuples(pieces, ends).map(lambda p: HEAD[framing] + b"".join(p[0]) + p[1])


@st.composite
def batched(draw, stream: bytes) -> list[list[bytes]]:
    """`stream` cut anywhere (a repeated cut makes an empty chunk), the chunks grouped in order."""
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    groups = sorted(draw(st.lists(st.integers(0, len(chunks)), max_size=6)))
    batches = [chunks[a:b] for a, b in zip([0, *groups], [*groups, len(chunks)])]
    return [batch for batch in batches if batch]  # [] would end the answer


def head(framing, batches):
    """(scanner, first, the batches left) as serve/attempt.py hands them to the relay: a framed
    answer is fed to a scanner up to its first frame, the rest of that batch kept; an unframed
    answer's head is its first batch."""
    batches = list(batches)
    if framing is None:
        return None, b"".join(batches.pop(0)) if batches else b"", batches
    scanner, verdict, after = FrameScanner(framing), HOLD, []
    while verdict == HOLD:
        chunks = batches.pop(0)
        for index, chunk in enumerate(chunks):
            verdict = scanner.feed(chunk)
            if verdict != HOLD:
                after = chunks[index + 1 :]
                break
    for chunk in after:
        scanner.keep(chunk)
    return scanner, b"".join(scanner.take_held() + after), batches


class Ends:
    """The relay's two ends. `write` records what it is handed (with delivered and bytes_out as
    they were then) and raises ClientLeft at write number `fail_write`; `next_chunks` hands out
    the batches, then [], and raises ConnectionLost at read number `fail_read`."""

    def __init__(self, relay, batches, fail_write=None, fail_read=None) -> None:
        self.relay, self.batches = relay, list(batches)
        self.fail_write, self.fail_read = fail_write, fail_read
        self.writes: list[tuple[bytes, bool, int]] = []
        self.reads = 0

    async def write(self, data: bytes) -> None:
        self.writes.append((data, self.relay.delivered, self.relay.bytes_out))
        if len(self.writes) == self.fail_write:
            raise ClientLeft("the client left")
        await asyncio.sleep(0)

    async def next_chunks(self) -> list[bytes]:
        self.reads += 1
        if self.reads == self.fail_read:
            raise ConnectionLost("the box died")
        await asyncio.sleep(0)
        return self.batches.pop(0) if self.batches else []


def drive(relay, first, batches, fail_write=None, fail_read=None) -> dict:
    """Runs `relay` (compiled or model) to its end; what it did and how far it got."""
    ends = Ends(relay, batches, fail_write, fail_read)

    async def main():
        try:
            await relay.run(first, ends.write, ends.next_chunks)
        except (ClientLeft, ConnectionLost) as exc:
            return type(exc)

    raised = uvloop.run(main())
    return {"writes": ends.writes, "raised": raised, "bytes_out": relay.bytes_out,
            "delivered": relay.delivered, "last": relay.last, "data": relay.data,
            "complete": relay.complete()}


def both(framing, batches, fail_write=None, fail_read=None) -> dict:
    """The compiled relay and the model on the same answer: equal in all; each write a batch."""
    scanner, first, rest = head(framing, batches)
    real = drive(Relay(scanner), first, rest, fail_write, fail_read)
    assert real == drive(RelayModel(framing, first), first, rest, fail_write, fail_read)
    expected = [joined for joined in (b"".join(b) for b in [[first], *rest]) if joined]
    assert [w[0] for w in real["writes"]] == expected[: len(real["writes"])]
    if real["raised"] is None:  # one write per batch with bytes, nothing more
        assert len(real["writes"]) == len(expected)
    assert real["bytes_out"] == sum(len(w[0]) for w in real["writes"])
    return real


@settings(max_examples=300, deadline=None)
@given(framing=st.sampled_from(FRAMINGS), data=st.data())
def test_relay_matches_model(framing, data):
    stream = data.draw(answers(framing))
    failing = st.none() | st.integers(1, 5)
    both(framing, data.draw(batched(stream)), data.draw(failing), data.draw(failing))


@settings(max_examples=200, deadline=None)
@given(framing=st.sampled_from(FRAMINGS), data=st.data())
def test_relay_split_invariance(framing, data):
    stream = data.draw(answers(framing))
    whole = both(framing, [[stream]])
    assert whole["delivered"] == (framing == SSE and whole["complete"])
    for _ in range(2):
        run = both(framing, data.draw(batched(stream)))
        assert b"".join(w[0] for w in run["writes"]) == stream
        assert run["bytes_out"] == len(stream)
        assert run["complete"] == whole["complete"]
        if whole["complete"] and framing == SSE:
            assert run["delivered"], "the [DONE] that ends the stream went out, however cut"
        if DONE not in stream:
            assert not run["delivered"]


@pytest.mark.parametrize("framing", FRAMINGS, ids=IDS)
def test_single_chunk_batch_is_not_copied(framing):
    one = b"".join([b'data: {"x":', b"1}\n\n"])  # built at run time: no shared constant
    two = [b'{"a":1}\n', b"data: b\n\n"]
    scanner, first, _ = head(framing, [[HEAD[framing] or b"raw"]])
    run = drive(Relay(scanner), first, [[one], two, [one]])
    data = [w[0] for w in run["writes"]]
    assert data[0] is first and data[1] is one and data[3] is one
    assert data[2] == b"".join(two)
    assert run["last"] == b"".join(two) and run["data"] is one


@pytest.mark.parametrize("framing", FRAMINGS, ids=IDS)
def test_errors_propagate_and_say_how_far_it_got(framing):
    first, body, end = HEAD[framing] or b"raw", b"data: a\n\n", DONE + b"\n\n"
    size = len(first + body)
    for fail_write, fail_read, raised, bytes_out, data in [
        (2, None, ClientLeft, size, body),  # the write that raised was handed its bytes
        (3, None, ClientLeft, size + len(end), end),
        (None, 2, ConnectionLost, size, body),
        (None, 3, ConnectionLost, size + len(end), end),
    ]:
        run = both(framing, [[first], [body], [end]], fail_write, fail_read)
        assert run["raised"] is raised
        assert run["bytes_out"] == bytes_out and run["data"] == data
        assert run["delivered"] == (framing == SSE and data == end)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_close_delimited_sse_ends_with_done(eol):
    """An SSE stream is complete when its bytes end with `data: [DONE]` (and blank lines); cut
    anywhere before that it is not, whether it came whole or a byte at a time."""
    stream = HEAD[SSE] + b"data: a" + eol + eol + DONE + eol + eol
    done_at = len(stream) - 2 * len(eol)
    for cut in range(done_at - len(DONE) - 3, len(stream) + 1):
        part = stream[:cut]
        for batches in ([[part]], [[part[i : i + 1]] for i in range(len(part))]):
            run = both(SSE, batches)
            assert run["complete"] == run["delivered"] == (cut >= done_at), (cut, len(batches))


def test_delivered_is_not_taken_back():
    """`delivered`: a `data: [DONE]` went to the client's write; bytes after it (a box that goes
    on) leave it set, though the stream no longer ends complete."""
    run = both(SSE, [[HEAD[SSE] + DONE + b"\n\n"], [b"data: more\n\n"]])
    assert run["delivered"] and not run["complete"]
    assert not both(SSE, [[HEAD[SSE] + DONE + b"\n\ndata: more\n\n"]])["delivered"]
