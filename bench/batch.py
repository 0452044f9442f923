"""Batches on idle capacity (issue 42, docs/batches.md): what a batch costs the interactive users,
how much of the fleet's spare capacity it uses, and what a line costs the router.

    .venv/bin/python bench/batch.py            # 10,000-line batches, 60 s interactive phases
    .venv/bin/python bench/batch.py --quick    # 1,000-line batches, 10 s phases: a minute's check

The fleet: `--boxes` simulated hugpy boxes (router.sim, in this process's background thread) with
the model resident, each stated `max_inflight` `--max-inflight` in the boxes file (the runner's
rule 1 then leaves each box a slot beyond the interactive calls' recent peak). Every call, a
line or an interactive one, has a prompt of its own of about `--prompt-tokens` tokens, so no box
has any of it cached, and waits `--prefill-us` µs a token of prefill before its first token
(150 ms by default). The router: `python -m router serve` in a process of its own, with a fresh
store, the boxes file, and nothing else set.

The runs, in one router's life:
1. `alone`: a `--lines` batch (uploaded and created with the official `openai` client), no
   interactive call. Every `--sample-ms` the calls in progress at the boxes (their own counts)
   over the fleet's slots (the boxes' `max_inflight` summed): `spare_used` is its mean over the
   batch's steady part (from its first line in flight to its last, less a second at each end;
   target ≥ 80 %; with HEADROOM 1 the most the runner takes is `max_inflight` - 1 of each box).
   Cost: the router process's CPU (user + system, psutil) from the upload to the batch seen
   `completed`, over the lines done (`cpu_us_per_line`; `idle_cpu_ms_per_s` is its CPU at rest,
   measured for `--idle-s` before, and `cpu_us_per_line_net` the figure less that rate over the
   batch's time), and lines/s over the same time. `metrics` keeps the router's router_batch_*
   series after it (`waited`: lines whose box's room was gone when they came, put back). The
   output file is read back: every `custom_id` once.
2. `interactive`: `--rate` interactive calls a second (open loop: Poisson arrivals, the same seeded
   schedule in both phases; streamed chat; TTFT from a call's scheduled start to its first
   content chunk) for `--seconds`, no batch; then a second `--lines` batch is made, and once its
   lines run, the same schedule again (`with_batch`). Reported: TTFT p50/p95 both ways and the p95
   rise (target ≤ 10 %); where the batch ended before the phase did, the headline compares only
   the calls scheduled before its last line ended, in both phases (`while_running`). The batch
   is then cancelled (if it has not ended) and its output and error files read back: every
   `custom_id` once across the two.

The sim's boxes serve a call in the same time however many run at once (no GPU contention), so
the TTFT rise is what the router adds: interactive calls meeting boxes that lines filled, a
call's wait for a slot, the runner's work on the router's loop. Client, boxes and router share
this machine's cores: run it on a quiet machine. Figures are written to
bench/results/<stamp>-batch.json and printed as a table.
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

import httpx
import openai
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.sim.fleet import SimFleet  # noqa: E402
from router.sim.hugpy import SimBox  # noqa: E402
from router.sim.prefix_cache import TOKEN_BYTES  # noqa: E402

MODEL = "tiny"
ENDPOINT = "/v1/chat/completions"
LISTENING_RE = re.compile(r"router listening on (https?://\S+)")
ENDED = ("completed", "failed", "expired", "cancelled")
POLL_S = 0.5  # how often the batch's object is read while it runs
STEADY_TRIM_S = 1.0  # the spare-capacity mean leaves out this much of each end of the batch's run
START_WAIT_S = 20.0  # the most a made batch may take to have its first line at a box
FILLER = "Summarise the ticket below in one sentence and name the component at fault. "


def prompt(tag: str, size_tokens: int) -> str:
    """A prompt no other call has (`tag` is unique), of about `size_tokens` tokens."""
    head = f"{tag}: "
    body_bytes = max(0, size_tokens * TOKEN_BYTES - len(head))
    return head + (FILLER * (body_bytes // len(FILLER) + 1))[:body_bytes]


def batch_file(tag: str, lines: int, size_tokens: int) -> bytes:
    rows = []
    for n in range(lines):
        body = {"model": MODEL, "max_tokens": 16,
                "messages": [{"role": "user", "content": prompt(f"{tag} line {n}", size_tokens)}]}
        rows.append(json.dumps({"custom_id": f"{tag}-{n}", "method": "POST", "url": ENDPOINT, "body": body}))
    return ("\n".join(rows) + "\n").encode()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


class Fleet:
    """The simulated boxes and what they count."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.boxes = [SimBox(f"sim-{i + 1}", residents=[MODEL], chunks=args.chunks, cadence_s=args.cadence_ms / 1000)
                      for i in range(args.boxes)]
        for box in self.boxes:
            box.prefix_cache.prefill_s_per_token = args.prefill_us / 1e6
        self.sims = SimFleet(self.boxes)
        self.slots = args.boxes * args.max_inflight

    def in_progress(self) -> int:
        """Calls at the boxes now: their seats' own counts (read from this thread; plain ints)."""
        return sum(box.residents.get(MODEL, {}).get("busy", 0) for box in self.boxes)

    def served(self) -> int:
        return sum(box.residents.get(MODEL, {}).get("calls", 0) for box in self.boxes)


