"""Real figures: the router in front of real llama-servers (`scripts/bench --figures real`).

The engine is scripts/setup's (scripts/real_engine/build.sh, in $REAL_ENGINE_HOME, default
~/.cache/real-engine): llama-server built from source and a 9 MB random-weight llama model. Its
text is noise; its tokenizer, slots, prompt cache, `usage`, `timings` and token cadence are real.

* affinity, on then off: 3 llama-servers (2 slots each, one thread each) behind a fresh `router
  serve --affinity on|off`, fresh engines for each run (empty caches); `--conversations`
  conversations of `--turns` turns, `--concurrency` at a time, streamed with the official `openai`
  client. Each turn resends the whole history: a shared ~1.6 kB system prompt, a ~2 kB first
  message of its own, then the answer and a new question. Reported: the engines' cached share of
  later turns' prompt tokens (their own `timings.cache_n` / `usage.prompt_tokens`), later-turn
  TTFT p50 and p99 (to the first content frame, at the client), and the busiest engine's share
  of all calls.
* streaming: one llama-server (4 slots), `--streams` streams of `--tokens` tokens each,
  `--concurrency` at a time, at the engine's own cadence (no delay added), through the router,
  the bare proxy (bench/floor_proxy.py) and HAProxy (bench/peers.py's, `nbthread 1`), in turn in
  one run: each proxy's process CPU (user+sys, psutil) per relayed content frame (one token each).

Everything runs on loopback on this machine's cores beside the client and the engines, so the
figures are ratios within one run; `background_pct` records other tenants' CPU during each run.
Written to bench/results/<stamp>-real.json and printed as markdown.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil

import measure
import peers
from measure import CpuMeter, Procs

ROOT = measure.ROOT
ENGINE_HOME = Path(os.environ.get("REAL_ENGINE_HOME") or Path.home() / ".cache" / "real-engine")
LLAMA_SERVER = ENGINE_HOME / "llama-server"
MODEL_FILE = ENGINE_HOME / "tiny-llama-F16.gguf"
ALIAS = "tiny-llama"
IGNORE_EOS = {"ignore_eos": True}  # llama-server's switch: every answer is exactly max_tokens long
SYSTEM = {"role": "system", "content": "You are a careful assistant for a large codebase. Answer briefly. " * 24}
LLAMA_READY = re.compile(r"listening on (http://\S+)")
ROUTER_READY = re.compile(r"router listening on (http://\S+)")
FLOOR_READY = re.compile(r"floor listening on (http://\S+)")


def start_engine(procs: Procs, name: str, parallel: int) -> str:
    port = peers.free_port()
    procs.start(name, [str(LLAMA_SERVER), "-m", str(MODEL_FILE), "--host", "127.0.0.1", "--port", str(port),
                       "-c", str(2048 * parallel), "--parallel", str(parallel), "--alias", ALIAS, "-t", "1"],
                LLAMA_READY, timeout_s=60)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    return url


def start_router(procs: Procs, engines: dict[str, str], *args: str) -> tuple[measure.Started, str]:
    home = Path(tempfile.mkdtemp(dir=procs.workdir))
    boxes = home / "boxes.json"
    boxes.write_text(json.dumps({"boxes": [{"name": n, "url": u, "kind": "openai"} for n, u in engines.items()]}))
    os.chmod(boxes, 0o600)
    started, match = procs.start("router", [sys.executable, "-m", "router", "serve", "--port", "auto",
                                            "--boxes-file", str(boxes), *args], ROUTER_READY,
                                 env={"HUGPY_ROUTER_HOME": str(home / "home")})
    url = match.group(1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # every engine online, its model read
        boxes_state = httpx.get(url + "/v1/router/state").json()["boxes"]
        if all(b["online"] and b["models"] for b in boxes_state):
            break
        time.sleep(0.1)
    return started, url


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def stream_turn(api: openai.OpenAI, messages: list, max_tokens: int) -> dict:
    """One streamed turn: its box, TTFT, the engine's prompt and cached tokens, the answer."""
    start = time.perf_counter()
    raw = api.chat.completions.with_raw_response.create(
        model=ALIAS, messages=messages, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    ttft, text, usage, timings = None, [], None, {}
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage, timings = chunk.usage, chunk.model_extra.get("timings") or {}
    return {"box": raw.headers["x-hugpy-box"], "ttft_s": ttft, "prompt": usage.prompt_tokens,
            "cached": timings.get("cache_n", 0), "prefill_ms": timings.get("prompt_ms", 0.0),
            "prefilled": timings.get("prompt_n", 0), "answer": "".join(text)}


def affinity_run(workdir: Path, meter: CpuMeter, mode: str, args: argparse.Namespace) -> dict:
    procs = Procs(workdir / f"affinity-{mode}", dict(os.environ), ROOT)
    procs.workdir.mkdir(parents=True)
    try:
        engines = {name: start_engine(procs, name, 2) for name in ("a", "b", "c")}
        _, url = start_router(procs, engines, "--affinity", mode)
        api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                            http_client=httpx.Client(timeout=120))

        def converse(n: int) -> list[dict]:
            messages = [SYSTEM, {"role": "user", "content": f"conversation {n}: here is my document. " * 60}]
            turns = []
            for t in range(args.turns):
                turns.append(stream_turn(api, messages, args.tokens_per_turn))
                messages = messages + [{"role": "assistant", "content": turns[-1]["answer"]},
                                       {"role": "user", "content": f"question {t + 1} about conversation {n}"}]
            return turns

        before = meter.snapshot()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            runs = list(pool.map(converse, range(args.conversations)))
        spent = CpuMeter.delta(before, meter.snapshot())
    finally:
        procs.stop_all()
    calls = [t for run in runs for t in run]
    later = [t for run in runs for t in run[1:]]
    per_box = {name: sum(1 for t in calls if t["box"] == name) for name in ("a", "b", "c")}
    return {"figure": "affinity", "affinity": mode, "calls": len(calls),
            "cached_share_later": round(sum(t["cached"] for t in later) / sum(t["prompt"] for t in later), 3),
            "later_ttft_p50_ms": round(pct([t["ttft_s"] for t in later], 0.5) * 1e3, 1),
            "later_ttft_p99_ms": round(pct([t["ttft_s"] for t in later], 0.99) * 1e3, 1),
            "busiest_box_share": round(max(per_box.values()) / len(calls), 3), "per_box": per_box,
            # the engines' own prefill rate over first turns (nothing cached but the shared system
            # prompt; their `timings`): what a cached token saves
            "prefill_us_per_token": round(1e3 * sum(run[0]["prefill_ms"] for run in runs)
                                          / sum(run[0]["prefilled"] for run in runs), 1),
            "later_home": round(sum(1 for run in runs for i in range(1, len(run))
                                    if run[i]["box"] == run[i - 1]["box"]) / len(later), 3),
            "wall_s": round(spent.wall_s, 1), "background_pct": round(spent.background_pct, 1)}


