"""Cache-aware routing, affinity on against off in one run (docs/affinity.md).

    .venv/bin/python bench/affinity.py            # the full scenario: 64 conversations × 8 turns
    .venv/bin/python bench/affinity.py --quick    # 16 × 4, 8 at a time: a minute's check
    .venv/bin/python bench/affinity.py --long     # an agent's long conversations at a real box's prefill rate

The fleet: `--boxes` simulated hugpy boxes (router.sim, in this process's background thread) with
the model resident, each keeping a prefix cache (router/sim/prefix_cache.py) that costs
`--prefill-us` µs of prefill per uncached token before the first token, then `--chunks` tokens
`--cadence-ms` apart. The router: `python -m router serve` in a process of its own, started once
with `--affinity on` and once with `--affinity off` (a fresh store and fresh box caches each).

The load: `--conversations` conversations, `--concurrency` at a time (asyncio, the official
`openai` client, streamed), each `--turns` turns; every conversation sends the same ~2 kB system
prompt, a large first message of its own (`--first-kb`) and, each turn, its whole history so far
(the previous answer and a new message: a question, with `--turn-kb` of a tool's output). A third
run, `killed`, is affinity on with one box stopped halfway through the first wave of conversations
(its later turns move once, then stick).

Reported per run: TTFT p50/p99 over all turns and over later turns (2..n), the share of prompt
tokens the boxes served from cache (their own counts), calls per box (max/min and max's share), how
often a later turn returned to the box of the turn before, and the router's X-Router-Affinity
hits. The issue's targets (affinity on): ≥ 95 % of later turns home, ≥ 80 % of later turns' prompt
tokens cached, later-turn TTFT p50 at most half of off's, no box above 1/4 + 15 % of the calls.
Figures are written to bench/results/<stamp>-affinity.json and printed as a table.

`--long` is a coding agent's conversations at a real box's prefill rate: 32 conversations × 12
turns, each turn adding a 1 kB tool output after the tool ran (`--think-ms`, 500 ms on average),
and 500 µs of prefill per uncached token (2k tokens/s; llama.cpp prefills ~1.2-1.4k tokens/s for a
27B model on two RTX 3090s, a few thousand for an 8B model on one GPU). There a long prompt's first token waits mostly on its prefill, as on real boxes;
with the default 40 µs a token the sim's fixed first-token delay hides most of what affinity saves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.sim.hugpy import SimBox  # noqa: E402
from router.sim.fleet import SimFleet  # noqa: E402

MODEL = "tiny"
SYSTEM = {"role": "system", "content": ("You are a careful assistant for a large codebase. Answer briefly, cite files, "
                                        "never invent APIs. ") * 20}  # ~2 kB
LISTENING_RE = re.compile(r"router listening on (https?://\S+)")


def first_message(n: int, size_kb: float) -> dict:
    text = f"Conversation {n}. Please review this file:\n"
    line = f"def handler_{n}(request): return respond(request, code=200)  # line\n"
    return {"role": "user", "content": text + line * max(1, int(size_kb * 1024 / len(line)))}


def turn_message(n: int, turn: int, size_kb: float) -> dict:
    """A later turn's new message: a short question, with `size_kb` of a tool's output when > 0."""
    text = f"Turn {turn}: and what about the error path?"
    line = f"conversation {n} turn {turn}: tests/test_handler.py::test_error_{turn} FAILED  # log\n"
    return {"role": "user", "content": text + "\n" + line * int(size_kb * 1024 / len(line))}


class Run:
    """One router's figures."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ttft_s: list[float] = []
        self.later_ttft_s: list[float] = []
        self.boxes: dict[str, int] = {}
        self.later = 0
        self.returned = 0
        self.hits = 0
        self.errors = 0
        self.later_tokens = [0, 0]  # later turns' prompt tokens, and of them cached (the box's usage)

    def report(self, fleet: list[SimBox]) -> dict:
        prompt = sum(box.prefix_cache.prompt_tokens for box in fleet)
        cached = sum(box.prefix_cache.cached_tokens for box in fleet)
        calls = sum(self.boxes.values())

        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            ordered = sorted(values)
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)

        return {
            "run": self.name,
            "ttft_p50_ms": pct(self.ttft_s, 0.5), "ttft_p99_ms": pct(self.ttft_s, 0.99),
            "later_ttft_p50_ms": pct(self.later_ttft_s, 0.5), "later_ttft_p99_ms": pct(self.later_ttft_s, 0.99),
            "cached_share": round(cached / prompt, 3) if prompt else None,
            "later_cached_share": round(self.later_tokens[1] / self.later_tokens[0], 3) if self.later_tokens[0] else None,
            "calls_per_box": dict(sorted(self.boxes.items())),
            "max_box_share": round(max(self.boxes.values()) / calls, 3) if calls else None,
            "calls_max_min": [max(self.boxes.values(), default=0), min(self.boxes.values(), default=0)],
            "later_returned": round(self.returned / self.later, 3) if self.later else None,
            "later_hits": round(self.hits / self.later, 3) if self.later else None,
            "errors": self.errors,
        }


