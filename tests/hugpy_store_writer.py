"""A stand-in for hugpy-wrapper's store writer (a helper process for tests, not a test).

Usage: python tests/hugpy_store_writer.py STORE WORKER

Creates STORE with the columns of contracts/hugpy-wrapper.md §2.3 for `residents` (sensor
columns included), `models`, `gpu_state` and `host_state`, plus a `call_log`-like table for
noise, in WAL mode with `synchronous=NORMAL` through the stdlib `sqlite3` module, as the box
does (§3.1). It then reads commands, one per stdin line, and answers each on stdout:

  resident KEY [STATE]   insert or replace a seat (STATE idle|serving|loading|error|dead)
  busy KEY 0|1           flip a seat's busy flag (and its state serving/idle), as a call does
  model KEY              add a catalog row
  gpu FREE_BYTES         rewrite card 0 with this much free memory
  used KEY               set a seat's last_used to now and nothing else (a call ended while
                         another kept the seat busy: a silent sensor write on the box)
  call                   one call_log row (an event the router does not read)
  pair KEY JSON          write a `pair_settings` row (KEY `*` is the blanket), as a settings
                         POST does; the other worker gets a `blocked` row for KEY at the same time
  sensor HZ SECONDS      sensor-only rewrites at HZ for SECONDS: every seat's vram_bytes,
                         ram_bytes, cpu_ms and observed_at, card 0's `at` and `changes`, the
                         host row's mem_available (the box's 250 ms watch on an idle box, so
                         last_used stays as it is)
  quit                   close and exit

Every commit prints `commit <n> <CLOCK_MONOTONIC seconds>` right after it returns (monotonic
time is system-wide, so a reader in another process can measure visibility latency); a
command prints `ok` when it is done. Every row carries `worker = WORKER`, and a second worker's
rows are always present, as in a store shared by two wrappers, so a reader must filter.
"""

from __future__ import annotations

import sqlite3
import sys
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS residents (
  worker TEXT NOT NULL, key TEXT NOT NULL, pid INTEGER, port INTEGER, endpoint TEXT,
  state TEXT, alive INTEGER, healthy INTEGER, busy INTEGER, loading INTEGER, load_error TEXT,
  vram_bytes INTEGER, ram_bytes INTEGER, device INTEGER, n_gpu_layers INTEGER,
  total_layers INTEGER, n_cpu_moe INTEGER, ctx INTEGER, is_moe INTEGER, quant TEXT,
  model_file TEXT, resident_since REAL, weights_loaded_at REAL, last_used REAL, calls INTEGER,
  engine TEXT, runner TEXT, observed_at REAL, cpu_set TEXT, threads INTEGER, cpu_ms REAL,
  PRIMARY KEY (worker, key));
CREATE TABLE IF NOT EXISTS models (
  worker TEXT NOT NULL, key TEXT NOT NULL, path TEXT, model_dir TEXT, quant TEXT, bytes INTEGER,
  files TEXT, engine TEXT DEFAULT 'gguf', runner TEXT, seen_at REAL,
  PRIMARY KEY (worker, key));
CREATE TABLE IF NOT EXISTS gpu_state (
  worker TEXT NOT NULL, device INTEGER NOT NULL, uuid TEXT, name TEXT, total INTEGER,
  reserved INTEGER, used INTEGER, free INTEGER, processes TEXT, process_models TEXT,
  hugpy_pids TEXT, probe_pids TEXT, reason TEXT, changes INTEGER, at REAL,
  PRIMARY KEY (worker, device));
CREATE TABLE IF NOT EXISTS host_state (
  worker TEXT PRIMARY KEY, mem_total INTEGER, mem_available INTEGER, swap_total INTEGER,
  swap_free INTEGER, hugpy_ram TEXT, reason TEXT, changes INTEGER, at REAL);
CREATE TABLE IF NOT EXISTS pair_settings (
  worker TEXT NOT NULL, model_key TEXT NOT NULL, settings TEXT NOT NULL DEFAULT '{}',
  env_profile TEXT, updated_at REAL, PRIMARY KEY (worker, model_key));
CREATE TABLE IF NOT EXISTS call_log (
  id INTEGER PRIMARY KEY AUTOINCREMENT, worker TEXT, request_id TEXT, model TEXT,
  call_state TEXT, received_at REAL, done_at REAL);