class Sampler:
    """Calls in progress at the boxes, every `every_s`, while running."""

    def __init__(self, fleet: Fleet, every_s: float) -> None:
        self.fleet = fleet
        self.every_s = every_s
        self.samples: list[tuple[float, int]] = []
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.samples.append((loop.time(), self.fleet.in_progress()))
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def steady_mean(self) -> tuple[float | None, float]:
        """(the mean in progress over the run's steady part, that part's seconds): from the first
        sample with a call in progress to the last, less STEADY_TRIM_S at each end."""
        busy = [t for t, n in self.samples if n > 0]
        if not busy:
            return None, 0.0
        start, end = busy[0] + STEADY_TRIM_S, busy[-1] - STEADY_TRIM_S
        kept = [n for t, n in self.samples if start <= t <= end]
        return (sum(kept) / len(kept) if kept else None), max(0.0, end - start)

    def mean(self) -> float | None:
        return sum(n for _, n in self.samples) / len(self.samples) if self.samples else None


def start_router(boxes_file: Path, home: Path, log_path: Path, log_level: str) -> tuple[subprocess.Popen, str]:
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes_file),
             "--log-level", log_level],
            stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
            env={**os.environ, "HUGPY_ROUTER_HOME": str(home)})
    line = proc.stdout.readline()
    match = LISTENING_RE.search(line)
    if match is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"router did not start: {line!r}; its log: {log_path.read_text()[-2000:]}")
    return proc, match.group(1)


def router_cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


async def warm(api: openai.AsyncOpenAI, fleet: Fleet) -> None:
    """Until the router answers and every box has served a call (the links' first inventories)."""
    for attempt in range(100):
        calls = [api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"warm {attempt} {i}"}])
                 for i in range(2 * len(fleet.boxes))]
        results = await asyncio.gather(*calls, return_exceptions=True)
        if all(not isinstance(r, Exception) for r in results) and all(
                box.residents.get(MODEL, {}).get("calls", 0) for box in fleet.boxes):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the router never answered on every box")


async def make_batch(api: openai.AsyncOpenAI, tag: str, args: argparse.Namespace):
    data = batch_file(tag, args.lines, args.prompt_tokens)
    upload = await api.files.create(file=(f"{tag}.jsonl", data), purpose="batch")
    return await api.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")