async def conversation(api: openai.AsyncOpenAI, n: int, args: argparse.Namespace, run: Run,
                       turns_done: list[int]) -> None:
    messages = [SYSTEM, first_message(n, args.first_kb)]
    before = None
    think = random.Random(n)
    for turn in range(args.turns):
        started = time.perf_counter()
        try:
            raw = await api.chat.completions.with_raw_response.create(model=MODEL, messages=messages, stream=True)
            stream = raw.parse()
            first = usage = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
                usage = chunk.usage or usage
        except openai.APIError:
            run.errors += 1
            turns_done[0] += 1
            continue
        box = raw.headers.get("x-hugpy-box", "?")
        run.boxes[box] = run.boxes.get(box, 0) + 1
        run.ttft_s.append(first or 0.0)
        if turn:
            run.later_ttft_s.append(first or 0.0)
            run.later += 1
            run.returned += box == before
            run.hits += (raw.headers.get("x-router-affinity") or "").startswith("hit")
            if usage is not None and usage.prompt_tokens_details is not None:
                run.later_tokens[0] += usage.prompt_tokens
                run.later_tokens[1] += usage.prompt_tokens_details.cached_tokens or 0
        before = box
        turns_done[0] += 1
        messages = messages + [{"role": "assistant", "content": "tok " * args.chunks},
                               turn_message(n, turn + 1, args.turn_kb)]
        if args.think_ms > 0:  # the agent runs its tool: uniform around the mean, the same each run
            await asyncio.sleep(think.uniform(0, 2 * args.think_ms) / 1000)


def start_router(boxes_file: Path, home: Path, affinity: str, slack: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes_file),
         "--affinity", affinity, "--log-level", "warning", *slack],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        env={**os.environ, "HUGPY_ROUTER_HOME": str(home)})
    line = proc.stdout.readline()
    match = LISTENING_RE.search(line)
    if match is None:
        proc.kill()
        raise RuntimeError(f"router did not start: {line!r}")
    return proc, match.group(1)


