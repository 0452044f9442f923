"""Two routers on the shared engines against one router on SQLite, same fake fleet, one run.

    .venv/bin/python bench/several_routers.py [--calls 4000] [--concurrency 32] [--rounds 3]
        [--shared-url redis://...] [--database-url postgresql://... | --postgres] [--keys] [--json FILE]
    .venv/bin/python bench/several_routers.py --processes [--seconds 10] [--pace-ms 20] [...]  # each router its own process
    .venv/bin/python bench/several_routers.py --round-trips   # the shared server's client alone
    .venv/bin/python bench/several_routers.py --instructions [--calls 1000] [--concurrency 32]

The fleet: `router.sim` hugpy boxes in a process of their own (bench/callpath_cpu.py's
`start_sim`), each with a `max_inflight` (so every call takes and gives a lease). The routers:
`router serve`'s app as server.Running builds it (bench/callpath_cpu.py), called in this process
by an in-process ASGI client, on one uvloop loop:
- `one`: one router, no --shared-url (its store SQLite);
- `one_shared`: one router with --shared-url: what the shared engine itself costs a call;
- `two`: two routers with --shared-url (a throw-away redis-server from tests/engines.py unless
  `--shared-url` names one; `--database-url` is handed to them, for the PostgreSQL store), the
  calls alternating between them (both routers' background work runs on the one loop too).
Each round runs each of them twice: at concurrency 1 (the latency a call pays: p50 and p99
of each call's time, so `added` is the shared round trips' own cost) and at `--concurrency`
(calls/s, the loop's CPU per call, the route log's rows written per second). `--keys` calls with
a key that has rpm, tpm and a budget set (never reached), so the key's tally is on the server too.
CPU is the loop thread's (`time.thread_time`: both routers share it, each call runs through one)
plus, for `two`, the redis-server's own (from /proc). Figures are from whatever machine runs it:
say how loaded it was.

`--processes` runs each router as `router serve` in a process of its own, as deployed, and loads it
with wrk over HTTP (bench/post.lua, the key in an Authorization header with `--keys`): one wrk at one
connection for the latency, and one wrk per router at `--concurrency` each, run at once (each router
batches as many calls per loop iteration as one router alone). CPU per call is each router process's whole CPU (every thread: the loop, Granian's
I/O, the route-log writer) over the calls it answered, so two routers no longer share one loop, one
GIL and one batch of round trips as they do in process. The HTTP hop from wrk is in every config
alike. With `--pin` the routers run on the first CPU and everything else (wrk, the boxes, redis-server,
PostgreSQL) on the last, as a router with a core of its own; two routers then share that core.
`--pace-ms N` adds a paced leg: the same connections, each waiting N ms between its calls
(bench/paced.lua), so every config serves about the same steady load below saturation. At
saturation a config that answers fewer calls a second also batches fewer calls a loop
iteration, and its CPU a call rises for that alone; paced, the CPU a call is what a router spends
on a given load. Each leg also reports the shared server's round trips a call (the routers'
`router_shared_round_trips_total`).

`--instructions` counts instead of timing (valgrind's callgrind, as bench/callpath_cpu.py
--allocations does): the loop thread's instructions a keyed call through one router on SQLite and
through one router on the shared server (its store SQLite too: the route log's writer is another
thread), each the difference of two legs (100 and 100 + `--calls` calls at `--concurrency`), so the
shared state's CPU a call is a count another tenant of the machine cannot move. Under callgrind the
loop runs ~50 times slower than the server answers, so more calls share each round trip than
they would (the legs report round trips a call): the count is the per-command work, and the
per-round-trip work less than its share.

`--round-trips` times the client alone (fleetwide/wire.py's SharedServer, no router): the loop
CPU and wall time of one command at a time, and of 8 callers asking at once (their commands
share round trips), against a throw-away redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from callpath_cpu import BODY, one_call, routable, scope, sim_fleet, start_sim  # noqa: E402

from router.facades import mounts  # noqa: E402
from router.serve.app import RouterApp  # noqa: E402
from router.serve.server import Running, ServeConfig, settle_collector  # noqa: E402

BOXES = 8
MAX_INFLIGHT = 64
CONFIGS = ("one", "one_shared", "two")
EVERY_COUNT = {"rpm": 10**9, "tpm": 10**12, "budget_tokens": 10**12, "budget_period": "month"}


def with_limits(boxes_file: Path) -> None:
    doc = json.loads(boxes_file.read_text())
    for box in doc["boxes"]:
        box["max_inflight"] = MAX_INFLIGHT
    boxes_file.write_text(json.dumps(doc))


def registry_from_file(boxes_file: Path, url: str) -> None:
    """With a database the routers read their boxes there, not from the file: copy them in."""
    from router.boxes import config as boxes_config
    from router.boxes.pg_registry import PgRegistry
    from router.store import engines

    engines.open_database(url)
    wanted = boxes_config.FileRegistry(boxes_file).load()

    def copy(boxes: boxes_config.BoxesFile) -> None:
        boxes.boxes, boxes.aliases = wanted.boxes, wanted.aliases

    registry = PgRegistry(url)
    try:
        registry.edit(copy)
    finally:
        registry.close()


async def start_router(boxes_file: Path, work: Path, name: str, shared_url: str | None,
                       database_url: str | None) -> tuple[RouterApp, Running]:
    config = ServeConfig(host="127.0.0.1", port=0, boxes_path=boxes_file, store_path=work / f"{name}.db",
                         instance=name, shared_url=shared_url, database_url=database_url)
    running = Running(config)
    running.instance = name
    process = await running.start(tracer=None)
    return RouterApp(process, mounts.main), running


def server_cpu_s(pid: int | None) -> float:
    """The redis-server's user + system CPU so far (0 when it is not ours to read)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(apps: list[RouterApp], calls: int, concurrency: int, keys: list[str | None],
              server_pid: int | None) -> dict:
    """`calls` calls over `apps` in turn, `concurrency` at a time: latency per call, calls/s,
    loop CPU per call, the server's CPU per call, route-log rows written per second."""
    scopes = [scope(0, key) for key in keys]
    latencies: list[float] = []
    left = calls
    turn = 0

    async def worker() -> None:
        nonlocal left, turn
        while left > 0:
            left -= 1
            index = turn = (turn + 1) % len(apps)
            started = time.perf_counter()
            status = await one_call(apps[index], scopes[index], BODY)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"status {status}")

    writers = [app.process.route_log for app in apps]
    written0 = sum(w.written for w in writers)
    thread0, wall0, server0 = time.thread_time(), time.perf_counter(), server_cpu_s(server_pid)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    thread1, wall1, server1 = time.thread_time(), time.perf_counter(), server_cpu_s(server_pid)
    await asyncio.sleep(0.3)  # the writers' last batch
    written = sum(w.written for w in writers) - written0
    latencies.sort()
    wall = wall1 - wall0
    return {
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 3),
        "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 3),
        "calls_per_s": round(calls / wall),
        "loop_us": round(1e6 * (thread1 - thread0) / calls, 1),
        "server_us": round(1e6 * (server1 - server0) / calls, 1),
        "route_log_rows_per_s": round(written / (wall + 0.3)),
    }