async def wait_ended(api: openai.AsyncOpenAI, batch_id: str, limit_s: float):
    """The batch's object once it ended, or as it is after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while True:
        batch = await api.batches.retrieve(batch_id)
        if batch.status in ENDED or time.monotonic() > deadline:
            return batch
        await asyncio.sleep(POLL_S)


async def wait_running(fleet: Fleet) -> bool:
    deadline = time.monotonic() + START_WAIT_S
    while fleet.in_progress() == 0:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def returned(api: openai.AsyncOpenAI, batch, tag: str, lines: int) -> dict:
    """The batch's files read back: each custom_id's appearances, across output and error file."""
    seen: dict[str, int] = {}
    kinds = {}
    for kind, file_id in (("output", batch.output_file_id), ("error", batch.error_file_id)):
        count = 0
        if file_id:
            content = await api.files.content(file_id)
            for raw in content.content.splitlines():
                if raw.strip():
                    custom_id = json.loads(raw)["custom_id"]
                    seen[custom_id] = seen.get(custom_id, 0) + 1
                    count += 1
        kinds[kind] = count
    expected = {f"{tag}-{n}" for n in range(lines)}
    return {
        "output_lines": kinds["output"], "error_lines": kinds["error"],
        "missing": len(expected - seen.keys()), "twice": sum(1 for n in seen.values() if n > 1),
        "unknown": len(seen.keys() - expected),
        "each_once": seen.keys() == expected and all(n == 1 for n in seen.values()),
    }


def counts(batch) -> dict:
    rc = batch.request_counts
    return {"total": rc.total, "completed": rc.completed, "failed": rc.failed} if rc else {}


async def metrics(url: str) -> dict[str, float]:
    """The router's router_batch_* series (serve/metrics.py rule 5), where it has them."""
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(url + "/metrics")).text
    except httpx.HTTPError:
        return {}
    found = {}
    for line in text.splitlines():
        if line.startswith("router_batch"):
            name, _, value = line.rpartition(" ")
            found[name] = float(value)
    return found


async def alone(api: openai.AsyncOpenAI, fleet: Fleet, router: psutil.Process, url: str,
                args: argparse.Namespace) -> dict:
    """Run 1: a batch on an otherwise idle fleet: spare capacity used, CPU a line, lines/s."""
    idle_cpu = router_cpu_s(router)
    await asyncio.sleep(args.idle_s)
    idle_cpu_ms_per_s = (router_cpu_s(router) - idle_cpu) / args.idle_s * 1000
    sampler = Sampler(fleet, args.sample_ms / 1000)
    sampler.start()
    cpu0, t0 = router_cpu_s(router), time.monotonic()
    batch = await make_batch(api, "alone", args)
    made_s = time.monotonic() - t0
    batch = await wait_ended(api, batch.id, args.batch_limit_s)
    elapsed = time.monotonic() - t0
    cpu = router_cpu_s(router) - cpu0
    await sampler.stop()
    mean, steady_s = sampler.steady_mean()
    done = batch.request_counts.completed + batch.request_counts.failed if batch.request_counts else 0
    report = {
        "run": "alone", "status": batch.status, "request_counts": counts(batch),
        "spare_used": round(mean / fleet.slots, 3) if mean is not None else None,
        "steady_s": round(steady_s, 1), "slots": fleet.slots,
        "cpu_us_per_line": round(cpu / done * 1e6, 1) if done else None,
        # less what the router spends at rest over the same time (its links' polls, telemetry)
        "cpu_us_per_line_net": round((cpu - idle_cpu_ms_per_s / 1000 * elapsed) / done * 1e6, 1) if done else None,
        "router_cpu_s": round(cpu, 2), "idle_cpu_ms_per_s": round(idle_cpu_ms_per_s, 1),
        "lines_per_s": round(done / elapsed, 1) if done else None,
        "upload_and_create_s": round(made_s, 2), "seconds": round(elapsed, 1),
        "metrics": await metrics(url),
    }
    if batch.status == "completed":
        report["returned"] = await returned(api, batch, "alone", args.lines)
    return report


