"""Turning bench/run.py's measurements into figures: medians and spreads, the markdown table,
the verdict against the targets, and the py-spy top-N."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Targets for the default (ASGI) router on this 2-core machine, unpinned, 1 worker.
TARGETS = {
    "cpu_per_call_us": 60.0,  # router CPU per non-stream call
    "cpu_per_chunk_us": 5.0,  # router CPU per relayed stream frame
    "calls_per_s": 15_000.0,  # non-stream throughput at c=64
    "added_p50_us": 150.0,  # c=1 latency, router minus direct
    "added_p99_us": 500.0,
    "open_streams": 2000,  # streams held open at once through one router process, none stalled
    "open_streams_rss_mb": 250.0,  # router RSS at their peak (MB = 10^6 bytes)
    "stalled_growth_mib": 2.0,  # router RSS growth over 10 s of one stalled reader
    "open_streams_10k_kb": 16.0,  # router RSS per open stream, 10,000 at one frame per second
    "c1_added_p99_us": 500.0,  # issue 41: what the router adds to a call's p99, one call at a time
}

# Issue 15's targets as ratios measured in one run (the `peers` figure): (label, numerator
# (target, figure, key), denominator, target, "≤" or "≥").
PEER_RATIOS = (
    # issue 41: the Rust routers are the bar (the bare proxy's ≤ 1.3× a call and 0.0.4's ≥ 6×, retired)
    ("router CPU per non-stream call ÷ sglang-router's", ("router", "peers", "cpu_us_per_call"),
     ("sglang-router", "peers", "cpu_us_per_call"), 1.0, "≤"),
    # a paced frame is a relayed token: the figure issue 41 says matters most
    ("router CPU per paced token ÷ sglang-router's", ("router", "peers_paced", "cpu_us_per_chunk"),
     ("sglang-router", "peers_paced", "cpu_us_per_chunk"), 1.0, "≤"),
    ("router CPU per paced token ÷ the bare proxy's", ("router", "peers_paced", "cpu_us_per_chunk"),
     ("floor", "peers_paced", "cpu_us_per_chunk"), 1.15, "≤"),
    # a burst (the whole answer in one write) coalesced: below every peer's
    ("router CPU per burst frame ÷ sglang-router's", ("router", "peers_stream", "cpu_us_per_chunk"),
     ("sglang-router", "peers_stream", "cpu_us_per_chunk"), 1.0, "≤"),
    ("router CPU per burst frame ÷ vllm-router's", ("router", "peers_stream", "cpu_us_per_chunk"),
     ("vllm-router", "peers_stream", "cpu_us_per_chunk"), 1.0, "≤"),
    ("router p99 under load ÷ sglang-router's", ("router", "peers", "p99_us"), ("sglang-router", "peers", "p99_us"),
     1.5, "≤"),
    ("router CPU per non-stream call ÷ HAProxy's", ("router", "peers", "cpu_us_per_call"),
     ("haproxy", "peers", "cpu_us_per_call"), 7.0, "≤"),
    ("router calls/s ÷ LiteLLM's", ("router", "peers", "rate"), ("litellm", "peers", "rate"), 50.0, "≥"),
)
PEER_LABELS = {
    "router": "router", "floor": "bare proxy (bench/floor_proxy.py)", "haproxy": "HAProxy 2.6, nbthread 1",
    "hugpy-router-0.0.4": "hugpy-router 0.0.4", "litellm": "LiteLLM proxy, one worker",
    "sglang-router": "sglang-router, round robin", "vllm-router": "vllm-router, round robin", "direct": "direct (the box)",
}

FIGURE_TITLES = {
    "nonstream": "non-stream c=64 (calls/s)",
    "stream": "20-chunk streams c=64 (streams/s)",
    "latency_p50": "latency c=1 p50 (µs)",
    "latency_p99": "latency c=1 p99 (µs)",
    "ttft_p50": "TTFT p50, 64 users, 20 ms cadence (ms)",
    "ttft_p99": "TTFT p99, 64 users, 20 ms cadence (ms)",
}


@dataclass
class Stat:
    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Stat | None":
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), len(values))

    def span(self, fmt: str) -> str:
        return f"{fmt.format(self.lo)}–{fmt.format(self.hi)}" if self.n > 1 else fmt.format(self.median)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# -- summaries ---------------------------------------------------------------------------------


def pairs(records: list[dict], interface: str, figure: str) -> list[dict[str, dict]]:
    """{target: record} of one figure per repeat (measured back to back): router and direct,
    and the floor proxy where it ran; repeats missing router or direct are left out."""
    by_repeat: dict[int, dict[str, dict]] = {}
    for r in records:
        if r["interface"] == interface and r["figure"] == figure:
            by_repeat.setdefault(r["repeat"], {})[r["target"]] = r
    return [d for _, d in sorted(by_repeat.items()) if "router" in d and "direct" in d]


# (row name, record figure, record key, router CPU key, router vs direct as "ratio" or "added")
ROWS = (
    ("nonstream", "nonstream", "rate", "cpu_us_per_call", "ratio"),
    ("stream", "stream", "rate", "cpu_us_per_chunk", "ratio"),
    ("latency_p50", "latency", "p50_us", "cpu_us_per_call", "added"),
    ("latency_p99", "latency", "p99_us", None, "added"),
    ("ttft_p50", "ttft", "ttft_p50_ms", "cpu_us_per_chunk", "added"),
    ("ttft_p99", "ttft", "ttft_p99_ms", None, "added"),
)
CPU_UNITS = {"cpu_us_per_call": "µs/call", "cpu_us_per_chunk": "µs/chunk"}


def summarize(records: list[dict], interfaces: list[str]) -> list[dict]:
    """One row per (interface, figure): router, direct, ratio or added, router CPU, spreads."""
    rows = []
    for interface in interfaces:
        for name, figure, key, cpu_key, mode in ROWS:
            matched = pairs(records, interface, figure)
            if not matched:
                continue
            router = [m["router"][key] for m in matched]
            direct = [m["direct"][key] for m in matched]
            floors = [m["floor"] for m in matched if "floor" in m]
            if mode == "ratio":
                relation = [r / d for r, d in zip(router, direct) if d]
            else:
                relation = [r - d for r, d in zip(router, direct)]
            everything = [x for m in matched for x in m.values()]
            rows.append({
                "interface": interface,
                "figure": name,
                "title": FIGURE_TITLES[name],
                "mode": mode,
                "router": Stat.of(router),
                "direct": Stat.of(direct),
                "relation": Stat.of(relation),
                "cpu": Stat.of([m["router"][cpu_key] for m in matched]) if cpu_key else None,
                # the bare proxy on the same stack (bench/floor_proxy.py): what is not the router's
                "floor": Stat.of([f[key] for f in floors]),
                "floor_cpu": Stat.of([f[cpu_key] for f in floors]) if cpu_key else None,
                "cpu_unit": CPU_UNITS.get(cpu_key, ""),
                "background": Stat.of([x["background_pct"] for x in everything]),
                "errors": sum(x["errors"] for x in everything),
                "noisy": sum(1 for x in everything if x.get("noisy")),
            })
    return rows


def row_value_format(row: dict) -> str:
    if row["figure"].startswith("ttft"):
        return "{:,.1f}"
    return "{:,.0f}"


def markdown_table(rows: list[dict]) -> str:
    head = ("| figure | router | direct | ratio / added | router CPU | bare proxy (CPU) "
            "| spread (min–max: router; direct; CPU) "
            "| other tenants' CPU % (max) | flags |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for row in rows:
        fmt = row_value_format(row)
        rel = row["relation"]
        relation = (f"{rel.median:.2f}×" if row["mode"] == "ratio"
                    else f"{'+' if rel.median >= 0 else ''}{fmt.format(rel.median)}")
        cpu = row["cpu"]
        cpu_text = f"{cpu.median:.1f} {row['cpu_unit']}" if cpu else "–"
        spread = "; ".join(filter(None, [
            row["router"].span(fmt), row["direct"].span(fmt),
            cpu.span("{:.1f}") if cpu else None,
        ]))
        if rel.n > 1:
            spread += f" (rel {rel.span('{:.2f}' if row['mode'] == 'ratio' else fmt)})"
        flags = []
        if row["errors"]:
            flags.append(f"{row['errors']} errors")
        if row["noisy"]:
            flags.append(f"{row['noisy']} noisy runs")
        bg = row["background"]
        floor, floor_cpu = row.get("floor"), row.get("floor_cpu")
        floor_text = fmt.format(floor.median) if floor else "–"
        if floor_cpu:
            floor_text += f" ({floor_cpu.median:.1f} {row['cpu_unit']}, {floor_cpu.span('{:.1f}')})"
        lines.append(f"| {row['interface']} · {row['title']} | {fmt.format(row['router'].median)} | "
                     f"{fmt.format(row['direct'].median)} | {relation} | {cpu_text} | {floor_text} | {spread} | "
                     f"{bg.median:.0f} ({bg.hi:.0f}) | {', '.join(flags) or '–'} |")
    return head + "\n".join(lines) + "\n"


def interface_cost(rows: list[dict]) -> str:
    """The price of the bounded ASGI path: RSGI/ASGI throughput and ASGI/RSGI CPU, medians."""
    by = {(r["interface"], r["figure"]): r for r in rows}
    lines = []
    for figure in ("nonstream", "stream", "latency_p50"):
        asgi, rsgi = by.get(("asgi", figure)), by.get(("rsgi", figure))
        if not asgi or not rsgi:
            continue
        if figure == "latency_p50":
            lines.append(f"| {FIGURE_TITLES[figure]} | added {asgi['relation'].median:+.0f} µs (asgi) vs "
                         f"{rsgi['relation'].median:+.0f} µs (rsgi) | "
                         f"{_ratio(asgi['cpu'], rsgi['cpu'])} |")
        else:
            lines.append(f"| {FIGURE_TITLES[figure]} | {rsgi['router'].median / asgi['router'].median:.2f}× "
                         f"(rsgi/asgi) | {_ratio(asgi['cpu'], rsgi['cpu'])} |")
    if not lines:
        return ""
    return ("| figure | throughput or latency | CPU asgi/rsgi |\n|---|---|---|\n" + "\n".join(lines) + "\n")


def _ratio(a: Stat | None, b: Stat | None) -> str:
    return f"{a.median / b.median:.2f}×" if a and b and b.median else "–"


def verdict(rows: list[dict], records: list[dict] = ()) -> list[str]:
    """One line per target and interface: value, target, PASS/MISS."""
    by = {(r["interface"], r["figure"]): r for r in rows}
    checks = [
        ("nonstream", "cpu", "router CPU per non-stream call", "cpu_per_call_us", "µs", False),
        ("stream", "cpu", "router CPU per relayed chunk", "cpu_per_chunk_us", "µs", False),
        ("nonstream", "router", "non-stream throughput", "calls_per_s", "calls/s", True),
        ("latency_p50", "relation", "added latency c=1 p50", "added_p50_us", "µs", False),
        ("latency_p99", "relation", "added latency c=1 p99", "added_p99_us", "µs", False),
    ]
    out = []
    for interface in sorted({r["interface"] for r in rows}):
        for figure, field_name, label, target_key, unit, at_least in checks:
            row = by.get((interface, figure))
            if not row or row[field_name] is None:
                continue
            value, target = row[field_name].median, TARGETS[target_key]
            ok = value >= target if at_least else value <= target
            sign = "≥" if at_least else "≤"
            out.append(f"{'PASS' if ok else 'MISS'}  {interface}: {label} = {value:,.1f} {unit} "
                       f"(target {sign} {target:,.0f} {unit})")
    return out + capacity_verdict(records) + peers_verdict(records)


def capacity_verdict(records: list[dict]) -> list[str]:
    """Open streams and the stalled reader, per interface."""
    out = []
    for r in records:
        if r["figure"] in ("open_streams", "open_streams_10k"):
            many = r["figure"] == "open_streams_10k"
            asked = r.get("streams_asked", TARGETS["open_streams"])
            target = (f"target {asked:,} none stalled, "
                      + (f"≤ {TARGETS['open_streams_10k_kb']:g} kB of router RSS per stream" if many
                         else f"RSS ≤ {TARGETS['open_streams_rss_mb']:.0f} MB"))
            if r.get("skipped"):
                out.append(f"MISS  {r['interface']}: {r['figure']} not run: {r['skipped']} ({target})")
                continue
            memory_ok = (r["router_rss_per_stream_kb"] <= TARGETS["open_streams_10k_kb"] if many
                         else r["router_rss_peak_mb"] <= TARGETS["open_streams_rss_mb"])
            ok = r["completed"] >= asked and r["stalled"] == 0 and memory_ok
            memory = (f"{r['router_rss_per_stream_kb']:.1f} kB of router RSS per stream" if many
                      else f"router RSS peak {r['router_rss_peak_mb']:.0f} MB")
            direct = f"; straight from the box: {_control(r['direct'])}" if r.get("direct") else ""
            out.append(f"{'PASS' if ok else 'MISS'}  {r['interface']}: {r['figure']} = {r['completed']:,} of "
                       f"{r['streams']:,} completed, {r['stalled']} stalled (max gap {_num(r['max_gap_ms'])} ms), "
                       f"{memory} ({target}{'; ' + r['reduced'] if r.get('reduced') else ''}){direct}")
            if many and r.get("floor"):  # issue 41: memory per stream ≤ the bare proxy's
                floor_kb = r["floor"]["rss_per_stream_kb"]
                peers = "".join(f", {name}'s {run['rss_per_stream_kb']:.1f} kB"
                                for name, run in r.get("peers", {}).items() if "skipped" not in run)
                out.append(f"{'PASS' if r['router_rss_per_stream_kb'] <= floor_kb else 'MISS'}  {r['interface']}: "
                           f"router RSS per open stream {r['router_rss_per_stream_kb']:.1f} kB (target ≤ the bare "
                           f"proxy's {floor_kb:.1f} kB{peers})")
        elif r["figure"] == "stalled_reader":
            ok = r["growth_mib"] <= TARGETS["stalled_growth_mib"]
            note = ("; expected: RSGI's response stream has no write backpressure, the reason ASGI is the "
                    "default" if r["interface"] == "rsgi" else "")
            out.append(f"{'PASS' if ok else 'MISS'}  {r['interface']}: stalled reader RSS growth over "
                       f"{r['stall_s']:g} s = {r['growth_mib']:+.2f} MiB (target ≤ "
                       f"{TARGETS['stalled_growth_mib']:g} MiB{note})")
    return out


def peer_ratios(records: list[dict]) -> list[tuple[str, Stat | None, float, str]]:
    """PEER_RATIOS measured per round (numerator and denominator from the same round), as
    (label, median and spread over rounds, target, sign)."""
    rounds: dict[int, dict[tuple[str, str], dict]] = {}
    for r in records:
        if r["figure"] in ("peers", "peers_stream", "peers_paced") and not r.get("skipped"):
            rounds.setdefault(r["repeat"], {})[(r["target"], r["figure"])] = r
    out = []
    for label, (t1, f1, k1), (t2, f2, k2), target, sign in PEER_RATIOS:
        values = [rnd[(t1, f1)][k1] / rnd[(t2, f2)][k2] for rnd in rounds.values()
                  if (t1, f1) in rnd and (t2, f2) in rnd and rnd[(t2, f2)].get(k2)]
        out.append((label, Stat.of(values), target, sign))
    return out


def marginal_by_round(records: list[dict]) -> dict[tuple[int, str], float]:
    """A paced token after the first, per (round, target): what a `peers_paced_long` stream cost
    more than a `peers_paced` one, over the content frames it had more (the call's own cost, the
    same in both, taken out)."""
    pairs: dict[tuple[int, str], dict[str, dict]] = {}
    for r in records:
        if r["figure"] in ("peers_paced", "peers_paced_long") and "cpu_us_per_call" in r:
            pairs.setdefault((r["repeat"], r["target"]), {})[r["figure"]] = r
    out = {}
    for key, pair in pairs.items():
        short, long = pair.get("peers_paced"), pair.get("peers_paced_long")
        if short and long and long["chunks"] > short["chunks"]:
            out[key] = (long["cpu_us_per_call"] - short["cpu_us_per_call"]) / (long["chunks"] - short["chunks"])
    return out


def peer_marginal(records: list[dict]) -> dict[str, Stat | None]:
    """`marginal_by_round`'s medians and spreads over rounds, per target."""
    values: dict[str, list[float]] = {}
    for (_, target), value in marginal_by_round(records).items():
        values.setdefault(target, []).append(value)
    return {target: Stat.of(v) for target, v in values.items()}


