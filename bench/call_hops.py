"""How far one call travels through the router's modules: the hops from one module of `router` to
another (a Python call whose caller and callee live in different modules) and the modules it
enters, for a call through one router with no key against a keyed call through two routers on
one redis-server (the issue-37 review's "35 extra hops through 8 modules"), with the shared
server's round trips it cost.

    .venv/bin/python bench/call_hops.py [--calls 20] [--json FILE]

Counted with sys.setprofile over each whole call, in process (bench/several_routers.py's
routers, bench/callpath_cpu.py's in-process client), at one call at a time; the median of
`--calls` calls after warm-up. Counted: the call's own task, and the callbacks the loop runs
meanwhile (the shared server's answers are read there); not the other tasks' turns (the
scheduler's, the once-a-second sync). A coroutine's resumption is entered from the event loop, which is
not the router's, so it is not a hop. Compiled code (router._fastpath) makes no frames: a call
into it is not counted. Run it from a checkout to measure that checkout (before and after a
change: one run in each, same machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from callpath_cpu import BODY, one_call, routable, scope  # noqa: E402
from several_routers import EVERY_COUNT, fleet_and_engines, start_router  # noqa: E402

import uvloop  # noqa: E402


async def traced(app, call_scope: dict) -> tuple[int, set[str], int]:
    """One call: (hops between router modules, the router modules entered, the status)."""
    hops, entered = 0, set()
    mine, current_task = asyncio.current_task(), asyncio.current_task

    def profile(frame, event, arg) -> None:
        nonlocal hops
        if event != "call":
            return
        task = current_task()
        if task is not None and task is not mine:  # another task's turn (the scheduler's, a sync)
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("router."):
            return
        entered.add(module)
        caller = frame.f_back
        if caller is not None:
            from_module = caller.f_globals.get("__name__", "")
            if from_module.startswith("router.") and from_module != module:
                hops += 1

    sys.setprofile(profile)
    try:
        status = await one_call(app, call_scope, BODY)
    finally:
        sys.setprofile(None)
    return hops, entered, status


def round_trips_of(apps: list) -> int:
    total = 0
    for app in apps:
        process = getattr(app, "process", None) or app.shared  # (`shared` before issue 37)
        several = getattr(process, "several", None)
        server = several.server if several is not None else getattr(getattr(process, "leases", None), "server", None)
        total += server.round_trips if server is not None else 0
    return total


async def leg(apps: list, keys: list, calls: int) -> dict:
    for app in apps:
        await routable(app, BODY)
    scopes = [scope(0, key) for key in keys]
    for i in range(20):  # warm: pools, caches, the key's account
        assert await one_call(apps[i % len(apps)], scopes[i % len(apps)], BODY) == 200
    hops, modules, trips = [], set(), []
    for i in range(calls):
        await asyncio.sleep(0.05)  # one call at a time, no credit for a key (a call every 50 ms is slow)
        before = round_trips_of(apps)
        count, entered, status = await traced(apps[i % len(apps)], scopes[i % len(apps)])
        trips.append(round_trips_of(apps) - before)
        assert status == 200, status
        hops.append(count)
        modules |= entered
    return {"hops": statistics.median(hops), "modules": sorted(modules), "round_trips": statistics.median(trips)}


async def main(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="call-hops-"))
    args.postgres, args.database_url = False, None
    with fleet_and_engines(args, work) as (boxes_file, shared_url, _):
        one = [await start_router(boxes_file, work, "one", None, None)]
        two = [await start_router(boxes_file, work, f"two-{i}", shared_url, None) for i in (1, 2)]
        keys = [(getattr(app, "process", None) or app.shared).keys.create("hops", "use", limits={**EVERY_COUNT, "max_parallel": 64})[1]
                for app, _ in two]
        figures = {"one_router_no_key": await leg([app for app, _ in one], [None], args.calls),
                   "two_routers_keyed": await leg([app for app, _ in two], keys, args.calls)}
        for _, running in one + two:
            await running.stop()
    base, keyed = figures["one_router_no_key"], figures["two_routers_keyed"]
    figures["extra"] = {"hops": keyed["hops"] - base["hops"],
                        "modules": sorted(set(keyed["modules"]) - set(base["modules"])),
                        "round_trips": keyed["round_trips"]}
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--shared-url", default=None)
    args = parser.parse_args()
    result = uvloop.run(main(args))
    print(json.dumps(result["extra"]))
    print(json.dumps({name: {k: (len(v) if k == "modules" else v) for k, v in leg.items()}
                      for name, leg in result.items() if name != "extra"}))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
