"""The Python objects one open stream holds in the router's process, against the bare proxy's.

    .venv/bin/python bench/stream_memory.py [--streams 1000]

One process, one uvloop loop, as bench/callpath_cpu.py: the router's app (what `router serve`
runs, less Granian) and the bare proxy's (bench/floor_proxy.py's `FloorApp`, the same upstream
pool) each hold `--streams` streams open at once through an in-process ASGI client, in front of
one simulated hugpy box writing a frame every 200 ms (a stream lasts 12 s, far longer than the
count takes). Once every stream has had its first frame, tracemalloc's snapshot against the one
taken before they opened gives the bytes each stream holds, by the line that allocated them.

What this counts is the part of the open-streams figure's RSS per stream that is the app's own:
the rest (Granian's connection, the kernel's socket buffers) is the same stack under both, so
the router's RSS per stream less the bare proxy's is about the difference printed here. The
client's own objects (this script's lines) are in both and cancel out.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import tracemalloc
from pathlib import Path

import uvloop

from callpath_cpu import (ROOT, STREAM_BODY, FloorApp, Origin, routable, scope, sim_fleet,
                          staying_client, start_router)

TOP_LINES = 15
OPEN_BATCH = 50  # streams opened per loop turn, so the box's accept queue never overflows


async def held_stream(app, call_scope: dict, started: list) -> None:
    """One streamed call whose client never leaves; `started` gets an entry at its first frame."""
    sent = 0

    async def send(message: dict) -> None:
        nonlocal sent
        sent += 1
        if sent == 2:  # the head, then the first frame
            started.append(None)

    await app(call_scope, staying_client(STREAM_BODY), send)


def where(frame: tracemalloc.Frame) -> str:
    """An allocating line, as `path:line` from the repository's root (a library's: its file name)."""
    path = Path(frame.filename)
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{frame.lineno}"


async def held_bytes(app, streams: int) -> dict:
    """Bytes and objects per open stream, in all and by allocating line (the top TOP_LINES)."""
    call_scope, started = scope(0), []
    tasks = [asyncio.create_task(held_stream(app, call_scope, started)) for _ in range(OPEN_BATCH)]
    while len(started) < OPEN_BATCH:  # warm: the pool's connections, the caches
        await asyncio.sleep(0.05)
    gc.collect()
    tracemalloc.start(1)
    before = tracemalloc.take_snapshot()
    started.clear()
    for i in range(streams):
        tasks.append(asyncio.create_task(held_stream(app, call_scope, started)))
        if i % OPEN_BATCH == OPEN_BATCH - 1:
            await asyncio.sleep(0.01)
    while len(started) < streams:
        await asyncio.sleep(0.05)
    gc.collect()
    diff = tracemalloc.take_snapshot().compare_to(before, "lineno")
    tracemalloc.stop()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    top = [{"line": where(d.traceback[0]), "bytes": round(d.size_diff / streams),
            "objects": round(d.count_diff / streams, 1)} for d in diff[:TOP_LINES]]
    return {"bytes": round(sum(d.size_diff for d in diff) / streams), "top": top}


async def main(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="stream-memory-"))
    boxes_file = work / "boxes.json"
    with sim_fleet(boxes_file, 1, chunks=60, cadence_ms=200):
        router, stop_router = await start_router(boxes_file, work)
        await routable(router, STREAM_BODY)
        box = router.fleet.ordered()[0]
        figures: dict = {"streams": args.streams}
        for name, app in (("router", router), ("floor", FloorApp(Origin(box.config.host, box.config.port)))):
            figures[name] = held = await held_bytes(app, args.streams)
            print(f"{name}: {held['bytes']:,} B a stream", flush=True)
            for line in held["top"]:
                print(f"  {line['bytes']:6,} B {line['objects']:5.1f} objects  {line['line']}")
            await asyncio.sleep(0.5)
        figures["router_less_floor"] = figures["router"]["bytes"] - figures["floor"]["bytes"]
        print(f"router less the bare proxy: {figures['router_less_floor']:,} B a stream")
        await stop_router()
        return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    figures = uvloop.run(main(args))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    sys.exit(0)