def marginal_ratios(records: list[dict]) -> list[tuple[str, Stat | None]]:
    """The router's paced token after the first ÷ each stream peer's, within each round."""
    by_round = marginal_by_round(records)
    out = []
    for peer, name in (("floor", "the bare proxy"), ("sglang-router", "sglang-router"),
                       ("vllm-router", "vllm-router"), ("haproxy", "HAProxy")):
        values = [by_round[(repeat, "router")] / value for (repeat, target), value in by_round.items()
                  if target == peer and (repeat, "router") in by_round and value > 0]
        out.append((f"router CPU per paced token after the first ÷ {name}'s", Stat.of(values)))
    return out


def peer_added(records: list[dict]) -> dict[str, tuple[Stat | None, Stat | None]]:
    """One call at a time (`peers_c1`): what each target adds to the box's p50 and p99, each
    round's less the box's own in that round, as medians and spreads over rounds."""
    rounds: dict[int, dict[str, dict]] = {}
    for r in records:
        if r["figure"] == "peers_c1" and not r.get("skipped"):
            rounds.setdefault(r["repeat"], {})[r["target"]] = r
    added: dict[str, tuple[list[float], list[float]]] = {}
    for rnd in rounds.values():
        direct = rnd.get("direct")
        for target, r in rnd.items():
            if direct is not None and target != "direct":
                p50s, p99s = added.setdefault(target, ([], []))
                p50s.append(r["p50_us"] - direct["p50_us"])
                p99s.append(r["p99_us"] - direct["p99_us"])
    return {target: (Stat.of(p50s), Stat.of(p99s)) for target, (p50s, p99s) in added.items()}


