"""Micro-benchmarks of the per-call pieces, in µs per operation (timeit, best of 5 repeats).

    .venv/bin/python bench/micro.py

What is measured: the decision over 8 and 100 boxes (half serving, half load tier, varied
load), one reservation reserve+release, the frame scanner per SSE chunk, one route-log
`record()` (the queue put; the writer thread runs), one key check (`scope_of`, a valid key).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
import timeit
from pathlib import Path

from router._fastpath import SSE, FrameScanner, Reservations
from router.core.decide import Verdicts, decide
from router.core.pairs import Fit, pair_view
from router.core.types import BoxFacts, BoxKind, Call, Resident
from router.store.keys import KeyStore
from router.store.route_log import Row, RouteLogWriter

REPEATS = 5


def per_op_us(stmt, number: int) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=REPEATS)) / number * 1e6


def fleet(n: int) -> list[BoxFacts]:
    boxes = []
    for i in range(n):
        residents = {"tiny": Resident("tiny", last_used_s=float(i))} if i % 2 else {}
        boxes.append(BoxFacts(
            id=f"box-{i:03d}", kind=BoxKind.HUGPY, order=i, catalog=frozenset({"tiny", "big"}),
            residents=residents, pending=i % 3, pressure=i % 4, reservations=i % 5,
            free_gpu_bytes=(i * 7919) % 80 << 30,
        ))
    return boxes


def main() -> int:
    call = Call(model="tiny", kinds=frozenset(BoxKind))
    rows = []
    for n in (8, 100):
        boxes = fleet(n)
        count = 20000 if n == 8 else 2000
        verdicts = Verdicts()
        rows.append((f"decide over {n} boxes, facts unchanged since the last call",
                     per_op_us(lambda: decide(call, boxes, verdicts=verdicts), count)))
        rows.append((f"decide over {n} boxes, nothing remembered (a failover)",
                     per_op_us(lambda: decide(call, boxes, ("none",)), count)))
    # hugpy boxes with their own pair settings (a blanket, a pair row) and verdicts: the gate's
    # block check, the contract per box in the tiers, the verdicts' fit in the load tier
    view = pair_view([{"worker": "w", "model_key": "*", "settings": {"tolerance": "slowest"}},
                      {"worker": "w", "model_key": "tiny", "settings": {"max_wait_s": 30}}], "w")
    boxes = [dataclasses.replace(b, pairs=view, fits={"tiny": Fit.GPU}) for b in fleet(8)]
    rows.append(("decide over 8 boxes with pair settings and verdicts, nothing remembered",
                 per_op_us(lambda: decide(call, boxes, ("none",)), 20000)))
    table = Reservations()
    rows.append(("reservation reserve + release", per_op_us(lambda: table.release(table.reserve(3, 0)), 200000)))
    chunk = b'data: {"id":"fe-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
    scanner = FrameScanner(SSE)
    scanner.feed(b'data: {"choices":[]}\n\n')
    rows.append((f"frame scanner keep (a relayed chunk's tail), one {len(chunk)} B SSE chunk",
                 per_op_us(lambda: scanner.keep(chunk), 200000)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "router.sqlite3"
        writer = RouteLogWriter(path)
        writer.start()
        counter = iter(range(10**9))
        rows.append(("route-log record() (queue put)", per_op_us(
            lambda: writer.record(Row(f"c{next(counter)}", "done", model="tiny", http_status=200, received_at=1.0)), 20000)))
        writer.stop()
        keys = KeyStore(path)
        _, key = keys.create("bench", "use")
        now = time.time()
        rows.append(("key check scope_of (valid key)", per_op_us(lambda: keys.scope_of(key, now, None), 100000)))
        keys.close()
    width = max(len(name) for name, _ in rows)
    print(f"{'operation':<{width}}  µs/op")
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
