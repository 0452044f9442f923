"""Chat latency while admin event streams are open (issue 20 item 12: 300 open
`/v1/router/events` streams raised chat p50 from 2.6 to 41.8 ms).

    .venv/bin/python bench/event_streams.py [--streams 0,30,300] [--calls 200] [--max-event-streams 32]

Starts one simulated hugpy box and `router serve` (a process of its own), then for each count in
`--streams` opens that many dashboard streams (raw sockets that read and discard what comes)
and times `--calls` sequential chat calls. Streams past the router's cap get 429, which is
counted. Prints one line, `EVENT_STREAMS_JSON {...}`: per count, the streams open, the ones
refused, and chat p50/p99 in ms. Ratios between counts in one run are the figure, not the
absolute milliseconds (DESIGN.md, Performance budget).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.sim import SimBox, SimFleet  # noqa: E402

CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()


def open_stream(host: str, port: int) -> tuple[socket.socket | None, bool]:
    """A dashboard stream, read and discarded in a thread; (socket, refused)."""
    sock = socket.create_connection((host, port), timeout=10)
    sock.sendall(b"GET /v1/router/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head = sock.recv(4096)
    if not head.startswith(b"HTTP/1.1 200"):
        sock.close()
        return None, True

    def drain() -> None:
        try:
            while sock.recv(65536):
                pass
        except OSError:
            pass

    threading.Thread(target=drain, daemon=True).start()
    return sock, False


def chat_ms(host: str, port: int, calls: int) -> list[float]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=CHAT, headers={"Content-Type": "application/json"})
        conn.getresponse().read()
        took.append((time.perf_counter() - started) * 1000)
    conn.close()
    return took


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", default="0,30,300")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--max-event-streams", type=int, default=32)
    args = parser.parse_args()
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    fleet = SimFleet([box])
    fleet.start()
    with tempfile.TemporaryDirectory() as tmp:
        boxes = Path(tmp) / "boxes.json"
        boxes.write_text(json.dumps({"boxes": [{"name": box.name, "url": box.url, "kind": box.kind}]}))
        env = {**os.environ, "HUGPY_ROUTER_HOME": tmp}
        router = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes),
             "--max-event-streams", str(args.max_event_streams)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        try:
            line = router.stdout.readline()  # "router listening on http://127.0.0.1:PORT"
            host, port = line.rsplit("http://", 1)[1].strip().rsplit(":", 1)
            chat_ms(host, int(port), 20)  # warm up: connections, the box's inventory
            results = []
            for count in (int(n) for n in args.streams.split(",")):
                opened = [open_stream(host, int(port)) for _ in range(count)]
                time.sleep(2.0)  # a tick or two with every stream open
                took = chat_ms(host, int(port), args.calls)
                results.append({
                    "streams": count, "open": sum(1 for s, _ in opened if s), "refused": sum(r for _, r in opened),
                    "p50_ms": round(statistics.median(took), 3),
                    "p99_ms": round(statistics.quantiles(took, n=100)[98], 3),
                })
                for sock, _ in opened:
                    if sock is not None:
                        sock.close()
                time.sleep(1.5)  # the router sees them close
            print("EVENT_STREAMS_JSON " + json.dumps(results), flush=True)
        finally:
            router.terminate()
            router.wait(30)
            fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
