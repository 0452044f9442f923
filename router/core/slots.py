"""A slot's answer: a key's `max_parallel` slot (router.core.limits rule 7), or a box's
`max_inflight` slot across routers (fleetwide/leases.py)."""

from __future__ import annotations

import enum


class Slot(enum.Enum):
    GO = "go"  # the call holds its slot (or needs none): it may go
    WAIT = "wait"  # none is free: the call decides again, or waits in the queue
    DOWN = "down"  # the shared server is down and --shared-down closed: 503 shared_store_down


# the answers as module names: on Python 3.11 a member read off its Enum class costs ~80 ns (the
# class's __getattr__), a module name ~7 ns, and the call path reads them on every call
GO, WAIT, DOWN = Slot.GO, Slot.WAIT, Slot.DOWN
