"""Where a stream's time to first frame goes: the router's path, stamped, beside the direct box.

    PYTHONPATH=. .venv/bin/python bench/ttft_trace.py [--users 16] [--seconds 5] [--in-step]
                                                     [--pin CPU] [--interface asgi|rsgi]

Starts a sim fleet (8 hugpy boxes, 20 ms cadence, as bench/run.py --locust) and `router serve`
with perf_counter stamps on one call's path, keyed by the X-Task header the probe sends (the
router forwards it to the box):

    t0          the client writes its request
    app         Granian handed the call to the loop (RouterApp.dispatch)
    read_body1  the body is in (edge.read_body returned: one receive() round trip)
    connect0/1  a fresh TCP connection to the box (none when an idle one was taken)
    sent        the request is written to the box
    recv_head   the box's head arrived; recv_frame: its first `data:` frame
    start0      the head goes to the edge (first frame judged); write0: the first frame
    first       the client has its first `data:` frame (same clock: CLOCK_MONOTONIC)

The probe runs `--users` closed-loop users (keep-alive to the router, a fresh connection per
direct stream since hugpy's streams are close-delimited), spread over one stream's length
unless `--in-step`. Prints the direct and routed time to first frame and each segment's
percentiles. Not a test: stamps cost a few µs per mark, so read gaps, not totals.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import uvloop

import measure
from report import percentile

BODY = json.dumps({"model": "tiny-llama", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
CADENCE_MS = 20
CHUNKS = 20
STREAM_S = CHUNKS * CADENCE_MS / 1000
SEGMENTS = [("t0", "app"), ("app", "read_body1"), ("read_body1", "connect0"), ("connect0", "connect1"),
            ("read_body1", "sent"), ("sent", "recv_head"), ("recv_head", "recv_frame"),
            ("recv_frame", "start0"), ("start0", "write0"), ("write0", "first"), ("t0", "first")]


# -- the traced router (runs in the router's process) ----------------------------------------

def serve_traced(argv: list[str], out: str) -> None:
    import atexit
    import runpy

    from router.serve import app as app_room, edge as edge_room
    from router.upstream import pool

    stamps: dict[str, dict[str, float]] = {}
    current = contextvars.ContextVar("task", default=None)
    conn_task: dict[int, str] = {}

    def mark(key: str | None, name: str) -> None:
        if key is not None:
            stamps.setdefault(key, {}).setdefault(name, time.perf_counter())

    dispatch = app_room.RouterApp.dispatch

    async def traced_dispatch(self, edge):
        key = edge.header("x-task")
        current.set(key)
        mark(key, "app")
        return await dispatch(self, edge)

    app_room.RouterApp.dispatch = traced_dispatch

    def traced(method, name):
        async def wrapper(self, *args, **kwargs):
            mark(current.get(), name + "0")
            result = await method(self, *args, **kwargs)
            mark(current.get(), name + "1")
            return result
        return wrapper

    for edge_class in (edge_room.AsgiEdge, edge_room.RsgiEdge):
        for name in ("read_body", "start", "write"):
            setattr(edge_class, name, traced(getattr(edge_class, name), name))
    pool.Origin._connect = traced(pool.Origin._connect, "connect")
    start, data_received = pool.Conn.start, pool.Conn.data_received

    def traced_start(self, payload, loop):
        conn_task[id(self)] = current.get()
        mark(current.get(), "sent")
        return start(self, payload, loop)

    def traced_data_received(self, data):
        key = conn_task.get(id(self))
        mark(key, "recv_head" if data.startswith(b"HTTP/") else "recv")
        if b"data:" in data:
            mark(key, "recv_frame")
        return data_received(self, data)

    pool.Conn.start, pool.Conn.data_received = traced_start, traced_data_received
    atexit.register(lambda: Path(out).write_text(json.dumps(stamps)))
    sys.argv = ["router", *argv]
    runpy.run_module("router", run_name="__main__")


# -- the probe -------------------------------------------------------------------------------

async def probe(url: str, users: int, seconds: float, in_step: bool, prefix: str) -> dict[str, dict]:
    """Closed-loop streamed calls; per call: t0 and the client's first `data:` frame."""
    target = urlsplit(url)
    until = time.monotonic() + seconds
    seen: dict[str, dict] = {}
    numbers = iter(range(1 << 30))

    async def user(delay: float) -> None:
        await asyncio.sleep(delay)
        reader = writer = None
        while time.monotonic() < until:
            key = f"{prefix}{next(numbers)}"
            request = (f"POST {target.path} HTTP/1.1\r\nHost: {target.netloc}\r\nContent-Type: application/json\r\n"
                       f"X-Task: {key}\r\nContent-Length: {len(BODY)}\r\n\r\n").encode() + BODY
            t0 = time.perf_counter()
            if writer is None:
                reader, writer = await asyncio.open_connection(target.hostname, target.port)
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            writer.write(request)
            got, first = b"", None
            while True:
                data = await reader.read(65536)
                if not data:  # close-delimited (direct): the next call connects again
                    writer.close()
                    reader = writer = None
                    break
                got += data
                if first is None and b"data:" in got:
                    first = time.perf_counter()
                if got.endswith(b"0\r\n\r\n") and b"[DONE]" in got:  # the router's chunked end
                    break
            seen[key] = {"t0": t0, "first": first}

    await asyncio.gather(*(user(0.0 if in_step else STREAM_S * i / users) for i in range(users)))
    return seen


