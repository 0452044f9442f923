"""The tokens a box reports for a call, in each API's words, and asking for them on a stream.

Rules:
1. A report is read off the end of an answer (`reported`): the last USAGE_WINDOW bytes of a whole
   body or of a stream's last writes. Prompt tokens are OpenAI's `prompt_tokens` (the Responses
   and Messages APIs' and LM Studio's stats' `input_tokens`, Ollama's `prompt_eval_count`);
   completion tokens `completion_tokens` (`output_tokens`, `total_output_tokens`, `eval_count`);
   cached tokens `prompt_tokens_details.cached_tokens` (the Responses API's
   `input_tokens_details.cached_tokens`, `cache_read_input_tokens`, llama.cpp's `timings.cache_n`). The
   occurrence of any of the names nearest the end counts: a stream's running counts end with
   the whole call's, and whatever an answer echoes of the call (a Responses answer's tools,
   whose schemas may hold any key) comes before its usage. A JSON key is
   found by its quoted name followed by `:`: inside a JSON string a quote is escaped, so a
   model's text can never read as a count. A hugpy box's own accounting is its final `usage`
   frame, read the same way.
2. `ask_usage(body)`: the body of an OpenAI-shaped stream with `stream_options.include_usage`
   true, or None when the client asked for usage itself (then its usage chunk is its own).
   Nothing else in the body changes: the member is added after the opening `{`, or an existing
   `stream_options` object (or `null`) is rewritten with the flag on.
3. `UsageStrip` is the client's side of a stream the router asked usage for: it passes every
   SSE event through byte for byte except the usage chunk (`"choices":[]` with a `usage`), which
   it keeps for rule 1. An event is written once it is whole, so a chunk boundary inside one
   delays that part of it until its end arrives, never reorders or changes a byte.
4. `response_id(tail)`: a Responses answer's own id (`resp_…`), read off its end the same way: a
   whole body's top-level `id`, a stream's `response.completed` event's `response.id` (the
   answer's items have ids of other prefixes). Affinity binds it to the box that answered.
"""

from __future__ import annotations

import re
from typing import Awaitable, Callable, NamedTuple

import orjson

from router._fastpath import json_members, last_counts
from router.core.types import new_tuple
from router.facades.genai import OPERATIONS

# A usage report sits at the end of an answer: OpenAI's `usage` is the body's last member, an
# Ollama answer's counts are its final line's last fields, LM Studio's `stats` follow `usage`.
USAGE_WINDOW = 16 << 10
PROMPT_KEYS = (b'"prompt_tokens"', b'"input_tokens"', b'"prompt_eval_count"')
COMPLETION_KEYS = (b'"completion_tokens"', b'"output_tokens"', b'"total_output_tokens"', b'"eval_count"')
CACHED_KEYS = (b'"cached_tokens"', b'"cache_read_input_tokens"', b'"cache_n"')
# What `reported` looks for: the cached count only where the answer's end says "cache" at all
# (else the one pass would go on to the window's start for it).
COUNTS = (PROMPT_KEYS, COMPLETION_KEYS)
COUNTS_CACHED = COUNTS + (CACHED_KEYS,)
_USAGE_CHUNK = re.compile(rb'"choices"\s*:\s*\[\s*\]')
STREAM_OPTIONS = (b"stream_options",)
# Routes whose answer is generated text: only there is an answer's size an estimate of tokens
# (speech is audio, an image is an image, an embedding has no completion).
TEXT_ANSWER_ROUTES = frozenset(path for path, operation in OPERATIONS.items() if operation != "embeddings")
INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'


class Reported(NamedTuple):
    prompt: int | None
    completion: int | None
    cached: int | None


def reported(tail: bytes) -> Reported | None:
    """The counts at the end of `tail` (rule 1, read in one pass by the compiled
    router._fastpath.last_counts), or None when it reports none."""
    floor = max(0, len(tail) - USAGE_WINDOW)
    if tail.rfind(b"cache", floor) >= 0:  # (from the end, where a report is)
        counts = last_counts(tail, COUNTS_CACHED, floor)
    else:
        counts = last_counts(tail, COUNTS, floor) + (None,)
    if counts[0] is None and counts[1] is None:
        return None
    return new_tuple(Reported, counts)


_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,200})"')


def response_id(tail: bytes) -> str | None:
    """Rule 4: the last `resp_` id in the end of `tail`, or None."""
    found = None
    for found in _RESPONSE_ID.finditer(tail, max(0, len(tail) - USAGE_WINDOW)):
        pass
    return found.group(1).decode() if found is not None else None


def ask_usage(body: bytes) -> bytes | None:
    """Rule 2. The body is one JSON object (the call's inspection checked it)."""
    span = json_members(body, STREAM_OPTIONS)[0]
    if span is None:
        start = body.index(b"{") + 1
        rest = body[start:].lstrip()
        joiner = INCLUDE_USAGE if not rest.startswith(b"}") else INCLUDE_USAGE[:-1]
        return body[:start] + joiner + body[start:]
    start, end, _ = span
    options = orjson.loads(body[start:end])
    if options is None:  # `"stream_options": null` (some clients' default) asks for nothing
        options = {}
    if not isinstance(options, dict):
        return None  # not ours to fix: the box answers the client's own mistake
    if options.get("include_usage") is True:
        return None
    return body[:start] + orjson.dumps({**options, "include_usage": True}) + body[end:]


class UsageStrip:
    """Rule 3: a `write` for the relay that drops the usage chunk the router asked for."""

    __slots__ = ("write_through", "held", "usage", "dropped_bytes")

    def __init__(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        self.write_through = write
        self.held = b""  # the start of an event whose end has not arrived
        self.usage = b""  # the usage chunk, kept for `reported`
        self.dropped_bytes = 0

    async def write(self, data: bytes) -> None:
        if self.held:
            data = self.held + data
            self.held = b""
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if end < len(data):  # the last event is not whole yet
            data, self.held = data[:end], data[end:]
        if b'"usage"' in data:
            data = self._drop_usage(data)
        if data:
            await self.write_through(data)

    def _drop_usage(self, data: bytes) -> bytes:
        kept = []
        for event in re.split(rb"(?<=\n\n)|(?<=\r\n\r\n)", data):
            if b'"usage"' in event and _USAGE_CHUNK.search(event):
                self.usage = event
                self.dropped_bytes += len(event)
            else:
                kept.append(event)
        return b"".join(kept)

    async def flush(self) -> None:
        """The stream ended: an unfinished last event goes out as it came."""
        if self.held:
            held, self.held = self.held, b""
            await self.write_through(held)