@contextlib.contextmanager
def fleet_and_engines(args: argparse.Namespace, work: Path) -> Iterator[tuple[Path, str, int | None]]:
    """The sim fleet (every box with a `max_inflight`), the PostgreSQL store when asked (its
    registry copied from the boxes file; `args.database_url` set to it), and the Redis-protocol
    server: (the boxes file, the server's URL, its pid when this run started it). All stopped on
    the way out."""
    boxes_file = work / "boxes.json"
    sim = start_sim(boxes_file, BOXES)
    redis = postgres = None
    try:
        with_limits(boxes_file)
        if args.postgres and args.database_url is None:
            from engines import PostgresServer

            postgres = PostgresServer()
            args.database_url = postgres.database("bench")
        if args.database_url is not None:
            registry_from_file(boxes_file, args.database_url)
        shared_url, server_pid = args.shared_url, None
        if shared_url is None:
            from engines import RedisServer

            redis = RedisServer()
            shared_url, server_pid = redis.url, redis.proc.pid
        yield boxes_file, shared_url, server_pid
    finally:
        sim.terminate()
        sim.wait(10)
        if redis is not None:
            redis.stop()
        if postgres is not None:
            postgres.close()


async def main(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="several-routers-"))
    with fleet_and_engines(args, work) as (boxes_file, shared_url, server_pid):
        started = {
            "one": [await start_router(boxes_file, work, "one", None, None)],
            "one_shared": [await start_router(boxes_file, work, "one-shared", shared_url, args.database_url)],
            "two": [await start_router(boxes_file, work, f"two-{i}", shared_url, args.database_url) for i in (1, 2)],
        }
        apps = {name: [app for app, _ in routers] for name, routers in started.items()}
        keys = {name: [app.process.keys.create("bench", "use", limits=EVERY_COUNT)[1] if args.keys else None
                       for app in group] for name, group in apps.items()}
        for group in apps.values():
            for app in group:
                await routable(app, BODY)
        rounds = []
        for number in range(args.rounds):
            measured: dict = {}
            for name in CONFIGS:
                pid = server_pid if name != "one" else None
                measured[name] = {
                    "sequential": await run(apps[name], max(args.calls // 4, 200), 1, keys[name], pid),
                    "loaded": await run(apps[name], args.calls, args.concurrency, keys[name], pid),
                }
                print(f"round {number + 1} {name}: {json.dumps(measured[name])}", flush=True)
            rounds.append(measured)
        figures = {"calls": args.calls, "concurrency": args.concurrency, "keys": args.keys,
                   "database_url": args.database_url is not None, "rounds": rounds, "added": added(rounds)}
        print("added by two routers on the shared engines (median of rounds): " + json.dumps(figures["added"]))
        for routers in started.values():
            for _, running in routers:
                await running.stop()
        return figures


async def round_trips(calls: int = 5000) -> dict:
    """The client's own cost a command: one at a time (a round trip each), and 8 at a time."""
    from engines import RedisServer

    from router.fleetwide.wire import SharedServer

    redis = RedisServer()
    server = SharedServer(redis.url)
    figures = {}
    try:
        await server.call(None, "SET", "n", "0")

        async def caller(count: int) -> None:
            for _ in range(count):
                await server.call(None, "INCR", "n")

        for name, callers in (("one_at_a_time", 1), ("eight_at_a_time", 8)):
            sent0, thread0, wall0 = server.round_trips, time.thread_time(), time.perf_counter()
            await asyncio.gather(*(caller(calls // callers) for _ in range(callers)))
            figures[name] = {"loop_us_per_command": round(1e6 * (time.thread_time() - thread0) / calls, 1),
                             "wall_us_per_command": round(1e6 * (time.perf_counter() - wall0) / calls, 1),
                             "commands_per_round_trip": round(calls / (server.round_trips - sent0), 1)}
            print(f"{name}: {json.dumps(figures[name])}", flush=True)
    finally:
        await server.close()
        redis.stop()
    return figures


def processes(args: argparse.Namespace) -> dict:
    """The same three configs, each router a `router serve` process loaded by wrk."""
    import measure

    work = Path(tempfile.mkdtemp(prefix="several-routers-"))
    if args.pin:  # everything this starts inherits the last CPU; each router then gets the first
        os.sched_setaffinity(0, {os.cpu_count() - 1})
    procs = measure.Procs(work, dict(os.environ), ROOT)
    with fleet_and_engines(args, work) as (boxes_file, shared_url, server_pid), contextlib.ExitStack() as stop:
        stop.callback(procs.stop_all)  # the routers before the fleet and the engines
        plan = {"one": [("one", False)], "one_shared": [("one-shared", True)],
                "two": [("two-1", True), ("two-2", True)]}
        routers: dict[str, list[tuple[str, int, str]]] = {}  # config -> [(url, pid, key header)]
        minted: dict[str, str] = {}  # a store (its home or the database) -> the key made there
        for config, members in plan.items():
            routers[config] = []
            for name, shared in members:
                env = {"HUGPY_ROUTER_HOME": str(work / name)}
                if shared and args.database_url:
                    env["HUGPY_ROUTER_DATABASE_URL"] = args.database_url
                store = env.get("HUGPY_ROUTER_DATABASE_URL", env["HUGPY_ROUTER_HOME"])
                if args.keys and store not in minted:
                    minted[store] = mint_key(env)
                argv = [measure.PYTHON, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes_file),
                        "--instance", name]
                if shared:
                    argv += ["--shared-url", shared_url]
                started, ready = procs.start(name, argv, measure.ROUTER_READY, env=env)
                if args.pin:
                    pin(started.pid, {0})
                url = ready.group(1)
                measure.wait_routable(url)
                header = f"Authorization: Bearer {minted[store]}" if args.keys else ""
                routers[config].append((url, started.pid, header))
        rounds = []
        for number in range(args.rounds):
            measured = {}
            for name, members in routers.items():
                pid = server_pid if name != "one" else None  # `one` asks the server nothing
                measured[name] = {"sequential": wrk_leg(members, 1, args.seconds // 2 or 1, pid),
                                  "loaded": wrk_leg(members, args.concurrency, args.seconds, pid)}
                if args.pace_ms:
                    measured[name]["paced"] = wrk_leg(members, args.concurrency, args.seconds, pid, paced=True)
            for name in CONFIGS:
                print(f"round {number + 1} {name}: {json.dumps(measured[name])}", flush=True)
            rounds.append(measured)
        figures = {"processes": True, "pinned": args.pin, "seconds": args.seconds, "concurrency": args.concurrency,
                   "keys": args.keys,
                   "database_url": args.database_url is not None, "rounds": rounds, "added": added(rounds, "process_us")}
        print("added by two routers on the shared engines (median of rounds): " + json.dumps(figures["added"]))
        return figures


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (the threads it starts later inherit it) on `cpus`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def mint_key(env: dict[str, str]) -> str:
    """`router keys create` with every count set and never reached, in the store `env` names."""
    import measure

    argv = [measure.PYTHON, "-m", "router", "keys", "create", "--name", "bench", "--rpm", str(EVERY_COUNT["rpm"]),
            "--tpm", str(EVERY_COUNT["tpm"]), "--budget-tokens", str(EVERY_COUNT["budget_tokens"]),
            "--budget-period", EVERY_COUNT["budget_period"]]
    done = measure.run_bounded(argv, 60, env={**os.environ, **env})
    if done.returncode != 0:
        raise RuntimeError(f"router keys create failed: {done.stderr[-800:]}")
    return done.stdout.strip()


def wrk_leg(members: list[tuple[str, int, str]], connections: int, seconds: int, server_pid: int | None,
            paced: bool = False) -> dict:
    """One wrk per router (at one connection, the first router only), run at once: latency,
    calls/s, and the router processes' CPU per call they answered (all their threads). Each router
    gets `connections`, the load one router gets alone, so that what `two` adds is the shared
    state's cost, not that of each router batching fewer calls per loop iteration. `paced`: each
    connection waits PACE_MS between its calls (bench/paced.lua), a steady load below what the
    machine can take."""
    import measure
    from concurrent.futures import ThreadPoolExecutor

    if connections == 1:
        members = members[:1]
    cpu0 = [measure.process_cpu_s(pid) for _, pid, _ in members]
    threads0 = [thread_cpu_s(pid) for _, pid, _ in members]
    server0 = server_cpu_s(server_pid)
    sent0 = sum(round_trips_sent(url, header) for url, _, header in members)
    with ThreadPoolExecutor(len(members)) as pool:
        runs = list(pool.map(lambda m: measure.wrk(m[0] + "/v1/chat/completions", "paced" if paced else "post",
                                                   connections, seconds, "router",
                                                   headers=(m[2],) if m[2] else ()), members))
    cpu = sum(measure.process_cpu_s(pid) - before for (_, pid, _), before in zip(members, cpu0))
    threads: dict[str, float] = {}
    for (_, pid, _), before in zip(members, threads0):
        for name, seconds in thread_cpu_s(pid).items():
            if seconds - before.get(name, 0.0) > 0:
                threads[name] = threads.get(name, 0.0) + seconds - before.get(name, 0.0)
    server = server_cpu_s(server_pid) - server0
    sent = sum(round_trips_sent(url, header) for url, _, header in members) - sent0
    calls = sum(run.requests for run in runs)
    errors = sum(run.errors for run in runs)
    if errors:
        raise RuntimeError(f"{errors} wrk errors")
    first = runs[0]
    return {"p50_ms": round(first.p50_us / 1000, 3), "p99_ms": round(first.p99_us / 1000, 3),
            "calls_per_s": round(sum(run.rate for run in runs)), "process_us": round(1e6 * cpu / calls, 1),
            "server_us": round(1e6 * server / calls, 1) if server_pid else 0.0,
            "round_trips_per_call": round(sent / calls, 3),
            "threads_us": {name: round(1e6 * seconds / calls, 1) for name, seconds in sorted(threads.items())}}


def round_trips_sent(url: str, header: str) -> float:
    """`router_shared_round_trips_total` from a router's /metrics (0 for a router without one)."""
    import urllib.request

    request = urllib.request.Request(url + "/metrics")
    if header:
        name, value = header.split(": ", 1)
        request.add_header(name, value)
    with urllib.request.urlopen(request, timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("router_shared_round_trips_total "):
                return float(line.split()[1])
    return 0.0


def thread_cpu_s(pid: int) -> dict[str, float]:
    """A process's CPU so far by thread ("main", else its name and id: the loop thread is
    the one Granian's RSGI or ASGI callbacks run on)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "main" if task.name == str(pid) else f"{(task / 'comm').read_text().strip()}-{task.name}"
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def instructions(args: argparse.Namespace) -> dict:
    """`--instructions`: per keyed call, the loop thread's instructions through `one` and
    `one_shared`, each the difference of two callgrind legs."""
    from engines import RedisServer

    redis = RedisServer()
    work = Path(tempfile.mkdtemp(prefix="several-routers-callgrind-"))
    figures: dict = {"calls": args.calls, "concurrency": args.concurrency}
    try:
        for name, shared_url in (("one", None), ("one_shared", redis.url)):
            legs = [instructions_leg(calls, args.concurrency, shared_url, work / f"{name}.{calls}")
                    for calls in (100, 100 + args.calls)]
            figures[name] = {field: round((legs[1][field] - legs[0][field]) / args.calls, 2) for field in legs[0]}
            print(f"{name}: {json.dumps(figures[name])}", flush=True)
    finally:
        redis.stop()
    added_count = figures["one_shared"]["loop_instructions"] - figures["one"]["loop_instructions"]
    figures["added_loop_instructions"] = round(added_count)
    print(f"the shared server adds {added_count:,.0f} loop-thread instructions a keyed call", flush=True)
    return figures


def instructions_leg(calls: int, concurrency: int, shared_url: str | None, out: Path) -> dict:
    """This script under callgrind (`--instructions-leg`): the loop thread's instructions, and
    the round trips sent, for `calls` keyed calls after the start-up."""
    from callpath_cpu import callgrind_counts

    argv = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
            sys.executable, __file__, "--instructions-leg", str(calls), "--concurrency", str(concurrency),
            "--json", str(out) + ".json"] + (["--shared-url", shared_url] if shared_url else [])
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the callgrind leg of {calls} calls failed: {done.stderr[-2000:]}")
    loop = callgrind_counts(Path(f"{out}-01"))
    return {"loop_instructions": loop["instructions"], **json.loads(Path(str(out) + ".json").read_text())}


async def one_leg(args: argparse.Namespace) -> dict:
    """One `--instructions` leg, in the process callgrind runs: a router (shared when
    `--shared-url` is given) and `--instructions-leg` keyed calls at `--concurrency`."""
    from callpath_cpu import quiet_background

    from router.fleetwide import leases

    work = Path(tempfile.mkdtemp(prefix="several-routers-leg-"))
    boxes_file = work / "boxes.json"
    with sim_fleet(boxes_file, BOXES):
        with_limits(boxes_file)
        app, running = await start_router(boxes_file, work, "leg", args.shared_url, None)
        key = app.process.keys.create("bench", "use", limits=EVERY_COUNT)[1]
        await routable(app, BODY)
        quiet_background()
        leases.SYNC_S = 3600.0  # the once-a-second sync too, after its current sleep
        settle_collector()  # as `router serve` does once it listens
        call_scope, left = scope(0, key), args.instructions_leg

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                if await one_call(app, call_scope, BODY) != 200:
                    raise RuntimeError("a call failed")

        server = app.process.several.server if app.process.several is not None else None
        sent0 = server.round_trips if server is not None else 0
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        round_trips = (server.round_trips - sent0) if server is not None else 0
        await running.stop()
        return {"round_trips": round_trips}


def added(rounds: list[dict], cpu: str = "loop_us") -> dict:
    """What `one_shared` and `two` add to `one`, the median over the rounds; `cpu` is the field
    with the CPU per call (the loop thread's in process, the router processes' with --processes)."""
    def median(name: str, part: str, field: str) -> float:
        return round(statistics.median(r[name][part][field] - r["one"][part][field] for r in rounds), 3)

    paced = "paced" in rounds[0]["one"]
    return {name: {"p50_ms": median(name, "sequential", "p50_ms"), "p99_ms": median(name, "sequential", "p99_ms"),
                   f"{cpu}_sequential": median(name, "sequential", cpu),
                   f"{cpu}_loaded": median(name, "loaded", cpu),
                   "server_us_loaded": median(name, "loaded", "server_us"),
                   "calls_per_s_loaded": median(name, "loaded", "calls_per_s"),
                   **({f"{cpu}_paced": median(name, "paced", cpu), "p50_ms_paced": median(name, "paced", "p50_ms")}
                      if paced else {})}
            for name in CONFIGS[1:]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shared-url", help="a Redis-protocol server to use (default: a throw-away redis-server)")
    parser.add_argument("--database-url", help="postgresql://... for the two routers' store")
    parser.add_argument("--postgres", action="store_true",
                        help="a throw-away PostgreSQL cluster (tests/engines.py) for the two routers' store")
    parser.add_argument("--keys", action="store_true", help="calls with a key whose tally is counted")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--round-trips", action="store_true", help="the shared server's client alone")
    parser.add_argument("--processes", action="store_true", help="each router a `router serve` process, wrk over HTTP")
    parser.add_argument("--seconds", type=int, default=10, help="--processes: each loaded wrk run (the latency's: half)")
    parser.add_argument("--pace-ms", type=int, default=0,
                        help="--processes: also a paced leg, each connection waiting this long between calls")
    parser.add_argument("--pin", action="store_true",
                        help="--processes: the routers on the first CPU, everything else (wrk, the boxes, the engines) "
                             "on the last, so a router's CPU is not what the engines beside it cost it")
    parser.add_argument("--instructions", action="store_true",
                        help="the shared state's loop-thread instructions a keyed call, counted by callgrind")
    parser.add_argument("--instructions-leg", type=int, help=argparse.SUPPRESS)  # one leg of --instructions
    args = parser.parse_args()
    if args.instructions_leg is not None:
        figures = uvloop.run(one_leg(args))
    elif args.instructions:
        args.calls = 1000 if "--calls" not in sys.argv else args.calls
        figures = instructions(args)
    elif args.processes:
        if args.pace_ms:
            os.environ["PACE_MS"] = str(args.pace_ms)  # bench/paced.lua reads it from wrk's environment
        figures = processes(args)
    else:
        figures = uvloop.run(round_trips() if args.round_trips else main(args))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
