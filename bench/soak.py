"""A bounded soak: mixed stream and non-stream calls through the router over 8 simulated hugpy
boxes, with faults injected at a set rate, for a few minutes.

    scripts/bench soak [--seconds 150] [--fault-rate 0.05] [--workers 16]

It reports calls made, what reached the clients (answers, and errors by cause), failovers
(from the router's own metrics), route-log rows versus calls (must be equal), and the router's
RSS and open file descriptors after warm-up and at the end (must be flat). Loopback only; the
router and the boxes are stopped at the end whatever happens.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import http.client
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import measure  # noqa: E402  (bench/, beside this file: the harness's process handling)
from router.sim import Behavior, SimBox, SimFleet  # noqa: E402
from router.store import db  # noqa: E402

BOXES = 8
WARMUP_S = 5.0
# The faults a fleet throws at a front door, each with the share it gets among injected faults.
FAULTS = (
    ("refuse_503", lambda: Behavior.refuse(503, "insufficient_resources", "won't fit"), 3),
    ("in_band_load_error", lambda: Behavior.in_band("load_error", "load failed"), 3),
    ("reset", Behavior.reset, 2),
    ("hang_300ms", lambda: Behavior.hang(0.3), 2),
    ("die_mid_stream", lambda: Behavior.die_after(3), 2),
)


def one_call(conn: http.client.HTTPConnection, stream: bool) -> str:
    """One call; returns its outcome: ok, or the cause of what the client saw."""
    body = json.dumps({"model": "tiny", "stream": stream, "messages": [{"role": "user", "content": "soak"}]})
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        return f"http_{resp.status}"
    if stream:
        if b'"error"' in data:
            return "in_band_error"
        if not data.rstrip().endswith(b"data: [DONE]"):
            return "stream_cut"
    return "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--fault-rate", type=float, default=0.05, help="share of calls that meet a fault")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--stream-share", type=float, default=0.3)
    args = parser.parse_args()

    boxes = [SimBox(f"sim-{i + 1}", catalog=["tiny"], residents=["tiny"], chunks=10) for i in range(BOXES)]
    fleet = SimFleet(boxes)
    fleet.start()
    work = Path(tempfile.mkdtemp(prefix="router-soak-"))
    boxes_path = work / "boxes.json"
    boxes_path.write_text(json.dumps({"boxes": [{"name": b.name, "url": b.url} for b in boxes]}))
    procs = measure.Procs(work, dict(os.environ), ROOT)
    started, ready = procs.start(
        "router",
        [sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes_path),
         "--log-level", "warning"],
        measure.ROUTER_READY,
        env={"HUGPY_ROUTER_HOME": str(work / "home")},
    )
    proc = started.popen
    host, port = ready.group(1).removeprefix("http://").split(":")
    router = psutil.Process(proc.pid)
    outcomes: collections.Counter = collections.Counter()
    faults: collections.Counter = collections.Counter()
    lock = threading.Lock()
    stop_at = [0.0]
    weighted = [f for f in FAULTS for _ in range(f[2])]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        while time.monotonic() < stop_at[0]:
            if rng.random() < args.fault_rate:
                name, make, _ = rng.choice(weighted)
                rng.choice(boxes).script("tiny", make())
                with lock:
                    faults[name] += 1
            try:
                outcome = one_call(conn, rng.random() < args.stream_share)
            except (OSError, http.client.HTTPException) as exc:
                outcome = f"client_{type(exc).__name__}"
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
            with lock:
                outcomes[outcome] += 1
        conn.close()

    try:
        stop_at[0] = time.monotonic() + WARMUP_S
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        start = {"rss_mib": router.memory_info().rss / 2**20, "fds": router.num_fds()}
        warm_calls = sum(outcomes.values())
        stop_at[0] = time.monotonic() + args.seconds
        threads = [threading.Thread(target=worker, args=(100 + i,)) for i in range(args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(1.0)  # idle connections settle
        end = {"rss_mib": router.memory_info().rss / 2**20, "fds": router.num_fds()}
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
        failovers = {m.group(1): float(m.group(2)) for m in
                     re.finditer(r'router_failovers_total\{reason="([^"]+)"\} (\S+)', metrics)}
    finally:
        procs.stop_all()  # SIGTERM: the router flushes its log and exits 0
        fleet.stop()
    conn = db.open_store(work / "home" / "router.sqlite3")
    rows = conn.execute("SELECT count(*) FROM route_log").fetchall()[0][0]
    states = dict(conn.execute("SELECT state, count(*) FROM route_log GROUP BY state").fetchall())
    conn.close()
    calls = sum(outcomes.values())
    # What the router logged at warning level or above: a bug inside it is logged as
    # "call failed inside the router" (serve/app.py), and a soak must show none.
    router_lines = started.log.read_text(errors="replace").splitlines()
    router_errors = [line for line in router_lines if " ERROR " in line or "Traceback" in line]
    report = {
        "seconds": args.seconds, "fault_rate": args.fault_rate, "workers": args.workers,
        "calls": calls, "warmup_calls": warm_calls, "outcomes": dict(outcomes), "faults_injected": dict(faults),
        "failovers": failovers, "route_rows": rows, "row_states": states,
        "rows_equal_calls": rows == calls, "router_start": start, "router_end": end,
        "exit_code": proc.returncode, "router_error_lines": len(router_errors),
    }
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    out = ROOT / "bench" / "results" / f"soak-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(f"written {out}")
    return 0 if report["rows_equal_calls"] and proc.returncode == 0 and not router_errors else 1


if __name__ == "__main__":
    sys.exit(main())