def stream_load(base_url: str, args: argparse.Namespace) -> int:
    """`--streams` streams, `--concurrency` at a time; content frames received in all."""
    def one(_: int) -> int:
        frames = 0
        with httpx.stream("POST", base_url + "/v1/chat/completions", timeout=120, json={
                "model": ALIAS, "messages": [{"role": "user", "content": "stream, please"}], "stream": True,
                "max_tokens": args.tokens, **IGNORE_EOS}) as answer:
            for line in answer.iter_lines():
                frames += line.startswith("data: {") and '"content":"' in line
        return frames

    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        return sum(pool.map(one, range(args.streams)))


def streaming_runs(workdir: Path, meter: CpuMeter, args: argparse.Namespace) -> list[dict]:
    procs = Procs(workdir / "streaming", dict(os.environ, PYTHONPATH=str(ROOT)), ROOT)
    procs.workdir.mkdir(parents=True)
    records = []
    try:
        engine = start_engine(procs, "engine", 4)
        router, router_url = start_router(procs, {"engine": engine})
        floor, floor_url = procs.start("floor", [sys.executable, str(ROOT / "bench" / "floor_proxy.py"),
                                                  "--interface", "asgi", "--box", engine], FLOOR_READY)
        floor_url = floor_url.group(1)
        haproxy, haproxy_url = peers.start_haproxy(procs, engine, workdir)
        targets = (("router", router, router_url), ("bare proxy", floor, floor_url),
                   ("HAProxy", haproxy, haproxy_url), ("direct", None, engine))
        for _, _, url in targets:  # warm-up
            stream_load(url, argparse.Namespace(**{**vars(args), "streams": args.concurrency}))
        for repeat in range(args.repeats):  # rounds, so that drift hits every target alike
            for name, proc, url in targets:
                meter.peer_pid = proc.pid if proc else None
                before = meter.snapshot()
                frames = stream_load(url, args)
                spent = CpuMeter.delta(before, meter.snapshot())
                records.append({"figure": "streaming", "target": name, "repeat": repeat, "frames": frames,
                                "frames_per_s": round(frames / spent.wall_s, 1),
                                "cpu_us_per_frame": round(spent.peer_s / frames * 1e6, 1) if proc else None,
                                "wall_s": round(spent.wall_s, 1), "background_pct": round(spent.background_pct, 1)})
    finally:
        meter.peer_pid = None
        procs.stop_all()
    for repeat in range(args.repeats):  # the router's cost over each proxy's, within a round
        rows = {r["target"]: r for r in records if r["repeat"] == repeat}
        for name in ("bare proxy", "HAProxy"):
            rows[name]["router_over_this"] = round(rows["router"]["cpu_us_per_frame"] / rows[name]["cpu_us_per_frame"], 2)
    return records


