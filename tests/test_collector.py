"""`router serve` settles the garbage collector once it listens (server.settle_collector): what
start-up made is frozen, and the youngest generation is collected at 20,000 net new tracked
objects instead of CPython's 700, so calls in flight are not collected and promoted over and
over (bench/callpath_cpu.py measures the collector's share of a call)."""

from __future__ import annotations

import gc

from router.serve import server


def test_settle_collector_freezes_start_up_and_raises_only_the_young_threshold():
    before = gc.get_threshold()
    try:
        server.settle_collector()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (server.YOUNG_GC_THRESHOLD, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)