async def one_run(name: str, affinity: str, args: argparse.Namespace, work: Path) -> dict:
    fleet_boxes = [SimBox(f"sim-{i + 1}", residents=[MODEL], chunks=args.chunks, cadence_s=args.cadence_ms / 1000)
                   for i in range(args.boxes)]
    for box in fleet_boxes:
        box.prefix_cache.prefill_s_per_token = args.prefill_us / 1e6
    fleet = SimFleet(fleet_boxes)
    fleet.start()
    boxes_file = work / f"{name}-boxes.json"
    boxes_file.write_text(json.dumps({"boxes": [{"name": b.name, "url": b.url, "kind": "hugpy"} for b in fleet_boxes]}))
    os.chmod(boxes_file, 0o600)
    slack = [] if args.slack is None else ["--affinity-slack", str(args.slack[0]),
                                           "--affinity-slack-share", str(args.slack[1])]
    proc, url = start_router(boxes_file, work / f"{name}-home", affinity, slack)
    run = Run(name)
    try:
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=60)
        for _ in range(50):  # the links' first inventories
            try:
                await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "warm"}])
                break
            except openai.APIError:
                await asyncio.sleep(0.1)
        for box in fleet_boxes:
            box.prefix_cache.forget()
            box.prefix_cache.prompt_tokens = box.prefix_cache.cached_tokens = 0
        gate = asyncio.Semaphore(args.concurrency)
        turns_done = [0]

        async def guarded(n: int) -> None:
            async with gate:
                await conversation(api, n, args, run, turns_done)

        async def killer() -> None:  # halfway through the first wave: its conversations are mid-way
            while turns_done[0] < min(args.concurrency, args.conversations) * args.turns // 2:
                await asyncio.sleep(0.005)
            fleet.stop_box(fleet_boxes[0])

        tasks = [asyncio.create_task(guarded(n)) for n in range(args.conversations)]
        if name == "killed":
            tasks.append(asyncio.create_task(killer()))
        started = time.perf_counter()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        report = run.report(fleet_boxes)
        report["seconds"] = round(elapsed, 2)
        return report
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        fleet.stop()


COST_ROUNDS = 20


