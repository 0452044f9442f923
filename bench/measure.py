"""Measuring pieces for bench/run.py: the processes it starts, CPU accounting, the quiet gate,
and the load generators (wrk, locust, py-spy).

Every process started here goes into a `Procs` registry in its own process group; `Procs.stop_all`
(called from run.py's `finally`) ends each group by its id: SIGTERM, then SIGKILL after a grace.
Every load run has a hard deadline (its own duration plus a margin) and is killed past it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PYTHON = str(ROOT / ".venv" / "bin" / "python")
CLK_TCK = os.sysconf("SC_CLK_TCK")

START_TIMEOUT_S = 20.0  # sim fleet / router start: both take ~1-3 s; a broken tree fails at import
STOP_GRACE_S = 5.0  # SIGTERM → SIGKILL; the router's own grace is for calls in flight, none at stop
RUN_MARGIN_S = 30.0  # a load run is killed this long after its nominal duration

# Quiet gate (the project's stack notes §0, not in this repository): other tenants share the 2
# cores. Wait until they use under QUIET_PCT (of 200 %), but never longer than GATE_MAX_S; a run
# during which they used over NOISY_PCT is flagged (and retried once if the gate had found the
# machine quiet before it).
QUIET_PCT = 20.0
NOISY_PCT = 35.0
GATE_MAX_S = 20.0
GATE_WINDOW_S = 1.0
SETTLE_WINDOW_S = 5.0  # --wait-quiet: a longer window, so one quiet second between test runs won't do

SIM_READY = re.compile(r"sim fleet ready: (\d+) boxes")
ROUTER_READY = re.compile(r"router listening on (http://\S+)")
FLOOR_READY = re.compile(r"floor listening on (http://\S+)")
WRK_JSON = re.compile(r"^BENCH_JSON (\{.*\})$", re.M)


# `--pin` (run.py `pin`): the proxy under test alone on PROXY_CPUS, everything else (the runner, the
# sim, wrk and every client, which inherit the runner's affinity) on the other cores. A proxy is
# started on its core, so a runtime that sizes its thread pool from the CPUs it may use at start
# (tokio, Granian) sizes it for one. None: unpinned.
PROXY_CPUS: set[int] | None = None


def pin(on: bool) -> str:
    """Pins this runner (and so all it starts later) off the proxy's core; the run's words for it."""
    global PROXY_CPUS
    cpus = sorted(os.sched_getaffinity(0))
    if not on:
        return f"unpinned on {len(cpus)} cores"
    if len(cpus) < 2:
        raise BenchError(f"--pin needs 2 CPUs, this process may use {cpus}")
    PROXY_CPUS = {cpus[-1]}
    os.sched_setaffinity(0, cpus[:-1])
    return f"pinned: the proxy on CPU {cpus[-1]}, the box, wrk and the runner on CPU {','.join(map(str, cpus[:-1]))}"


def on_proxy_cpus() -> None:  # a preexec_fn: runs in the child before it executes the proxy
    os.sched_setaffinity(0, PROXY_CPUS)


class BenchError(RuntimeError):
    """A piece failed in a way that makes the figure meaningless (not a slow result)."""


# -- processes -------------------------------------------------------------------------------


@dataclass
class Started:
    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid


class Procs:
    """Every long-lived process this run started, each in its own session/process group."""

    def __init__(self, workdir: Path, env: dict[str, str], cwd: Path) -> None:
        self.workdir = workdir
        self.env = env
        self.cwd = cwd  # `python -m router` imports from its working directory first
        self.live: list[Started] = []

    def start(self, name: str, argv: list[str], ready: re.Pattern, env: dict[str, str] | None = None,
              timeout_s: float = START_TIMEOUT_S, proxy: bool = False) -> tuple[Started, re.Match]:
        """Starts `argv` with stdout+stderr in a log file; returns once `ready` matches a line.
        `env` adds to the run's environment. `proxy`: a proxy under test, on its own core when
        the run is pinned (`pin`)."""
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=self.cwd, env={**self.env, **(env or {})}, start_new_session=True,
                                     preexec_fn=on_proxy_cpus if proxy and PROXY_CPUS else None)
        started = Started(name, popen, log)
        self.live.append(started)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = ready.search(log.read_text(errors="replace"))
            if match:
                return started, match
            if popen.poll() is not None:
                break
            time.sleep(0.05)
        tail = log.read_text(errors="replace")[-2000:]
        self.stop(started)
        raise BenchError(f"{name} did not start (exit {popen.poll()}); log tail:\n{tail}")

    def stop(self, started: Started) -> None:
        stop_group(started.popen)
        if started in self.live:
            self.live.remove(started)

    def stop_all(self) -> None:
        for started in list(self.live):
            self.stop(started)


def stop_group(popen: subprocess.Popen) -> None:
    """Ends the process group led by `popen` (started with start_new_session): TERM, then KILL."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            popen.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:  # the leader may be gone while a child of it lives on in the group
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if popen.poll() is None:
        popen.wait(STOP_GRACE_S)


