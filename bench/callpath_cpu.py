"""The router's own Python per call, without Granian and without the machine's noise.

    .venv/bin/python bench/callpath_cpu.py [--calls 20000] [--concurrency 64] [--stream] [--keys | --alias | --features]
    .venv/bin/python bench/callpath_cpu.py --allocations --calls 1000 [--keys]

One process, one uvloop loop: the router's app (`RouterApp` over what `router serve` runs,
router.serve.server.Running: fleet, scheduler, store, route-log writer, CallClock and the
background tasks) and the bare proxy's app
(bench/floor_proxy.py's `FloorApp`) are each called as an ASGI app by an in-process client that
hands over the body at once and takes the answer, `--concurrency` calls at a time, in front of
the same simulated hugpy box (a `router.sim` fleet of 8, in a process of its own). Measured per
call: the loop thread's CPU (`time.thread_time`) and the whole process's (`time.process_time`:
the route-log writer thread included). Granian's own share (its Rust threads and the hand-off to
the loop) is absent on both sides, so the difference is the router's own work, and the ratio is
the floor the wrk figures can approach. Thread CPU clocks count only this process's running
time, so another tenant on the machine moves the figures far less than it moves wrk's.

`--keys` measures tenancy instead (docs/tenancy.md; budget: 5 µs of router CPU a call): the
same router, called with a key that has every limit set (high enough never to refuse) against
a key with none, alternated over several rounds; the figure is the median difference.
`--alias` measures an alias instead (docs/aliases.md; budget: 3 µs): the same calls naming an
alias whose chain's first model serves them, against the calls naming the model, alternated
the same way.

`--features` measures the three at once, in one run, against the plain call (no key, the model's
name, affinity on: the same body every time, so every call after the first is an affinity hit),
alternated KEY_ROUNDS times: a key with every limit, an alias its first model serves, and the
affinity hit (the plain call less the same call on a second router with `--affinity off`).

`--allocations`: instead, the instructions and heap allocations a call costs the router's
process, and of those its loop thread's (`loop_*`), counted exactly by valgrind's callgrind (so
another tenant on the machine moves them not at all): this script runs twice under callgrind,
driving 100 calls after the warm-up and then 100 + `--calls`, and the difference is divided by
`--calls`. Allocations are calls of CPython's object
allocator (`_PyObject_Malloc`: every object not served from a free list) and, of those, the
garbage-collected objects (`_PyObject_GC_Link`); `PyMem_Malloc` counts buffers (lists' and dicts'
storage). The router's timed background work is held off during the legs (`quiet_background`),
so the counts repeat to within 0.2 % (one commit, two runs: 647,853 and 648,858 loop-thread
instructions a call). Needs valgrind; slow (~50× a plain run), so use
`--calls 1000`. With `--keys`, two pairs of legs: the calls made with a key with none, then with
a key with every limit (EVERY_LIMIT), and what the limits add (`limits_added`: the second less
the first), tenancy's own cost counted exactly.

`--affinity-cost`: instead, the CPU affinity adds to a call (bench/affinity.py `affinity_cost`:
key, chain hash, index look-up, steered decision, lesson) at 16 and at 100 boxes, over 64
conversations' bodies at random turns (issue 25: ≤ 5 µs at 16 boxes, ≤ 20 µs at 100).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterator

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from floor_proxy import FloorApp  # noqa: E402

from router.boxes import aliases as box_aliases  # noqa: E402
from router.boxes import config as boxes_config  # noqa: E402
from router.core.affinity import OFF as AFFINITY_OFF  # noqa: E402
from router.facades import mounts  # noqa: E402
from router.serve.app import RouterApp  # noqa: E402
from router.serve.server import Running, ServeConfig, settle_collector  # noqa: E402
from router.upstream.pool import Origin  # noqa: E402

SIM_READY = re.compile(r"sim fleet ready: (\d+) boxes")
BODY = b'{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}]}'
STREAM_BODY = b'{"model":"tiny-llama","stream":true,"messages":[{"role":"user","content":"hi"}]}'
# The same length as the plain bodies: an alias as long as the model's name.
ALIAS = "tiny-alias"
ALIAS_CHAIN = ("tiny-llama", "tiny-other")


def scope(port: int, key: str | None = None) -> dict:
    headers = [(b"host", b"127.0.0.1:%d" % port), (b"content-type", b"application/json"),
               (b"content-length", b"%d" % len(BODY))]
    if key is not None:
        headers.append((b"authorization", b"Bearer " + key.encode()))
    return {
        "type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", port), "headers": headers,
    }


def staying_client(body: bytes) -> Callable[[], Awaitable[dict]]:
    """The ASGI `receive` of a client that sends `body` at once and never leaves."""
    given = False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    return receive


async def one_call(app, call_scope: dict, body: bytes) -> int:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app(call_scope, staying_client(body), send)
    return sent[0]["status"]


async def drive(app, calls: int, concurrency: int, body: bytes, port: int,
                key: str | None = None) -> tuple[float, float, float]:
    """(loop thread CPU µs per call, process CPU µs per call, wall s) over `calls` calls."""
    call_scope = scope(port, key)
    for _ in range(200):  # warm: pools, caches
        assert await one_call(app, call_scope, body) == 200
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            status = await one_call(app, call_scope, body)
            if status != 200:
                raise RuntimeError(f"status {status}")

    thread0, process0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    thread1, process1, wall1 = time.thread_time(), time.process_time(), time.perf_counter()
    return 1e6 * (thread1 - thread0) / calls, 1e6 * (process1 - process0) / calls, wall1 - wall0


def start_sim(boxes_file: Path, boxes: int, chunks: int = 20, cadence_ms: int = 0) -> subprocess.Popen:
    """A `router.sim` fleet of hugpy boxes in a process of its own (its objects are not this
    process's), writing `boxes_file`; returns once it serves. Terminate it when done."""
    sim = subprocess.Popen(
        [sys.executable, "-m", "router.sim", "--boxes", str(boxes), "--boxes-file", str(boxes_file),
         "--chunks", str(chunks), "--cadence-ms", str(cadence_ms), "--load-ms", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    for line in sim.stdout:  # type: ignore[union-attr]
        if SIM_READY.search(line):
            return sim
    sim.wait(10)
    raise RuntimeError("the sim fleet did not start")


@contextlib.contextmanager
def sim_fleet(boxes_file: Path, boxes: int, **options) -> Iterator[subprocess.Popen]:
    """`start_sim`'s fleet, terminated on the way out."""
    sim = start_sim(boxes_file, boxes, **options)
    try:
        yield sim
    finally:
        sim.terminate()
        sim.wait(10)


async def routable(router: RouterApp, body: bytes) -> None:
    """Returns once a call is answered 200: the fleet's links have seen the boxes' inventory."""
    for _ in range(100):
        if await one_call(router, scope(0), body) == 200:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("no box took the call")


async def start_router(boxes_file: Path, work: Path, **config) -> tuple[RouterApp, Callable[[], Awaitable[None]]]:
    """The router's app as `router serve` builds it (server.Running: the fleet and its links, the
    telemetry scan, the scheduler, the store, the background tasks), less its listeners, in front
    of the boxes in `boxes_file`, its store in `work`, `config` more ServeConfig fields; and its stop."""
    running = Running(ServeConfig(host="127.0.0.1", port=0, boxes_path=boxes_file, store_path=work / "router.db",
                                  **config))
    process = await running.start(tracer=None)
    return RouterApp(process, mounts.main), running.stop


async def main(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="callpath-"))
    boxes_file = work / "boxes.json"
    with sim_fleet(boxes_file, 8):
        router, stop_router = await start_router(boxes_file, work)
        fleet = router.fleet
        body = STREAM_BODY if args.stream else BODY
        await routable(router, body)
        settle_collector()  # as `router serve` does once it listens
        if args.callgrind_leg is not None:  # one leg of --allocations, under callgrind
            quiet_background()
            key = None
            if args.callgrind_key is not None:  # --allocations --keys: its key, with or without limits
                limits = EVERY_LIMIT if args.callgrind_key == "limits" else None
                _, key = router.process.keys.create(f"bench-{args.callgrind_key}", "use", limits=limits)
            await drive(router, args.callgrind_leg, args.concurrency, body, 0, key)  # warm-up included
            await stop_router()
            return {}
        if args.keys:
            return await measure_keys(router, stop_router, args, body)
        if args.alias:
            return await measure_alias(router, stop_router, args, body, boxes_file)
        if args.features:
            return await measure_features(router, stop_router, args, body, boxes_file, work)
        box = next(b for b in fleet.ordered() if b.in_flight == 0 and b.last_picked_s)  # the one it picks
        floor = FloorApp(Origin(box.config.host, box.config.port))
        figures: dict = {"calls": args.calls, "concurrency": args.concurrency, "stream": args.stream}
        for name, app in (("router", router), ("floor", floor), ("router_again", router)):
            thread_us, process_us, wall_s = await drive(app, args.calls, args.concurrency, body, 0)
            figures[name] = {"loop_us": round(thread_us, 1), "process_us": round(process_us, 1),
                             "calls_per_s": round(args.calls / wall_s)}
            print(f"{name:13s} loop thread {thread_us:6.1f} µs/call, process {process_us:6.1f} µs/call, "
                  f"{args.calls / wall_s:,.0f} calls/s", flush=True)
        router_loop = (figures["router"]["loop_us"] + figures["router_again"]["loop_us"]) / 2
        router_process = (figures["router"]["process_us"] + figures["router_again"]["process_us"]) / 2
        figures["ratio_loop"] = round(router_loop / figures["floor"]["loop_us"], 2)
        figures["ratio_process"] = round(router_process / figures["floor"]["process_us"], 2)
        print(f"router ÷ bare proxy: loop thread {figures['ratio_loop']}×, process {figures['ratio_process']}×")
        await stop_router()
        return figures


# What --allocations counts per call: callgrind's total instructions, and the calls of these.
ALLOCATORS = {"_PyObject_Malloc": "objects", "_PyObject_GC_Link": "gc_objects", "PyMem_Malloc": "buffers"}
CALLGRIND_FN = re.compile(r"^(c?fn)=\((\d+)\)(?: (.*))?$")


def quiet_background() -> None:
    """For a callgrind leg: the router's timed background work (the boxes' polls, the loop-lag
    watch, the boxes-file watch, the CallClock's ticks) waits an hour after its current sleep, so
    that the count is the calls' own and not the leg's wall time (under valgrind a leg takes
    minutes, and a hugpy box's link polls up to four times a second while calls change its state).
    The CallClock's tick also starts the disconnect watcher of a call older than WATCH_AFTER_S,
    which a call under valgrind (~50 times slower) often is and a real one seldom: a count that
    moved with the machine's load by several per cent."""
    from router.boxes import fleet, hugpy, link
    from router.serve import clock, metrics

    for module, name in ((hugpy, "MIN_POLL_GAP_S"), (link, "HEALTH_INTERVAL_S"), (link, "POLL_INTERVAL_S"),
                         (metrics, "LOOP_WATCH_INTERVAL_S"), (fleet, "WATCH_INTERVAL_S"),
                         (clock, "CLOCK_TICK_S")):
        setattr(module, name, 3600.0)


def callgrind_leg(calls: int, args: argparse.Namespace, work: Path, key: str | None = None) -> dict:
    """This script under callgrind, driving `calls` calls after the warm-up (with a key: `none`,
    a key without limits, or `limits`, one with EVERY_LIMIT): the whole process's instructions
    and calls of ALLOCATORS, and the same of the loop thread alone (`loop_*`: the main thread,
    which runs the loop; the route-log writer's thread is the rest). Callgrind writes a file per
    thread (`-01` is the main one)."""
    out = work / f"callgrind.{key or 'plain'}.{calls}"
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
           sys.executable, __file__, "--callgrind-leg", str(calls), "--concurrency", str(args.concurrency)]
    cmd += ["--stream"] if args.stream else []
    cmd += ["--callgrind-key", key] if key is not None else []
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the callgrind leg of {calls} calls failed: {done.stderr[-2000:]}")
    threads = {path.name.rpartition("-")[2]: callgrind_counts(path) for path in work.glob(f"{out.name}-*")}
    whole = {name: sum(counts[name] for counts in threads.values()) for name in threads["01"]}
    return {**whole, **{f"loop_{name}": value for name, value in threads["01"].items()}}


def callgrind_counts(path: Path) -> dict:
    """One callgrind output's instructions and calls of ALLOCATORS (names are compressed:
    `(id) name` the first time, `(id)` after; a `calls=` line counts calls of the last `cfn`)."""
    names: dict[str, str] = {}
    counted = dict.fromkeys(ALLOCATORS.values(), 0)
    callee = None
    instructions = 0
    with open(path) as lines:
        for line in lines:
            named = CALLGRIND_FN.match(line)
            if named:
                kind, number, name = named.groups()
                if name:
                    names[number] = name
                if kind == "cfn":
                    callee = names.get(number)
            elif line.startswith("calls=") and callee in ALLOCATORS:
                counted[ALLOCATORS[callee]] += int(line[6:].split()[0])
            elif line.startswith(("summary:", "totals:")):
                instructions = int(line.split()[1])
    return {"instructions": instructions, **counted}


def measure_allocations(args: argparse.Namespace) -> dict:
    """`--allocations`: per call, the difference of two callgrind legs over `args.calls`; with
    `--keys`, that for a key with none and for a key with every limit, and the second less the first."""
    figures: dict = {"calls": args.calls, "concurrency": args.concurrency, "stream": args.stream}
    work = Path(tempfile.mkdtemp(prefix="callgrind-"))
    for name, key in ((("key_none", "none"), ("key_limits", "limits")) if args.keys else (("per_call", None),)):
        warm, driven = callgrind_leg(100, args, work, key), callgrind_leg(100 + args.calls, args, work, key)
        figures[name] = {count: round((driven[count] - warm[count]) / args.calls, 1) for count in warm}
        print_counts(f"per call (callgrind){' ' + name if key else ''}", figures[name])
    if args.keys:
        figures["limits_added"] = {count: round(figures["key_limits"][count] - figures["key_none"][count], 1)
                                   for count in figures["key_none"]}
        print_counts("every limit set adds", figures["limits_added"])
    return figures


def print_counts(what: str, counts: dict) -> None:
    print(f"{what}: " + ", ".join(f"{name} {value:,.1f}" for name, value in counts.items()), flush=True)


KEY_ROUNDS = 5
# Every limit set, none of them reached in the run (the cost measured is counting, not refusing).
EVERY_LIMIT = {"rpm": 10**9, "tpm": 10**12, "max_parallel": 10**6, "budget_tokens": 10**12,
               "budget_period": "month", "models": ["tiny-llama"]}


async def measure_keys(router: RouterApp, stop_router, args: argparse.Namespace, body: bytes) -> dict:
    """`--keys`: a key with every limit against a key with none, on the same router, alternated
    KEY_ROUNDS times (this machine's other tenants move a single run by more than the cost)."""
    keys = router.process.keys
    _, plain = keys.create("bench-none", "use")
    _, limited = keys.create("bench-limits", "use", limits=EVERY_LIMIT)
    figures = await alternated(args, (("key_none", router, body, plain), ("key_limits", router, body, limited)))
    report_added(figures, "limits_added_loop_us", loop_added(figures, "key_none", "key_limits"), "every limit set", 5)
    await stop_router()
    return figures


async def measure_alias(router: RouterApp, stop_router, args: argparse.Namespace, body: bytes,
                        boxes_file: Path) -> dict:
    """`--alias`: calls naming an alias whose first model serves them against calls naming the
    model, alternated as `--keys` alternates."""
    boxes_config.edit(boxes_file, lambda file: box_aliases.set_alias(file, ALIAS, ALIAS_CHAIN))
    await router.fleet.reload()
    aliased = body.replace(b'"%s"' % ALIAS_CHAIN[0].encode(), b'"%s"' % ALIAS.encode())
    figures = await alternated(args, (("model", router, body, None), ("alias", router, aliased, None)))
    report_added(figures, "alias_added_loop_us", loop_added(figures, "model", "alias"),
                 "an alias its first model serves", 3)
    await stop_router()
    return figures


async def measure_features(router: RouterApp, stop_router, args: argparse.Namespace, body: bytes,
                           boxes_file: Path, work: Path) -> dict:
    """`--features`: per round, the plain call, a key with every limit, an alias and the plain call
    on a router with affinity off; each feature's median difference from the plain call."""
    _, limited = router.process.keys.create("bench-limits", "use", limits=EVERY_LIMIT)
    boxes_config.edit(boxes_file, lambda file: box_aliases.set_alias(file, ALIAS, ALIAS_CHAIN))
    await router.fleet.reload()
    aliased = body.replace(b'"%s"' % ALIAS_CHAIN[0].encode(), b'"%s"' % ALIAS.encode())
    (work / "off").mkdir()
    unsteered, stop_unsteered = await start_router(boxes_file, work / "off", affinity_slack=AFFINITY_OFF)
    await routable(unsteered, body)
    runs = (("plain", router, body, None), ("key_limits", router, body, limited),
            ("alias", router, aliased, None), ("affinity_off", unsteered, body, None))
    figures = await alternated(args, runs)
    report_added(figures, "limits_added_loop_us", loop_added(figures, "plain", "key_limits"), "every limit set", 5)
    report_added(figures, "alias_added_loop_us", loop_added(figures, "plain", "alias"),
                 "an alias its first model serves", 3)
    report_added(figures, "affinity_hit_added_loop_us", loop_added(figures, "affinity_off", "plain"),
                 "an affinity hit (against affinity off)", 5)
    await stop_unsteered()
    await stop_router()
    return figures


def report_added(figures: dict, name: str, added: list[float], what: str, budget_us: float) -> None:
    """The median of the rounds' differences into `figures[name]`, and one line saying it."""
    figures[name] = round(statistics.median(added), 1)
    print(f"{what}: {figures[name]:+.1f} µs of loop thread CPU a call, median of {KEY_ROUNDS} rounds "
          f"({', '.join(f'{a:+.1f}' for a in added)}; budget {budget_us:g} µs)")


async def alternated(args: argparse.Namespace, runs: tuple) -> dict:
    """Runs each of `runs` ((name, router, body, key)) in turn, KEY_ROUNDS times (this machine's
    other tenants move a single run by more than a feature costs): the figures, each round's
    under `rounds` by name."""
    figures: dict = {"calls": args.calls, "concurrency": args.concurrency, "stream": args.stream, "rounds": []}
    for round_number in range(KEY_ROUNDS):
        measured = {}
        for name, app, body, key in runs:
            thread_us, process_us, wall_s = await drive(app, args.calls, args.concurrency, body, 0, key)
            measured[name] = {"loop_us": round(thread_us, 1), "process_us": round(process_us, 1),
                              "calls_per_s": round(args.calls / wall_s)}
            print(f"round {round_number + 1} {name:12s} loop thread {thread_us:6.1f} µs/call, "
                  f"process {process_us:6.1f} µs/call, {args.calls / wall_s:,.0f} calls/s", flush=True)
        figures["rounds"].append(measured)
    return figures


def loop_added(figures: dict, base: str, name: str) -> list[float]:
    """Per round, the loop thread µs a call `name` took beyond `base`."""
    return [measured[name]["loop_us"] - measured[base]["loop_us"] for measured in figures["rounds"]]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--stream", action="store_true", help="20-chunk streams instead of non-stream calls")
    parser.add_argument("--keys", action="store_true", help="a key with every limit against a key with none")
    parser.add_argument("--alias", action="store_true", help="calls naming an alias against calls naming its model")
    parser.add_argument("--features", action="store_true",
                        help="a key with limits, an alias and an affinity hit against the plain call, in one run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--affinity-cost", action="store_true", help="affinity's own CPU per call, 16 and 100 boxes")
    parser.add_argument("--allocations", action="store_true",
                        help="instructions and heap allocations per call, counted by valgrind's callgrind")
    parser.add_argument("--callgrind-leg", type=int, help=argparse.SUPPRESS)  # one leg of --allocations
    parser.add_argument("--callgrind-key", choices=("none", "limits"), help=argparse.SUPPRESS)  # its key
    args = parser.parse_args()
    if args.allocations:
        figures = measure_allocations(args)
    elif args.affinity_cost:
        from affinity import affinity_cost

        figures = {"affinity": [affinity_cost(boxes, args.calls) for boxes in (16, 100)]}
        for row in figures["affinity"]:
            print(f"{row['boxes']:4d} boxes: affinity {row['affinity_us']:5.2f} µs/call, median round "
                  f"{row['affinity_median_us']:5.2f} (read and decide alone {row['decide_us']:5.2f} µs, "
                  f"bodies {row['body_kb']} kB)", flush=True)
    else:
        figures = uvloop.run(main(args))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