def table(calls: dict[str, dict], stamps: dict[str, dict]) -> list[str]:
    lines = []
    for a, b in SEGMENTS:
        gaps = [1000 * (s[b] - s[a]) for key, call in calls.items()
                if a in (s := {**stamps.get(key, {}), **{k: v for k, v in call.items() if v}}) and b in s]
        if gaps:
            lines.append(f"  {a:>10} → {b:<10} n={len(gaps):5d}  p50 {percentile(gaps, 50):7.3f}  "
                         f"p90 {percentile(gaps, 90):7.3f}  p99 {percentile(gaps, 99):7.3f} ms")
    return lines


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-traced":
        serve_traced(sys.argv[3:], sys.argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--in-step", action="store_true", help="every user starts at once (bursts)")
    p.add_argument("--pin", help="taskset CPU list for the router (the issue pinned it to one core)")
    p.add_argument("--interface", choices=("asgi", "rsgi"), default="asgi")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ttft-") as tmp:
        work = Path(tmp)
        (work / "store").mkdir(mode=0o700)
        procs = measure.Procs(work, dict(os.environ, PYTHONPATH=str(measure.ROOT)), cwd=measure.ROOT)
        try:
            procs.start("sim", [measure.PYTHON, "-m", "router.sim", "--boxes", "8", "--boxes-file",
                                str(work / "boxes.json"), "--chunks", str(CHUNKS), "--cadence-ms", str(CADENCE_MS),
                                "--load-ms", "0"], measure.SIM_READY)
            stamps_file = work / "stamps.json"
            router, match = procs.start("router", [
                measure.PYTHON, __file__, "--serve-traced", str(stamps_file), "serve", "--port", "auto",
                "--boxes-file", str(work / "boxes.json"), "--interface", args.interface, "--log-level", "warning",
            ], measure.ROUTER_READY, env={"HUGPY_ROUTER_HOME": str(work / "store")})
            if args.pin:
                os.system(f"taskset -a -p -c {args.pin} {router.pid} >/dev/null")
            box = measure.wait_routable(match.group(1))
            direct = {b["name"]: b["url"] for b in json.loads((work / "boxes.json").read_text())["boxes"]}[box]
            path = "/v1/chat/completions"
            direct_calls = uvloop.run(probe(direct + path, args.users, args.seconds, args.in_step, "d"))
            uvloop.run(probe(match.group(1) + path, 4, 1.0, False, "w"))  # fills the router's pool
            routed = uvloop.run(probe(match.group(1) + path, args.users, args.seconds, args.in_step, "r"))
            procs.stop(router)  # the router writes its stamps at exit
            stamps = json.loads(stamps_file.read_text())
        finally:
            procs.stop_all()
    print(f"{args.users} users{' in step' if args.in_step else ''}, {args.seconds:g} s, {args.interface}; "
          f"time to first frame (ms):")
    for name, calls in (("direct", direct_calls), ("router", routed)):
        firsts = [1000 * (c["first"] - c["t0"]) for c in calls.values() if c["first"]]
        print(f"  {name:<6} n={len(firsts):5d}  p50 {percentile(firsts, 50):7.3f}  p99 {percentile(firsts, 99):7.3f}")
    print("router segments:")
    print("\n".join(table(routed, stamps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
