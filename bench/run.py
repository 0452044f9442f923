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
* the floor, beside the three figures above: the same wrk runs against bench/floor_proxy.py, a
  bare proxy on the router's own stack (Granian with the router's settings, router.upstream.pool)
  in front of the same box, with its CPU: what any proxy on this stack costs here, so the router's
  CPU above it is the router's own (access, decision, reservation, hold, route-log row, metrics);
* the peers and the floors in one round (`peers`), N rounds with the first interface's router:
  non-stream `wrk -t1 -c64` (the same post.lua, same durations) against, in turn, the router, the
  bare proxy, HAProxy 2.6 (`nbthread 1`, keep-alive to the box: the C floor), hugpy-router 0.0.4
  (the release this router replaces, in front of the same 8 boxes), LiteLLM's proxy (one worker,
  the box as an OpenAI-compatible backend) and the Rust routers sglang-router and vllm-router
  (round robin), each in front of the box the router picks, then the box itself; 20-chunk
  streams too for the router, the bare proxy, HAProxy, the Rust routers and the box, and for the
  same, one call at a time (`peers_c1`: `wrk -t1 -c1`, the latency figure's length), whose p50
  and p99 less the box's own in the same round are the latency each adds. Those streams come
  from a box that writes the whole answer at once (the burst figure: how well a proxy coalesces);
  the same round then runs them again from a fleet whose box writes a content frame every
  PACED_CADENCE_MS (`peers_paced`, 100 tokens a second per stream, c streams at once), where each
  frame reaches the proxy alone: CPU per paced frame is the cost of relaying a token, the call's
  own share included; and once more PACED_LONG_CHUNKS frames long (`peers_paced_long`): what a
  stream costs more over the frames it has more is a token after the first, alone. Each peer
  is started, warmed up, measured and stopped in turn (bench/peers.py says how each is run); its
  CPU per call = its process tree's user+sys CPU (psutil) / calls, the router's as above. The
  ratios issue 41 sets targets for (router CPU per call, per paced token and per burst frame ÷
  sglang-router's, per paced token ÷ the bare proxy's, per burst frame ÷ vllm-router's, p99 ÷
  sglang-router's; and ÷ HAProxy's, calls/s ÷ LiteLLM's) are taken within a round;
  a peer that is not installed or does not start is recorded as not run, with why;
* with `--locust`: time to first token at 64 users against a fleet with a 20 ms token cadence
  (bench/locustfile.py, FastHttpUser, headless, `--csv`), added TTFT p50/p99 router vs direct;
* once per interface, each with a fleet and router of its own (`--figures` picks, e.g.
  `--figures open_streams,stalled_reader,latency_curve` for these three only):
  - open streams: 2,000 streaming calls held open at once through one router process
    (bench/open_streams.py: raw sockets on uvloop, opened 100 every 50 ms) against a fleet with a
    200 ms cadence and 30-chunk streams (6 s each, so all 2,000 overlap); every stream must get
    all 33 `data: ` events and its end, with no gap between two frames over 5 × the cadence
    (1 s) — else it counts as stalled; the router's RSS (psutil, every 100 ms) at the peak, and
    its descriptors (2 per stream). The router and the sim need `ulimit -n` ≥ 5,024 and 2,256
    (scripts/bench raises it);
  - 10,000 open streams (`open_streams_10k`): the same client, 10,000 streams at one frame per
    second (23 frames, opened 100 every 100 ms, so all overlap), a gap over 2 s counts as a stall;
    the router's RSS growth at the peak per stream it held then (its descriptors / 2). Both
    open-streams figures run as many streams as fit the router's and the sim's `ulimit -n` (and
    the router's client budget under it, (limit - 1024) / 2) and record why when fewer: 10,000
    need a hard limit of at least 21,024 (scripts/bench raises the soft limit to 21,280 or the
    hard one); a figure with fewer than half its streams fitting is recorded as not run. After the
    router's run, both figures run the same streams through the bare proxy (its RSS per stream:
    the stack's share), through sglang-router and vllm-router when installed (theirs), and
    straight from the box (a late frame there is the box's or the machine's, not the router's);
  - stalled reader: a box writes a 200,000-frame stream (~43 MB) at once; a client with a
    16 KiB receive buffer reads the head, then nothing for 10 s: the router's RSS growth over
    those 10 s (from the head's arrival), sampled every 200 ms, and 2 s after the client closed.
    Under ASGI a write waits for the client, so the router pauses reading the box (256 KiB
    buffered); under RSGI nothing waits and the whole answer lands in the router's memory;
  - latency against concurrency: non-stream `wrk -t1 -cN -d3s` at N = 1, 4, 16, 64, 128, router
    then direct back to back after the quiet gate; p50 and p99 in a table and in a plot
    (matplotlib, Agg, log-scale y) saved as bench/results/<stamp>-latency.png and latency.png;
* with `--profile`: py-spy (`record --nonblocking -r 200 -d 8 --format raw`) on the router during
  a non-stream and a stream load at c=64 and a non-stream load at c=1; the top-15 functions by
  own samples, and own samples by area, go to bench/results/profile-<stamp>.txt.

`--pin`: the proxy under test (the router, the bare proxy, every peer) runs alone on the last
CPU, started there, so a runtime that sizes its threads from the CPUs it may use runs one
worker (tokio, Granian); the runner, the sim, wrk and the clients share the others. Per-core
figures, comparable across proxies; unpinned (the default) they share both cores.

How: every (repeat, interface) gets a fresh sim fleet (`python -m router.sim --boxes 8`) and a
fresh router (`python -m router serve --port auto`), a warm-up, and then for each figure one
router run and one direct run back to back, so a pair shares the machine's conditions.
Repeats interleave the interfaces (asgi, rsgi, asgi, ...) so drift hits both alike. Everything
runs on loopback, unpinned, on this 2-core machine: wrk, the fleet and the router share both
cores, so ratios compare "router + box + wrk" with "box + wrk"; CPU per call is the portable
number (the project's stack notes §2.2, not in this repository).

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
latest.md (the tables), <stamp>-latency.png and latency.png (the curve), profile-<stamp>.txt; logs, locust CSVs and py-spy raw files of the last
run under bench/results/tmp/bench-run/ (git-ignored, wiped at the next run).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import json
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

import measure
import peers
import report
from measure import BenchError, CpuMeter, Procs

RESULTS = measure.BENCH / "results"
INTERFACES = ("asgi", "rsgi")
PAIR_FIGURES = ("nonstream", "stream", "latency")  # router vs direct, repeated
PEER_FIGURES = ("peers",)  # router, bare proxy, peers and direct in one round, repeated
ONCE_FIGURES = ("open_streams", "open_streams_10k", "stalled_reader", "latency_curve")  # once per interface
FIGURES = PAIR_FIGURES + PEER_FIGURES + ONCE_FIGURES

BOXES = 8  # as many boxes as a small fleet; the router's decision walks all of them per call
CHUNKS = 20  # content frames per stream (the spike's 20-chunk stream, stack-notes §0)
FRAMES_PER_STREAM = CHUNKS + 2  # + role frame + final frame; [DONE] is a terminator
CONNECTIONS = 64  # the spike's concurrency for throughput figures
LOCUST_USERS = 64
LOCUST_CADENCE_MS = 20  # a realistic token pace: ~156 streams/s at 64 users, far below locust's limit


@dataclass(frozen=True)
class OpenStreams:
    """Streaming calls held open at once through one router process, each a slow stream that
    outlasts the ramp (opening 100 every `batch_gap_ms`), so every stream is open while the last
    ones are being opened."""
    figure: str
    streams: int
    cadence_ms: float
    chunks: int
    stall_factor: float  # a gap between two frames over this × the cadence is a stall
    batch_gap_ms: float

    @property
    def frames(self) -> int:  # `data: ` events: role + content + final + [DONE]
        return self.chunks + 3

    def fds_needed(self, streams: int) -> dict[str, int]:
        """Every open stream costs the router two descriptors (client and box connection) and the
        sim one, plus their own. Both inherit scripts/bench's `ulimit -n` (raised there); Granian
        lifts the router's soft limit to its hard limit at import, the sim keeps what it inherited."""
        return {"router": 2 * streams + 256, "sim": streams + 256}


# 2,000 streams of 6 s, opened in 1 s
OPEN = OpenStreams("open_streams", streams=2000, cadence_ms=200, chunks=30, stall_factor=5.0, batch_gap_ms=50)
# 10,000 streams at one frame per second, 23 s each, opened in 10 s (1,000 a second: a held
# stream, not the rate of new ones, is what this figure is about): the router's memory per open
# stream. A frame over 2 s late is a stall.
OPEN_10K = OpenStreams("open_streams_10k", streams=10_000, cadence_ms=1000, chunks=20, stall_factor=2.0,
                       batch_gap_ms=100)
OPEN_FIGURES = {o.figure: o for o in (OPEN, OPEN_10K)}
RSS_SAMPLE_S = 0.1
OPEN_JSON = re.compile(r"^OPEN_STREAMS_JSON (\{.*\})$", re.M)

# Stalled reader: a box that writes a ~43 MB stream at once (200,000 frames of ~214 B, no
# cadence) to a client that reads the head and then nothing for STALL_S.
STALL_CHUNKS = 200_000
STALL_S = 10.0
SIM_FRAME_BYTES = 214  # one content frame of the sim's stream, `data: {...}\n\n`
STALL_RCVBUF = 16 << 10  # the stalled client's receive buffer: keep the kernel's share small

# Latency against concurrency: non-stream wrk at each concurrency, router then direct.
CURVE_CONNECTIONS = (1, 4, 16, 64, 128)


@dataclass(frozen=True)
class Durations:
    repeats: int
    throughput_s: int  # non-stream and stream wrk runs (wrk takes whole seconds)
    latency_s: int  # c=1 runs
    locust_s: int
    warmup_s: int  # per warm-up wrk run
    curve_s: int  # each wrk run of the latency-against-concurrency curve
    connections: int = CONNECTIONS  # wrk's connections in the throughput and peers figures


FULL = Durations(repeats=3, throughput_s=10, latency_s=5, locust_s=20, warmup_s=2, curve_s=3)
QUICK = Durations(repeats=1, throughput_s=5, latency_s=3, locust_s=10, warmup_s=1, curve_s=2)


# -- the rig: one sim fleet + one router ------------------------------------------------------


class Rig:
    """A fresh sim fleet and router for one interface; stopped (by PID group) on exit.

    The router gets a store of its own (HUGPY_ROUTER_HOME in the run's tmp folder, removed on
    exit): it logs a row per call there, and must neither write to the user's store nor carry
    a store grown by earlier rigs into the next measurement."""

    def __init__(self, procs: Procs, meter: CpuMeter, interface: str, cadence_ms: float = 0.0,
                 chunks: int = CHUNKS, tag: str = "", floor: bool = False) -> None:
        self.procs, self.meter, self.interface, self.cadence_ms = procs, meter, interface, cadence_ms
        self.chunks = chunks
        self.name = f"{interface}{'-' + tag if tag else ''}"  # logs, boxes file and store of this rig
        self.with_floor = floor  # also start bench/floor_proxy.py in front of the same box
        self.sim = self.router = self.floor = None
        self.router_url = self.direct_url = self.floor_url = self.box = ""
        self.boxes_file = procs.workdir / f"boxes-{self.name}-{self.cadence_ms:g}.json"
        self.peer_urls: dict[str, str] = {}  # the peers running now (bench/peers.py), by target name
        self.store = procs.workdir / f"store-{self.name}"

    def __enter__(self) -> "Rig":
        boxes_file = self.boxes_file
        boxes_file.unlink(missing_ok=True)
        shutil.rmtree(self.store, ignore_errors=True)
        self.store.mkdir(mode=0o700)
        self.sim, _ = self.procs.start(f"sim-{self.name}", [
            measure.PYTHON, "-m", "router.sim", "--boxes", str(BOXES), "--boxes-file", str(boxes_file),
            "--chunks", str(self.chunks), "--cadence-ms", f"{self.cadence_ms:g}", "--load-ms", "0",
        ], measure.SIM_READY)
        self.router, match = self.procs.start(f"router-{self.name}", [
            measure.PYTHON, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes_file),
            "--interface", self.interface, "--log-level", "warning",
            # Every load generator here is one address: a cap above the most connections it
            # holds (open_streams_10k), so that the cap's sweeps run and cost what they cost, and
            # close nothing.
            "--max-conns-per-client", str(OPEN_10K.streams + 100),
        ], measure.ROUTER_READY, env={"HUGPY_ROUTER_HOME": str(self.store)}, proxy=True)
        self.meter.sim_pid, self.meter.router_pid = self.sim.pid, self.router.pid
        self.router_url = match.group(1)
        self.box = measure.wait_routable(self.router_url)
        urls = {b["name"]: b["url"] for b in json.loads(boxes_file.read_text())["boxes"]}
        self.direct_url = urls[self.box]  # "direct" = the box the router picks
        if self.with_floor:
            self.floor, match = self.procs.start(f"floor-{self.name}", [
                measure.PYTHON, str(measure.BENCH / "floor_proxy.py"), "--interface", self.interface,
                "--box", self.direct_url,
            ], measure.FLOOR_READY, proxy=True)
            self.meter.floor_pid = self.floor.pid
            self.floor_url = match.group(1)
        return self

    def __exit__(self, *_exc) -> None:
        self.meter.sim_pid = self.meter.router_pid = self.meter.floor_pid = None
        for started in (self.floor, self.router, self.sim):
            if started is not None:
                self.procs.stop(started)
        shutil.rmtree(self.store, ignore_errors=True)

    def targets(self) -> tuple[str, ...]:
        return ("router", "floor", "direct") if self.floor else ("router", "direct")

    @contextmanager
    def running_peer(self, name: str) -> Iterator[str]:
        """The peer `name` (bench/peers.py) in front of this rig's box, reachable as a target
        (`url`) while it runs; stopped on exit."""
        with peers.running(name, self.procs, self.meter, self.direct_url, self.boxes_file) as url:
            self.peer_urls[name] = url
            try:
                yield url
            finally:
                del self.peer_urls[name]

    def url(self, target: str) -> str:
        base = {"router": self.router_url, "floor": self.floor_url, "direct": self.direct_url,
                **self.peer_urls}[target]
        return base + "/v1/chat/completions"

    def warm_up(self, seconds: int) -> None:
        """Fills the proxies' box pools and every side's caches; nothing is recorded."""
        for target in self.targets():
            measure.wrk(self.url(target), "post", CONNECTIONS, seconds, target)
            if target != "direct":
                measure.wrk(self.url(target), "stream", CONNECTIONS, seconds, target)


# -- figures -----------------------------------------------------------------------------------


def wrk_script(figure: str) -> str:
    return "stream" if figure in ("stream", "peers_stream", "peers_paced", "peers_paced_long") else "post"


def wrk_record(rig: Rig, figure: str, target: str, d: Durations) -> dict:
    """One wrk run of `figure` against `target`, with the CPU of every party during it."""
    script = wrk_script(figure)
    one_at_a_time = figure in ("latency", "peers_c1")
    connections = 1 if one_at_a_time else d.connections
    seconds = d.latency_s if one_at_a_time else d.throughput_s
    before = rig.meter.snapshot()
    run = measure.wrk(rig.url(target), script, connections, seconds, target,
                      close_delimited=(script == "stream" and target in CLOSE_DELIMITED))
    cpu = CpuMeter.delta(before, rig.meter.snapshot())
    record = {k: v for k, v in asdict(run).items() if k != "raw"}
    record.update(wrk=run.raw, **cpu_fields(cpu, run.requests))
    proxy_s = cpu.peer_s if target in peers.PEERS else {"router": cpu.router_s, "floor": cpu.floor_s}.get(target)
    if script == "stream":
        record["chunks"] = rig.chunks
    if proxy_s is not None and run.requests:  # the proxy's own CPU: the router's, the floor's or a peer's
        record["cpu_us_per_call"] = 1e6 * proxy_s / run.requests
        if script == "stream":
            record["cpu_us_per_chunk"] = 1e6 * proxy_s / (run.requests * (rig.chunks + 2))
    return record


# Who answers a stream by closing the connection: the hugpy box, and HAProxy passing its answer on.
CLOSE_DELIMITED = ("direct", "haproxy")


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
        "ttft_p50_ms": report.percentile(samples["ttft_ms"], 50), "ttft_p99_ms": report.percentile(samples["ttft_ms"], 99),
        "first_byte_p50_ms": report.percentile(samples["first_byte_ms"], 50),
        "total_p50_ms": report.percentile(samples["total_ms"], 50), "total_p99_ms": report.percentile(samples["total_ms"], 99),
        "errors": locust_failures(Path(f"{csv_prefix}_stats.csv")), "csv": f"{csv_prefix}_stats.csv",
        **cpu_fields(cpu, streams), **per_stream,
    }


def locust_failures(stats_csv: Path) -> int:
    if not stats_csv.exists():
        return -1
    with open(stats_csv, newline="") as f:
        return sum(int(row["Failure Count"]) for row in csv.DictReader(f) if row["Name"] != "Aggregated")


def measure_pair(rig: Rig, figure: str, repeat: int, d: Durations, log) -> list[dict]:
    """Router then direct (and the floor between them when the rig has one), after the quiet
    gate. A pair that started quiet but turned noisy is measured once more, and the quieter of
    the two attempts is kept."""
    attempts = []
    for attempt in (1, 2):
        gate = measure.wait_quiet(rig.meter)
        if figure == "ttft":
            pair = [ttft_record(rig, target, d, repeat) for target in ("router", "direct")]
        else:
            pair = [wrk_record(rig, figure, target, d) for target in rig.targets()]
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
        cpu = f", {r['target']} {r['cpu_us_per_call']:.0f} µs/stream = {r['cpu_us_per_chunk']:.1f} µs/frame"
    elif "cpu_us_per_call" in r:
        cpu = f", {r['target']} {r['cpu_us_per_call']:.1f} µs/call"
    return (f"{head} {body}{cpu}; router {r['router_cpu_pct']:.0f} % sim {r['sim_cpu_pct']:.0f} % "
            f"others {r['background_pct']:.0f} % (gate {r['gate']['background_pct']:.0f} %)"
            f"{'; ' + str(r['errors']) + ' errors' if r['errors'] else ''}")


# -- the peers: the router, the bare proxy, HAProxy, hugpy-router 0.0.4, LiteLLM, the Rust routers, the box --

PEER_ORDER = ("router", "floor", *peers.PEERS, "direct")
# 20-chunk streams too, for CPU per relayed chunk: the router, the floor on its stack, the C floor,
# and the Rust routers (issue 41: the streamed token is the figure that matters most)
PEER_STREAMS = ("router", "floor", "haproxy", "sglang-router", "vllm-router", "direct")
# One call at a time through each (`peers_c1`): the latency each adds to the box's, p50 and p99.
PEER_C1 = PEER_STREAMS
# Paced streams (`peers_paced`): the same 20-chunk streams from a box that writes a content frame
# every PACED_CADENCE_MS, as an engine decodes (100 tokens a second), c streams at once: each
# frame reaches the proxy alone, so its CPU per frame is the cost of relaying a token, where the
# burst figure (`peers_stream`, the whole answer in one write) measures how well it coalesces.
PACED_CADENCE_MS = 10.0
# The same paced streams PACED_LONG_CHUNKS content frames long (`peers_paced_long`): the CPU a
# stream costs more, over the frames it has more, is the cost of a token after the first, with
# the call's own cost taken out (report.peer_marginal).
PACED_LONG_CHUNKS = 60


def measure_peers(rig: Rig, repeat: int, d: Durations, log, figures_of) -> list[dict]:
    """One round: every target `figures_of` names figures for, in front of the same box (the one
    the router picks) with the same wrk load. Each peer is started, warmed up, measured and
    stopped in turn, while the router and the bare proxy wait idle (their idle CPU counts as
    ours, not as other tenants'). A peer that is missing or fails to start is recorded as not
    run, with why."""
    records = []
    for target in PEER_ORDER:
        figures = figures_of(target)
        if not figures:
            continue
        if target not in peers.PEERS:
            records += peer_runs(rig, target, figures, repeat, d, log)
            continue
        reason = peers.missing(target)
        try:
            if not reason:
                with rig.running_peer(target):
                    for figure in figures:
                        measure.wrk(rig.url(target), wrk_script(figure), 1 if figure == "peers_c1" else d.connections,
                                    d.warmup_s, target)
                    records += peer_runs(rig, target, figures, repeat, d, log)
        except BenchError as exc:
            reason = str(exc)
        if reason:
            log(f"[peers #{repeat + 1}] {target} NOT RUN: {reason}")
            records.append({"interface": rig.interface, "figure": figures[0], "repeat": repeat, "target": target,
                            "skipped": reason, "errors": 0, "background_pct": 0.0})
    return records


def peer_figures(target: str) -> tuple[str, ...]:
    """The round on a box that answers at once: calls, burst streams, one call at a time."""
    return (("peers",) + (("peers_stream",) if target in PEER_STREAMS else ())
            + (("peers_c1",) if target in PEER_C1 else ()))


def streams_only(figure: str) -> Callable[[str], tuple[str, ...]]:
    """`figures_of` for a round of `figure` alone, through the targets that relay streams."""
    return lambda target: (figure,) if target in PEER_STREAMS else ()


def peer_runs(rig: Rig, target: str, figures: tuple[str, ...], repeat: int, d: Durations, log) -> list[dict]:
    records = []
    for figure in figures:
        gate = measure.wait_quiet(rig.meter)
        record = wrk_record(rig, figure, target, d)
        record.update(interface=rig.interface, repeat=repeat, figure=figure, gate=asdict(gate))
        log(progress_line(record))
        records.append(record)
    return records


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


# -- capacity and memory: open streams, a stalled reader, latency against concurrency ----------------


def rss_of(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def fd_limit_of(pid: int) -> int:
    """The soft limit on open files of a running process (what `ulimit -n` gave it)."""
    soft, _hard = psutil.Process(pid).rlimit(psutil.RLIMIT_NOFILE)
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


def once_record(rig: Rig, figure: str, **fields) -> dict:
    return {"interface": rig.interface, "figure": figure, "repeat": 0, "target": "router", **fields}


def router_client_capacity(rig: Rig, fd_limit: int) -> int:
    """Client connections the router serves at once under `fd_limit`: its Granian backpressure
    (router.serve.server.conns_per_listener, one listener), asked of the run's router snapshot."""
    code = "import sys; from router.serve.server import conns_per_listener as c; print(c(int(sys.argv[1]), 1))"
    done = subprocess.run([measure.PYTHON, "-c", code, str(fd_limit)], cwd=rig.procs.cwd, env=rig.procs.env,
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise BenchError(f"could not ask the router snapshot for its connection budget: {done.stderr[-800:]}")
    return int(done.stdout)


def streams_that_fit(rig: Rig, spec: OpenStreams, limits: dict[str, int]) -> tuple[int, str]:
    """How many of `spec.streams` the descriptor limits let one router and the sim hold open at
    once, and why fewer ("" when all fit)."""
    budget = router_client_capacity(rig, limits["router"])
    fit = min(spec.streams, budget, limits["sim"] - 256, (limits["router"] - 256) // 2)
    if fit == spec.streams:
        return fit, ""
    need = spec.fds_needed(spec.streams)
    return fit, (f"{spec.streams:,} streams need {need['router']:,} descriptors in the router and {need['sim']:,} "
                 f"in the sim; they may open {limits['router']:,} and {limits['sim']:,} (`ulimit -n`: scripts/bench "
                 f"raises the soft limit up to the hard one, which only a privileged process can raise), and "
                 f"under that limit the router serves {budget:,} client connections at once "
                 f"(conns_per_listener): {fit:,} fit")


def open_streams(rig: Rig, spec: OpenStreams, log) -> dict:
    """`spec.streams` streaming calls held open at once through the router (bench/open_streams.py,
    a separate client process), or as many as the descriptor limits allow (recorded, with why);
    the router's RSS and descriptors sampled every RSS_SAMPLE_S."""
    limits = {"router": fd_limit_of(rig.router.pid), "sim": fd_limit_of(rig.sim.pid)}
    streams, reduced = streams_that_fit(rig, spec, limits)
    if streams < spec.streams // 2:
        reason = reduced + ": too few to count; run it through scripts/bench (raises `ulimit -n`)"
        log(f"[{rig.interface}] {spec.figure} NOT RUN: {reason}")
        return once_record(rig, spec.figure, skipped=reason, streams_asked=spec.streams,
                           router_fd_limit=limits["router"], sim_fd_limit=limits["sim"], errors=0,
                           background_pct=0.0)
    if reduced:
        log(f"[{rig.interface}] {spec.figure}: {reduced}")
    gate = measure.wait_quiet(rig.meter)
    router = psutil.Process(rig.router.pid)
    rss_base, fds_base = router.memory_info().rss, router.num_fds()
    result, rss_peak, fds_peak, cpu = open_streams_client(rig, spec, streams, "router", router)
    time.sleep(1.0)  # every stream is done: what the router keeps afterwards
    rss_after = router.memory_info().rss
    # The same streams through the bare proxy (the stack's own memory per stream), and straight
    # from the box (whether a late frame is the router's or already the box's and the machine's).
    floor = control_run(rig, spec, streams, "floor", psutil.Process(rig.floor.pid))
    direct = control_run(rig, spec, streams, "direct", psutil.Process(rig.sim.pid))
    # and through the Rust routers: their memory per open stream (issue 41)
    rust = {name: peer_control_run(rig, spec, streams, name) for name in RUST_ROUTERS}
    held = max(1, (fds_peak - fds_base) // 2)
    record = once_record(
        rig, spec.figure, gate=asdict(gate), cadence_ms=spec.cadence_ms, streams_asked=spec.streams,
        reduced=reduced, **result,
        router_rss_base_mb=rss_base / 1e6, router_rss_peak_mb=rss_peak / 1e6,
        router_rss_after_mb=rss_after / 1e6, router_fds_peak=fds_peak,
        router_streams_held_peak=held,
        router_rss_per_stream_kb=rss_per_stream_kb(rss_base, rss_peak, fds_base, fds_peak),
        router_fd_limit=limits["router"], sim_fd_limit=limits["sim"], errors=sum(result["failures"].values()),
        router_cpu_s=round(cpu.router_s, 2), cpu_us_per_frame=1e6 * cpu.router_s / max(1, result["frames_received"]),
        **cpu_fields(cpu, result["completed"]), floor=floor, direct=direct, peers=rust)
    log(f"[{rig.interface}] {spec.figure}: {result['completed']:,}/{result['streams']:,} completed, "
        f"{result['stalled']} stalled, peak {result['peak_open']:,} open, max gap {result['max_gap_ms']:.0f} ms "
        f"(threshold {result['stall_threshold_ms']:.0f}), first frame p99 {result['first_frame_p99_ms']:.0f} ms; "
        f"router RSS {rss_base / 1e6:.0f} → peak {rss_peak / 1e6:.0f} MB "
        f"({record['router_rss_per_stream_kb']:.1f} kB per stream held), {fds_peak:,} fds; "
        f"others {cpu.background_pct:.0f} %; bare proxy: {floor['stalled']} stalled, max gap "
        f"{floor['max_gap_ms']:.0f} ms, {floor['rss_per_stream_kb']:.1f} kB per stream; direct: "
        f"{direct['stalled']} stalled, max gap {direct['max_gap_ms']:.0f} ms"
        + "".join(f"; {name}: " + (f"not run ({run['skipped']})" if "skipped" in run else
                                   f"{run['stalled']} stalled, {run['rss_per_stream_kb']:.1f} kB per stream")
                  for name, run in rust.items()))
    return record


def rss_per_stream_kb(rss_base: int, rss_peak: int, fds_base: int, fds_peak: int) -> float:
    """A proxy's RSS growth at the peak over the streams it held then (its descriptors, two per
    stream), not over the client's count, which the kernel may have accepted for it."""
    return (rss_peak - rss_base) / max(1, (fds_peak - fds_base) // 2) / 1e3


CONTROL_KEYS = ("completed", "stalled", "failures", "frames_received", "max_gap_ms", "gap_p99_ms",
                "first_frame_p50_ms", "first_frame_p99_ms")


RUST_ROUTERS = ("sglang-router", "vllm-router")


def control_run(rig: Rig, spec: OpenStreams, streams: int, target: str, proc: psutil.Process) -> dict:
    """The open-streams client against the bare proxy, a peer or the box: the stream figures and
    other tenants' CPU; for a proxy also its RSS per stream and CPU per frame."""
    rss_base, fds_base = proc.memory_info().rss, proc.num_fds()
    result, rss_peak, fds_peak, cpu = open_streams_client(rig, spec, streams, target, proc)
    out = {k: result[k] for k in CONTROL_KEYS}
    out["background_pct"] = round(cpu.background_pct, 1)
    if target != "direct":
        out.update(rss_peak_mb=rss_peak / 1e6,
                   rss_per_stream_kb=rss_per_stream_kb(rss_base, rss_peak, fds_base, fds_peak),
                   cpu_us_per_frame=1e6 * (cpu.floor_s if target == "floor" else cpu.peer_s)
                   / max(1, result["frames_received"]))
    return out


def peer_control_run(rig: Rig, spec: OpenStreams, streams: int, name: str) -> dict:
    """`control_run` through the peer `name`, started in front of the rig's box for it; or why not."""
    reason = peers.missing(name)
    if reason:
        return {"skipped": reason}
    try:
        with rig.running_peer(name):
            return control_run(rig, spec, streams, name, psutil.Process(rig.meter.peer_pid))
    except BenchError as exc:
        return {"skipped": str(exc)}


def open_streams_client(rig: Rig, spec: OpenStreams, streams: int, target: str,
                        watched: psutil.Process) -> tuple[dict, int, int, measure.CpuDelta]:
    """One bench/open_streams.py run against `target`: its result, the peak RSS and descriptors
    of `watched` (sampled every RSS_SAMPLE_S) and everyone's CPU."""
    timeout_s = 30.0 + spec.frames * spec.cadence_ms / 1000 + streams / 100 * spec.batch_gap_ms / 1000
    argv = [measure.PYTHON, str(measure.BENCH / "open_streams.py"), rig.url(target),
            "--streams", str(streams), "--frames", str(spec.frames), "--cadence-ms", f"{spec.cadence_ms:g}",
            "--stall-factor", f"{spec.stall_factor:g}", "--batch-gap-ms", f"{spec.batch_gap_ms:g}",
            "--timeout-s", f"{timeout_s:g}"]
    before = rig.meter.snapshot()
    client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              cwd=measure.ROOT, start_new_session=True, text=True)
    rss_peak, fds_peak = watched.memory_info().rss, watched.num_fds()
    try:
        deadline = time.monotonic() + timeout_s + measure.RUN_MARGIN_S
        while client.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"open_streams.py ran past {timeout_s + measure.RUN_MARGIN_S:.0f} s")
            rss_peak = max(rss_peak, watched.memory_info().rss)
            fds_peak = max(fds_peak, watched.num_fds())
            time.sleep(RSS_SAMPLE_S)
        out, err = client.communicate(timeout=measure.STOP_GRACE_S)
    finally:
        measure.stop_group(client)
    cpu = CpuMeter.delta(before, rig.meter.snapshot())
    match = OPEN_JSON.search(out)
    if not match:
        raise BenchError(f"open_streams.py gave no result (exit {client.returncode}): {out[-800:]} {err[-800:]}")
    return json.loads(match.group(1)), rss_peak, fds_peak, cpu


def stalled_reader(rig: Rig, log) -> dict:
    """One stream whose box writes STALL_CHUNKS frames at once; the client reads the head, then
    nothing for STALL_S: the router's RSS growth over those seconds, then after the close."""
    gate = measure.wait_quiet(rig.meter)
    router = psutil.Process(rig.router.pid)
    rss_before = router.memory_info().rss
    url = urlsplit(rig.url("router"))
    body = (b'{"model":"tiny-llama","stream":true,"messages":[{"role":"user","content":"stall"}]}')
    request = (f"POST {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    samples: list[tuple[float, int]] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALL_RCVBUF)  # before connect: sets the window
        sock.settimeout(10.0)
        sock.connect((url.hostname, url.port))
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(4096)
            if not data:
                raise BenchError(f"stalled reader: the router closed before the head: {head[:300]!r}")
            head += data
        status = head.split(b" ", 2)[1].decode(errors="replace")
        before = rig.meter.snapshot()
        t0 = time.monotonic()
        rss_start = router.memory_info().rss
        while (elapsed := time.monotonic() - t0) < STALL_S:
            samples.append((round(elapsed, 2), router.memory_info().rss))
            time.sleep(0.2)
        rss_end = router.memory_info().rss
        samples.append((round(time.monotonic() - t0, 2), rss_end))
        cpu = CpuMeter.delta(before, rig.meter.snapshot())
    finally:
        sock.close()
    time.sleep(2.0)  # the router sees the close and drops what it held
    rss_closed = router.memory_info().rss
    mib = 1 << 20
    peak = max(rss for _, rss in samples)
    record = once_record(
        rig, "stalled_reader", gate=asdict(gate), status=status, stall_s=STALL_S,
        answer_frames=STALL_CHUNKS + 3, answer_mb=STALL_CHUNKS * SIM_FRAME_BYTES / 1e6, head_bytes_read=len(head),
        rss_before_mib=rss_before / mib, rss_start_mib=rss_start / mib, rss_end_mib=rss_end / mib,
        rss_peak_mib=peak / mib, rss_closed_mib=rss_closed / mib,
        growth_mib=(rss_end - rss_start) / mib, peak_growth_mib=(peak - rss_start) / mib,
        growth_after_1s_mib=(rss_end - next(rss for t, rss in samples if t >= 1.0)) / mib,
        router_cpu_s=round(cpu.router_s, 2), samples=[(t, round(r / mib, 2)) for t, r in samples],
        errors=0 if status == "200" else 1, **cpu_fields(cpu, 1))
    log(f"[{rig.interface}] stalled reader: router RSS {rss_start / mib:.1f} → {rss_end / mib:.1f} MiB over "
        f"{STALL_S:g} s (growth {record['growth_mib']:+.2f} MiB, peak {peak / mib:.1f}), "
        f"{rss_closed / mib:.1f} MiB after the close; router CPU {cpu.router_s:.2f} s")
    return record


def latency_curve(rig: Rig, d: Durations, log) -> list[dict]:
    """Non-stream latency at each CURVE_CONNECTIONS concurrency: router then direct, back to back."""
    records = []
    for connections in CURVE_CONNECTIONS:
        gate = measure.wait_quiet(rig.meter)
        for target in ("router", "direct"):
            before = rig.meter.snapshot()
            run = measure.wrk(rig.url(target), "post", connections, d.curve_s, target)
            cpu = CpuMeter.delta(before, rig.meter.snapshot())
            record = {k: v for k, v in asdict(run).items() if k != "raw"}
            record.update(interface=rig.interface, figure="latency_curve", repeat=0, gate=asdict(gate),
                          **cpu_fields(cpu, run.requests))
            if target == "router" and run.requests:
                record["cpu_us_per_call"] = 1e6 * cpu.router_s / run.requests
            records.append(record)
        router, direct = records[-2], records[-1]
        log(f"[{rig.interface}] curve c={connections:<3} router p50 {router['p50_us'] / 1000:.2f} ms "
            f"p99 {router['p99_us'] / 1000:.2f} ms {router['rate']:,.0f}/s; direct p50 "
            f"{direct['p50_us'] / 1000:.2f} ms p99 {direct['p99_us'] / 1000:.2f} ms {direct['rate']:,.0f}/s; "
            f"others {max(router['background_pct'], direct['background_pct']):.0f} %")
    return records


# -- the whole run ---------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="1 repeat, shorter runs")
    p.add_argument("--repeats", type=int, help="repeats per figure (default 3, quick 1)")
    p.add_argument("--connections", type=int, default=CONNECTIONS,
                   help=f"wrk's connections in the throughput and peers figures (default {CONNECTIONS}; "
                        "issue 24 reports the peers at 16 and at 64)")
    p.add_argument("--interfaces", default=",".join(INTERFACES), help="comma list of asgi,rsgi")
    p.add_argument("--figures", default=",".join(FIGURES), help="comma list of " + ",".join(FIGURES) +
                   " (default all; e.g. --figures open_streams,stalled_reader,latency_curve for the capacity "
                   "figures only; empty: none, e.g. with --locust or --profile only)")
    p.add_argument("--locust", action="store_true", help="also measure TTFT with locust (20 ms cadence)")
    p.add_argument("--profile", action="store_true", help="also profile the router with py-spy")
    p.add_argument("--pin", action="store_true",
                   help="the proxy under test alone on the last CPU, everything else on the others "
                        "(a runtime then sizes its threads for one core: tokio runs one worker)")
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
    pair_figures = [f for f in args.figures if f in PAIR_FIGURES]
    for repeat in range(d.repeats if pair_figures else 0):
        for interface in args.interfaces:  # interleaved, so drift hits both interfaces alike
            with Rig(procs, meter, interface, floor=True) as rig:
                rig.warm_up(d.warmup_s)
                for figure in pair_figures:
                    records += measure_pair(rig, figure, repeat, d, log)
    if "peers" in args.figures:
        for repeat in range(d.repeats):  # the peers do not depend on the router's interface: the first one
            with Rig(procs, meter, args.interfaces[0], floor=True, tag="peers") as rig:
                rig.warm_up(d.warmup_s)
                records += measure_peers(rig, repeat, d, log, peer_figures)
            for chunks, figure in ((CHUNKS, "peers_paced"), (PACED_LONG_CHUNKS, "peers_paced_long")):
                with Rig(procs, meter, args.interfaces[0], cadence_ms=PACED_CADENCE_MS, chunks=chunks, floor=True,
                         tag=f"peers-paced-{chunks}") as rig:
                    rig.warm_up(d.warmup_s)
                    records += measure_peers(rig, repeat, d, log, streams_only(figure))
    if args.locust:
        for repeat in range(d.repeats):
            for interface in args.interfaces:
                with Rig(procs, meter, interface, cadence_ms=LOCUST_CADENCE_MS) as rig:
                    records += measure_pair(rig, "ttft", repeat, d, log)
    for interface in args.interfaces:  # once each, every one with a fleet and router of its own
        for spec in OPEN_FIGURES.values():
            if spec.figure in args.figures:
                with Rig(procs, meter, interface, cadence_ms=spec.cadence_ms, chunks=spec.chunks,
                         tag=spec.figure.replace("_", "-"), floor=True) as rig:
                    records.append(open_streams(rig, spec, log))
        if "stalled_reader" in args.figures:
            with Rig(procs, meter, interface, chunks=STALL_CHUNKS, tag="stall") as rig:
                records.append(stalled_reader(rig, log))
        if "latency_curve" in args.figures:
            with Rig(procs, meter, interface, tag="curve") as rig:
                rig.warm_up(d.warmup_s)
                records += latency_curve(rig, d, log)
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
        d = dataclasses.replace(d, repeats=args.repeats)
    d = dataclasses.replace(d, connections=args.connections)
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
        pinning = measure.pin(args.pin)
        env, digest = measure.snapshot_router(src, workdir / "src")
        procs = Procs(workdir, env, cwd=workdir / "src")
        if args.wait_quiet > 0:
            gate = measure.wait_quiet(meter, args.wait_quiet * 60, measure.SETTLE_WINDOW_S)
            log(f"machine {'quiet' if gate.quiet else 'still busy'} after {gate.waited_s:.0f} s "
                f"(other tenants {gate.background_pct:.0f} %)")
        records, profile_file = measure_all(args, d, procs, meter, stamp)
        for record in records:
            record["pinned"] = args.pin
    except BenchError as exc:
        log(f"bench failed: {exc}")
        return 1
    finally:
        if procs is not None:
            procs.stop_all()

    rows = report.summarize(records, args.interfaces)
    lines = report.verdict(rows, records)
    plots = []
    if any(r["figure"] == "latency_curve" for r in records):
        plot = RESULTS / f"{stamp}-latency.png"
        try:
            report.plot_latency_curve(records, plot, f"Router latency against concurrency, {stamp}")
        except ImportError as exc:
            log(f"no plot ({exc}): `.venv/bin/pip install matplotlib`")
        else:
            shutil.copyfile(plot, RESULTS / "latency.png")
            plots = [plot, RESULTS / "latency.png"]
    doc = {
        "stamp": stamp, "args": {k: str(v) for k, v in vars(args).items()}, "durations": asdict(d),
        "elapsed_s": round(time.monotonic() - started_at, 1), "git": {**git, "snapshot_sha256": digest},
        "pinning": pinning,
        "versions": {**measure.versions(), **(peers.versions() if "peers" in args.figures else {})}, "targets": report.TARGETS, "frames_per_stream": FRAMES_PER_STREAM,
        "rows": [{k: (asdict(v) if isinstance(v, report.Stat) else v) for k, v in r.items()} for r in rows],
        "verdict": lines, "profile": str(profile_file) if profile_file else None,
        "plots": [str(p) for p in plots], "records": records,
    }
    (RESULTS / f"{stamp}.json").write_text(json.dumps(doc, indent=1, default=str))
    markdown = latest_markdown(stamp, doc, rows, lines, records, profile_file, plots)
    (RESULTS / f"{stamp}.md").write_text(markdown)
    (RESULTS / "latest.md").write_text(markdown)
    print(markdown)
    if profile_file:
        print(profile_file.read_text())
    return 0


def latest_markdown(stamp: str, doc: dict, rows: list[dict], lines: list[str], records: list[dict],
                    profile_file: Path | None, plots: list[Path] = ()) -> str:
    d = doc["durations"]
    git = doc["git"]
    dirty = f" + {len(git['router_changes'])} uncommitted changes under router/" if git["router_changes"] else ""
    def opens(target: str) -> report.Stat | None:
        return report.Stat.of([r["passive_opens_per_unit"] for r in records if r["figure"] == "stream"
                               and r["target"] == target and r["passive_opens_per_unit"] is not None])

    pairs = (f"{d['repeats']} repeat(s), wrk {d['throughput_s']:g} s at c={d.get('connections', CONNECTIONS)}, {d['latency_s']:g} s at c=1; "
             f"{CHUNKS}-chunk streams ({FRAMES_PER_STREAM} frames counted); ") if rows else ""
    parts = [
        f"# Router benchmark {stamp}", "",
        f"router snapshot {git['snapshot_sha256']} (git {git['rev']}{dirty}); granian {doc['versions']['granian']}, wrk {doc['versions']['wrk']}; "
        f"{pairs}{BOXES} sim boxes; {doc['pinning']}; took {doc['elapsed_s']:.0f} s.", "",
    ]
    if rows:
        parts.append(report.markdown_table(rows))
    peer_table = report.peers_table(records)
    if peer_table:
        interface = next(r["interface"] for r in records if r["figure"] == "peers")
        v = doc["versions"]
        parts += [f"Peers and floors (HAProxy {v.get('haproxy', '-')}, hugpy-router {v.get('hugpy-router-0.0.4', '-')}, "
                  f"LiteLLM {v.get('litellm', '-')}, sglang-router {v.get('sglang-router', '-')}, "
                  f"vllm-router {v.get('vllm-router', '-')}), each in front of the same box (the one the router picks), in one round per "
                  f"repeat: wrk {d['throughput_s']:g} s at c={d.get('connections', CONNECTIONS)} per target and load, after a "
                  f"{d['warmup_s']:g} s warm-up; burst streams from a box that writes the whole answer at once, paced "
                  f"streams from one that writes a frame every {PACED_CADENCE_MS:g} ms; the router and the bare proxy on {interface}; CPU = the "
                  "proxy's process (tree) user+sys CPU during the run (psutil) ÷ calls or frames:", "", peer_table]
    capacity = report.capacity_table(records)
    if capacity:
        parts += [capacity]
    curve = report.curve_table(records)
    if curve:
        parts += [f"Non-stream latency against concurrency (wrk {d['curve_s']:g} s per point, router then "
                  "direct back to back, once per interface; ms):", "", curve]
        if plots:
            parts += [f"![latency against concurrency]({plots[0].name})", ""]
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
