"""`router` with one rule broken on purpose, for bench/faults.py --mutant: the checker
(bench/faults_check.py) must catch each. Bench code only: the router itself has no such switch.

    python bench/fault_mutants.py NAME serve ...   # as `python -m router serve ...`

- no_lease: a box's lease is never asked of the shared server (each router counts its own calls
  only), so `max_inflight` holds per router, not across them.
- drop_settle: a key's settles are thrown away, so its `max_parallel` slots and reserved tokens
  are never given back while the router lives.
- no_hold_expiry: what a router holds for a key's calls never expires, so a dead router's slots
  lock the key.
- drop_parked_rows: route-log rows held while PostgreSQL is down are thrown away.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def no_lease() -> None:
    from router.core.slots import Slot
    from router.fleetwide.leases import SlotLeases

    def take(self, load, box):
        load.count_on(box)
        return Slot.GO

    SlotLeases.ask = lambda self, load, box: None
    SlotLeases.take = take


def drop_settle() -> None:
    from router.fleetwide.tallies import SharedCounters

    SharedCounters.settle = lambda self, *args, **kwargs: None


def no_hold_expiry() -> None:
    from router.fleetwide import tallies

    tallies.HOLD_MS = 10**12


def drop_parked_rows() -> None:
    from router.store.pg.route_log import PgRouteLogWriter

    PgRouteLogWriter._park = lambda self, batch: None


MUTANTS = {f.__name__: f for f in (no_lease, drop_settle, no_hold_expiry, drop_parked_rows)}

if __name__ == "__main__":
    MUTANTS[sys.argv[1]]()
    from router.cli.main import main

    sys.exit(main(sys.argv[2:]))
