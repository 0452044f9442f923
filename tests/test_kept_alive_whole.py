"""A kept-alive stream whose box answers whole (issue 20 item 9): the router had sent the stream's
head and `: waiting` comments, then the box answered `application/json` 200. The answer goes out
in the stream's format, or the row says why it did not; never `done` for an answer the client
did not get (router/serve/reply.py rule 4, deliver.py rule 5)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from conftest import wait_for
from support.boxes import RawBox
from support.raw_calls import client, row_of, rows

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "user", "content": "x"}]
COMPLETION = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "whole answer"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
}).encode()
KEEPALIVE = ("--stream-keepalive", "0.2")


def late(head: bytes, body: bytes, after_s: float = 0.7):
    """A box that answers after `after_s` (long enough for the router's keep-alives)."""
    async def answer(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(after_s)
        writer.write(head + body)
        await writer.drain()
    return answer


def sized(content_type: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\nContent-Length: %d\r\n\r\n" % len(body)


def chunked(body: bytes) -> tuple[bytes, bytes]:
    half = len(body) // 2
    pieces = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:])) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n", pieces


def streamed(router) -> tuple[list, str]:
    with client(router).chat.completions.with_streaming_response.create(
            model="tiny", messages=MESSAGES, stream=True) as response:
        call_id = response.headers["x-hugpy-router-request-id"]
        return list(response.parse()), call_id


@pytest.mark.parametrize("framing", ["sized", "chunked"])
def test_a_whole_json_answer_after_keep_alives_reaches_the_client_as_a_stream(start_fleet_in_process, framing):
    head, body = (sized(b"application/json", COMPLETION), COMPLETION) if framing == "sized" else chunked(COMPLETION)
    box = RawBox("whole", late(head, body))
    router = start_fleet_in_process(box, extra_args=KEEPALIVE)
    chunks, call_id = streamed(router)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "whole answer"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage.total_tokens == 3
    row = row_of(router, call_id)
    assert (row["state"], row["http_status"], row["error"]) == ("done", 200, None)


def test_a_whole_answer_the_stream_cannot_carry_is_a_failed_row_with_its_reason(start_fleet_in_process):
    page = b"<html>not a stream</html>"
    box = RawBox("html", late(sized(b"text/html", page), page))
    router = start_fleet_in_process(box, extra_args=KEEPALIVE)
    with pytest.raises(openai.APIError) as info:
        streamed(router)
    assert "cannot carry" in str(info.value)
    logged = wait_for(lambda: [(r["state"], r["error"]) for r in rows(router) if r["route"] == "/v1/chat/completions"], 3)
    assert logged == [("failed", "answer_not_a_stream")]