"""
GPU_TOTAL_BYTES = 150_754_820_096  # one H200, as in the contract's gpu_state example
OTHER_WORKER = "other-box"  # the rows a reader filtering by worker must never see
GPU_ROW_SQL = (
    "INSERT OR REPLACE INTO gpu_state VALUES (?, 0, 'GPU-test', 'NVIDIA H200', ?, 0, ?, ?,"
    " '{}', '{}', '[]', '[]', 'loaded', 0, ?)"
)


class Writer:
    def __init__(self, path: str, worker: str) -> None:
        self.worker = worker
        self.commits = 0
        self.sensor_ticks = 0
        # The box's connection: autocommit, 10 s busy timeout, WAL, synchronous=NORMAL (§3.1).
        self.conn = sqlite3.connect(path, timeout=10, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.executescript(SCHEMA)
        now = time.time()
        self.transaction(
            *[("INSERT OR IGNORE INTO host_state VALUES (?, 270000000000, 200000000000, 0, 0, '{}',"
               " 'watch', 0, ?)", (name, now)) for name in (worker, OTHER_WORKER)],
            ("INSERT OR REPLACE INTO models (worker, key, runner, seen_at)"
             " VALUES (?, 'not-ours', 'llama', ?)", (OTHER_WORKER, now)),
            (GPU_ROW_SQL, (OTHER_WORKER, GPU_TOTAL_BYTES, 0, GPU_TOTAL_BYTES, now)),
        )

    def transaction(self, *steps: tuple[str, tuple]) -> None:
        """`BEGIN IMMEDIATE`, the statements, `COMMIT`: the box's `Store.transaction()`."""
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            for sql, params in steps:
                self.conn.execute(sql, params)

    def commit(self, *steps: tuple[str, tuple]) -> None:
        """One transaction, then the commit line with the monotonic time it returned at."""
        self.transaction(*steps)
        done = time.clock_gettime(time.CLOCK_MONOTONIC)
        self.commits += 1
        print(f"commit {self.commits} {done:.6f}", flush=True)

    def resident(self, key: str, state: str = "idle") -> None:
        now = time.time()
        loaded = state in ("idle", "serving")
        self.commit((
            "INSERT OR REPLACE INTO residents (worker, key, pid, port, endpoint, state, alive, healthy,"
            " busy, loading, load_error, vram_bytes, ram_bytes, device, n_gpu_layers, total_layers, ctx,"
            " is_moe, quant, resident_since, weights_loaded_at, last_used, calls, engine, runner,"
            " observed_at, threads, cpu_ms)"
            " VALUES (?, ?, 4242, 8205, 'http://127.0.0.1:8205', ?, ?, ?, ?, ?, ?, 0, 40833024, 0, -1,"
            " 2, 1024, 0, ?, ?, ?, ?, 0, 'gguf', 'llama', ?, 1, 0.0)",
            (self.worker, key, state, int(state not in ("dead", "error")), int(loaded),
             int(state == "serving"), int(state == "loading"),
             "load failed" if state == "error" else None, f"{key}-F16.gguf", now,
             now if loaded else None, now, now),
        ))

    def busy(self, key: str, busy: str) -> None:
        now = time.time()
        self.commit((
            "UPDATE residents SET busy = ?, state = ?, last_used = ?, observed_at = ?"
            " WHERE worker = ? AND key = ?",
            (int(busy), "serving" if int(busy) else "idle", now, now, self.worker, key),
        ))

    def used(self, key: str) -> None:
        self.commit(("UPDATE residents SET last_used = ? WHERE worker = ? AND key = ?",
                     (time.time(), self.worker, key)))

    def model(self, key: str) -> None:
        self.commit((
            "INSERT OR REPLACE INTO models (worker, key, path, quant, bytes, files, runner, seen_at)"
            " VALUES (?, ?, ?, 'f16', 9082400, '[]', 'llama', ?)",
            (self.worker, key, f"/models/{key}/{key}-F16.gguf", time.time()),
        ))

    def gpu(self, free: str) -> None:
        self.commit((GPU_ROW_SQL, (self.worker, GPU_TOTAL_BYTES, GPU_TOTAL_BYTES - int(free), int(free),
                                   time.time())))

    def pair(self, key: str, settings: str) -> None:
        now = time.time()
        sql = "INSERT OR REPLACE INTO pair_settings (worker, model_key, settings, updated_at) VALUES (?, ?, ?, ?)"
        self.commit((sql, (self.worker, key, settings, now)),
                    (sql, (OTHER_WORKER, key, '{"blocked": true}', now)))

    def call(self) -> None:
        self.commit((
            "INSERT INTO call_log (worker, request_id, model, call_state, received_at)"
            " VALUES (?, ?, 'tiny', 'pending', ?)",
            (self.worker, f"fe-{self.commits:08x}", time.time()),
        ))

    def sensor(self, hz: str, seconds: str) -> None:
        """Sensor-only rewrites, each its own commit, paced on the monotonic clock."""
        period = 1.0 / float(hz)
        start = time.monotonic()
        for tick in range(round(float(hz) * float(seconds))):
            time.sleep(max(0.0, start + tick * period - time.monotonic()))
            self.sensor_ticks += 1
            n, now = self.sensor_ticks, time.time()
            self.commit(
                ("UPDATE residents SET vram_bytes = ?, ram_bytes = ?, cpu_ms = ?, observed_at = ?"
                 " WHERE worker = ?", (1000 + n, 40833024 + n, 5680.0 + n, now, self.worker)),
                ("UPDATE gpu_state SET at = ?, changes = changes + 1, reason = 'watch' WHERE worker = ?",
                 (now, self.worker)),
                ("UPDATE host_state SET mem_available = ?, at = ? WHERE worker = ?",
                 (200000000000 - n, now, self.worker)),
            )


COMMANDS = {
    name: getattr(Writer, name) for name in ("resident", "busy", "used", "model", "gpu", "call", "sensor", "pair")
}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    writer = Writer(argv[1], argv[2])
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        COMMANDS[words[0]](writer, *words[1:])
        print("ok", flush=True)
    writer.conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
