"""`python -m router.sim`: a fleet of simulated hugpy boxes on loopback, for `router demo`.

Starts N boxes named sim-1..sim-N on free ports in one uvloop loop (this thread), every box
with the whole catalog and the first model resident on sim-1 only; writes the boxes file
atomically (tmp + os.replace, mode 0600) so a reader never sees half a file; prints one
ready line; runs until SIGTERM/SIGINT, then stops the boxes cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import tempfile

import uvloop

from router.sim.hugpy import SimBox

DEFAULT_MODELS = "tiny-llama,qwen3-8b"
DEFAULT_CHUNKS = 20  # the benchmark's 20-chunk stream (contracts/stack-notes.md)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m router.sim", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--boxes", type=int, default=3, help="how many boxes (default 3)")
    p.add_argument("--boxes-file", required=True, help="where to write the boxes file")
    p.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS, help="content frames per stream")
    p.add_argument("--cadence-ms", type=float, default=0.0, help="pause between stream frames")
    p.add_argument("--load-ms", type=float, default=0.0, help="cold-load delay")
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated catalog")
    args = p.parse_args(argv)
    if args.boxes < 1:
        p.error("--boxes must be at least 1")
    return args


def write_boxes_file(path: str, boxes: list[SimBox]) -> None:
    """Writes {"boxes": [...]} with mode 0600 via a temp file in the same directory."""
    doc = {"boxes": [{"name": b.name, "url": b.url, "kind": "hugpy", "key": b.key} for b in boxes]}
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".boxes-", dir=directory)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


async def run(args: argparse.Namespace) -> None:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    boxes = [
        SimBox(f"sim-{i}", key="hpk_box_" + secrets.token_urlsafe(32), catalog=models,
               residents=models[:1] if i == 1 else (), chunks=args.chunks,
               cadence_s=args.cadence_ms / 1000, load_s=args.load_ms / 1000)
        for i in range(1, args.boxes + 1)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for box in boxes:
            await box.start()
        write_boxes_file(args.boxes_file, boxes)
        print(f"sim fleet ready: {len(boxes)} boxes", flush=True)
        await stop.wait()
    finally:
        for box in boxes:
            await box.stop()


def main(argv: list[str] | None = None) -> int:
    uvloop.run(run(_parse(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
