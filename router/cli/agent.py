"""`router agent`: serve this host's GPU reading to routers on other hosts.

Rules:
1. It binds 127.0.0.1 unless told otherwise: a router on another host needs `--host` set to
   an address it can reach (the reading is not secret, but exposure stays a choice).
2. `--port 0` (or `auto`) picks a free port; the line `router agent listening on URL` on
   stdout names it, as `router serve` does.
3. SIGTERM and SIGINT stop it cleanly; the exit status is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import uvloop

from router.telemetry.agent import AgentServer
from router.telemetry.nvml import Scanner


def _port(value: str) -> int:
    port = 0 if value == "auto" else int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError("port must be 0-65535 or 'auto'")
    return port


def add_agent_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds `agent` to the `router` subcommands. Returns its parser."""
    agent = subparsers.add_parser("agent", help="serve this host's GPU reading to routers elsewhere")
    agent.add_argument("--port", type=_port, required=True, help="port to listen on (0 or 'auto': any free one)")
    agent.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: set it for remote routers)")
    agent.add_argument("--interval", type=float, default=1.0, help="seconds between GPU scans (default 1)")
    agent.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return agent


def agent_command(args: argparse.Namespace) -> int:
    """Runs the agent until SIGTERM or SIGINT. Returns the exit status."""
    return uvloop.run(_serve(args.host, args.port, args.interval))


async def _serve(host: str, port: int, interval_s: float) -> int:
    server = AgentServer(Scanner(), interval_s=interval_s)
    bound = await server.start(host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"router agent listening on http://{shown}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop()
    return 0
