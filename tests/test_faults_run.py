"""bench/faults.py in its short form, and its checker (bench/faults_check.py) against histories
broken on purpose: each invariant of docs/several-routers.md's "What is proven" caught.

The run is real processes under real faults (three routers, PostgreSQL, redis-server, kill -9,
SIGSTOP): its times are real time, and its bounds are those the docs state."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import faults_check  # noqa: E402

# its schedule: a router killed, redis-server stalled, PostgreSQL restarted, redis-server
# restarted, a box cut mid-stream, a router paused (as the machine's pace allows in a minute)
SEED = 90


@pytest.mark.timeout(400)
def test_a_minute_of_faults_keeps_every_invariant(tmp_path):
    out = tmp_path / "faults"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "faults.py"), "--seconds", "60", "--seed", str(SEED),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=380)
    verdict = json.loads((out / "verdict.json").read_text())
    assert done.returncode == 0 and verdict["ok"], (verdict["findings"], done.stdout[-3000:], done.stderr[-3000:])
    assert verdict["figures"]["calls"] > 1000
    injected = set(verdict["figures"]["faults"]) - {"shared_down"}
    assert {"router_kill", "redis_stall", "pg_restart"} <= injected and len(injected) >= 4, injected
    assert (out / "calls.svg").read_text().startswith("<svg")


# -- the checker, on a small history made by hand ---------------------------------------------

T0 = 1_800_000_000.0
KEY = "k1"


def history() -> tuple[list[dict], list[dict]]:
    """A clean run of 10 s: calls every 0.1 s through two routers, one key (rpm 600,
    max_parallel 2) and keyless ones, each at a box for 0.05 s; a PostgreSQL restart at 1-2 s."""
    run = {"type": "run", "seed": 1, "routers": 2, "boxes": 1, "max_inflight": 2, "hold_s": 5.0,
           "queue_timeout_s": 15, "start": T0, "end": T0 + 10, "max_reservation": 60,
           "keys": {"team": {"id": KEY, "limits": {"rpm": 600, "max_parallel": 2, "budget_tokens": 10**6}}},
           "mutant": None}
    records, rows = [run, {"type": "fault", "kind": "pg_restart", "start": T0 + 1, "end": T0 + 2}], []
    for i in range(100):
        sent = T0 + i * 0.1
        call_id = f"rt-{i}"
        keyed = i % 2 == 0
        records.append({"type": "call", "router": f"r{i % 2}", "key": "team" if keyed else None, "stream": True,
                        "sent": sent, "status": 200, "call_id": call_id, "end": "done", "tokens": 30,
                        "answered": sent + 0.06})
        records.append({"type": "box_call", "box": "b0", "call_id": call_id, "start": sent + 0.005,
                        "end": sent + 0.055})
        rows.append({"request_id": call_id, "router": f"r{i % 2}", "key_id": KEY if keyed else None,
                     "http_status": 200, "state": "done", "error": None, "received_at": sent + 0.001,
                     "responded_at": sent + 0.06, "waited_ms": None, "box": "b0", "stream": 1,
                     "prompt_tokens": 20, "completion_tokens": 10})
    return records, rows


def findings(records, rows) -> list[str]:
    return faults_check.check(records, rows)["findings"]


def test_the_checker_passes_a_clean_history():
    assert findings(*history()) == []


def box_overloaded(records, rows):
    records.append({"type": "box_call", "box": "b0", "call_id": "x1", "start": T0 + 1.01, "end": T0 + 1.04})
    records.append({"type": "box_call", "box": "b0", "call_id": "x2", "start": T0 + 1.02, "end": T0 + 1.04})


def key_over_its_slots(records, rows):
    for n in range(2):
        rows.append({**rows[0], "request_id": f"p{n}"})
        records.append({"type": "box_call", "box": "b1", "call_id": f"p{n}", "start": T0 + 2.01, "end": T0 + 2.04})


def row_thrown_away(records, rows):
    del rows[10]


def charged_twice(records, rows):
    records.append(next(r for r in records if r.get("call_id") == "rt-3" and r["type"] == "call"))


def charged_nothing(records, rows):
    rows[4]["prompt_tokens"] = rows[4]["completion_tokens"] = 0


def stream_cut(records, rows):
    next(r for r in records if r.get("call_id") == "rt-7" and r["type"] == "call")["end"] = "cut"


def rpm_passed(records, rows):
    records[0]["keys"]["team"]["limits"]["rpm"] = 20


def budget_passed(records, rows):
    records[0]["keys"]["team"]["limits"]["budget_tokens"] = 1000


def slot_lost(records, rows):
    records.append({"type": "call", "router": "r0", "key": "team", "stream": False, "sent": T0 + 9.5, "status": 503,
                    "error": "queue_timeout", "answered": T0 + 23})


def nothing_after_a_fault(records, rows):
    for record in records:
        if record["type"] == "call" and record["sent"] > T0 + 1.9:
            record["status"] = 502


@pytest.mark.parametrize("broken, caught", [
    (box_overloaded, "boxes:"), (key_over_its_slots, "parallel:"), (row_thrown_away, "rows:"),
    (charged_twice, "charges:"), (charged_nothing, "charges:"), (stream_cut, "streams:"),
    (rpm_passed, "keys:"), (budget_passed, "budget:"), (slot_lost, "liveness:"), (nothing_after_a_fault, "liveness:"),
])
def test_the_checker_catches_each_invariant_broken(broken, caught):
    records, rows = copy.deepcopy(history())
    broken(records, rows)
    assert any(finding.startswith(caught) for finding in findings(records, rows)), findings(records, rows)


def test_a_kill_excuses_only_what_it_could_cost():
    """A row and a stream lost to a kill -9 of their router are counted, not found; the same
    loss on the router that was not killed is."""
    records, rows = copy.deepcopy(history())
    records.append({"type": "fault", "kind": "router_kill", "router": "r0", "start": T0 + 3.05, "end": T0 + 4})
    del rows[30]  # r0's, answered at 3.06: its router killed in its last flush
    next(r for r in records if r.get("call_id") == "rt-30" and r["type"] == "call")["end"] = "cut"
    verdict = faults_check.check(records, rows)
    assert verdict["ok"], verdict["findings"]
    assert verdict["figures"]["rows_lost_to_kills"] == 1
    del rows[30]  # r1's, answered at 3.16: no kill of r1
    assert any(f.startswith("rows:") for f in findings(records, rows))