def peers_verdict(records: list[dict]) -> list[str]:
    out = []
    router = peer_added(records).get("router")
    if any(r.get("pinned") for r in records):  # the box shares its core with wrk: its own tail is not the floor
        out.append("n/a   peers: router c=1 added p99 is not judged in a pinned run (the box shares a core with "
                   "wrk and the runner there, so its own p99 is no baseline)")
    elif router is not None and router[1] is not None:
        ok = router[1].median <= TARGETS["c1_added_p99_us"]
        out.append(f"{'PASS' if ok else 'MISS'}  peers: router c=1 added p99 = {router[1].median:,.0f} µs "
                   f"(target ≤ {TARGETS['c1_added_p99_us']:g} µs)")
    for label, stat, target, sign in peer_ratios(records):
        if stat is None:
            continue
        ok = stat.median <= target if sign == "≤" else stat.median >= target
        out.append(f"{'PASS' if ok else 'MISS'}  peers: {label} = {stat.median:.2f}× (target {sign} {target:g}×)")
    return out


def peers_table(records: list[dict]) -> str:
    """The peers figure: one row per target (medians over rounds, min–max when more than one),
    then the ratios against issue 15's targets."""
    runs = [r for r in records if r["figure"] in ("peers", "peers_stream", "peers_c1", "peers_paced",
                                                  "peers_paced_long")]
    if not runs:
        return ""
    lines = ["| | calls/s | CPU per call | p50 / p99 (ms) | burst streams/s | CPU per burst frame "
             "| CPU per paced token | a paced token after the first | c=1 added p50 / p99 "
             "| other tenants' CPU % (max) | flags |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    added = peer_added(records)
    marginal = peer_marginal(records)
    for target, label in PEER_LABELS.items():
        mine = [r for r in runs if r["target"] == target]
        skipped = [r["skipped"] for r in mine if r.get("skipped")]
        calls = [r for r in mine if r["figure"] == "peers" and not r.get("skipped")]
        streams = [r for r in mine if r["figure"] == "peers_stream"]
        paced = [r for r in mine if r["figure"] == "peers_paced" and not r.get("skipped")]
        if not mine:
            continue
        if not calls:
            lines.append(f"| {label} | not run: {skipped[0]} | | | | | | | | | |")
            continue
        rate, cpu = Stat.of([r["rate"] for r in calls]), Stat.of([r["cpu_us_per_call"] for r in calls
                                                                  if "cpu_us_per_call" in r])
        p50, p99 = Stat.of([r["p50_us"] / 1000 for r in calls]), Stat.of([r["p99_us"] / 1000 for r in calls])
        srate = Stat.of([r["rate"] for r in streams])
        chunk = Stat.of([r["cpu_us_per_chunk"] for r in streams if "cpu_us_per_chunk" in r])
        token = Stat.of([r["cpu_us_per_chunk"] for r in paced if "cpu_us_per_chunk" in r])
        bg = Stat.of([r["background_pct"] for r in mine if not r.get("skipped")])
        errors = sum(r["errors"] for r in mine)
        noisy = sum(1 for r in mine if r.get("noisy"))
        flags = ", ".join(filter(None, [f"{errors} errors" if errors else "", f"{noisy} noisy run(s)" if noisy else "",
                                        f"{len(skipped)} round(s) not run" if skipped else ""])) or "–"
        c1_p50, c1_p99 = added.get(target, (None, None))
        c1 = "–" if c1_p50 is None else f"{_stat(c1_p50, '{:+,.0f}')} / {_stat(c1_p99, '{:+,.0f}', ' µs')}"
        lines.append(
            f"| {label} | {_stat(rate, '{:,.0f}')} | {_stat(cpu, '{:,.0f}', ' µs')} | "
            f"{p50.median:.1f} / {p99.median:.1f} | {_stat(srate, '{:,.0f}')} | {_stat(chunk, '{:.1f}', ' µs')} | "
            f"{_stat(token, '{:.1f}', ' µs')} | {_stat(marginal.get(target), '{:.1f}', ' µs')} | {c1} | {bg.median:.0f} ({bg.hi:.0f}) | {flags} |")
    ratios = ["| ratio, same round | measured | target |", "|---|---|---|"]
    for label, stat, target, sign in peer_ratios(records):
        ratios.append(f"| {label} | {_stat(stat, '{:.2f}', '×')} | {sign} {target:g}× |")
    for label, stat in marginal_ratios(records):  # what the paced token's gap is made of: no target
        if stat is not None:
            ratios.append(f"| {label} | {_stat(stat, '{:.2f}', '×')} | – |")
    return "\n".join(lines) + "\n\n" + "\n".join(ratios) + "\n"


def _stat(stat: Stat | None, fmt: str, unit: str = "") -> str:
    if stat is None:
        return "–"
    return fmt.format(stat.median) + unit + (f" ({stat.span(fmt)})" if stat.n > 1 else "")


def _control(d: dict) -> str:
    """An open-streams control run: through the bare proxy, or straight from the box."""
    return (f"{d['completed']:,} completed, {d['stalled']} stalled, max gap {_num(d['max_gap_ms'])} ms, first "
            f"frame p99 {_num(d['first_frame_p99_ms'])} ms, other tenants {d['background_pct']:.0f} %")


def _proxy_control(d: dict) -> str:
    """An open-streams control run through another proxy: `_control`'s, and the proxy's memory
    and CPU."""
    return (f"{_control(d)}, {d['rss_per_stream_kb']:.1f} kB of its RSS per stream, "
            f"{d['cpu_us_per_frame']:.1f} µs of its CPU per frame")


def _num(value: float | None, fmt: str = "{:,.0f}") -> str:
    return "–" if value is None else fmt.format(value)


# -- capacity and memory, latency against concurrency --------------------------------------------


def capacity_table(records: list[dict]) -> str:
    """Open streams and stalled reader: one row per figure and interface."""
    lines = []
    for r in records:
        if r["figure"] in ("open_streams", "open_streams_10k"):
            many = r["figure"] == "open_streams_10k"
            title = f"{r['interface']} · {r.get('streams', r.get('streams_asked', 0)):,} open streams"
            if r.get("skipped"):
                lines.append(f"| {title} | not run | – | {r['skipped']} | – |")
                continue
            result = (f"{r['completed']:,} completed, {r['stalled']} stalled; router RSS peak "
                      f"{r['router_rss_peak_mb']:.0f} MB, {r['router_rss_per_stream_kb']:.1f} kB per stream")
            asked = r.get("streams_asked", TARGETS["open_streams"])
            target = (f"{asked:,}, none stalled, ≤ {TARGETS['open_streams_10k_kb']:g} kB per stream" if many
                      else f"{asked:,}, none stalled, ≤ {TARGETS['open_streams_rss_mb']:.0f} MB")
            failures = ", ".join(f"{n} {cause}" for cause, n in r["failures"].items())
            detail = (f"{r['frames_expected']} frames per stream every {r['cadence_ms']:g} ms; "
                      f"peak {r['peak_open']:,} open at once; max gap between frames {_num(r['max_gap_ms'])} ms "
                      f"(stall: > {r['stall_threshold_ms']:.0f} ms); first frame p50/p99 "
                      f"{_num(r['first_frame_p50_ms'])}/{_num(r['first_frame_p99_ms'])} ms; router RSS "
                      f"{r['router_rss_base_mb']:.0f} MB before, {r['router_rss_after_mb']:.0f} MB after; "
                      f"{r['router_fds_peak']:,} fds (limit {r['router_fd_limit']:,}; sim's {r.get('sim_fd_limit', 0):,}); router CPU "
                      f"{r['router_cpu_pct']:.0f} %, sim {r['sim_cpu_pct']:.0f} %"
                      + (f"; failures: {failures}" if failures else "")
                      + (f"; router CPU {r['cpu_us_per_frame']:.1f} µs per frame (call set-up included)"
                         if "cpu_us_per_frame" in r else "")
                      + (f"; the same streams through the bare proxy: {_proxy_control(r['floor'])}" if r.get("floor") else "")
                      + (f"; straight from the box: {_control(r['direct'])}" if r.get("direct") else "")
                      + "".join(f"; through {name}: "
                                + (f"not run ({run['skipped']})" if "skipped" in run else _proxy_control(run))
                                for name, run in r.get("peers", {}).items())
                      + (f"; fewer than asked: {r['reduced']}" if r.get("reduced") else ""))
            lines.append(f"| {title} | {result} | {target} | {detail} | {r['background_pct']:.0f} |")
        elif r["figure"] == "stalled_reader":
            title = f"{r['interface']} · stalled reader, {r['stall_s']:g} s"
            result = f"RSS growth {r['growth_mib']:+.2f} MiB"
            target = f"≤ {TARGETS['stalled_growth_mib']:g} MiB"
            detail = (f"a {r['answer_frames']:,}-frame stream (~{r['answer_mb']:.0f} MB) written "
                      f"at once; router RSS {r['rss_start_mib']:.1f} → {r['rss_end_mib']:.1f} MiB (peak "
                      f"{r['rss_peak_mib']:.1f}; {r['growth_after_1s_mib']:+.2f} MiB from 1 s to the end), "
                      f"{r['rss_closed_mib']:.1f} MiB 2 s after the client closed; "
                      f"router CPU during the stall {r['router_cpu_s']:.2f} s")
            lines.append(f"| {title} | {result} | {target} | {detail} | {r['background_pct']:.0f} |")
    if not lines:
        return ""
    return ("| figure | result | target | details | other tenants' CPU % |\n|---|---|---|---|---|\n"
            + "\n".join(lines) + "\n")


def curve_points(records: list[dict]) -> dict[tuple[str, str], dict[int, dict]]:
    """latency_curve records → {(interface, target): {connections: record}}."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for r in records:
        if r["figure"] == "latency_curve":
            out.setdefault((r["interface"], r["target"]), {})[r["connections"]] = r
    return out


def curve_table(records: list[dict]) -> str:
    points = curve_points(records)
    if not points:
        return ""
    series = sorted(points, key=lambda k: (k[1] != "router", k[0]))
    conns = sorted({c for p in points.values() for c in p})
    head = ("| c | " + " | ".join(f"{i} {t} p50 / p99" for i, t in series) + " | calls/s "
            + " / ".join(f"{i} {t}" for i, t in series) + " |\n|" + "---|" * (len(series) + 2) + "\n")
    lines = []
    for c in conns:
        cells = []
        rates = []
        for key in series:
            r = points[key].get(c)
            noisy = " †" if r and r.get("noisy") else ""
            cells.append(f"{r['p50_us'] / 1000:.2f} / {r['p99_us'] / 1000:.2f}{noisy}" if r else "–")
            rates.append(f"{r['rate']:,.0f}" if r else "–")
        lines.append(f"| {c} | " + " | ".join(cells) + " | " + " / ".join(rates) + " |")
    note = ""
    if any(r.get("noisy") for p in points.values() for r in p.values()):
        note = "\n† other tenants used over 35 % of a core during that run (not retried).\n"
    return head + "\n".join(lines) + "\n" + note


def plot_latency_curve(records: list[dict], out: Path, title: str) -> None:
    """p50 (solid) and p99 (dashed) against concurrency, log-scale y; one colour per series.
    Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = curve_points(records)
    colours = {("asgi", "router"): "tab:blue", ("rsgi", "router"): "tab:orange",
               ("asgi", "direct"): "tab:gray", ("rsgi", "direct"): "black"}
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for key in sorted(points, key=lambda k: (k[1] != "router", k[0])):
        interface, target = key
        conns = sorted(points[key])
        label = f"router ({interface})" if target == "router" else f"direct (box, {interface} run)"
        colour = colours.get(key)
        for pct, style, marker in (("p50_us", "-", "o"), ("p99_us", "--", "^")):
            ax.plot(conns, [points[key][c][pct] / 1000 for c in conns], linestyle=style, marker=marker,
                    color=colour, label=f"{label} {pct[:3]}", alpha=0.6 if target == "direct" else 1.0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    conns = sorted({c for p in points.values() for c in p})
    ax.set_xticks(conns)
    ax.set_xticklabels([str(c) for c in conns])
    ax.set_xlabel("concurrent connections (wrk -t1 -cN, non-stream chat calls)")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# -- py-spy ------------------------------------------------------------------------------------

# A sample whose thread holds a Python thread state but runs no Python frame: in the router these
# are Granian's Rust runtime threads (stack-notes §2.3).
NO_FRAME = "(no Python frame)"
# The frame that called uvloop's run_forever: a sample ending there is time inside the native
# loop itself (epoll, socket reads and writes, callback dispatch), not in any Python callback.
NATIVE_LOOP = "Runner.run (asyncio/runners.py"


def top_functions(raw_file: Path, n: int = 15) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """py-spy `--format raw` (collapsed stacks, "f1;f2;leaf count") → total samples, the top-n
    leaf functions by own samples, and own samples grouped by area (router subpackage, granian,
    asyncio, uvloop, other)."""
    own: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    total = 0
    for line in raw_file.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        samples = int(count)
        total += samples
        leaf = _short(stack.rsplit(";", 1)[-1].strip()) or NO_FRAME
        own[leaf] += samples
        areas[_area(leaf)] += samples
    return total, own.most_common(n), areas.most_common()


def _short(frame: str) -> str:
    """`func (/long/path/site-packages/pkg/mod.py:12)` → `func (pkg/mod.py:12)`."""
    name, _, where = frame.partition(" (")
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{name} ({where}" if where else name


def _area(frame: str) -> str:
    if frame == NO_FRAME:
        return "Granian's Rust threads (no Python frame)"
    if frame.startswith(NATIVE_LOOP):
        return "uvloop's native loop (run_forever: I/O, scheduling)"
    where = frame.partition(" (")[2]
    if where.startswith("router/"):
        parts = where.split("/")
        return "/".join(parts[:2]) if len(parts) > 2 else parts[0] + "/" + parts[1].split(":")[0]
    for area in ("granian", "uvloop", "asyncio", "orjson", "httptools"):
        if where.startswith(area):
            return area
    return "other"


def profile_text(label: str, raw_file: Path, rate_hz: int, duration_s: int, n: int = 15) -> str:
    total, top, areas = top_functions(raw_file, n)
    wall_samples = rate_hz * duration_s  # samples one thread busy the whole time would give
    lines = [f"## {label}: {total} samples ({total / wall_samples:.2f} busy Python threads on average) "
             f"from {raw_file.name}", "", f"top {n} functions by own samples:",
             f"{'own':>6} {'% samples':>9}  function"]
    for frame, samples in top:
        lines.append(f"{samples:>6} {100 * samples / total:>8.1f}%  {frame}")
    lines += ["", "own samples by area:"]
    for area, samples in areas:
        lines.append(f"{samples:>6} {100 * samples / total:>8.1f}%  {area}")
    return "\n".join(lines) + "\n"
