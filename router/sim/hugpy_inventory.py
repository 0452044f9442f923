"""The simulated hugpy box's inventory: its catalog, its seats (a model resident under some
settings) and the rows that report them (contracts/hugpy-wrapper.md §2.3, §11.2.7).

Rules:
1. `catalog` is every model key the box can load; `residents[key]` is the seat of a loaded (or
   loading, or failed) model: `settings`, `contract`, `busy`, `state`, `last_used`, `since`,
   `calls`, and `load_error` once it failed. The test thread may edit both (rule 3 of
   `router.sim.hugpy`).
2. A seat's `state` is loading → serving ↔ idle, or error. A call takes a seat (busy + 1) and
   needs a load when the model is not resident, is resident under another load contract (§5:
   reloaded), or is loading or failed; it releases it when it ends, whatever happened (an
   interrupted load still completes on the box). Every take and release moves `changes`.
3. Sizes, pids and paths are plausible and stable per key, not measured: MODEL_BYTES per
   model, one H200, a GGUF file per model with the QUANT_LABEL quant (`model_path`).
4. `snapshot()` is the trimmed `/v1/telemetry/state` body: every row carries `worker`;
   `/residents` gives the same seat rows with booleans; `/v1/models` lists the catalog.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

from router.sim.connection import Connection, Exchange
from router.sim.wire import json_body as _json

# What a seat looks like in `residents` rows (sizes are plausible, not measured).
MODEL_BYTES = 4_920_000_000
GPU_TOTAL_BYTES = 150_754_820_096  # one H200, as in the contract's constructed gpu_state row
CTX_DEFAULT = 4096
CTX_BY_PRESET = {"ctx-low": 2048, "ctx-medium": 8192, "ctx-high": 32768, "ctx-xhigh": 65536, "ctx-max": 65536}
LOAD_ERROR_TEXT = "child exited rc=1: exiting due to model loading error"
QUANT_LABEL = "q4_k_m"  # every simulated model has one GGUF file with this quant


def model_path(key: str) -> str:
    """The GGUF file of `key` (rule 3): what llama-server names as its `model`."""
    return f"/models/gguf/sim/{key}/{key}-{QUANT_LABEL.upper()}.gguf"


class Inventory:
    """Mixed into SimBox: its seats and what reports them."""

    def snapshot(self) -> dict[str, Any]:
        """The trimmed `/v1/telemetry/state` body (§2.3): every row carries `worker`."""
        now = time.time()
        worker = self.name
        gpu = []
        if self.free_gpu_bytes is not None:
            total = max(GPU_TOTAL_BYTES, self.free_gpu_bytes)
            gpu.append({"worker": worker, "device": 0, "uuid": f"GPU-sim-{worker}", "name": "NVIDIA H200",
                        "total": total, "reserved": 0, "used": total - self.free_gpu_bytes,
                        "free": self.free_gpu_bytes, "processes": {}, "process_models": {},
                        "hugpy_pids": [], "probe_pids": [], "reason": "watch", "changes": self.changes,
                        "at": now})
        return {
            "gpu_state": gpu,
            "host_state": [{"worker": worker, "mem_total": 270_000_000_000, "mem_available": 200_000_000_000,
                            "swap_total": 0, "swap_free": 0, "hugpy_ram": {}, "reason": "watch",
                            "changes": self.changes, "at": now}],
            "residents": [self._resident_row(k, seat, now) for k, seat in sorted(list(self.residents.items()))],
            "models": [self._model_row(k) for k in sorted(self.catalog)],
            "cpu_state": [{"worker": worker, "cpus": 16, "physical_cores": 8, "mode": "affinity", "cpuset": 0,
                           "busy": {}, "hugpy_cpus": {}, "free_cores": 8, "reserved_cores": [],
                           "pressure_some": 0.0, "reason": "watch", "changes": self.changes, "at": now,
                           "reclaimable_cores": 0, "busy_held_cores": 0, "obtainable_cores": 8}],
            "pair_settings": self.pair_rows(),
            "store_id": self.store_id,
            "changes": self.changes,
            "data_service": {"protocol": "hugpy-wrapper-data", "version": 1, "authority": "wrapper",
                             "backend": "sqlite", "store_id": self.store_id, "schema_version": 37,
                             "paths": {"state": "/v1/telemetry/state", "log": "/v1/telemetry"},
                             "settings_confirmation": "write-then-read"},
        }

    # -- seats (rule 2) ----------------------------------------------------------------------

    def _take_seat(self, base: str, settings: str | None, knobs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Marks the seat busy. Returns (seat, needs a load): a load when the model is not
        resident, is resident under other settings (§5: reloaded), or is loading/errored."""
        now = time.time()
        seat = self.residents.get(base)
        contract = self.seat_contract(base, settings, knobs)
        if seat is None or seat.get("contract", self.seat_contract(base, seat.get("settings"))) != contract:
            seat = {"settings": settings, "contract": contract, "busy": 0, "state": "loading", "last_used": now,
                    "since": now}
            self.residents[base] = seat
        loading = seat.get("state") in ("loading", "error")
        seat["busy"] = seat.get("busy", 0) + 1
        seat["state"] = "loading" if loading else "serving"
        self._bump()
        return seat, loading

    def _release_seat(self, base: str, seat: dict[str, Any]) -> None:
        seat["busy"] = max(seat.get("busy", 1) - 1, 0)
        seat["last_used"] = time.time()
        seat["calls"] = seat.get("calls", 0) + 1
        # An interrupted load still completes on the box (the engine does not see the client).
        if seat["busy"] == 0 and seat.get("state") != "error":
            seat["state"] = "idle"
        if self.residents.get(base) is seat:
            self._bump()

    # -- rows and routes (rules 3, 4) -----------------------------------------------------------

    def _model_row(self, key: str) -> dict[str, Any]:
        path = model_path(key)
        file = path.rsplit("/", 1)[1]
        return {"worker": self.name, "key": key, "path": path, "model_dir": path.rsplit("/", 1)[0],
                "quant": QUANT_LABEL, "bytes": MODEL_BYTES,
                "files": [{"file": file, "path": path, "quant": QUANT_LABEL, "bytes": MODEL_BYTES,
                           "mmproj": False, "elected": True, "variant": file, "variant_bytes": MODEL_BYTES,
                           "complete": True}],
                "engine": "gguf", "runner": "llama", "seen_at": 0.0}

    def _resident_row(self, key: str, seat: dict[str, Any], now: float) -> dict[str, Any]:
        state = seat.get("state", "idle")
        tokens = set((seat.get("settings") or "").split("+"))
        loaded = state in ("idle", "serving")
        fake_pid = 10_000 + zlib.crc32(key.encode()) % 50_000
        since = seat.get("since", seat.get("last_used"))
        path = model_path(key)
        return {
            "worker": self.name, "key": key, "pid": fake_pid, "port": fake_pid,
            "state": state, "alive": int(state != "error"), "healthy": int(loaded),
            "busy": int(seat.get("busy", 0) > 0 or state == "serving"), "loading": int(state == "loading"),
            "load_error": seat.get("load_error") or (LOAD_ERROR_TEXT if state == "error" else None),
            "vram_bytes": 0 if "ram-only" in tokens else MODEL_BYTES, "ram_bytes": 500_000_000,
            "device": 0, "n_gpu_layers": 0 if "ram-only" in tokens else -1, "total_layers": 32,
            "n_cpu_moe": None,
            "ctx": next((CTX_BY_PRESET[t] for t in sorted(tokens) if t in CTX_BY_PRESET), CTX_DEFAULT),
            "is_moe": 0, "quant": path.rsplit("/", 1)[1], "model_file": path,
            "endpoint": f"http://127.0.0.1:{fake_pid}", "resident_since": since,
            "weights_loaded_at": since if loaded else None, "last_used": seat.get("last_used"),
            "calls": seat.get("calls", 0), "engine": "gguf", "runner": "llama", "observed_at": now,
            "cpu_set": None, "threads": 1, "cpu_ms": 0.0,
        }

    def _list_models(self, conn: Connection, ex: Exchange) -> None:
        if self._turned_away(conn, ex, admin=False):
            return
        data = [{"id": k, "object": "model", "owned_by": "hugpy"} for k in sorted(self.catalog)]
        conn.respond(ex, 200, _json({"object": "list", "data": data}))

    def _list_residents(self, conn: Connection, ex: Exchange) -> None:
        if self._turned_away(conn, ex, admin=False):
            return
        now = time.time()
        rows = []
        for key, seat in sorted(self.residents.items()):
            row = self._resident_row(key, seat, now)
            rows.append({**row, **{k: bool(row[k]) for k in ("alive", "healthy", "busy", "loading", "is_moe")}})
        conn.respond(ex, 200, _json({"residents": rows}))


ROUTES = {
    ("GET", "/v1/models"): Inventory._list_models,
    ("GET", "/residents"): Inventory._list_residents,
}
