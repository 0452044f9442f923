"""Many concurrent open streams through the router: the client half of bench/run.py's
"open streams" figure.

    .venv/bin/python bench/open_streams.py URL --streams 2000 --frames 33 --cadence-ms 200

Opens `--streams` streaming chat calls (raw sockets on uvloop, one asyncio Protocol per
connection, `--batch` connections every `--batch-gap-ms` so the listen backlog is never the
bottleneck), holds them all open while the box trickles frames at its cadence, and checks that
every stream receives every frame (`data: ` events, `[DONE]` included) and its end (the chunked
end, or the close of an answer with neither chunks nor a length, as a hugpy box sends it), with
no gap between consecutive frames longer than `--stall-factor` × the cadence. Each finished
stream closes its connection.

Prints one line, `OPEN_STREAMS_JSON {...}`: streams asked, opened, completed, stalled (any gap
over the threshold, or incomplete), failures by cause, the peak number open at once, the largest
gap, and percentiles of first-frame time and stream duration. Bounded by `--timeout-s`: what has
not finished by then counts as incomplete.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from collections import Counter
from urllib.parse import urlsplit

import uvloop

import report  # bench/ is this script's directory, first on sys.path

FRAME = b"data: "
CHUNKED_END = b"\r\n0\r\n\r\n"


class Tally:
    def __init__(self) -> None:
        self.open_now = 0
        self.peak_open = 0
        self.opened = 0
        self.all_done = asyncio.get_running_loop().create_future()
        self.remaining = 0

    def opened_one(self) -> None:
        self.opened += 1
        self.open_now += 1
        self.peak_open = max(self.peak_open, self.open_now)

    def closed_one(self) -> None:
        self.open_now -= 1

    def finished_one(self) -> None:
        self.remaining -= 1
        if self.remaining == 0 and not self.all_done.done():
            self.all_done.set_result(None)


class StreamCall(asyncio.Protocol):
    """One streaming call: request on connect, then counts frames and their arrival gaps."""

    __slots__ = ("request", "tally", "t_start", "t_first", "t_last", "max_gap", "frames", "status",
                 "head_done", "buf", "tail", "done", "error", "transport", "t_end", "connected",
                 "close_delimited")

    def __init__(self, request: bytes, tally: Tally, t_start: float) -> None:
        self.request, self.tally, self.t_start = request, tally, t_start
        self.t_first = self.t_last = self.t_end = 0.0
        self.max_gap = 0.0
        self.frames = 0
        self.status = 0
        self.head_done = False
        self.buf = b""  # the head until it is complete
        self.tail = b""  # the last bytes of the body, so a frame marker split across reads counts
        self.done = False
        self.connected = False
        self.close_delimited = False  # the answer ends when the server closes (no chunks, no length)
        self.error = ""
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.connected = True
        self.tally.opened_one()
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.head_done:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.buf[:end], self.buf[end + 4:]
            self.buf = b""
            self.head_done = True
            try:
                self.status = int(head.split(b" ", 2)[1])
            except (IndexError, ValueError):
                self.status = -1
            if self.status != 200:
                self._finish(f"http_{self.status}")
                return
            lowered = head.lower()
            self.close_delimited = b"transfer-encoding: chunked" not in lowered and b"content-length:" not in lowered
            if not data:
                return
        joined = self.tail + data
        new = joined.count(FRAME) - self.tail.count(FRAME)
        self.tail = joined[-16:]
        if new:
            if self.frames == 0:
                self.t_first = now
            else:
                self.max_gap = max(self.max_gap, now - self.t_last)
            self.t_last = now
            self.frames += new
        if joined.endswith(CHUNKED_END):
            self._finish("")

    def connection_lost(self, exc) -> None:
        if self.connected:
            self.connected = False
            self.tally.closed_one()
        if not self.done:
            self._finish("" if self.close_delimited and exc is None else "reset" if exc else "eof_before_end")

    def _finish(self, error: str) -> None:
        if self.done:
            return
        self.done = True
        self.error = error
        self.t_end = time.monotonic()
        self.tally.finished_one()
        if self.transport is not None:
            self.transport.close()


def raise_fd_limit(needed: int) -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


async def run(args: argparse.Namespace) -> dict:
    url = urlsplit(args.url)
    host, port = url.hostname, url.port
    body = json.dumps({"model": args.model, "stream": True,
                       "messages": [{"role": "user", "content": "open streams"}]}).encode()
    request = (f"POST {url.path or '/'} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
               f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    tally = Tally()
    tally.remaining = args.streams
    calls: list[StreamCall] = []
    connect_errors: Counter[str] = Counter()
    t0 = time.monotonic()
    deadline = t0 + args.timeout_s

    async def connect(call: StreamCall) -> None:
        try:
            await asyncio.wait_for(loop.create_connection(lambda: call, host, port),
                                   max(0.1, deadline - time.monotonic()))
        except (OSError, asyncio.TimeoutError) as exc:
            connect_errors[type(exc).__name__] += 1
            call._finish("connect_" + type(exc).__name__)

    connects = []
    for i in range(0, args.streams, args.batch):
        for _ in range(min(args.batch, args.streams - i)):
            call = StreamCall(request, tally, time.monotonic())
            calls.append(call)
            connects.append(loop.create_task(connect(call)))
        await asyncio.sleep(args.batch_gap_ms / 1000)
    ramp_s = time.monotonic() - t0
    try:
        await asyncio.wait_for(asyncio.shield(tally.all_done), max(0.1, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        pass
    elapsed = time.monotonic() - t0
    for call in calls:
        if not call.done:
            call._finish("timeout")
    for task in connects:
        task.cancel()
    await asyncio.sleep(0.1)  # let the closes go out

    threshold_s = args.stall_factor * args.cadence_ms / 1000
    causes: Counter[str] = Counter()
    stalled = completed = 0
    for call in calls:
        complete = not call.error and call.frames == args.frames
        if call.error:
            causes[call.error] += 1
        elif call.frames != args.frames:
            causes[f"frames_{call.frames}"] += 1
        completed += complete
        stalled += (not complete) or call.max_gap > threshold_s
    firsts = [1000 * (c.t_first - c.t_start) for c in calls if c.frames]
    durations = [1000 * (c.t_end - c.t_start) for c in calls if not c.error]
    gaps = [1000 * c.max_gap for c in calls if c.frames > 1]
    return {
        "streams": args.streams, "opened": tally.opened, "completed": completed, "stalled": stalled,
        "failures": dict(causes), "peak_open": tally.peak_open, "frames_expected": args.frames,
        "frames_received": sum(c.frames for c in calls),
        "stall_threshold_ms": 1000 * threshold_s,
        "max_gap_ms": max(gaps) if gaps else None, "gap_p99_ms": report.percentile(gaps, 99),
        "first_frame_p50_ms": report.percentile(firsts, 50), "first_frame_p99_ms": report.percentile(firsts, 99),
        "first_frame_max_ms": max(firsts) if firsts else None,
        "duration_p50_ms": report.percentile(durations, 50), "duration_max_ms": max(durations) if durations else None,
        "ramp_s": round(ramp_s, 3), "elapsed_s": round(elapsed, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("url", help="the chat completions URL")
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--frames", type=int, required=True, help="`data: ` events per stream, [DONE] included")
    p.add_argument("--cadence-ms", type=float, required=True, help="the box's pause between frames")
    p.add_argument("--stall-factor", type=float, default=5.0, help="a gap over this × cadence is a stall")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--batch", type=int, default=100, help="connections opened together")
    p.add_argument("--batch-gap-ms", type=float, default=50.0, help="pause between batches")
    p.add_argument("--timeout-s", type=float, default=60.0)
    args = p.parse_args(argv)
    limit = raise_fd_limit(args.streams + 256)
    result = uvloop.run(run(args))
    result["client_fd_limit"] = limit[0]
    print("OPEN_STREAMS_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
