"""`GET /metrics` in Prometheus text format (exposition format 0.0.4).

Counters and histograms are plain dicts and lists bumped on the event loop when a call ends
(no locks: one thread); gauges (in flight, reservations, pressure, route-log backlog) are read
at scrape time from the objects that own them.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

# Seconds: from a warm answer (ms) to a cold load (minutes).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# The router's own share before the box is contacted: tens of µs when healthy.
OVERHEAD_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class Histogram:
    __slots__ = ("buckets", "counts", "total", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.count}")
        return lines


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


LOOP_WATCH_INTERVAL_S = 0.01


async def watch_loop(metrics: "Metrics") -> None:
    """Sleeps in short steps and records how late each wake-up was: a blocked loop shows."""
    import asyncio

    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(LOOP_WATCH_INTERVAL_S)
        late = loop.time() - before - LOOP_WATCH_INTERVAL_S
        if late > metrics.loop_stall_max_s:
            metrics.loop_stall_max_s = late


class Metrics:
    def __init__(self) -> None:
        self.calls: dict[tuple[str, str, int], int] = defaultdict(int)
        self.failovers: dict[str, int] = defaultdict(int)
        self.refused: dict[str, int] = defaultdict(int)
        self.ttfb = Histogram(LATENCY_BUCKETS_S)
        self.duration = Histogram(LATENCY_BUCKETS_S)
        self.overhead = Histogram(OVERHEAD_BUCKETS_S)
        self.queue_wait = Histogram(LATENCY_BUCKETS_S)
        self.loop_stall_max_s = 0.0  # the longest the event loop was late (LoopWatch)

    def render(self, boxes, reservations, route_log, admission) -> bytes:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                text = ",".join(f'{k}="{_label(v)}"' for k, v in labels)
                lines.append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")

        family("router_calls_total", "counter", "Calls by facade, box and HTTP status.",
               [((("facade", f), ("box", b), ("status", s)), n) for (f, b, s), n in sorted(self.calls.items())])
        family("router_failovers_total", "counter", "Boxes that refused a call before its first byte, by reason.",
               [((("reason", r),), n) for r, n in sorted(self.failovers.items())])
        family("router_no_box_total", "counter", "Calls no box could take, by facade.",
               [((("facade", f),), n) for f, n in sorted(self.refused.items())])
        family("router_in_flight", "gauge", "The router's calls on each box now.",
               [((("box", b.name),), b.in_flight) for b in boxes])
        family("router_reservations", "gauge", "Reservations counted on each box since the last snapshot.",
               [((("box", b.name),), reservations.count(b.index)) for b in boxes])
        family("router_pressure", "gauge", "GPU pressure 0-3 of each box in the last snapshot.",
               [((("box", b.name),), b.pressure) for b in boxes])
        family("router_box_online", "gauge", "1 when the box's health check passes.",
               [((("box", b.name),), int(b.online)) for b in boxes])
        family("router_box_full", "gauge", "1 while the box is at its in-flight limit.",
               [((("box", b.name),), int(b.full)) for b in boxes])
        family("router_box_cooling_models", "gauge",
               "Models the box refused to place lately (full for them during the back-off).",
               [((("box", b.name),), len(b.cooling)) for b in boxes])
        family("router_box_unreachable", "gauge", "1 while a connect failure keeps the box out.",
               [((("box", b.name),), int(b.unreachable)) for b in boxes])
        family("router_queue_depth", "gauge", "Calls waiting for a box with room, by model and class.",
               [((("model", m), ("class", c)), n) for (m, c), n in sorted(admission.depth().items())])
        family("router_queue_outcomes_total", "counter",
               "Calls that waited, by outcome (admitted, queue_full: 429, queue_timeout: 503, left).",
               [((("outcome", o),), n) for o, n in sorted(admission.outcomes.items())])
        backlog = route_log.queued - route_log.written - route_log.dropped
        family("router_route_log_queue", "gauge", "Route-log rows waiting for the writer.", [((), backlog)])
        family("router_route_log_write_lag_seconds", "gauge", "How long the last flushed row waited.",
               [((), route_log.last_flush_lag_s)])
        family("router_loop_stall_max_seconds", "gauge",
               "The longest the event loop ran late since start (nothing may block it).",
               [((), self.loop_stall_max_s)])
        lines += self.ttfb.render("router_time_to_first_byte_seconds", "From call received to first byte sent.")
        lines += self.duration.render("router_call_duration_seconds", "From call received to call end.")
        lines += self.queue_wait.render("router_queue_wait_seconds", "Time a call waited for a box with room.")
        lines += self.overhead.render("router_overhead_seconds", "Router time from body read to the box contacted.")
        return ("\n".join(lines) + "\n").encode()