def spread(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):g}{unit} ({min(values):g}-{max(values):g})"


def markdown(records: list[dict], machine: str) -> str:
    lines = [f"Real engine figures ({machine}); ratios within one run.", "",
             "| affinity | calls | cached share, later turns | later-turn TTFT p50 / p99 | busiest box | later turns home | engines' prefill | engines + other tenants |",
             "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in records if r["figure"] == "affinity"):
        lines.append(f"| {r['affinity']} | {r['calls']} | {r['cached_share_later']:.0%} | {r['later_ttft_p50_ms']} / "
                     f"{r['later_ttft_p99_ms']} ms | {r['busiest_box_share']:.0%} | {r['later_home']:.0%} | "
                     f"{r['prefill_us_per_token']} µs/token | {r['background_pct']:.0f} % of a core |")
    lines += ["", f"| streaming through (median, min-max of {len({r['repeat'] for r in records if 'repeat' in r})} rounds) "
              "| content frames a round | frames/s | CPU per relayed frame (a token) | router ÷ this | engine + other tenants |",
              "|---|---|---|---|---|---|"]
    for target in ("router", "bare proxy", "HAProxy", "direct"):
        rows = [r for r in records if r["figure"] == "streaming" and r["target"] == target]
        cost = "-" if rows[0]["cpu_us_per_frame"] is None else spread([r["cpu_us_per_frame"] for r in rows], " µs")
        ratio = spread([r["router_over_this"] for r in rows]) if "router_over_this" in rows[0] else "-"
        lines.append(f"| {target} | {round(statistics.median(r['frames'] for r in rows))} | "
                     f"{spread([r['frames_per_s'] for r in rows])} | {cost} | {ratio} | "
                     f"{spread([r['background_pct'] for r in rows], ' %')} of a core |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--figures", default="real", help="real (what scripts/bench passes)")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--tokens-per-turn", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--streams", type=int, default=64, help="streams per target and round")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the streaming targets")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="6 conversations x 4 turns, 12 streams, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.streams, args.repeats = 6, 4, 12, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not (LLAMA_SERVER.exists() and MODEL_FILE.exists()):
        print(f"bench/real.py: no real engine in {ENGINE_HOME}: run scripts/setup (without "
              "HUGPY_ROUTER_SKIP_REAL_ENGINE=1)", file=sys.stderr)
        return 2
    missing = peers.missing("haproxy")
    if missing:
        print(f"bench/real.py: {missing}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="bench-real-"))
    meter = CpuMeter()
    records = [affinity_run(workdir, meter, mode, args) for mode in ("on", "off")]
    records += streaming_runs(workdir, meter, args)
    machine = f"{psutil.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "bench" / "results" / f"{stamp}-real.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": machine, "records": records}, indent=1))
    print(markdown(records, machine))
    print(f"\nwritten to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
