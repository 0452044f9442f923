"""`python -m router.sim`: a fleet of simulated boxes on loopback, for `router demo` and for
rehearsing a real set-up before the GPUs arrive.

Two ways to ask for boxes:
- `--boxes N --boxes-file F` (what `router demo` runs): N hugpy boxes named sim-1..sim-N on
  free ports, every box with the whole catalog and the first model resident on sim-1 only.
- `--kind K [--port P]`, repeated (K: hugpy, ollama, lmstudio, llamacpp): one box of that kind
  per `--kind`, the n-th `--port` going with the n-th `--kind` (no port: a free one). It prints
  the `router boxes add` line of each box, ready to paste; `--boxes-file` is optional here. The
  names (sim-<kind>-<n>-<run>) carry a tag of this run, so the lines of a second run add boxes
  beside the first run's instead of meeting a taken name.
Boxes run in one uvloop loop (this thread). The boxes file, when asked for, is written
atomically (tmp + os.replace, mode 0600) so a reader never sees half a file. One ready line is
printed once every box listens; it runs until SIGTERM/SIGINT, then stops the boxes cleanly.
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
from router.sim.llamacpp import SimLlamaCpp
from router.sim.lmstudio import SimLMStudio
from router.sim.ollama import SimOllama
from router.sim.server import SimServer

DEFAULT_MODELS = "tiny-llama,qwen3-8b"
DEFAULT_CHUNKS = 20  # the benchmark's 20-chunk stream (contracts/stack-notes.md)


def _hugpy(name: str, models: list[str], args: argparse.Namespace, resident: bool) -> SimServer:
    return SimBox(name, key="hpk_box_" + secrets.token_urlsafe(32), catalog=models,
                  residents=models[:1] if resident else (), chunks=args.chunks,
                  cadence_s=args.cadence_ms / 1000, load_s=args.load_ms / 1000)


def _ollama(name: str, models: list[str], args: argparse.Namespace, resident: bool) -> SimServer:
    return SimOllama(name, tags=models, loaded=models[:1] if resident else (), chunks=args.chunks,
                     cadence_s=args.cadence_ms / 1000)


def _lmstudio(name: str, models: list[str], args: argparse.Namespace, resident: bool) -> SimServer:
    return SimLMStudio(name, models=models, loaded=models[:1] if resident else (), chunks=args.chunks,
                       cadence_s=args.cadence_ms / 1000)


def _llamacpp(name: str, models: list[str], args: argparse.Namespace, resident: bool) -> SimServer:
    return SimLlamaCpp(name, alias=models[0])  # a llama.cpp server serves the one model it loaded


# `--kind` → how to make that box. A llama.cpp server is an OpenAI-compatible box to the router.
KINDS = {"hugpy": _hugpy, "ollama": _ollama, "lmstudio": _lmstudio, "llamacpp": _llamacpp}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m router.sim", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--boxes", type=int, default=None, help="how many hugpy boxes (default 3, unless --kind)")
    p.add_argument("--kind", action="append", choices=sorted(KINDS), default=[],
                   help="one box of this kind; repeat for more (prints its `router boxes add` line)")
    p.add_argument("--port", action="append", type=int, default=[],
                   help="the port of the box of the --kind in the same position (default: a free one)")
    p.add_argument("--boxes-file", default=None, help="where to write the boxes file (needed with --boxes)")
    p.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS, help="content frames per stream")
    p.add_argument("--cadence-ms", type=float, default=0.0, help="pause between stream frames")
    p.add_argument("--load-ms", type=float, default=0.0, help="cold-load delay")
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated catalog")
    args = p.parse_args(argv)
    if args.kind and args.boxes is not None:
        p.error("give either --boxes N or --kind K (repeated), not both")
    if not args.kind and args.boxes_file is None:
        p.error("--boxes-file is needed with --boxes")
    if len(args.port) > len(args.kind):
        p.error("each --port goes with the --kind before it: more ports than kinds")
    if any(not 1 <= port <= 65535 for port in args.port):
        p.error("--port must be 1-65535")
    if args.boxes is None:
        args.boxes = 3
    if args.boxes < 1:
        p.error("--boxes must be at least 1")
    return args


def make_boxes(args: argparse.Namespace) -> list[tuple[SimServer, int]]:
    """The boxes asked for, each with the port to listen on (0: a free one)."""
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.kind:
        return [(_hugpy(f"sim-{i}", models, args, i == 1), 0) for i in range(1, args.boxes + 1)]
    ports = args.port + [0] * (len(args.kind) - len(args.port))
    run = secrets.token_hex(2)
    return [(KINDS[kind](f"sim-{kind}-{n}-{run}", models, args, True), port)
            for n, (kind, port) in enumerate(zip(args.kind, ports), 1)]


def boxes_add_line(box: SimServer) -> str:
    """The `router boxes add` command that puts this box in a router's fleet."""
    key = box.router_key
    return (f"router boxes add --name {box.name} --url {box.url} --kind {box.kind}"
            + (f" --key {key}" if key else ""))


def write_boxes_file(path: str, boxes: list[SimServer]) -> None:
    """Writes {"boxes": [...]} with mode 0600 via a temp file in the same directory."""
    doc = {"boxes": [{"name": b.name, "url": b.url, "kind": b.kind, **({"key": b.router_key} if b.router_key else {})}
                     for b in boxes]}
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
    asked = make_boxes(args)
    boxes = [box for box, _ in asked]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for box, port in asked:
            await box.start(port=port)
        if args.boxes_file:
            write_boxes_file(args.boxes_file, boxes)
        print(f"sim fleet ready: {len(boxes)} boxes", flush=True)
        if args.kind:
            for box in boxes:
                print(boxes_add_line(box), flush=True)
        await stop.wait()
    finally:
        for box in boxes:
            await box.stop()


def main(argv: list[str] | None = None) -> int:
    uvloop.run(run(_parse(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
