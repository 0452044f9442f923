"""Many idle sockets from many addresses, each under the per-client cap: does /health still answer?
(issue 20 item 8: 20 addresses x 500 idle sockets took every accept permit, and /health timed
out until the idle timeout closed them.)

    .venv/bin/python bench/idle_flood.py --sockets 10000 --addresses 20 --seconds 30
    .venv/bin/python bench/idle_flood.py --sockets 600 --addresses 4 --seconds 5 --nofile 1536   # small

Starts one simulated box and `router serve` in front of it (`--nofile N` caps the router's
descriptors, and so its accept permits: (N - 1024) / 2), opens `--sockets` connections that send
nothing, spread over the loopback addresses 127.0.0.2, 127.0.0.3, ... (on Linux every 127.x
address is this host, no alias needed), as fast as the kernel takes them. Then for `--seconds` it
asks GET /health from 127.0.0.1 every `--probe-gap-ms`, each with a `--probe-timeout-s` limit, and
reports how long each took.

Prints one line, `IDLE_FLOOD_JSON {...}`: sockets asked and connected, the router's accept
permits (from its start-up line), worst / p50 / p99 /health time in ms, probes that failed, how
many flood sockets the router still holds at the end and how many it closed.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from router.sim import SimBox, SimFleet  # noqa: E402

LISTENING_RE = re.compile(r"router listening on (https?://\S+)")
PERMITS_RE = re.compile(r"up to (\d+) connections")


def start_router(boxes_path: Path, home: Path, args) -> tuple[subprocess.Popen, str, Path]:
    log_path = home / "router.log"
    nofile = args.nofile
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes_path),
         "--idle-timeout", str(args.idle_timeout), "--max-conns-per-client", str(args.max_conns_per_client)],
        stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True, cwd=ROOT,
        env={**os.environ, "HUGPY_ROUTER_HOME": str(home)},
        preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)),
    )
    match = LISTENING_RE.search(proc.stdout.readline())
    if match is None:
        proc.kill()
        raise SystemExit(f"router did not start:\n{log_path.read_text()}")
    return proc, match.group(1), log_path


def open_idle(host: str, port: int, count: int, addresses: int) -> list[socket.socket]:
    socks = []
    for i in range(count):
        sock = socket.socket()
        sock.bind((f"127.0.0.{2 + i % addresses}", 0))
        sock.setblocking(False)
        err = sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            continue
        socks.append(sock)
    return socks


def closed_by_router(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def probe(url: str, timeout_s: float) -> float | None:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as answer:
            answer.read()
            if answer.status != 200:
                return None
    except OSError:
        return None
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sockets", type=int, default=10_000)
    parser.add_argument("--addresses", type=int, default=20, help="127.0.0.2 ... (at most 250)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to probe /health")
    parser.add_argument("--probe-gap-ms", type=float, default=100.0)
    parser.add_argument("--probe-timeout-s", type=float, default=20.0)
    parser.add_argument("--idle-timeout", type=float, default=60.0,
                        help="the router's --idle-timeout: above --seconds, so only the drain closes sockets")
    parser.add_argument("--max-conns-per-client", type=int, default=512)
    parser.add_argument("--nofile", type=int, default=None, help="the router's RLIMIT_NOFILE (default: as inherited)")
    args = parser.parse_args()
    if not 1 <= args.addresses <= 250:
        parser.error("--addresses must be 1-250")

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < args.sockets + 256:
        raise SystemExit(f"needs {args.sockets + 256} descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    fleet = SimFleet([SimBox("a", catalog=["tiny"], residents=["tiny"])])
    fleet.start()
    with tempfile.TemporaryDirectory(prefix="idle-flood-") as workdir:
        home = Path(workdir)
        boxes_path = home / "boxes.json"
        box = fleet.boxes[0]
        boxes_path.write_text(json.dumps({"boxes": [
            {"name": box.name, "url": box.url, "kind": box.kind, "key": getattr(box, "token", None)}
        ]}))
        os.chmod(boxes_path, 0o600)
        proc, url, log_path = start_router(boxes_path, home, args)
        socks: list[socket.socket] = []
        try:
            assert probe(url, 5.0) is not None, "no /health before the flood"
            host, port = url.removeprefix("http://").rsplit(":", 1)
            opened_at = time.monotonic()
            socks = open_idle(host, int(port), args.sockets, args.addresses)
            open_s = time.monotonic() - opened_at
            times: list[float] = []
            failed = 0
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                took = probe(url, args.probe_timeout_s)
                if took is None:
                    failed += 1
                else:
                    times.append(took)
                time.sleep(args.probe_gap_ms / 1000)
            flood = {f"127.0.0.{2 + i}" for i in range(args.addresses)}
            held = sum(1 for c in psutil.Process(proc.pid).net_connections(kind="tcp")
                       if c.raddr and c.raddr.ip in flood and c.status == psutil.CONN_ESTABLISHED)
            closed = sum(1 for s in socks if closed_by_router(s))
            log_text = log_path.read_text()
            permits = PERMITS_RE.search(log_text)
            times.sort()
            result = {
                "sockets": args.sockets, "connected": len(socks), "addresses": args.addresses,
                "open_s": round(open_s, 2), "accept_permits": int(permits.group(1)) if permits else None,
                "probes": len(times) + failed, "failed": failed,
                "worst_ms": round(times[-1] * 1000, 1) if times else None,
                "p50_ms": round(statistics.median(times) * 1000, 1) if times else None,
                "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1000, 1) if times else None,
                "held_by_router": held, "closed_by_router": closed,
                "drain_log": [line.split(": ", 1)[-1] for line in log_text.splitlines() if "idle connections" in line][:4],
            }
            print("IDLE_FLOOD_JSON " + json.dumps(result), flush=True)
        finally:
            for sock in socks:
                sock.close()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