async def interactive_phase(api: openai.AsyncOpenAI, phase: str, arrivals: list[float],
                            args: argparse.Namespace) -> tuple[dict[int, float], list[str], float]:
    """The schedule's calls, each at its time (open loop), streamed: (TTFT by call, errors, the
    phase's start in time.monotonic())."""
    loop = asyncio.get_running_loop()
    ttft: dict[int, float] = {}
    errors: list[str] = []

    async def one(n: int, scheduled: float) -> None:
        messages = [{"role": "user", "content": prompt(f"{phase} call {n}", args.prompt_tokens)}]
        try:
            stream = await api.chat.completions.create(model=MODEL, messages=messages, stream=True, max_tokens=16)
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = loop.time() - scheduled
            if first is None:
                errors.append("no content")
            else:
                ttft[n] = first
        except openai.APIError as exc:
            errors.append(type(exc).__name__)

    start = loop.time() + 0.05
    started = time.monotonic() + (start - loop.time())
    tasks = []
    for n, at in enumerate(arrivals):
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(n, start + at)))
    await asyncio.gather(*tasks)
    return ttft, errors, started


def phase_report(ttft: dict[int, float], errors: list[str], calls: int, mean_in_progress: float | None) -> dict:
    values = list(ttft.values())
    return {"calls": calls, "ttft_p50_ms": pct(values, 0.5), "ttft_p95_ms": pct(values, 0.95),
            "ttft_p99_ms": pct(values, 0.99), "errors": len(errors), "error_kinds": sorted(set(errors)),
            "mean_in_progress": round(mean_in_progress or 0, 2)}


def rise(before: float | None, after: float | None) -> float | None:
    return round(after / before - 1, 3) if before and after else None


def batch_calls_ended(fleet: Fleet, since: float) -> float | None:
    """When the boxes finished the last batch line (a plain call) begun since `since`
    (time.monotonic()); None while one runs."""
    ends = [rec.finished_at for box in fleet.boxes for rec in box.calls
            if not rec.stream and rec.model == MODEL and rec.started_at >= since]
    return None if not ends or None in ends else max(ends)