def affinity_cost(boxes: int, calls: int = 20000, conversations: int = 64, turns: int = 8) -> dict:
    """Router CPU per call that affinity adds (issue 25: ≤ 5 µs at 16 boxes, ≤ 20 µs at 100), on
    one thread's clock: the key (session headers looked up, the prompt's chain hashed), the index's
    look-up, the steer applied by decide() (less decide() without it) and the lesson of the answer,
    over the bodies of `conversations` conversations at random turns, `boxes` serving boxes. The
    calls run in COST_ROUNDS batches, each timed without affinity and then with it: `affinity_us`
    is the least disturbed rounds' difference (the fastest of each), `affinity_median_us` the
    rounds' median difference; `decide_us` is the fastest round's read and decide() alone."""
    from types import SimpleNamespace

    import orjson

    from router.core.decide import Verdicts, decide
    from router.core.types import BoxFacts, BoxKind, Resident
    from router.facades import openai as openai_facade
    from router.facades.body import read_call
    from router.serve.affinity import Affinity
    from router.serve.edge import AsgiEdge

    rng = random.Random(7)
    facade = openai_facade.FACADE
    route, _ = facade.route("POST", "/v1/chat/completions")
    names = [f"box-{i}" for i in range(boxes)]
    facts = [BoxFacts(id=name, kind=BoxKind.HUGPY, order=i, residents={MODEL: Resident(MODEL)},
                      catalog=frozenset({MODEL}), pending=rng.randrange(4)) for i, name in enumerate(names)]
    states = {name: SimpleNamespace(name=name, config=SimpleNamespace(kind=BoxKind.HUGPY),
                                    cache_epoch=lambda key: 1) for name in names}
    affinity = Affinity(fleet=SimpleNamespace(boxes=states))
    edge = AsgiEdge({"method": "POST", "path": "/v1/chat/completions", "query_string": b"", "client": ("127.0.0.1", 50000),
                     "headers": [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json"),
                                 (b"authorization", b"Bearer unused"), (b"user-agent", b"OpenAI/Python 1.54.0"),
                                 (b"accept", b"application/json")]}, None, None)
    edge.caller = "127.0.0.1"  # the access gate found the caller
    bodies = []
    for n in range(conversations):
        messages = [SYSTEM, first_message(n, 8.0)]
        for turn in range(turns):
            bodies.append(orjson.dumps({"model": MODEL, "messages": messages, "stream": True}))
            messages = messages + [{"role": "assistant", "content": "tok " * 8},
                                   turn_message(n, turn + 1, 0)]
    order = [rng.randrange(len(bodies)) for _ in range(calls)]
    call = read_call(bodies[0], "application/json", route, facade, None, None).call
    record = SimpleNamespace(call=call, placed=lambda affinity: None)  # the call's own, made before
    verdicts = Verdicts()  # the fleet's (router.boxes.fleet)

    # As on the call path, each body was just read and scanned (json_members) when affinity hashes
    # it, so both batches read it first: the difference is affinity's own.
    def plain(batch: list[int]) -> None:
        for index in batch:
            read_call(bodies[index], "application/json", route, facade, None, None)
            decide(call, facts, verdicts=verdicts)

    def keyed(batch: list[int]) -> None:
        for index in batch:
            body = bodies[index]
            seen = read_call(body, "application/json", route, facade, None, None)
            key = affinity.key(edge, seen, body)
            steer = affinity.steer(key)
            decision = decide(call, facts, steer=steer, verdicts=verdicts)
            affinity.took(key, steer, states[decision.boxes[0]], record)

    keyed(list(range(len(bodies))))  # every conversation's turns known, as in a long-running router
    clock = time.thread_time
    size = max(1, calls // COST_ROUNDS)
    plain_s, keyed_s = [], []
    for start in range(0, size * COST_ROUNDS, size):  # the same calls in both, alternated
        batch = order[start:start + size]
        t0 = clock()
        plain(batch)
        t1 = clock()
        keyed(batch)
        t2 = clock()
        plain_s.append((t1 - t0) / size)
        keyed_s.append((t2 - t1) / size)
    added = sorted(k - p for k, p in zip(keyed_s, plain_s))
    return {"boxes": boxes, "calls": size * COST_ROUNDS,
            "affinity_us": round((min(keyed_s) - min(plain_s)) * 1e6, 2),
            "affinity_median_us": round(added[len(added) // 2] * 1e6, 2),
            "decide_us": round(min(plain_s) * 1e6, 2), "index_entries": len(affinity.index),
            "body_kb": round(sum(len(b) for b in bodies) / len(bodies) / 1024, 1)}


def table(reports: list[dict]) -> str:
    columns = ["run", "ttft_p50_ms", "ttft_p99_ms", "later_ttft_p50_ms", "later_ttft_p99_ms", "cached_share", "later_cached_share",
               "calls_max_min", "max_box_share", "later_returned", "later_hits", "errors", "seconds"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for report in reports:
        lines.append("| " + " | ".join(str(report.get(c)) for c in columns) + " |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-affinity-") as tmp:
        work = Path(tmp)
        runs = [("on", "on"), ("off", "off")] + ([("killed", "on")] if args.killed else [])
        return [await one_run(name, affinity, args, work) for name, affinity in runs]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 conversations × 4 turns, 8 at a time")
    parser.add_argument("--long", action="store_true",
                        help="an agent's long conversations: 32 × 12 turns, 1 kB added a turn after a 500 ms tool run "
                        "on average, 500 µs prefill a token")
    parser.add_argument("--boxes", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--first-kb", type=float, default=8.0, help="the first message's size (default 8 kB)")
    parser.add_argument("--turn-kb", type=float, default=0.0,
                        help="a tool's output added to each later turn's message (default 0 kB: a short question)")
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="mean pause before each later turn, uniform from 0 to twice it (default 0)")
    parser.add_argument("--prefill-us", type=float, default=40.0,
                        help="prefill µs per uncached token (default 40: ~25k tokens/s, a small model on one GPU)")
    parser.add_argument("--chunks", type=int, default=8, help="tokens per answer")
    parser.add_argument("--cadence-ms", type=float, default=10.0, help="ms between tokens")
    parser.add_argument("--slack", type=float, nargs=2, metavar=("ABSOLUTE", "SHARE"), default=None,
                        help="the router's --affinity-slack and --affinity-slack-share (default: its defaults)")
    parser.add_argument("--no-killed", dest="killed", action="store_false", help="skip the one-box-killed run")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.concurrency = 16, 4, 8
    if args.long:
        args.conversations, args.turns, args.turn_kb, args.think_ms, args.prefill_us = 32, 12, 1.0, 500.0, 500.0
    return args


if __name__ == "__main__":
    arguments = parse_args()
    reports = asyncio.run(main(arguments))
    print(table(reports))
    arguments.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H-%M-%SZ", time.gmtime())
    (arguments.out / f"{stamp}-affinity.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(arguments).items()}, "runs": reports}, indent=2))
