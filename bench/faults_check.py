"""The checker of bench/faults.py: reads a run's history (one JSON object a line: the clients'
calls, the boxes' calls, the faults, the run's settings) and its route log, and says which
invariants held (docs/several-routers.md, "What is proven").

    .venv/bin/python bench/faults_check.py RUN_DIR     # history.jsonl, route_log.jsonl -> verdict

Pure: it reads records and returns findings, so tests/test_faults_run.py breaks each invariant in
a recorded history on purpose and sees it caught. Times are epoch seconds.

The invariants, each with the bound the docs state (N routers):
1. keys: a key's rpm bucket, replayed over the calls it admitted (route-log rows not answered 429
   or 403), never holds more than rpm + 1; tpm likewise over the tokens charged, past tpm by at
   most one call's reservation. Within a shared fault (the shared server restarted or stalled, a
   router paused past a hold's life) and the minute after it, N times that. A restart of the
   shared server empties the replayed buckets: its new run starts the windows from the copy the
   first router to write there saw (docs: what it forgets), at worst empty, and the
   routers' draws from then on are all it counts.
2. budget: the tokens charged to a budget key never pass the budget by more than one call's
   reservation per router, and the tokens of the calls a router killed before then had in
   flight or answered in its last ROW_LOSS_S (their settles died with it); N times the budget
   where a shared fault came before it ran out.
3. parallel: a key's calls at the boxes at once (as the boxes saw them, which is inside the
   key's slots) never pass max_parallel (N times it in a shared fault, the paused router's holds
   having expired while its calls ran).
4. boxes: a box's calls at once, as the box saw them, never pass its max_inflight (N times it in
   a shared fault).
5. rows: every call a client saw answered with a call id has a route-log row, except those its
   router answered in its last ROW_LOSS_S before a kill -9 (counted and stated).
6. charges: no call id twice, and no call whose client saw tokens charged 0.
7. streams: every stream answered 200 ends with [DONE] or an in-band error frame, except those
   cut by a kill of their router (the client sees a reset).
8. liveness: after each fault ends, a call is served within LIVENESS_S; no call waits out the
   queue's timeout but in a fault (a slot or a settle lost locks a key, and its calls then
   time out); no key with calls sent is answered nothing (served, or refused by its limits) for
   KEY_STALL_S while it has budget; a
   hold's life after a router's kill, no router but those running holds anything on a key's
   tally (the run samples the server's live holds and the routers' tags then).
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

# shared_down: a router's own view of the server down (its warning lines), injected or not
SHARED_FAULTS = ("redis_restart", "redis_stall", "router_pause", "shared_down")
ROW_LOSS_S = 1.0  # a kill -9 loses the rows its router answered in its last flush (docs: ~0.25 s)
LIVENESS_S = 10.0
KEY_STALL_S = 20.0
AFTER_SHARED_FAULT_S = 60.0  # a bucket passed in an outage stays passed for a window's length
WINDOW_S = 60.0
# the route log's received_at is a little before the admission (the body read, a round trip):
# a bucket replayed at it may run this far ahead of the router's own
TIMING_SLACK_S = 0.5
LIMITED = (429, 403)


def load(run_dir: Path) -> tuple[list[dict], list[dict]]:
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line]
    rows = [json.loads(line) for line in (run_dir / "route_log.jsonl").read_text().splitlines() if line]
    return history, rows


def _windows(faults: list[dict], kinds: tuple[str, ...], after: float) -> list[tuple[float, float]]:
    return [(f["start"], f["end"] + after) for f in faults if f["kind"] in kinds]


def _inside(moment: float, windows: list[tuple[float, float]]) -> bool:
    return any(start <= moment <= end for start, end in windows)


def _most_at_once(spans: list[tuple[float, float]]) -> list[tuple[float, int]]:
    """(moment, count) at each start where the count of overlapping spans rises."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    level, peaks = 0, []
    for moment, step in edges:
        level += step
        if step > 0:
            peaks.append((moment, level))
    return peaks


