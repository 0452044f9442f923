"""The command line: `router serve`, `router boxes ...`, `router demo`, `router agent`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from router.boxes import config as boxes_config
from router.cli.agent import add_agent_parser, agent_command
from router.cli.keys import add_keys_parser, keys_command
from router.core.errors import ConfigError
from router.core.types import BoxKind


def _port(value: str) -> int:
    if value == "auto":
        return 0
    port = int(value)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError("port must be 1-65535 or 'auto'")
    return port


def _size(value: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    value = value.strip().lower().removesuffix("ib").removesuffix("b")
    if value and value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value)


def add_serve_options(parser: argparse.ArgumentParser, *, port_required: bool) -> None:
    parser.add_argument(
        "--port",
        type=_port,
        required=port_required,
        default=None if port_required else 0,
        help="port to listen on, or 'auto' to pick a free one (printed at start)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        choices=[1],
        help="worker processes. Only 1: the reservation table, the box links and the "
        "settings contracts are per process, so two workers would each route blind to "
        "the other's load",
    )
    parser.add_argument(
        "--interface",
        choices=["asgi", "rsgi"],
        default="asgi",
        help="Granian interface. asgi (default) bounds what a slow reader makes the router "
        "buffer; rsgi has no write backpressure (a stalled reader grew the router by 45 MiB "
        "in the bench), so keep it for trusted, fast clients",
    )
    parser.add_argument("--max-body", type=_size, default=64 << 20, help="largest request body (default 64MiB)")
    parser.add_argument(
        "--first-byte-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for a box's first byte (a cold load can take minutes; default 900)",
    )
    parser.add_argument("--ollama-port", type=_port, default=None,
                        help="also listen here as an Ollama server (every path is Ollama's; 'auto' picks one)")
    parser.add_argument("--lmstudio-port", type=_port, default=None,
                        help="also listen here as an LM Studio server (every path is LM Studio's)")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds in-flight calls get at stop")
    parser.add_argument("--otel", action="store_true",
                        help="export an OpenTelemetry span per call over OTLP (needs the otel extra; "
                        "also on when OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="router", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the router")
    add_serve_options(serve, port_required=True)
    serve.add_argument("--boxes-file", type=Path, default=None, help="boxes file (default: $HUGPY_ROUTER_BOXES or <config dir>/router/boxes.json)")

    demo = sub.add_parser("demo", help="run the router in front of a fleet of simulated boxes")
    add_serve_options(demo, port_required=False)
    demo.add_argument("--sim-boxes", type=int, default=3, help="simulated boxes (default 3)")

    boxes = sub.add_parser("boxes", help="manage the boxes file")
    boxes.add_argument("--boxes-file", type=Path, default=None)
    bsub = boxes.add_subparsers(dest="boxes_command", required=True)
    add = bsub.add_parser("add", help="add or replace a box")
    add.add_argument("--name", required=True)
    add.add_argument("--url", required=True, help="http://host:port of the box's front door")
    add.add_argument("--kind", choices=[k.value for k in BoxKind], default=BoxKind.HUGPY.value)
    add.add_argument("--key-file", help="env file with the box key (FITEVICT_TOKEN=...)")
    add.add_argument("--store", help="the box's store file, when readable on this machine")
    add.add_argument("--pool")
    add.add_argument("--agent", help="http://host:port of a `router agent` on the box's host (GPU telemetry)")
    bsub.add_parser("list", help="list boxes (keys are never shown)")
    for name in ("remove", "block", "unblock"):
        cmd = bsub.add_parser(name, help=f"{name} a box")
        cmd.add_argument("name")
    add_agent_parser(sub)
    add_keys_parser(sub)
    return parser


def boxes_command(args: argparse.Namespace) -> int:
    boxes = boxes_config.load(args.boxes_file)
    if args.boxes_command == "list":
        for box in boxes.boxes:
            flags = " ".join(
                f for f in (f"pool={box.pool}" if box.pool else "", "blocked" if box.blocked else "",
                            "key" if box.key else "no-key", f"store={box.store}" if box.store else "") if f
            )
            print(f"{box.name}\t{box.kind.value}\t{box.url}\t{flags}")
        return 0
    if args.boxes_command == "add":
        key = boxes_config.read_key_file(args.key_file) if args.key_file else None
        new = boxes_config.validate(
            boxes_config.BoxConfig(
                name=args.name, url=args.url.rstrip("/"), kind=BoxKind(args.kind), key=key,
                store=args.store, pool=args.pool, agent=args.agent,
            )
        )
        index = next((i for i, b in enumerate(boxes.boxes) if b.name == new.name), None)
        if index is None:
            boxes.boxes.append(new)
        else:
            boxes.boxes[index] = new
        boxes_config.save(boxes)
        print(f"box {new.name} {'added' if index is None else 'replaced'} in {boxes.path}")
        return 0
    box = boxes.find(args.name)
    if box is None:
        print(f"no box named {args.name} in {boxes.path}", file=sys.stderr)
        return 1
    if args.boxes_command == "remove":
        boxes.boxes.remove(box)
    else:
        blocked = args.boxes_command == "block"
        boxes.boxes[boxes.boxes.index(box)] = boxes_config.BoxConfig(
            **{**box.__dict__, "blocked": blocked}
        )
    boxes_config.save(boxes)
    print(f"box {args.name}: {args.boxes_command} done")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "boxes":
            return boxes_command(args)
        if args.command == "agent":
            return agent_command(args)
        if args.command == "keys":
            return keys_command(args)
        from router.cli.run import run_demo, run_serve

        if args.command == "serve":
            return run_serve(args)
        return run_demo(args)
    except ConfigError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