def run_bounded(argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
                cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Runs a load generator to completion in its own process group; kills the group past timeout."""
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             cwd=cwd, env=env, start_new_session=True, text=True)
    try:
        out, err = popen.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(popen)
        raise BenchError(f"{Path(argv[0]).name} ran past {timeout_s:.0f} s and was killed") from None
    finally:
        if popen.poll() is None:
            stop_group(popen)
    return subprocess.CompletedProcess(argv, popen.returncode, out, err)


# -- CPU accounting --------------------------------------------------------------------------


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat, all cores)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def process_cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return t.user + t.system


def tree_cpu_s(pid: int | None) -> float:
    """CPU of a process and its live descendants (a peer proxy may run its server in a child)."""
    if pid is None:
        return 0.0
    try:
        tree = [psutil.Process(pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    return sum(process_cpu_s(p.pid) for p in tree)


def tcp_passive_opens() -> int:
    """Connections accepted machine-wide (/proc/net/snmp): shows wrk's reconnects on direct streams."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("PassiveOpens")])


@dataclass
class CpuSnapshot:
    wall: float
    machine: float
    router: float
    floor: float
    peer: float
    sim: float
    reaped: float  # our finished children (wrk, locust, py-spy), from RUSAGE_CHILDREN
    runner: float  # this Python process
    opens: int


@dataclass
class CpuDelta:
    wall_s: float
    router_s: float
    floor_s: float
    peer_s: float
    sim_s: float
    loadgen_s: float
    background_pct: float  # other tenants, % of one core (the machine has 200 %)
    passive_opens: int

    def pct(self, seconds: float) -> float:
        return 100.0 * seconds / self.wall_s if self.wall_s > 0 else 0.0


class CpuMeter:
    """CPU of the router, the floor proxy, the peer proxy being measured (bench/peers.py), the sim
    fleet, our load generators, and everything else on the box."""

    def __init__(self) -> None:
        self.router_pid: int | None = None
        self.floor_pid: int | None = None
        self.peer_pid: int | None = None
        self.sim_pid: int | None = None

    def snapshot(self) -> CpuSnapshot:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        me = resource.getrusage(resource.RUSAGE_SELF)
        return CpuSnapshot(
            wall=time.monotonic(),
            machine=machine_busy_s(),
            router=process_cpu_s(self.router_pid),
            floor=process_cpu_s(self.floor_pid),
            peer=tree_cpu_s(self.peer_pid),
            sim=process_cpu_s(self.sim_pid),
            reaped=children.ru_utime + children.ru_stime,
            runner=me.ru_utime + me.ru_stime,
            opens=tcp_passive_opens(),
        )

    @staticmethod
    def delta(a: CpuSnapshot, b: CpuSnapshot) -> CpuDelta:
        wall = b.wall - a.wall
        ours = ((b.router - a.router) + (b.floor - a.floor) + (b.peer - a.peer) + (b.sim - a.sim)
                + (b.reaped - a.reaped) + (b.runner - a.runner))
        other = max(0.0, (b.machine - a.machine) - ours)
        return CpuDelta(
            wall_s=wall,
            router_s=b.router - a.router,
            floor_s=b.floor - a.floor,
            peer_s=b.peer - a.peer,
            sim_s=b.sim - a.sim,
            loadgen_s=b.reaped - a.reaped,
            background_pct=100.0 * other / wall if wall > 0 else 0.0,
            passive_opens=b.opens - a.opens,
        )


@dataclass
class Gate:
    quiet: bool
    waited_s: float
    background_pct: float


def wait_quiet(meter: CpuMeter, max_s: float = GATE_MAX_S, window_s: float = GATE_WINDOW_S) -> Gate:
    """Waits (at most `max_s`) until other tenants used under QUIET_PCT of a core over `window_s`."""
    start = time.monotonic()
    while True:
        a = meter.snapshot()
        time.sleep(window_s)
        background = CpuMeter.delta(a, meter.snapshot()).background_pct
        waited = time.monotonic() - start
        if background < QUIET_PCT or waited >= max_s:
            return Gate(background < QUIET_PCT, round(waited, 1), round(background, 1))


# -- wrk ---------------------------------------------------------------------------------------


@dataclass
class WrkRun:
    target: str  # "router" | "direct"
    script: str  # "post" | "stream"
    connections: int
    duration_s: float
    requests: int
    rate: float  # completed requests (or streams) per second
    p50_us: int
    p90_us: int
    p99_us: int
    p999_us: int
    mean_us: float
    errors: int  # real errors: see close_delimited
    close_delimited_ends: int  # read errors that are only wrk's way of ending a close-delimited body
    raw: dict = field(repr=False, default_factory=dict)


def wrk(url: str, script: str, connections: int, duration_s: int, target: str,
        close_delimited: bool = False, headers: tuple[str, ...] = ()) -> WrkRun:
    """`wrk -t1 -cN -dTs --latency -s bench/<script>.lua [-H header ...] URL`, parsed from
    wrk_report.lua's line. wrk takes whole seconds only."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:d}s", "--latency", "--timeout", "10s",
            "-s", str(BENCH / f"{script}.lua"), *(arg for header in headers for arg in ("-H", header)), url]
    done = run_bounded(argv, duration_s + RUN_MARGIN_S)
    match = WRK_JSON.search(done.stdout)
    if done.returncode != 0 or not match:
        raise BenchError(f"wrk failed (exit {done.returncode}): {done.stdout[-800:]} {done.stderr[-800:]}")
    raw = json.loads(match.group(1))
    requests = raw["requests"]
    read_errors = raw["read_errors"]
    # Close-delimited: each completed message is followed by exactly one "read error" (see
    # stream.lua); more than that are real failures.
    ends = min(read_errors, requests) if close_delimited else 0
    errors = (raw["connect_errors"] + raw["write_errors"] + raw["status_errors"] + raw["timeouts"]
              + read_errors - ends)
    return WrkRun(
        target=target, script=script, connections=connections, duration_s=duration_s,
        requests=requests, rate=requests / (raw["duration_us"] / 1e6),
        p50_us=raw["p50_us"], p90_us=raw["p90_us"], p99_us=raw["p99_us"], p999_us=raw["p999_us"],
        mean_us=raw["mean_us"], errors=errors, close_delimited_ends=ends, raw=raw,
    )


def wrk_background(url: str, script: str, connections: int, duration_s: int) -> subprocess.Popen:
    """A wrk load with no result wanted (for profiling), in its own process group."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:d}s", "-s", str(BENCH / f"{script}.lua"), url]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)


