"""Router benchmark: the router in front of a simulated hugpy fleet vs the same box called directly.

Run it with `scripts/bench [--quick] [--profile] [--locust] ...` (`--help` for all options).

What is measured, for each interface (`asgi`, the default, and `rsgi`) and each figure, N repeats
(default 3; `--quick`: 1 repeat, shorter runs), reported as median and min–max:

* non-stream throughput: `wrk -t1 -c64 -d10s --latency -s bench/post.lua` against the router and,
  right after, against the box the router picks (sim-1, where tiny-llama is resident): calls/s
  each, their ratio, and the router's own CPU per call = (router process user+sys CPU during the
  wrk run, psutil) / calls completed;
* 20-chunk streams: the same with bench/stream.lua: streams/s, ratio, router CPU per relayed
  frame = router CPU / (streams × 22), 22 = role frame + 20 content frames + final frame (the
  `[DONE]` terminator is not counted as a frame);
* added latency at c=1: `wrk -t1 -c1 -d5s`, p50 and p99 router minus direct, in µs (exact
  percentiles printed by bench/wrk_report.lua, not wrk's rounded summary);
* with `--locust`: time to first token at 64 users against a fleet with a 20 ms token cadence
  (bench/locustfile.py, FastHttpUser, headless, `--csv`), added TTFT p50/p99 router vs direct;
* with `--profile`: py-spy (`record --nonblocking -r 200 -d 8 --format raw`) on the router during
  a non-stream and a stream load at c=64 and a non-stream load at c=1; the top-15 functions by
  own samples, and own samples by area, go to bench/results/profile-<stamp>.txt.

How: every (repeat, interface) gets a fresh sim fleet (`python -m router.sim --boxes 8`) and a
fresh router (`python -m router serve --port auto`), a warm-up, and then for each figure one
router run and one direct run back to back, so a pair shares the machine's conditions.
Repeats interleave the interfaces (asgi, rsgi, asgi, ...) so drift hits both alike. Everything
runs on loopback, unpinned, on this 2-core machine: wrk, the fleet and the router share both
cores, so ratios compare "router + box + wrk" with "box + wrk"; CPU per call is the portable
number (contracts/stack-notes.md §2.2).

Other tenants: before each pair the runner waits until other processes use under 20 % of a
core (at most 20 s), and it records their CPU during every run (machine busy time from
/proc/stat minus ours). A run during which they used over 35 % is flagged "noisy"; the pair is
retried once if the gate had found the machine quiet.

Direct streams: a hugpy box ends an SSE stream by closing the connection (no length, no
chunking). wrk completes such a message at EOF and counts it with its full latency and bytes
(checked: bytes per stream equal a curl-read stream), but then also counts one read error and
reconnects twice, so every direct stream costs the box one extra accept of a connection wrk
drops unused. The runner subtracts that one read error per stream (any more are real errors)
and records TCP passive opens per stream (≈2 direct, ≈1 through the router, whose pool opens one
box connection per stream and keeps the client's alive). The extra accept makes the direct
figure slightly pessimistic, i.e. the router/direct stream ratio slightly flattering.

Outputs: bench/results/<UTC stamp>.json (every run, conditions, versions), <stamp>.md and
latest.md (the table), profile-<stamp>.txt; logs, locust CSVs and py-spy raw files of the last
run under bench/results/tmp/bench-run/ (git-ignored, wiped at the next run).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import measure
import report
from measure import BenchError, CpuMeter, Procs

RESULTS = measure.BENCH / "results"
INTERFACES = ("asgi", "rsgi")
FIGURES = ("nonstream", "stream", "latency")

BOXES = 8  # as many boxes as a small fleet; the router's decision walks all of them per call
CHUNKS = 20  # content frames per stream (the spike's 20-chunk stream, stack-notes §0)
FRAMES_PER_STREAM = CHUNKS + 2  # + role frame + final frame; [DONE] is a terminator
CONNECTIONS = 64  # the spike's concurrency for throughput figures
LOCUST_USERS = 64
LOCUST_CADENCE_MS = 20  # a realistic token pace: ~156 streams/s at 64 users, far below locust's limit


@dataclass(frozen=True)
class Durations:
    repeats: int
    throughput_s: int  # non-stream and stream wrk runs (wrk takes whole seconds)
    latency_s: int  # c=1 runs
    locust_s: int
    warmup_s: int  # per warm-up wrk run


FULL = Durations(repeats=3, throughput_s=10, latency_s=5, locust_s=20, warmup_s=2)
QUICK = Durations(repeats=1, throughput_s=5, latency_s=3, locust_s=10, warmup_s=1)


# -- the rig: one sim fleet + one router ------------------------------------------------------


class Rig:
    """A fresh sim fleet and router for one interface; stopped (by PID group) on exit.

    The router gets a store of its own (HUGPY_ROUTER_HOME in the run's tmp folder, removed on
    exit): it logs a row per call there, and must neither write to the user's store nor carry
    a store grown by earlier rigs into the next measurement."""

    def __init__(self, procs: Procs, meter: CpuMeter, interface: str, cadence_ms: float = 0.0) -> None:
        self.procs, self.meter, self.interface, self.cadence_ms = procs, meter, interface, cadence_ms
        self.sim = self.router = None
        self.router_url = self.direct_url = self.box = ""
        self.store = procs.workdir / f"store-{interface}"

    def __enter__(self) -> "Rig":
        boxes_file = self.procs.workdir / f"boxes-{self.interface}-{self.cadence_ms:g}.json"
        boxes_file.unlink(missing_ok=True)
        shutil.rmtree(self.store, ignore_errors=True)
        self.store.mkdir(mode=0o700)
        self.sim, _ = self.procs.start(f"sim-{self.interface}", [
            measure.PYTHON, "-m", "router.sim", "--boxes", str(BOXES), "--boxes-file", str(boxes_file),
            "--chunks", str(CHUNKS), "--cadence-ms", f"{self.cadence_ms:g}", "--load-ms", "0",
        ], measure.SIM_READY)
        self.router, match = self.procs.start(f"router-{self.interface}", [
            measure.PYTHON, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes_file),
            "--interface", self.interface, "--log-level", "warning",
        ], measure.ROUTER_READY, env={"HUGPY_ROUTER_HOME": str(self.store)})
        self.meter.sim_pid, self.meter.router_pid = self.sim.pid, self.router.pid
        self.router_url = match.group(1)
        self.box = measure.wait_routable(self.router_url)
        urls = {b["name"]: b["url"] for b in json.loads(boxes_file.read_text())["boxes"]}
        self.direct_url = urls[self.box]  # "direct" = the box the router picks
        return self

    def __exit__(self, *_exc) -> None:
        self.meter.sim_pid = self.meter.router_pid = None
        for started in (self.router, self.sim):
            if started is not None:
                self.procs.stop(started)
        shutil.rmtree(self.store, ignore_errors=True)

    def url(self, target: str) -> str:
        return (self.router_url if target == "router" else self.direct_url) + "/v1/chat/completions"

    def warm_up(self, seconds: int) -> None:
        """Fills the router's box pool and both sides' caches; nothing is recorded."""
        measure.wrk(self.url("router"), "post", CONNECTIONS, seconds, "router")
        measure.wrk(self.url("router"), "stream", CONNECTIONS, seconds, "router")
        measure.wrk(self.url("direct"), "post", CONNECTIONS, seconds, "direct")


# -- figures -----------------------------------------------------------------------------------


def wrk_record(rig: Rig, figure: str, target: str, d: Durations) -> dict:
    """One wrk run of `figure` against `target`, with the CPU of every party during it."""
    script = "stream" if figure == "stream" else "post"
    connections = 1 if figure == "latency" else CONNECTIONS
    seconds = d.latency_s if figure == "latency" else d.throughput_s
    before = rig.meter.snapshot()
    run = measure.wrk(rig.url(target), script, connections, seconds, target,
                      close_delimited=(script == "stream" and target == "direct"))
    cpu = CpuMeter.delta(before, rig.meter.snapshot())
    record = {k: v for k, v in asdict(run).items() if k != "raw"}
    record.update(wrk=run.raw, **cpu_fields(cpu, run.requests))
    if target == "router" and run.requests:
        record["cpu_us_per_call"] = 1e6 * cpu.router_s / run.requests
        if script == "stream":
            record["cpu_us_per_chunk"] = 1e6 * cpu.router_s / (run.requests * FRAMES_PER_STREAM)
    return record


def cpu_fields(cpu: measure.CpuDelta, units: int) -> dict:
    return {
        "wall_s": round(cpu.wall_s, 3),
        "router_cpu_pct": round(cpu.pct(cpu.router_s), 1),
        "sim_cpu_pct": round(cpu.pct(cpu.sim_s), 1),
        "loadgen_cpu_pct": round(cpu.pct(cpu.loadgen_s), 1),
        "background_pct": round(cpu.background_pct, 1),
        "noisy": cpu.background_pct > measure.NOISY_PCT,
        "sim_cpu_us_per_unit": 1e6 * cpu.sim_s / units if units else None,
        "passive_opens_per_unit": cpu.passive_opens / units if units else None,
    }


def ttft_record(rig: Rig, target: str, d: Durations, repeat: int) -> dict:
    """One locust run against `target` → TTFT percentiles in ms."""
    tag = f"{rig.interface}-{target}-{repeat}"
    samples_file = rig.procs.workdir / f"ttft-{tag}.json"
    csv_prefix = rig.procs.workdir / f"locust-{tag}"
    host = rig.router_url if target == "router" else rig.direct_url
    before = rig.meter.snapshot()
    samples = measure.locust(host, LOCUST_USERS, d.locust_s, csv_prefix, samples_file)
    cpu = CpuMeter.delta(before, rig.meter.snapshot())
    streams = len(samples["ttft_ms"])
    # At a 20 ms cadence each frame reaches the router on its own, so this per-frame CPU is the
    # unbatched cost, unlike the c=64 stream figure where frames arrive back to back.
    per_stream = {"cpu_us_per_call": 1e6 * cpu.router_s / streams,
                  "cpu_us_per_chunk": 1e6 * cpu.router_s / (streams * FRAMES_PER_STREAM)} \
        if target == "router" and streams else {}
    return {
        "target": target, "streams": streams, "rate": streams / d.locust_s,
        "ttft_p50_ms": percentile(samples["ttft_ms"], 50), "ttft_p99_ms": percentile(samples["ttft_ms"], 99),
        "first_byte_p50_ms": percentile(samples["first_byte_ms"], 50),
        "total_p50_ms": percentile(samples["total_ms"], 50), "total_p99_ms": percentile(samples["total_ms"], 99),
        "errors": locust_failures(Path(f"{csv_prefix}_stats.csv")), "csv": f"{csv_prefix}_stats.csv",
        **cpu_fields(cpu, streams), **per_stream,
    }


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def locust_failures(stats_csv: Path) -> int:
    if not stats_csv.exists():
        return -1
    with open(stats_csv, newline="") as f:
        return sum(int(row["Failure Count"]) for row in csv.DictReader(f) if row["Name"] != "Aggregated")


def measure_pair(rig: Rig, figure: str, repeat: int, d: Durations, log) -> list[dict]:
    """Router then direct, after the quiet gate. A pair that started quiet but turned noisy is
    measured once more, and the quieter of the two attempts is kept."""
    attempts = []
    for attempt in (1, 2):
        gate = measure.wait_quiet(rig.meter)
        if figure == "ttft":
            pair = [ttft_record(rig, target, d, repeat) for target in ("router", "direct")]
        else:
            pair = [wrk_record(rig, figure, target, d) for target in ("router", "direct")]
        for record in pair:
            record.update(interface=rig.interface, repeat=repeat, figure=figure, attempt=attempt,
                          gate=asdict(gate))
            log(progress_line(record))
        attempts.append(pair)
        if not any(r["noisy"] for r in pair) or not gate.quiet:
            break
        if attempt == 1:
            log(f"  noisy pair (other tenants over {measure.NOISY_PCT:.0f} %), measuring it once more")
    return min(attempts, key=lambda pair: max(r["background_pct"] for r in pair))


def progress_line(r: dict) -> str:
    head = f"[{r['interface']} #{r['repeat'] + 1}] {r['figure']:9} {r['target']:6}"
    if r["figure"] == "ttft":
        body = f"TTFT p50 {r['ttft_p50_ms']:.1f} ms p99 {r['ttft_p99_ms']:.1f} ms, {r['rate']:.0f} streams/s"
    elif r["figure"] == "latency":
        body = f"p50 {r['p50_us']} µs p99 {r['p99_us']} µs"
    else:
        body = f"{r['rate']:>9,.0f}/s p50 {r['p50_us'] / 1000:.2f} ms p99 {r['p99_us'] / 1000:.2f} ms"
    cpu = ""
    if "cpu_us_per_chunk" in r:
        cpu = f", router {r['cpu_us_per_call']:.0f} µs/stream = {r['cpu_us_per_chunk']:.1f} µs/frame"
    elif "cpu_us_per_call" in r:
        cpu = f", router {r['cpu_us_per_call']:.1f} µs/call"
    return (f"{head} {body}{cpu}; router {r['router_cpu_pct']:.0f} % sim {r['sim_cpu_pct']:.0f} % "
            f"others {r['background_pct']:.0f} % (gate {r['gate']['background_pct']:.0f} %)"
            f"{'; ' + str(r['errors']) + ' errors' if r['errors'] else ''}")


# -- profile -------------------------------------------------------------------------------------


# What --profile samples: the two figures the CPU targets are about, plus c=1, where the router
# spends about twice the CPU per call that it does at c=64 (no batching of wake-ups).
PROFILE_LOADS = (("post", CONNECTIONS, "non-stream c=64"), ("stream", CONNECTIONS, "20-chunk streams c=64"),
                 ("post", 1, "non-stream c=1"))


def profile(rig: Rig, log) -> str:
    """py-spy on the router under each PROFILE_LOADS load → top-15 text per load."""
    sections = []
    for script, connections, label in PROFILE_LOADS:
        raw = rig.procs.workdir / f"pyspy-{rig.interface}-{script}-c{connections}.txt"
        load = measure.wrk_background(rig.url("router"), script, connections, measure.PYSPY_DURATION_S + 3)
        try:
            time.sleep(1)  # let the load reach steady state before sampling
            measure.pyspy(rig.router.pid, raw)
            load.wait(timeout=measure.RUN_MARGIN_S)
        finally:
            measure.stop_group(load)
        sections.append(report.profile_text(f"{rig.interface} · {label}", raw, measure.PYSPY_RATE_HZ,
                                            measure.PYSPY_DURATION_S))
        log(f"[{rig.interface}] profiled {label}")
    return "\n".join(sections)


# -- the whole run ---------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 repeat, shorter runs")
    p.add_argument("--repeats", type=int, help="repeats per figure (default 3, quick 1)")
    p.add_argument("--interfaces", default=",".join(INTERFACES), help="comma list of asgi,rsgi")
    p.add_argument("--figures", default=",".join(FIGURES), help="comma list of nonstream,stream,latency "
                   "(empty: none, e.g. with --locust or --profile only)")
    p.add_argument("--locust", action="store_true", help="also measure TTFT with locust (20 ms cadence)")
    p.add_argument("--profile", action="store_true", help="also profile the router with py-spy")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="MINUTES",
                   help="first wait up to this long for other tenants to go quiet (default 0)")
    p.add_argument("--router-src", type=Path, help="run the router and sim from this checkout instead")
    args = p.parse_args(argv)
    args.interfaces = [i for i in args.interfaces.split(",") if i]
    args.figures = [f for f in args.figures.split(",") if f]
    for name, allowed in (("interfaces", INTERFACES), ("figures", FIGURES)):
        unknown = set(getattr(args, name)) - set(allowed)
        if unknown:
            p.error(f"unknown {name}: {', '.join(sorted(unknown))}")
    return args


def git_state(src: Path) -> dict:
    def git(*cmd: str) -> str:
        done = subprocess.run(["git", "-C", str(src), *cmd], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"src": str(src), "rev": git("rev-parse", "--short", "HEAD"),
            "router_changes": git("status", "--porcelain", "--", "router").splitlines()}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def measure_all(args: argparse.Namespace, d: Durations, procs: Procs, meter: CpuMeter,
                stamp: str) -> tuple[list[dict], Path | None]:
    """Every figure asked for; the profile last. Returns the records and the profile file."""
    records: list[dict] = []
    for repeat in range(d.repeats if args.figures else 0):
        for interface in args.interfaces:  # interleaved, so drift hits both interfaces alike
            with Rig(procs, meter, interface) as rig:
                rig.warm_up(d.warmup_s)
                for figure in args.figures:
                    records += measure_pair(rig, figure, repeat, d, log)
    if args.locust:
        for repeat in range(d.repeats):
            for interface in args.interfaces:
                with Rig(procs, meter, interface, cadence_ms=LOCUST_CADENCE_MS) as rig:
                    records += measure_pair(rig, "ttft", repeat, d, log)
    if not args.profile:
        return records, None
    texts = []
    for interface in args.interfaces:
        with Rig(procs, meter, interface) as rig:
            rig.warm_up(d.warmup_s)
            texts.append(profile(rig, log))
    profile_file = RESULTS / f"profile-{stamp}.txt"
    profile_file.write_text("\n".join(texts))
    return records, profile_file


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    d = QUICK if args.quick else FULL
    if args.repeats:
        d = Durations(args.repeats, d.throughput_s, d.latency_s, d.locust_s, d.warmup_s)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    started_at = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops what we started
    workdir = RESULTS / "tmp" / "bench-run"  # only this run's own folder is wiped
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    src = (args.router_src or measure.ROOT).resolve()
    git = git_state(src)  # the tree as snapshotted: others may edit it while we run
    meter = CpuMeter()
    procs = None
    try:
        env, digest = measure.snapshot_router(src, workdir / "src")
        procs = Procs(workdir, env, cwd=workdir / "src")
        if args.wait_quiet > 0:
            gate = measure.wait_quiet(meter, args.wait_quiet * 60, measure.SETTLE_WINDOW_S)
            log(f"machine {'quiet' if gate.quiet else 'still busy'} after {gate.waited_s:.0f} s "
                f"(other tenants {gate.background_pct:.0f} %)")
        records, profile_file = measure_all(args, d, procs, meter, stamp)
    except BenchError as exc:
        log(f"bench failed: {exc}")
        return 1
    finally:
        if procs is not None:
            procs.stop_all()

    rows = report.summarize(records, args.interfaces)
    lines = report.verdict(rows)
    doc = {
        "stamp": stamp, "args": {k: str(v) for k, v in vars(args).items()}, "durations": asdict(d),
        "elapsed_s": round(time.monotonic() - started_at, 1), "git": {**git, "snapshot_sha256": digest},
        "versions": measure.versions(), "targets": report.TARGETS, "frames_per_stream": FRAMES_PER_STREAM,
        "rows": [{k: (asdict(v) if isinstance(v, report.Stat) else v) for k, v in r.items()} for r in rows],
        "verdict": lines, "profile": str(profile_file) if profile_file else None, "records": records,
    }
    (RESULTS / f"{stamp}.json").write_text(json.dumps(doc, indent=1, default=str))
    markdown = latest_markdown(stamp, doc, rows, lines, records, profile_file)
    (RESULTS / f"{stamp}.md").write_text(markdown)
    (RESULTS / "latest.md").write_text(markdown)
    print(markdown)
    if profile_file:
        print(profile_file.read_text())
    return 0


def latest_markdown(stamp: str, doc: dict, rows: list[dict], lines: list[str], records: list[dict],
                    profile_file: Path | None) -> str:
    d = doc["durations"]
    git = doc["git"]
    dirty = f" + {len(git['router_changes'])} uncommitted changes under router/" if git["router_changes"] else ""
    def opens(target: str) -> report.Stat | None:
        return report.Stat.of([r["passive_opens_per_unit"] for r in records if r["figure"] == "stream"
                               and r["target"] == target and r["passive_opens_per_unit"] is not None])

    parts = [
        f"# Router benchmark {stamp}", "",
        f"router snapshot {git['snapshot_sha256']} (git {git['rev']}{dirty}); granian {doc['versions']['granian']}, wrk {doc['versions']['wrk']}; "
        f"{d['repeats']} repeat(s), wrk {d['throughput_s']:g} s at c={CONNECTIONS}, {d['latency_s']:g} s at c=1; "
        f"{BOXES} sim boxes, {CHUNKS}-chunk streams ({FRAMES_PER_STREAM} frames counted); unpinned on "
        f"{os.cpu_count()} cores; took {doc['elapsed_s']:.0f} s.", "",
        report.markdown_table(rows),
    ]
    cost = report.interface_cost(rows)
    if cost:
        parts += ["Price of the bounded ASGI path (medians):", "", cost]
    parts += ["Verdict (targets for the router on this machine):", "", "```", *lines, "```", ""]
    direct, routed = opens("direct"), opens("router")
    if direct and routed:
        parts.append(f"Streams: {direct.median:.2f} TCP connections accepted per direct stream (wrk's extra "
                     f"reconnect on a close-delimited answer), {routed.median:.2f} per routed stream; see "
                     "bench/run.py's docstring.")
    if profile_file:
        parts.append(f"Profile: {profile_file.relative_to(measure.ROOT)}")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
