"""How long one large request body stalls the router's event loop (issue 11, item 7).

    .venv/bin/python bench/body_stall.py [--mb 60] [--repeats 3] [--interface asgi]

Starts a router (a subprocess, like `router serve`) in front of one simulated hugpy box, then,
per case, sends a body of `--mb` MB `--repeats` times while a second client (another thread,
its own keep-alive connection) asks `GET /health` every 1 ms. The figure is the worst `/health`
latency seen while the body was read and inspected, against the same client's worst with no
body in flight. Every body names a model no box serves, so the router reads the body, inspects
it and refuses it (503 no_box) without sending it on: what is measured is the read and the
inspection, not the upload to a box. One body goes first, unmeasured
(a warm-up). The router's own loop-stall gauge (`router_loop_stall_max_seconds`, the worst
since start, so it includes the warm-up) is printed too.

Cases: one JSON string (a base64 image, the usual way a large JSON body is large), a JSON chat
of many small messages (token-dense), the same with `model` keys nested in every message, one
file in a multipart upload, and a multipart upload of many small parts.

Prints a table and one `BODY_STALL_JSON {...}` line. A bench figure, not a test: on a shared
2-core machine the figures swing; compare the columns of one run.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.sim import SimBox, SimFleet  # noqa: E402

NOBODY = "nobody-serves-this"
BOUNDARY = "----body-stall-boundary"


def json_one_string(size: int) -> bytes:
    data = base64.b64encode(os.urandom(size * 3 // 4)).decode()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}
    return json.dumps({"model": NOBODY, "messages": [{"role": "user", "content": [image]}]}).encode()


def json_many_messages(size: int, nested_model: bool = False) -> bytes:
    message = {"role": "user", "content": "hello there, how are you"}
    if nested_model:
        message["model"] = "x"
    one = len(json.dumps(message)) + 2
    return json.dumps({"model": NOBODY, "messages": [message] * (size // one)}).encode()


def multipart(parts: list[tuple[str, str | None, bytes]]) -> bytes:
    out = bytearray()
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    out += f"--{BOUNDARY}--\r\n".encode()
    return bytes(out)


def multipart_one_file(size: int) -> bytes:
    return multipart([("file", "a.wav", os.urandom(size)), ("model", None, NOBODY.encode())])


def multipart_many_parts(size: int) -> bytes:
    part = ("f", None, b"x" * 16)
    one = len(multipart([part])) - len(f"--{BOUNDARY}--\r\n")
    return multipart([part] * (size // one) + [("model", None, NOBODY.encode())])


CASES = {
    "json, one 60 MB string": ("/v1/chat/completions", "application/json", json_one_string),
    "json, many small messages": ("/v1/chat/completions", "application/json", json_many_messages),
    "json, `model` nested in each message": (
        "/v1/chat/completions", "application/json", lambda size: json_many_messages(size, True)),
    "multipart, one file": (
        "/v1/audio/transcriptions", f"multipart/form-data; boundary={BOUNDARY}", multipart_one_file),
    "multipart, many small parts": (
        "/v1/audio/transcriptions", f"multipart/form-data; boundary={BOUNDARY}", multipart_many_parts),
}


class Pinger(threading.Thread):
    """GET /health every 1 ms on one keep-alive connection; keeps the worst latency per window."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection(host, port, timeout=30)
        self.worst_s = 0.0
        self.count = 0
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            started = time.perf_counter()
            self.conn.request("GET", "/health")
            self.conn.getresponse().read()
            spent = time.perf_counter() - started
            self.worst_s = max(self.worst_s, spent)
            self.count += 1
            time.sleep(0.001)

    def window(self) -> float:
        """The worst latency since the last call, then starts a new window."""
        worst, self.worst_s = self.worst_s, 0.0
        return worst


def start_router(boxes_path: Path, home: Path, interface: str) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes_path),
         "--interface", interface, "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        env={**os.environ, "HUGPY_ROUTER_HOME": str(home)},
    )
    line = proc.stdout.readline()
    match = re.search(r"listening on http://([\d.]+):(\d+)", line)
    if match is None:
        proc.kill()
        raise SystemExit(f"router did not start: {line!r}")
    return proc, match.group(1), int(match.group(2))


def send(host: str, port: int, path: str, content_type: str, body: bytes) -> int:
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def loop_stall_gauge(host: str, port: int) -> float:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    match = re.search(r"^router_loop_stall_max_seconds (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interface", choices=["asgi", "rsgi"], default="asgi")
    args = parser.parse_args()
    size = int(args.mb * (1 << 20))
    box = SimBox("h", catalog=["tiny"], residents=["tiny"])
    fleet = SimFleet([box])
    fleet.start()
    with tempfile.TemporaryDirectory() as tmp:
        boxes_path = Path(tmp) / "boxes.json"
        boxes_path.write_text(json.dumps({"boxes": [{"name": "h", "url": box.url, "kind": "hugpy"}]}))
        os.chmod(boxes_path, 0o600)
        proc, host, port = start_router(boxes_path, Path(tmp) / "home", args.interface)
        pinger = Pinger(host, port)
        results = {}
        try:
            # One body first, unmeasured: the router's first large allocations fault in fresh
            # pages (measured here: the first 60 MB read took ~1 s, later ones ~0.15 s).
            warm_path, warm_type, warm_build = next(iter(CASES.values()))
            send(host, port, warm_path, warm_type, warm_build(size))
            pinger.start()
            time.sleep(1.0)
            pinger.window()
            time.sleep(2.0)
            results["no body in flight"] = {"worst_health_ms": round(pinger.window() * 1000, 1)}
            for name, (path, content_type, build) in CASES.items():
                body = build(size)
                worst, statuses, took = [], [], []
                for _ in range(args.repeats):
                    pinger.window()
                    started = time.perf_counter()
                    statuses.append(send(host, port, path, content_type, body))
                    took.append(time.perf_counter() - started)
                    time.sleep(0.3)  # the ping held up by the stall comes back after the answer
                    worst.append(pinger.window())
                del body
                results[name] = {
                    "worst_health_ms": round(max(worst) * 1000, 1),
                    "median_worst_ms": round(sorted(worst)[len(worst) // 2] * 1000, 1),
                    "answer_s": round(sorted(took)[len(took) // 2], 3),
                    "statuses": sorted(set(statuses)),
                }
            results["router_loop_stall_max_s"] = loop_stall_gauge(host, port)
        finally:
            pinger.stopping = True
            proc.terminate()
            proc.wait(20)
            fleet.stop()
    print(f"{args.mb:g} MB bodies, {args.repeats} each, {args.interface}; /health every 1 ms meanwhile")
    print(f"{'case':40} {'worst /health ms':>17} {'median worst':>13} {'answer s':>9}  statuses")
    for name, row in results.items():
        if isinstance(row, dict):
            print(f"{name:40} {row['worst_health_ms']:>17} {row.get('median_worst_ms', ''):>13} "
                  f"{row.get('answer_s', ''):>9}  {row.get('statuses', '')}")
    print(f"router_loop_stall_max_seconds: {results['router_loop_stall_max_s']}")
    print("BODY_STALL_JSON " + json.dumps({"mb": args.mb, "interface": args.interface, **results}))


if __name__ == "__main__":
    main()