# -- one HTTP call, to check routing before measuring ----------------------------------------


CHAT_BODY = b'{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}]}'


def chat_once(base_url: str, timeout_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(base_url + "/v1/chat/completions", data=CHAT_BODY, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def wait_routable(router_url: str, timeout_s: float = 10.0) -> str:
    """Waits until the router answers tiny-llama with 200; returns the box it picked."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            status, headers, body = chat_once(router_url)
        except OSError as exc:
            status, headers, body = 0, {}, str(exc).encode()
        if status == 200 and "x-hugpy-box" in headers:
            return headers["x-hugpy-box"]
        last = f"{status} {body[:300]!r}"
        time.sleep(0.2)
    raise BenchError(f"router never routed tiny-llama within {timeout_s:.0f} s; last answer: {last}")


# -- locust ------------------------------------------------------------------------------------


def locust(host: str, users: int, duration_s: float, csv_prefix: Path, samples_out: Path) -> dict:
    """Headless locust (bench/locustfile.py, FastHttpUser) → TTFT samples in ms (exact, not
    rounded like locust's CSV percentiles)."""
    argv = [str(ROOT / ".venv" / "bin" / "locust"), "-f", str(BENCH / "locustfile.py"), "--headless",
            "-u", str(users), "-r", str(users), "-t", f"{duration_s:g}s", "--host", host,
            "--csv", str(csv_prefix), "--only-summary", "--loglevel", "WARNING", "--stop-timeout", "5"]
    env = dict(os.environ, BENCH_TTFT_OUT=str(samples_out))
    done = run_bounded(argv, duration_s + RUN_MARGIN_S + 15, env=env)
    if not samples_out.exists():
        raise BenchError(f"locust wrote no samples (exit {done.returncode}): {done.stderr[-1500:]}")
    return json.loads(samples_out.read_text())


# -- py-spy ------------------------------------------------------------------------------------

PYSPY_RATE_HZ = 200
PYSPY_DURATION_S = 8


def pyspy(pid: int, out: Path) -> None:
    argv = [str(ROOT / ".venv" / "bin" / "py-spy"), "record", "--nonblocking", "-r", str(PYSPY_RATE_HZ),
            "-d", str(PYSPY_DURATION_S), "--format", "raw", "--function", "-o", str(out), "-p", str(pid)]
    done = run_bounded(argv, PYSPY_DURATION_S + RUN_MARGIN_S)
    if not out.exists():
        raise BenchError(f"py-spy wrote nothing (exit {done.returncode}): {done.stderr[-800:]}")


def snapshot_router(src: Path, dest: Path) -> tuple[dict[str, str], str]:
    """Copies `src`/router (sources and the compiled fast path) to `dest`/router, so that every
    process of a run imports the same code while others edit the tree; returns the environment
    to run from `dest` (used as the working directory too) and a digest of what was copied."""
    shutil.copytree(src / "router", dest / "router",
                    ignore=shutil.ignore_patterns("__pycache__", "*.c", "*.pyc"))
    digest = hashlib.sha256()
    for path in sorted((dest / "router").rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(dest)).encode() + b"\0" + path.read_bytes())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(dest), os.environ.get("PYTHONPATH")])))
    check = subprocess.run([PYTHON, "-c", "import router._fastpath, router; print(router.__file__)"],
                           cwd=dest, env=env, capture_output=True, text=True)
    if check.returncode != 0 or not check.stdout.strip().startswith(str(dest)):
        raise BenchError(f"the router snapshot does not import from {dest}: {check.stdout}{check.stderr[-800:]}")
    return env, digest.hexdigest()[:16]


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("granian", "uvloop", "httptools", "orjson", "psutil", "locust", "py-spy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "-"
    done = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    first = (done.stdout + done.stderr).split()  # "wrk debian/4.1.0-3+b2 [epoll] Copyright ..."
    out["wrk"] = first[1] if len(first) > 1 else "-"
    return out
