"""router.facades.usage: the tokens a box reports, in each API's words; asking a stream for them
and taking the answer back out, byte for byte."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.facades.usage import UsageStrip, ask_usage, reported

OPENAI_STREAM = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"\\"prompt_tokens\\": 99"}}]}\n\n'
    b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
)
USAGE_CHUNK = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12,' \
              b'"prompt_tokens_details":{"cached_tokens":2}}}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("tail, counts", [
    (OPENAI_STREAM + USAGE_CHUNK + DONE, (3, 9, 2)),
    (b'{"message":{"content":"x"},"done":false}\n{"done":true,"prompt_eval_count":12,"eval_count":4}\n', (12, 4, None)),
    (b'{\n  "usage": {"input_tokens": 5, "output_tokens": 7, "input_tokens_details": {"cached_tokens": 1}}\n}', (5, 7, 1)),
    (b'data: {"type":"chat.end","result":{"stats":{"input_tokens":12,"total_output_tokens":3}}}\n\n', (12, 3, None)),
    (b'{"object":"list","data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}', (4, None, None)),  # an embedding
    (OPENAI_STREAM + DONE, None),  # a model's text that looks like a count is never one
    (b'{"usage": {"prompt_tokens": true, "completion_tokens": -1}}', None),
    (b"", None),
])
def test_counts_are_read_off_the_answers_end_in_each_apis_words(tail, counts):
    assert reported(tail) == counts


def test_asking_for_usage_adds_only_the_flag():
    body = b'{"model":"m","stream":true,"messages":[]}'
    asked = ask_usage(body)
    assert orjson.loads(asked) == {**orjson.loads(body), "stream_options": {"include_usage": True}}
    assert asked.replace(b'"stream_options":{"include_usage":true},', b"") == body
    other = b'{"model":"m","stream":true,"stream_options":{"x":1}}'
    assert orjson.loads(ask_usage(other))["stream_options"] == {"x": 1, "include_usage": True}
    assert ask_usage(b'{"stream_options":{"include_usage":true},"stream":true}') is None  # the client asked


@settings(deadline=None)  # a loaded machine must not fail a rule
@given(st.lists(st.integers(1, 60), max_size=12))
def test_the_usage_chunk_is_taken_out_and_nothing_else_changes_however_the_stream_is_cut(cuts):
    stream = OPENAI_STREAM + USAGE_CHUNK + DONE
    pieces, start = [], 0
    for size in cuts:
        pieces.append(stream[start:start + size])
        start += size
    pieces.append(stream[start:])
    written: list[bytes] = []

    async def write(data: bytes) -> None:
        written.append(data)

    async def relay() -> UsageStrip:
        strip = UsageStrip(write)
        for piece in pieces:
            if piece:
                await strip.write(piece)
        await strip.flush()
        return strip

    strip = asyncio.run(relay())
    assert b"".join(written) == OPENAI_STREAM + DONE
    assert strip.usage == USAGE_CHUNK and strip.dropped_bytes == len(USAGE_CHUNK)


class WholeScanRefused(bytes):
    def __contains__(self, part):
        raise AssertionError("scanned the whole answer, not its last USAGE_WINDOW bytes")


def test_counts_are_read_off_the_window_only_however_long_the_answer():
    """A whole answer is its tail: a 100 MB embedding list is read for its last 16 KiB only, on
    the loop, for every call."""
    answer = WholeScanRefused(b'{"data":[' + b"0.1," * 50_000 + b'0.1],"usage":{"prompt_tokens":4,"total_tokens":4}}')
    assert reported(answer) == (4, None, None)


def test_a_count_the_client_echoed_before_the_usage_never_counts():
    """A Responses answer echoes the call's tools, whose JSON schemas may hold any key: a client
    that names `prompt_tokens` and `completion_tokens` there must not set its own charge."""
    schema = b'{"type":"object","properties":{},"prompt_tokens":0,"completion_tokens":0,"cached_tokens":0}'
    answer = (b'{"id":"resp_1","object":"response","output":[{"type":"message","content":[{"type":"output_text",'
              b'"text":"hi"}]}],"tools":[{"type":"function","name":"f","parameters":' + schema + b'}],'
              b'"usage":{"input_tokens":900,"input_tokens_details":{"cached_tokens":100},"output_tokens":50,'
              b'"total_tokens":950},"user":null}')
    assert reported(answer) == (900, 50, 100)


def test_a_null_stream_options_is_a_client_that_did_not_ask():
    """`"stream_options": null` is how some clients write "not given": the router asks the box
    for the usage all the same, rather than charging the stream by an estimate."""
    asked = ask_usage(b'{"model":"m","stream":true,"stream_options":null}')
    assert asked == b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}'


def _last_by_regex(tail: bytes, keys: tuple[bytes, ...], floor: int) -> int | None:
    """rule 1 written with bytes.rfind and a regular expression: the reference for the compiled
    `last_counts` (router/_fastpath_body.pxi), one count's keys."""
    import re

    value, after = None, floor
    for key in keys:
        at = tail.rfind(key, after)
        while at >= 0:
            found = re.compile(rb"\s*:\s*(\d{1,15})").match(tail, at + len(key))
            if found is not None:
                value, after = int(found.group(1)), at + 1
                break
            at = tail.rfind(key, after, at)
    return value


TAIL_PIECES = st.lists(st.sampled_from([
    b'"prompt_tokens":1234567890123456789', b'"input_tokens" :\x0b 42', b'"cache_n"\r:\n7',
    b'"prompt_tokens"', b'"input_tokens"', b'"cache_n"', b'cache_n"', b":", b" ", b"\n", b"\t", b"\r", b"\x0b", b"\x0c",
    b"7", b"1234567890123456789", b'"', b"{", b",", b"x", b"\\",
]), max_size=40).map(b"".join)


# last_counts' counts: one, several (one pass finds them all), a key in two counts, keys that
# do not share their first byte.
COUNTS = st.sampled_from([
    ((b'"prompt_tokens"', b'"input_tokens"', b'"cache_n"'),),
    ((b'"prompt_tokens"', b'"input_tokens"'), (b'"cache_n"',)),
    ((b'"input_tokens"',), (b'"cache_n"', b'"input_tokens"'), ()),
    ((b'"cache_n"', b'cache_n"'), (b'"prompt_tokens"',)),
])


@given(TAIL_PIECES, COUNTS, st.integers(0, 50))
def test_the_compiled_counts_read_a_tail_as_the_reference_does(tail, counts, floor):
    from router._fastpath import last_counts

    assert last_counts(tail, counts, floor) == tuple(_last_by_regex(tail, keys, floor) for keys in counts)
