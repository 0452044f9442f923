"""Limits and leases under faults, Jepsen's way: three routers on one PostgreSQL and one
redis-server, four simulated boxes with `max_inflight`, keys with `rpm`, `tpm`, `max_parallel`
and a budget; concurrent clients send stream and non-stream calls, with and without keys,
through all three routers while a seeded schedule injects faults; every operation is recorded as
the clients and the boxes saw it, and bench/faults_check.py reads the history and the route log.

    .venv/bin/python bench/faults.py [--seconds 60 | --minutes N] [--seed S] [--out DIR]
        [--clients 12] [--mutant NAME]

Writes DIR/history.jsonl (one JSON object a line: the run's settings, each call, each box call,
each fault), DIR/route_log.jsonl (the routers' rows, from PostgreSQL), DIR/verdict.json (the
checker's) and DIR/calls.svg (calls a second per router, the faults marked). Prints the seed
first: the same seed replays the same schedule (the faults, their moments and targets; the
calls' interleaving is the machine's). Exits 1 when an invariant broke.

The faults, one at a time, each at a random moment (a gap of GAP_S), in a shuffled cycle so a
short run meets each kind: a router `kill -9` and restarted; a router SIGSTOPped past a hold's
life (HOLD_S + 2 s), then SIGCONTinued; redis-server restarted; redis-server SIGSTOPped 3 s;
PostgreSQL restarted; a box that dies mid-stream (its next streams cut after 2 frames); a box
that stops answering for 3 s (its loop held, as a SIGSTOP would). A router killed or paused gets
no new calls after BALANCER_CHECK_S, as behind a balancer's health check; the calls already sent
to it wait, as its clients would.

`--mutant NAME` runs the routers with one rule broken (bench/fault_mutants.py), to show the
checker catches it: `no_lease` (a box's lease is never asked), `drop_settle` (a key's settles
are thrown away), `no_hold_expiry` (a dead router's holds never expire), `drop_parked_rows`
(route-log rows held while the database is down are thrown away).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from engines import PostgresServer, RedisServer  # noqa: E402  (tests/engines.py)
import faults_check  # noqa: E402
from support.calls import request  # noqa: E402  (tests/support/calls.py)

from router.sim import SimFleet  # noqa: E402
from router.sim.behavior import Behavior  # noqa: E402
from router.sim.hugpy import SimBox  # noqa: E402
from router.fleetwide.tallies import HOLD_S  # noqa: E402

ROUTERS = 3
BOXES = 4
MAX_INFLIGHT = 3
MAX_TOKENS = 16  # every call's answer bound: a reservation is its prompt's estimate and this
GAP_S = (3.0, 8.0)
QUEUE_TIMEOUT_S = 15
BALANCER_CHECK_S = 1.0  # how soon the clients stop sending to a router killed or paused
# A quarter of the calls each (and a quarter keyless). "tpm" has one slot: a router killed while
# it holds it must give it back within a hold's life, or the key locks.
KEYS = {
    "rpm": {"rpm": 240},
    "tpm": {"tpm": 20000, "max_parallel": 1},
    "budget": {"budget_tokens": 6000, "max_parallel": 2},
}
FAULTS = ("router_kill", "router_pause", "redis_restart", "redis_stall", "pg_restart", "box_cut", "box_stall")
LISTENING_RE = re.compile(r"router listening on (http://\S+)")
MESSAGES = [{"role": "user", "content": "Say something short about the sea."}]


class Router:
    """One `router serve` process (or its mutant's), restartable under the same instance name."""

    def __init__(self, name: str, folder: Path, args: list[str], mutant: str | None) -> None:
        self.name, self.folder, self.args, self.mutant = name, folder, args, mutant
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.start()

    def start(self) -> None:
        entry = ([sys.executable, str(ROOT / "bench" / "fault_mutants.py"), self.mutant] if self.mutant
                 else [sys.executable, "-m", "router"])
        log = open(self.folder / "router.log", "a")
        self.proc = subprocess.Popen([*entry, "serve", "--port", "auto", *self.args], stdout=subprocess.PIPE,
                                     stderr=log, text=True, cwd=ROOT,
                                     env={**os.environ, "HUGPY_ROUTER_HOME": str(self.folder / "home")})
        line = self.proc.stdout.readline()
        match = LISTENING_RE.search(line)
        if match is None:
            raise RuntimeError(f"router {self.name} did not start: {line!r}")
        self.url = match.group(1)
        # its stdout is not read after the first line: drain it so it never blocks
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.folder = Path(tempfile.mkdtemp(prefix="router-faults-"))
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.stopping = threading.Event()
        self.offset = time.time() - time.monotonic()  # the boxes' monotonic times as epoch seconds
        self.unhealthy: dict[str, float] = {}  # router name -> since when it is killed or paused

    def record(self, doc: dict) -> None:
        with self.lock:
            self.records.append(doc)

    # -- set-up ------------------------------------------------------------------------------
    def start(self) -> None:
        self.pg = PostgresServer()
        self.redis = RedisServer()
        self.db_url = self.pg.database("router")
        self.boxes = [SimBox(f"b{i}", residents=["tiny"], chunks=8, cadence_s=0.02) for i in range(BOXES)]
        self.fleets = [SimFleet([box]) for box in self.boxes]  # a loop each: one can stall alone
        for fleet in self.fleets:
            fleet.start()
        self.routers = []
        for i in range(ROUTERS):
            folder = self.folder / f"r{i}"
            folder.mkdir()
            (folder / "boxes.json").write_text('{"boxes": []}')  # the boxes live in the database
            self.routers.append(Router(f"r{i}", folder, [
                "--boxes-file", str(folder / "boxes.json"), "--database-url", self.db_url,
                "--shared-url", self.redis.url, "--instance", f"r{i}",
                "--queue-timeout", str(QUEUE_TIMEOUT_S)], self.args.mutant))
        first = self.routers[0]
        for box in self.boxes:
            status, _, body = request(first, "POST", "/v1/boxes", {"name": box.name, "url": box.url, "kind": "hugpy",
                                                                    "max_inflight": MAX_INFLIGHT}, timeout=10)
            assert status == 201, body
        self.keys = {}
        for name, limits in KEYS.items():
            status, _, body = request(first, "POST", "/v1/keys", {"name": f"faults-{name}", "limits": limits},
                                      timeout=10)
            assert status == 201, body
            doc = json.loads(body)
            self.keys[name] = {"id": doc["id"], "secret": doc["key"], "limits": limits}
        deadline = time.monotonic() + 20
        while not all(self._ready(router) for router in self.routers):  # the database told every router
            if time.monotonic() > deadline:
                raise RuntimeError("the routers did not learn the boxes and keys")
            time.sleep(0.2)

    def _ready(self, router: Router) -> bool:
        try:
            status, _, body = request(router, "GET", "/v1/keys/usage", timeout=10)
            boxes = json.loads(request(router, "GET", "/v1/router/state", timeout=10)[2])["boxes"]
        except OSError:
            return False
        known = {k["id"] for k in json.loads(body)["keys"]} if status == 200 else set()
        return known >= {k["id"] for k in self.keys.values()} and len(boxes) >= BOXES

    # -- clients -----------------------------------------------------------------------------
    def client(self, number: int) -> None:
        rng = random.Random(self.args.seed * 1000 + number)  # its choices; the moments are the machine's
        while not self.stopping.is_set():
            # as a balancer's health check would: a router killed or paused for BALANCER_CHECK_S
            # gets no new calls (those already sent to it wait, as its clients would)
            now = time.time()
            healthy = [r for r in self.routers if now - self.unhealthy.get(r.name, now) < BALANCER_CHECK_S]
            router = rng.choice(healthy or self.routers)
            key = rng.choice([None, *self.keys])
            stream = rng.random() < 0.5
            self.record(self.one_call(router, key, stream))

    def one_call(self, router: Router, key: str | None, stream: bool) -> dict:
        doc = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS}
        if stream:
            doc.update(stream=True, stream_options={"include_usage": True})
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {self.keys[key]['secret']}"
        op = {"type": "call", "router": router.name, "key": key, "stream": stream, "sent": time.time()}
        host, port = router.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=QUEUE_TIMEOUT_S + 20)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(doc), headers=headers)
            resp = conn.getresponse()
            op["status"] = resp.status
            op["call_id"] = resp.getheader("x-hugpy-router-request-id")
            if stream and resp.status == 200:
                op["end"], op["tokens"] = read_stream(resp)
            else:
                body = json.loads(resp.read() or b"null") or {}
                usage = body.get("usage") or {}
                op["tokens"] = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
                if resp.status != 200 and isinstance(body.get("error"), dict):
                    op["error"] = body["error"].get("code")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            op.setdefault("status", None)
            op["failure"] = type(exc).__name__
            if stream and op.get("status") == 200:
                op["end"] = "cut"
        finally:
            conn.close()
        op["answered"] = time.time()
        return op

    # -- faults ------------------------------------------------------------------------------
    def faults(self, until: float) -> None:
        cycle: list[str] = []
        while True:
            gap = self.rng.uniform(*GAP_S)
            if time.time() + gap + 10 > until or self.stopping.wait(gap):
                return
            if not cycle:
                cycle = list(FAULTS)
                self.rng.shuffle(cycle)
            kind = cycle.pop()
            target = self.rng.randrange(ROUTERS if kind.startswith("router") else BOXES)
            event = {"type": "fault", "kind": kind, "start": time.time()}
            getattr(self, kind)(target, event)
            event["end"] = time.time()
            self.record(event)
            print(f"  {event['start'] - self.started:6.1f} s  {kind} {event.get('router') or event.get('box') or ''}",
                  flush=True)

    def router_kill(self, target: int, event: dict) -> None:
        router = self.routers[target]
        event["router"] = router.name
        self.unhealthy[router.name] = time.time()
        router.proc.kill()  # kill -9: nothing flushed, nothing given back
        router.proc.wait()
        time.sleep(1.5)
        router.start()
        del self.unhealthy[router.name]
        time.sleep(HOLD_S + 2)  # past the dead run's holds' life (and a renewal of every live router's)
        self.record_holds(event)

    def record_holds(self, after: dict) -> None:
        """Who holds something on each key's tally now, by the server's clock (live holds only),
        against the routers running (each names its holds' tag in its state): the checker's proof
        that a dead router's holds expired."""
        import redis

        alive = set()
        for router in self.routers:
            try:
                state = json.loads(request(router, "GET", "/v1/router/state", timeout=10)[2])
                alive.add(state["shared"]["tallies"]["tag"])
            except (OSError, KeyError, ValueError):
                return  # a router not answering: not this time, the next kill samples again
        client = redis.Redis.from_url(self.redis.url)
        try:
            seconds, micros = client.time()
            now_ms = seconds * 1000 + micros // 1000
            for name, key in self.keys.items():
                holds = json.loads(client.hget(f"hugpy-router:tally:key:{key['id']}", "h") or b"{}")
                dead = [tag for tag, hold in holds.items() if hold[2] > now_ms and tag not in alive]
                self.record({"type": "holds", "key": name, "at": time.time(), "after": after["kind"],
                             "dead_holders": len(dead)})
        except redis.RedisError:
            pass
        finally:
            client.close()

    def router_pause(self, target: int, event: dict) -> None:
        router = self.routers[target]
        event["router"] = router.name
        self.unhealthy[router.name] = time.time()
        router.proc.send_signal(signal.SIGSTOP)
        time.sleep(HOLD_S + 2)  # past a hold's (and a lease's) life: its holds expire meanwhile
        router.proc.send_signal(signal.SIGCONT)
        del self.unhealthy[router.name]

    def redis_restart(self, target: int, event: dict) -> None:
        self.redis.stop()
        time.sleep(0.5)
        self.redis.start()

    def redis_stall(self, target: int, event: dict) -> None:
        self.redis.proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        self.redis.proc.send_signal(signal.SIGCONT)

    def pg_restart(self, target: int, event: dict) -> None:
        self.pg.stop()
        time.sleep(1.0)
        self.pg.start()

    def box_cut(self, target: int, event: dict) -> None:
        box = self.boxes[target]
        event["box"] = box.name
        box.script("tiny", *[Behavior.die_after(2)] * 3)
        time.sleep(1.0)

    def box_stall(self, target: int, event: dict) -> None:
        event["box"] = self.boxes[target].name
        self.fleets[target].call_soon(time.sleep, 3.0)  # its loop held: it accepts, answers nothing
        time.sleep(3.0)

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> dict:
        self.started = time.time()
        until = self.started + self.args.seconds
        clients = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.args.clients)]
        for thread in clients:
            thread.start()
        faults = threading.Thread(target=self.faults, args=(until,), daemon=True)
        faults.start()
        while time.time() < until:
            time.sleep(0.2)
        self.stopping.set()
        faults.join()
        for thread in clients:
            thread.join(QUEUE_TIMEOUT_S + 30)
        end = time.time()
        for router in self.routers:
            router.stop()  # SIGTERM: every row flushed
            for window in shared_down_windows(router.folder / "router.log"):
                self.record({"type": "fault", "kind": "shared_down", "router": router.name, **window})
        for box in self.boxes:
            for call in list(box.calls):
                if call.path == "/v1/chat/completions":
                    self.record({"type": "box_call", "box": box.name, "call_id": call.parent_id,
                                 "start": call.started_at + self.offset,
                                 "end": (call.finished_at or time.monotonic()) + self.offset})
        self.record({"type": "run", "seed": self.args.seed, "routers": ROUTERS, "boxes": BOXES,
                     "max_inflight": MAX_INFLIGHT, "hold_s": HOLD_S, "queue_timeout_s": QUEUE_TIMEOUT_S, "start": self.started, "end": end,
                     "max_reservation": self.max_reservation(),
                     "keys": {name: {"id": k["id"], "limits": k["limits"]} for name, k in self.keys.items()},
                     "mutant": self.args.mutant})
        return self.route_log()

    def max_reservation(self) -> int:
        """One call's reservation: its prompt's estimate (the body's bytes / 4) and its bound."""
        body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": True,
                           "stream_options": {"include_usage": True}})
        return -(-len(body) // 4) + MAX_TOKENS

    def route_log(self) -> list[dict]:
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(self.db_url, row_factory=dict_row) as conn:
            return conn.execute(
                "SELECT request_id, router, key_id, http_status, state, error, received_at, responded_at,"
                " waited_ms, box, stream, prompt_tokens, completion_tokens FROM route_log").fetchall()

    def close(self) -> None:
        self.args.out.mkdir(parents=True, exist_ok=True)
        for router in getattr(self, "routers", []):
            router.stop()
            shutil.copy(router.folder / "router.log", self.args.out / f"{router.name}.log")
        for fleet in getattr(self, "fleets", []):
            fleet.stop()
        for engine in ("redis", "pg"):
            if hasattr(self, engine):
                server = getattr(self, engine)
                server.proc.send_signal(signal.SIGCONT)
                server.close() if hasattr(server, "close") else server.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


DOWN_RE = re.compile(r"^(\S+ \S+) WARNING router.shared: shared server \S+ is (DOWN|up)")


def shared_down_windows(log: Path) -> list[dict]:
    """When a router saw the shared server down (its own warning lines, fleetwide/wire.py rule 4):
    an injected fault, or a round trip past its deadline on a loaded machine. Its counts are
    alone then, whatever the cause, so the checker gives those moments the outage's bound."""
    windows, down = [], None
    for line in log.read_text(errors="replace").splitlines():
        match = DOWN_RE.match(line)
        if match is None:
            continue
        moment = time.mktime(time.strptime(match.group(1).split(",")[0], "%Y-%m-%d %H:%M:%S"))
        moment += int(match.group(1).split(",")[1]) / 1000
        if match.group(2) == "DOWN":
            down = down if down is not None else moment
        elif down is not None:
            windows.append({"start": down, "end": moment})
            down = None
    if down is not None:
        windows.append({"start": down, "end": time.time()})
    return windows


def read_stream(resp) -> tuple[str, int]:
    """How a stream ended ([DONE]: done; an in-band error frame: error; else cut) and the tokens
    its usage frame reported."""
    tokens, end = 0, "cut"
    for line in resp:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return "done" if end == "cut" else end, tokens
        frame = json.loads(data)
        if "error" in frame:
            end = "error"
        usage = frame.get("usage") or {}
        tokens = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0) or tokens
    return end, tokens


