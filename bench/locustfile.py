"""Locust scenario for bench/run.py --locust: time to first token of streamed chat calls.
Alone, against a router already running that serves tiny-llama (README.md, "How fast"):
`locust -f bench/locustfile.py --headless -u 64 -r 64 -t 30s --host http://127.0.0.1:8080`.

Not a test (pytest collects only tests/), and never imported by the router: `import locust`
monkey-patches the process with gevent (locust/__init__.py calls `gevent.monkey.patch_all()`).

Each user, in a closed loop (no wait), POSTs one streamed tiny-llama call and times:
  * TTFT: until the first content frame with a non-empty token has arrived. The sim box sends
    its role frame (empty content) at once and then one token per cadence, so TTFT measures
    the first *token*, not the first byte;
  * stream total: until the connection's message ended, checked to hold `data: [DONE]`.
geventhttpclient's `iter_content(n)` blocks until n bytes or the end (measured: a first read of
64 KiB made the TTFT the whole stream's time), so the head of the stream is read in SMALL_READ
pieces until the token shows, the rest in big reads.

Both are fired as locust request events (so `--csv` has them, in locust's whole-ms rounding),
and the exact TTFTs are written as JSON to $BENCH_TTFT_OUT when the test stops.
"""

from __future__ import annotations

import json
import os
import re
import time

from locust import FastHttpUser, constant, events, task

PATH = "/v1/chat/completions"
BODY = {"model": "tiny-llama", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
FIRST_TOKEN = re.compile(rb'"content":\s*"[^"]')  # a delta whose content is not empty
SMALL_READ = 16  # bytes per read until the first token: small enough not to wait for the next frame
BIG_READ = 65536
DONE_MARK = b"data: [DONE]"

SAMPLES: dict[str, list[float]] = {"ttft_ms": [], "first_byte_ms": [], "total_ms": []}


class ChatStreamUser(FastHttpUser):
    wait_time = constant(0)  # closed loop: the cadence, not the user, sets the pace
    network_timeout = 30.0

    @task
    def chat_stream(self) -> None:
        t0 = time.perf_counter()
        start = time.time()
        with self.client.post(PATH, json=BODY, stream=True, catch_response=True,
                              name="chat stream (headers)") as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            seen, first_byte, ttft = b"", None, None
            for piece in resp.iter_content(SMALL_READ, decode_content=False):
                if first_byte is None:
                    first_byte = time.perf_counter() - t0
                seen += piece
                if FIRST_TOKEN.search(seen):
                    ttft = time.perf_counter() - t0
                    break
            if ttft is None:
                resp.failure("stream ended before its first token")
                return
            size, tail = len(seen), seen[-64:]
            for piece in resp.iter_content(BIG_READ, decode_content=False):
                size += len(piece)
                tail = (tail + piece)[-64:]
            if DONE_MARK not in tail:
                resp.failure("stream ended without [DONE]")
                return
        total = time.perf_counter() - t0
        SAMPLES["ttft_ms"].append(ttft * 1000)
        SAMPLES["first_byte_ms"].append(first_byte * 1000)
        SAMPLES["total_ms"].append(total * 1000)
        fire = self.environment.events.request.fire
        for name, value, length in (("TTFT", ttft, 0), ("stream total", total, size)):
            fire(request_type="SSE", name=name, response_time=value * 1000, response_length=length,
                 exception=None, context={}, start_time=start, url=None, response=None)


@events.test_stop.add_listener
def _write_samples(environment, **_kwargs) -> None:
    out = os.environ.get("BENCH_TTFT_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(SAMPLES, f)