async def interactive(api: openai.AsyncOpenAI, fleet: Fleet, args: argparse.Namespace) -> dict:
    """Run 2: the same interactive schedule without a batch, then with one running. Where the
    batch ends before the second phase does, `while_running` compares the calls scheduled before
    its end, in both phases."""
    rng = random.Random(args.seed)
    arrivals, at = [], rng.expovariate(args.rate)
    while at < args.seconds:
        arrivals.append(at)
        at += rng.expovariate(args.rate)
    sampler = Sampler(fleet, args.sample_ms / 1000)
    sampler.start()
    ttft_without, errors_without, _ = await interactive_phase(api, "without", arrivals, args)
    await sampler.stop()
    without = phase_report(ttft_without, errors_without, len(arrivals), sampler.mean())

    made_at = time.monotonic()
    batch = await make_batch(api, "with", args)
    running = await wait_running(fleet)
    served0 = fleet.served()
    sampler = Sampler(fleet, args.sample_ms / 1000)
    sampler.start()
    ttft_with, errors_with, started = await interactive_phase(api, "with_batch", arrivals, args)
    await sampler.stop()
    with_batch = phase_report(ttft_with, errors_with, len(arrivals), sampler.mean())
    with_batch["batch_lines_served"] = fleet.served() - served0 - len(arrivals)
    batch = await api.batches.retrieve(batch.id)
    ended = None if batch.status == "in_progress" else batch_calls_ended(fleet, made_at)
    with_batch["batch_ran_throughout"] = running and ended is None
    with_batch["batch_ended_s_into_phase"] = round(ended - started, 1) if ended is not None else None
    if batch.status == "in_progress":
        batch = await api.batches.cancel(batch.id)
    batch = await wait_ended(api, batch.id, args.batch_limit_s)
    report = {"run": "interactive", "without": without, "with_batch": with_batch,
              "ttft_p95_rise": rise(without["ttft_p95_ms"], with_batch["ttft_p95_ms"]),
              "batch_status": batch.status, "request_counts": counts(batch)}
    if ended is not None:  # the same calls both ways: those scheduled while the batch ran
        calls = [n for n, at in enumerate(arrivals) if at < ended - started and n in ttft_without and n in ttft_with]
        report["while_running"] = {
            "calls": len(calls),
            "without_p50_ms": pct([ttft_without[n] for n in calls], 0.5),
            "without_p95_ms": pct([ttft_without[n] for n in calls], 0.95),
            "with_p50_ms": pct([ttft_with[n] for n in calls], 0.5),
            "with_p95_ms": pct([ttft_with[n] for n in calls], 0.95)}
        report["while_running"]["ttft_p95_rise"] = rise(report["while_running"]["without_p95_ms"],
                                                        report["while_running"]["with_p95_ms"])
    if batch.status in ENDED:
        report["returned"] = await returned(api, batch, "with", args.lines)
    return report


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        work = Path(tmp)
        fleet = Fleet(args)
        fleet.sims.start()
        boxes_file = work / "boxes.json"
        boxes_file.write_text(json.dumps({"boxes": [
            {"name": b.name, "url": b.url, "kind": "hugpy", "max_inflight": args.max_inflight} for b in fleet.boxes]}))
        os.chmod(boxes_file, 0o600)
        log_path = work / "router.log"
        proc = None
        try:
            proc, url = start_router(boxes_file, work / "home", log_path, args.router_log_level)
            router = psutil.Process(proc.pid)
            api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=120)
            await warm(api, fleet)
            runs = [await alone(api, fleet, router, url, args), await interactive(api, fleet, args)]
            result = {"runs": runs}
            if runs[0]["status"] != "completed" or runs[1]["batch_status"] not in ("completed", "cancelled") or not all(
                    run.get("returned", {}).get("each_once") for run in runs):
                result["router_log_tail"] = log_tail(log_path)
            return result
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            fleet.sims.stop()