def check(history: list[dict], rows: list[dict]) -> dict:
    """{"ok": bool, "findings": [...], "figures": {...}} for one run."""
    settings = next(r for r in history if r["type"] == "run")
    calls = [r for r in history if r["type"] == "call"]
    box_calls = [r for r in history if r["type"] == "box_call"]
    faults = [r for r in history if r["type"] == "fault"]
    routers = settings["routers"]
    shared = _windows(faults, SHARED_FAULTS, settings["hold_s"] + 1.0)
    shared_minute = _windows(faults, SHARED_FAULTS, AFTER_SHARED_FAULT_S)
    kills = [f for f in faults if f["kind"] == "router_kill"]
    restarted = sorted(f["start"] for f in faults if f["kind"] == "redis_restart")
    findings: list[str] = []
    figures: dict = {"calls": len(calls), "faults": Counter(f["kind"] for f in faults), "worst": {}}
    rows_by_id = {row["request_id"]: row for row in rows}
    keys = settings["keys"]

    def worst(name: str, seen: float, bound: float) -> None:
        figures["worst"][name] = max(figures["worst"].get(name, 0.0), round(seen / bound, 3))

    def at_once(invariant: str, name: str, spans: list[tuple[float, float]], limit: int) -> None:
        """Calls at once within `limit`, N times it in a shared fault (invariants 3 and 4)."""
        for moment, level in _most_at_once(spans):
            bound = limit * (routers if _inside(moment, shared) else 1)
            worst(f"{invariant}.{name}", level, bound)
            if level > bound:
                findings.append(f"{invariant}: {name} had {level} calls at once at {moment:.3f} (bound {bound})")
                return

    # 1-3. keys
    key_rows: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row.get("key_id") is not None:
            key_rows[row["key_id"]].append(row)
    for name, key in keys.items():
        limits, mine = key["limits"], sorted(key_rows.get(key["id"], []), key=lambda r: r["received_at"])
        admitted = [r for r in mine if r.get("http_status") not in LIMITED]
        charged = [(r["received_at"], (r.get("prompt_tokens") or 0) + (r.get("completion_tokens") or 0))
                   for r in admitted]
        reservation = settings["max_reservation"]
        for limit, amounts, slack in (("rpm", [(t, 1) for t, _ in charged], 1), ("tpm", charged, reservation)):
            if limits.get(limit) is None:
                continue
            rate, level, last = limits[limit], 0.0, None
            restarts = iter(restarted)
            forget = next(restarts, None)
            for moment, amount in amounts:
                while forget is not None and forget <= moment:  # the server's new run forgot them
                    level, forget = 0.0, next(restarts, None)
                if last is not None:
                    level = max(0.0, level - (moment - last) * rate / WINDOW_S)
                level, last = level + amount, moment
                bound = rate + slack + rate * TIMING_SLACK_S / WINDOW_S
                if _inside(moment, shared_minute):
                    bound *= routers
                worst(f"{name}.{limit}", level, bound)
                if level > bound:
                    findings.append(f"keys: {name}'s {limit} bucket held {level:.1f} at {moment:.3f} (bound {bound})")
                    break
        if limits.get("budget_tokens") is not None:
            spent = sum(tokens for _, tokens in charged)
            ran_out = next((r["received_at"] for r in mine if r.get("error") == "budget_exceeded"), None)
            bound = limits["budget_tokens"] + routers * reservation
            if any(start <= (ran_out or settings["end"]) for start, _ in shared):  # spent alone, in part
                bound = routers * limits["budget_tokens"]
            # a router killed before then took its calls' settles with it: their tokens (those
            # it had in flight, or answered in its last flush) reached no tally
            bound += sum(call.get("tokens") or reservation for kill in kills
                         if kill["start"] <= (ran_out or settings["end"])
                         for call in calls if call.get("key") == name and call["router"] == kill["router"]
                         and call["sent"] <= kill["start"] <= (call.get("answered") or call["sent"]) + ROW_LOSS_S)
            worst(f"{name}.budget", spent, bound)
            if spent > bound:
                findings.append(f"budget: {name} charged {spent} tokens (bound {bound})")
        if limits.get("max_parallel") is not None:  # its calls as the boxes saw them: inside its slots
            spans = [(b["start"], b["end"]) for b in box_calls
                     if b.get("call_id") in rows_by_id and rows_by_id[b["call_id"]].get("key_id") == key["id"]]
            at_once("parallel", name, spans, limits["max_parallel"])

    # 4. boxes
    by_box: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for record in box_calls:
        by_box[record["box"]].append((record["start"], record["end"]))
    for box, spans in sorted(by_box.items()):
        at_once("boxes", box, spans, settings["max_inflight"])

    def killed_near(call: dict, after: float) -> bool:
        """Its router was killed while it ran, or within `after` of its answer."""
        end = call.get("answered") or call["sent"]
        return any(k["router"] == call["router"] and call["sent"] <= k["start"] <= end + after for k in kills)

    # 5. rows
    missing = excused = 0
    for call in calls:
        if call.get("call_id") and call.get("status") is not None and call["call_id"] not in rows_by_id:
            if killed_near(call, ROW_LOSS_S):
                excused += 1
            else:
                missing += 1
    figures["rows_lost_to_kills"] = excused
    if missing:
        findings.append(f"rows: {missing} answered calls have no route-log row")

    # 6. charges
    ids = Counter(call["call_id"] for call in calls if call.get("call_id"))
    twice = [i for i, n in ids.items() if n > 1]
    if twice:
        findings.append(f"charges: {len(twice)} call ids seen twice")
    uncharged = [call["call_id"] for call in calls
                 if call.get("tokens") and call.get("key") and call.get("call_id") in rows_by_id
                 and not ((rows_by_id[call["call_id"]].get("prompt_tokens") or 0)
                          + (rows_by_id[call["call_id"]].get("completion_tokens") or 0))]
    if uncharged:
        findings.append(f"charges: {len(uncharged)} calls that produced tokens were charged 0")

    # 7. streams
    cut = [call for call in calls if call["stream"] and call.get("status") == 200 and call.get("end") == "cut"]
    unexcused = [call for call in cut if not killed_near(call, 0.0)]
    figures["streams_cut_by_kills"] = len(cut) - len(unexcused)
    if unexcused:
        findings.append(f"streams: {len(unexcused)} streams cut silently")

    # 8. liveness
    served = sorted(call["answered"] for call in calls if call.get("status") == 200)
    recoveries = []
    for fault in faults:
        after = next((moment for moment in served if moment >= fault["end"]), None)
        if after is None or after - fault["end"] > LIVENESS_S:
            findings.append(f"liveness: nothing served within {LIVENESS_S:g} s after {fault['kind']} ended at "
                            f"{fault['end']:.3f}")
        else:
            recoveries.append(round(after - fault["end"], 3))
    figures["recovery_s_max"] = max(recoveries, default=0.0)
    stale = [h for h in history if h["type"] == "holds" and h["dead_holders"]]
    if stale:
        findings.append(f"liveness: a dead router's holds outlived their life ({len(stale)} samples, the first on key "
                        f"{stale[0]['key']})")
    any_fault = _windows(faults, tuple({f["kind"] for f in faults}), settings["hold_s"] + 2.0)
    timed_out = [c for c in calls if c.get("error") == "queue_timeout"
                 and not any(start - settings["queue_timeout_s"] <= c["sent"] <= end for start, end in any_fault)]
    if timed_out:
        findings.append(f"liveness: {len(timed_out)} calls waited out the queue's timeout outside any fault")
    end = settings["end"]
    for name, key in keys.items():
        mine = sorted((c for c in calls if c.get("key") == name), key=lambda c: c["sent"])
        out_of_budget = next((c["sent"] for c in mine if c.get("error") == "budget_exceeded"), end)
        last = settings["start"]
        for call in mine:
            if call["sent"] >= out_of_budget:
                break
            if call.get("status") in (200, *LIMITED):  # answered: served, or refused at once by its limits
                last = call["answered"]
            elif call["sent"] - last > KEY_STALL_S:
                findings.append(f"liveness: key {name} served nothing from {last:.3f} to {call['sent']:.3f}")
                break
    figures["faults"] = dict(figures["faults"])
    return {"ok": not findings, "findings": findings, "figures": figures}


def main(argv: list[str]) -> int:
    run_dir = Path(argv[0])
    verdict = check(*load(run_dir))
    (run_dir / "verdict.json").write_text(json.dumps(verdict, indent=1))
    print(json.dumps(verdict, indent=1))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