def plot(history: list[dict], path: Path) -> None:
    """Calls a second per router (answered 200), the faults marked: a plain SVG."""
    run = next(r for r in history if r["type"] == "run")
    start, seconds = run["start"], max(1, int(run["end"] - run["start"]) + 1)
    per: dict[str, list[int]] = {}
    for call in history:
        if call["type"] == "call" and call.get("status") == 200:
            per.setdefault(call["router"], [0] * seconds)[min(seconds - 1, int(call["answered"] - start))] += 1
    top = max((max(counts) for counts in per.values()), default=1) or 1
    width, height = 900, 300
    x = lambda s: 40 + s * (width - 60) / seconds  # noqa: E731
    y = lambda n: height - 30 - n * (height - 60) / top  # noqa: E731
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>']
    for fault in (r for r in history if r["type"] == "fault"):
        a, b = x(fault["start"] - start), x(fault["end"] - start)
        if fault["kind"] == "shared_down":  # a router's own view of an outage: shaded, not named
            parts.append(f'<rect x="{a:.1f}" y="20" width="{max(b - a, 1):.1f}" height="{height - 50}" '
                         f'fill="#f6f0e0"/>')
            continue
        parts.append(f'<rect x="{a:.1f}" y="20" width="{max(b - a, 1):.1f}" height="{height - 50}" fill="#e4e4e4"/>'
                     f'<text x="{a:.1f}" y="15">{fault["kind"]}</text>')
    for (name, counts), color in zip(sorted(per.items()), colors):
        points = " ".join(f"{x(s + 0.5):.1f},{y(n):.1f}" for s, n in enumerate(counts))
        parts.append(f'<polyline fill="none" stroke="{color}" points="{points}"/>'
                     f'<text x="{width - 55}" y="{40 + 14 * colors.index(color)}" fill="{color}">{name}</text>')
    parts.append(f'<text x="40" y="{height - 8}">0 s</text><text x="{width - 60}" y="{height - 8}">{seconds} s</text>'
                 f'<text x="4" y="{y(top) + 4:.1f}">{top}/s</text></svg>')
    path.write_text("".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--minutes", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tmp" / "faults")
    parser.add_argument("--mutant", default=None,
                        choices=("no_lease", "drop_settle", "no_hold_expiry", "drop_parked_rows"))
    args = parser.parse_args(argv)
    if args.minutes is not None:
        args.seconds = args.minutes * 60
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 10**6)
    print(f"seed {args.seed}: {args.seconds:g} s, {ROUTERS} routers, {BOXES} boxes, {args.clients} clients"
          + (f", mutant {args.mutant}" if args.mutant else ""), flush=True)
    run = Run(args)
    try:
        run.start()
        rows = run.run()
    finally:
        run.close()
    args.out.mkdir(parents=True, exist_ok=True)
    history = sorted(run.records, key=lambda r: r.get("sent", r.get("start", 0.0)))
    (args.out / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    (args.out / "route_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot(history, args.out / "calls.svg")
    return faults_check.main([str(args.out)])


if __name__ == "__main__":
    sys.exit(main())