def table(result: dict) -> str:
    alone_run, inter = result["runs"]
    without, with_batch = inter["without"], inter["with_batch"]
    spare = alone_run["spare_used"]
    # the headline compares the calls scheduled while the batch ran, both ways
    headline = inter.get("while_running") or {
        "calls": without["calls"], "without_p50_ms": without["ttft_p50_ms"], "with_p50_ms": with_batch["ttft_p50_ms"],
        "without_p95_ms": without["ttft_p95_ms"], "with_p95_ms": with_batch["ttft_p95_ms"],
        "ttft_p95_rise": inter["ttft_p95_rise"]}
    rise_p95 = headline["ttft_p95_rise"]
    scope = "all calls" if "while_running" not in inter else (
        f"the {headline['calls']} calls before the batch ended, {with_batch['batch_ended_s_into_phase']} s in")

    def ok(good: bool | None) -> str:
        return "-" if good is None else "yes" if good else "NO"

    rows = [
        (f"interactive TTFT p50 ms, without / with batch ({scope})",
         f"{headline['without_p50_ms']} / {headline['with_p50_ms']}", "", ""),
        (f"interactive TTFT p95 ms, without / with batch ({scope})",
         f"{headline['without_p95_ms']} / {headline['with_p95_ms']}", "", ""),
        ("interactive TTFT p95 rise", f"{rise_p95:+.1%}" if rise_p95 is not None else "-", "≤ +10 %",
         ok(rise_p95 <= 0.10 if rise_p95 is not None else None)),
        ("interactive TTFT p95 ms over the whole phase, without / with",
         f"{without['ttft_p95_ms']} / {with_batch['ttft_p95_ms']}", "", ""),
        ("interactive calls, errors (without / with)",
         f"{without['calls']}, {without['errors']} / {with_batch['calls']}, {with_batch['errors']}", "", ""),
        ("calls in progress at the boxes, mean (without / with)",
         f"{without['mean_in_progress']} / {with_batch['mean_in_progress']}", "", ""),
        ("batch lines served during 'with'; batch ran throughout",
         f"{with_batch['batch_lines_served']}; {with_batch['batch_ran_throughout']}", "", ""),
        (f"spare capacity used (batch alone, {alone_run['steady_s']} s steady)",
         f"{spare:.1%}" if spare is not None else "-", "≥ 80 %", ok(spare >= 0.80 if spare is not None else None)),
        ("router CPU µs per line; less its CPU at rest (at rest: ms/s)",
         f"{alone_run['cpu_us_per_line']}; {alone_run['cpu_us_per_line_net']} ({alone_run['idle_cpu_ms_per_s']})", "", ""),
        ("lines put back to wait (batch alone: router_batch_lines_total waited)",
         str(alone_run["metrics"].get('router_batch_lines_total{state="waited"}', "-")), "", ""),
        ("lines/s (batch alone)", str(alone_run["lines_per_s"]), "", ""),
        ("batch alone: status, request_counts", f"{alone_run['status']}, {alone_run['request_counts']}",
         "completed", ok(alone_run["status"] == "completed")),
        ("batch alone: files read back", str(alone_run.get("returned")), "each custom_id once",
         ok(alone_run.get("returned", {}).get("each_once"))),
        ("batch with interactive: status, request_counts", f"{inter['batch_status']}, {inter['request_counts']}",
         "completed or cancelled", ok(inter["batch_status"] in ("completed", "cancelled"))),
        ("batch with interactive: files read back", str(inter.get("returned")), "each custom_id once",
         ok(inter.get("returned", {}).get("each_once"))),
    ]
    lines = ["| figure | value | target | met |", "|---|---|---|---|"]
    lines += [f"| {name} | {value} | {target} | {met} |" for name, value, target, met in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,000-line batches, 10 s interactive phases")
    parser.add_argument("--boxes", type=int, default=4)
    parser.add_argument("--max-inflight", type=int, default=8, help="each box's max_inflight in the boxes file")
    parser.add_argument("--lines", type=int, help="lines of each batch (default 10,000; --quick 1,000)")
    parser.add_argument("--seconds", type=float, help="each interactive phase's length (default 60; --quick 10)")
    parser.add_argument("--rate", type=float, default=8.0,
                        help="interactive calls a second (Poisson; default 8: ~2 of the 32 slots on average)")
    parser.add_argument("--prompt-tokens", type=int, default=150, help="each call's prompt, in the sim's tokens")
    parser.add_argument("--prefill-us", type=float, default=1000.0,
                        help="prefill µs per uncached token (default 1000: 150 ms for a default prompt)")
    parser.add_argument("--chunks", type=int, default=8, help="tokens per streamed answer")
    parser.add_argument("--cadence-ms", type=float, default=10.0, help="ms between streamed tokens")
    parser.add_argument("--sample-ms", type=float, default=50.0, help="how often the boxes' calls in progress are counted")
    parser.add_argument("--idle-s", type=float,
                        help="the router's CPU at rest is measured this long (default 5; --quick 2)")
    parser.add_argument("--batch-limit-s", type=float,
                        help="the most a batch is waited for to end (default 600; --quick 120)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--router-log-level", default="warning")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    for name, full, quick in (("lines", 10_000, 1_000), ("seconds", 60.0, 10.0), ("idle_s", 5.0, 2.0),
                              ("batch_limit_s", 600.0, 120.0)):
        if getattr(args, name) is None:  # what is given stands, --quick or not
            setattr(args, name, quick if args.quick else full)
    return args


if __name__ == "__main__":
    arguments = parse_args()
    outcome = asyncio.run(main(arguments))
    print(table(outcome))
    if "router_log_tail" in outcome:
        print("\nrouter log (tail):\n" + outcome["router_log_tail"])
    arguments.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H-%M-%SZ", time.gmtime())
    (arguments.out / f"{stamp}-batch.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(arguments).items()}, **outcome}, indent=2))
