"""Overload: two tenants offer about twice what a small fleet can serve; admission off, then on.

    scripts/bench overload [--seconds 20] [--users 44] [--rate 2]

The fleet: 2 simulated Ollama servers, each answering at most 2 calls at once (OLLAMA_NUM_PARALLEL=2
with no queue: a third gets 503 "server busy"), every call a 5-token stream at a 20 ms cadence
(~0.1 s), so the fleet serves about 40 calls/s. Locust (bench/overload_locustfile.py) runs
`--users` closed-loop users at `--rate` calls/s each, 10 heavy-tenant users for each light one,
each tenant with its own key: 44 users at 2/s offer ~88 calls/s, 2.2x the fleet. Users start
over SPAWN_S seconds (not at once), so their calls are not in lockstep; the figures count from
the start.

Both runs use the same fleet and load; only the boxes file differs:
* off: no `max_inflight`: every call goes to a box, a busy box refuses, the router fails over;
* on: `max_inflight: 2` per box, the boxes' real capacity: calls wait in the router's queue.
First, the light tenant alone (its 4 users, with no heavy tenant) gives its unloaded latency.

Reported per run: goodput (200s per second), each tenant's p50/p99 latency (request to stream
end) and status counts, 429s, and the calls the boxes refused (the sims' own count). Target
(issue 12): with admission on the boxes refuse nothing, and the light tenant's p99 stays within
2x its unloaded p99. Loopback only, bounded; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))

import measure  # noqa: E402  (bench/, beside this file: the harness's process handling)
from report import percentile  # noqa: E402
from router.sim import SimFleet, SimOllama  # noqa: E402

BOXES = 2
PARALLEL = 2  # calls each box answers at once
CHUNKS, CADENCE_S = 5, 0.02
SPAWN_S = 5.0


def admin(url: str, path: str, doc: dict | None = None) -> dict:
    data = json.dumps(doc).encode() if doc is not None else None
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def run_load(url: str, keys: dict[str, str], users: int, rate: float, seconds: float, work: Path,
             name: str, light_only: bool = False) -> dict[str, list[tuple[int, float]]]:
    out = work / f"{name}.json"
    argv = [str(ROOT / ".venv" / "bin" / "locust"), "-f", str(BENCH / "overload_locustfile.py"),
            "--headless", "-u", str(users), "-r", f"{users / SPAWN_S:g}", "-t", f"{seconds:g}s", "--host", url,
            "--only-summary", "--loglevel", "WARNING", "--stop-timeout", "10"]
    if light_only:
        argv.append("LightTenant")
    env = dict(os.environ, OVERLOAD_OUT=str(out), OVERLOAD_RATE=str(rate),
               OVERLOAD_KEY_HEAVY=keys["heavy"], OVERLOAD_KEY_LIGHT=keys["light"])
    done = measure.run_bounded(argv, seconds + 60, env=env)
    if not out.exists():
        raise measure.BenchError(f"locust wrote no samples (exit {done.returncode}): {done.stderr[-1500:]}")
    return json.loads(out.read_text())


def summary(samples: dict[str, list[tuple[int, float]]], seconds: float, refused: int) -> dict:
    doc = {"goodput_per_s": round(sum(1 for t in samples.values() for s, _ in t if s == 200) / seconds, 1),
           "box_refusals": refused, "tenants": {}}
    for tenant, calls in samples.items():
        ok = [ms for status, ms in calls if status == 200]
        doc["tenants"][tenant] = {
            "calls": len(calls),
            "statuses": dict(collections.Counter(str(status) for status, _ in calls)),
            "p50_ms": round(percentile(ok, 50) or 0, 1),
            "p99_ms": round(percentile(ok, 99) or 0, 1),
        }
    doc["429s"] = sum(t["statuses"].get("429", 0) for t in doc["tenants"].values())
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--users", type=int, default=44)
    parser.add_argument("--rate", type=float, default=2.0)
    args = parser.parse_args()

    boxes = [SimOllama(f"ol-{i + 1}", tags=["llama3"], loaded=["llama3"], chunks=CHUNKS, cadence_s=CADENCE_S,
                       max_parallel=PARALLEL) for i in range(BOXES)]
    fleet = SimFleet(boxes)
    fleet.start()
    work = Path(tempfile.mkdtemp(prefix="router-overload-"))
    procs = measure.Procs(work, dict(os.environ), ROOT)
    results: dict[str, dict] = {}
    try:
        for mode in ("off", "on"):
            boxes_path = work / f"boxes-{mode}.json"
            limit = {"max_inflight": PARALLEL} if mode == "on" else {}
            boxes_path.write_text(json.dumps({"boxes": [
                {"name": b.name, "url": b.url, "kind": "ollama", **limit} for b in boxes]}))
            started, ready = procs.start(
                f"router-{mode}",
                [sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes_path),
                 "--log-level", "warning"],
                measure.ROUTER_READY,
                env={"HUGPY_ROUTER_HOME": str(work / f"home-{mode}"), "HUGPY_ROUTER_REQUIRE_KEY": "never"},
            )
            url = ready.group(1)
            keys = {t: admin(url, "/v1/keys", {"name": t})["key"] for t in ("heavy", "light")}
            if mode == "off":
                light_users = max(1, round(args.users / 11))
                unloaded = run_load(url, keys, light_users, args.rate, args.seconds, work, "unloaded", True)
                results["unloaded"] = summary(unloaded, args.seconds, 0)
            before = sum(b.busy_refusals for b in boxes)
            samples = run_load(url, keys, args.users, args.rate, args.seconds, work, mode)
            results[mode] = summary(samples, args.seconds, sum(b.busy_refusals for b in boxes) - before)
            procs.stop(started)
    finally:
        procs.stop_all()
        fleet.stop()
    light_unloaded = results["unloaded"]["tenants"]["light"]["p99_ms"]
    results["verdict"] = {
        "boxes_refused_nothing_with_admission": results["on"]["box_refusals"] == 0,
        "light_p99_within_2x_unloaded": results["on"]["tenants"]["light"]["p99_ms"] <= 2 * light_unloaded,
    }
    stamp = time.strftime("%Y-%m-%dT%H-%M-%SZ", time.gmtime())
    out = BENCH / "results" / f"overload-{stamp}.json"
    out.write_text(json.dumps({"args": vars(args), **results}, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
