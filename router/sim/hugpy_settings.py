"""The simulated hugpy box's pair and box settings, a model name's `@options`, verdicts and
management reads (contracts/hugpy-wrapper.md §5, §11). A stand-in: it shares no code with
router.core.pairs.

Rules (the box's, as §11 records them):
1. `pair_settings[model_key]` is a pair's own row, `pair_settings["*"]` the blanket (box-only
   knobs included). A row is found as the box finds it: the exact key, else `owner~repo` in
   either direction, case-insensitively. Every write moves `changes` (the long-poll answers).
2. A call's load contract: the blanket's BLANKET_KNOBS, the pair's own row, then the call's
   knobs, the call winning; a call cannot touch `blocked`. The call's knobs are its JSON
   body's `knobs` object with its `model@options` as knobs (variants.parse) over it (§5,
   §11.2.6). The options are OPTION_TOKENS and `ctx-<pct>`, case-insensitive (`read_options`).
   `blocked`, `residency` and `fit_order` are not in a seat's contract. A seat is reused only
   under an equal contract, compared as Python dicts (§11.2.6); the box never enforces
   `blocked`.
3. `verdicts[model]` is one of VERDICT_KINDS (default "unknown": `fits: null`, not priced yet);
   `GET /v1/verdicts` has one row per catalog model but those set to "none".
4. Writes are POSTs answered with the row after the merge (§11.2.3, §11.2.4); a key set to null
   is removed. `GET /v1/settings/pair?model_key=K` gives own row, blanket and `effective`.
5. The management routes are admin (a use key would need to be told apart from the box key:
   the sim has only the box key).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any
from urllib.parse import parse_qs

from router.sim.connection import Connection, Exchange
from router.sim.hugpy_inventory import QUANT_LABEL, model_path
from router.sim.wire import json_body as _json

# constants.py:138-140
BLANKET_KNOBS = frozenset(
    "auto_preferences video_allow_cpu min_decode_tok_s disk_mmap disk_mmap_cache_gib auto_goal "
    "tolerance quality_alternatives allowed_placements wait_before_quality resident_priority "
    "latency_target_s max_wait_s cpu_floor_cores ctx_pct ctx_min_pct ctx_range_enabled ctx_yield "
    "ctx_restore".split())
BOX_ONLY_KNOBS = frozenset(
    "assist_model drive_roles drive_budgets copy_to_central upload_to_worker reap_to_fit model_paths "
    "model_paths_only".split())
OFF_CONTRACT = frozenset({"blocked", "residency", "fit_order"})
VERDICT_KINDS = ("gpu", "ram", "unknown", "impossible", "none")
# variants.parse's fixed tokens (quant labels become `gguf_file`)
_TOKEN_KNOBS: dict[str, tuple[str, Any]] = {
    **{mode: ("alloc_mode", mode) for mode in ("gpu-only", "ram-only", "max-gpu", "max-ram", "explicit")},
    "moe": ("moe", True), "no-moe": ("moe", False), "4bit": ("bnb_4bit", True), "fa": ("flash_attn", True),
    "ctx-max": ("ctx_preset", "xhigh"), "fit": ("@fit", True),
    **{f"ctx-{level}": ("ctx_preset", level) for level in ("low", "medium", "high", "xhigh")},
    **{f"kv-{kv}": ("kv_cache_type", kv) for kv in ("f16", "q8_0", "q4_0")},
}
# §5: the option tokens the box accepts after `@` (case-insensitive, split on `+` or `,`).
OPTION_TOKENS = frozenset(_TOKEN_KNOBS) | {QUANT_LABEL}
_CTX_PCT_RE = re.compile(r"ctx-(100|[1-9][0-9]?)")
_OPTION_SPLIT_RE = re.compile(r"[+,]")


def read_options(options: str) -> tuple[str | None, list[str]]:
    """A model name's `@options` as the box reads them (§5, rule 2): (the seat's settings,
    tokens sorted and joined with `+`, or None; the tokens it does not know)."""
    tokens = [t.strip() for t in _OPTION_SPLIT_RE.split(options) if t.strip()]
    unknown = [t for t in tokens if t.lower() not in OPTION_TOKENS and not _CTX_PCT_RE.fullmatch(t.lower())]
    return "+".join(sorted({t.lower() for t in tokens})) or None, unknown


def _error(status: int, message: str) -> bytes:
    return _json({"error": {"message": message, "code": status}})  # manage.py `_err`: no type


class PairSettings:
    """Mixed into SimBox: its §11 state and routes."""

    def _init_pair_settings(self) -> None:
        self.pair_settings: dict[str, dict[str, Any]] = {}
        self.verdicts: dict[str, str] = {}
        self.pair_updated: dict[str, float] = {}
        self.verdict_reads = 0  # observation: GET /v1/verdicts answered

    # -- public API (from the test thread; rule 1) ----------------------------------------------

    def set_pair(self, model_key: str, **settings: Any) -> None:
        """Merges `settings` into a pair's own row (`"*"`: the blanket) as a POST would."""
        self._on_loop(lambda: self._write(model_key, settings))

    # -- the rules ------------------------------------------------------------------------------

    def _write(self, model_key: str, settings: dict[str, Any]) -> dict[str, Any]:
        row = dict(self.pair_settings.get(model_key, {}))
        for key, value in settings.items():
            if value is None:
                row.pop(key, None)
            else:
                row[key] = value
        self.pair_settings[model_key] = row
        self.pair_updated[model_key] = time.time()
        self._bump()
        return row

    def own_row(self, key: str) -> dict[str, Any]:
        rows = self.pair_settings
        if key in rows and key != "*":
            return rows[key]
        low = key.lower()
        for row_key, row in rows.items():
            if row_key != "*" and (row_key.lower().endswith("~" + low) or low.endswith("~" + row_key.lower())):
                return row
        return {}

    def effective(self, key: str) -> dict[str, Any]:
        blanket = {k: v for k, v in self.pair_settings.get("*", {}).items() if k in BLANKET_KNOBS}
        return {**blanket, **self.own_row(key)}

    def seat_contract(self, base: str, options: str | None, body_knobs: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
        """Rule 2: the contract a call for `base@options` with `body_knobs` loads under."""
        call = dict(body_knobs or {})
        for token in (options or "").split("+"):
            if not token:
                continue
            knob, value = _TOKEN_KNOBS.get(token, ("gguf_file", token))
            if token.startswith("ctx-") and token[4:].isdigit():
                knob, value = "ctx_pct", int(token[4:])
            call[knob] = value
        knobs = {**self.effective(base), **{k: v for k, v in call.items() if k != "blocked"}}
        return {k: v for k, v in knobs.items() if k not in OFF_CONTRACT and v is not None}

    @staticmethod
    def body_knobs(ex: Exchange) -> dict[str, Any]:
        """The `knobs` object of a call's JSON body (rule 2); {} for none, or for a form body."""
        if ex.headers.get("content-type", "").lower().startswith("multipart/"):
            return {}
        try:
            knobs = json.loads(ex.body or b"{}").get("knobs")
        except (ValueError, AttributeError):
            return {}
        return knobs if isinstance(knobs, dict) else {}

    def pair_rows(self) -> list[dict[str, Any]]:
        """`pair_settings` as the state long-poll lists them (§11.2.7)."""
        return [{"worker": self.name, "model_key": key, "settings": row, "env_profile": None,
                 "updated_at": self.pair_updated.get(key, 0.0)} for key, row in sorted(self.pair_settings.items())]

    def verdict_row(self, key: str, kind: str) -> dict[str, Any]:
        fits = {"gpu": (True, True), "ram": (False, True), "unknown": (None, None),
                "impossible": (False, False)}[kind]
        mode = "gpu-only" if kind in ("gpu", "unknown", "impossible") else "ram-only"
        file = model_path(key).rsplit("/", 1)[1]
        return {"model_key": key, "file": file, "quant": "q4_k_m", "engine": "gguf", "elected": True,
                "on_disk": True,
                "feasibility": {"status": "impossible" if kind == "impossible" else "candidate",
                                "admissible": kind != "impossible", "basis": "wrapper capacity bounds",
                                "why": "", "measurement_required": False},
                "memory": {"gpu-only": {"fits": fits[0], "ctx": 4096}, "ram-only": {"fits": fits[1], "ctx": 4096}},
                "auto": {"standard": {"mode": mode, "ctx": 4096, "fits": fits[0] if mode == "gpu-only" else fits[1]}},
                "settings": {}, "at": 1796130745.99}

    # -- routes -----------------------------------------------------------------------------------

    def _query(self, ex: Exchange) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(ex.query or "").items()}

    def _verdicts(self, conn: Connection, ex: Exchange) -> None:
        if self._turned_away(conn, ex, admin=True):
            return
        self.verdict_reads += 1
        wanted = self._query(ex).get("model_key")
        rows = [self.verdict_row(key, self.verdicts.get(key, "unknown")) for key in sorted(self.catalog)
                if self.verdicts.get(key, "unknown") != "none" and wanted in (None, key)]
        conn.respond(ex, 200, _json({"worker": self.name, "budgets": {"gpu_budget": None, "ram_budget": None,
                                                                         "swap": None},
                                     "available": {"gpu": None, "ram": None, "swap": 0, "cores": 8,
                                                   "sampled_at": time.time()},
                                     "verdicts": rows, "at": time.time()}))

    def _body_object(self, conn: Connection, ex: Exchange) -> dict[str, Any] | None:
        try:
            doc = json.loads(ex.body or b"{}")
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            conn.respond(ex, 400, _error(400, "the body must be a JSON object"))
            return None
        return doc

    def _pair_get(self, conn: Connection, ex: Exchange) -> None:
        if self._turned_away(conn, ex, admin=True):
            return
        key = self._query(ex).get("model_key", "")
        blanket = {k: v for k, v in self.pair_settings.get("*", {}).items() if k in BLANKET_KNOBS}
        conn.respond(ex, 200, _json({"model_key": key, "settings": self.own_row(key) if key else {},
                                     "box": blanket, "effective": self.effective(key) if key else blanket,
                                     "env_profile": None, "quant_fallback": "auto"}))

    def _pair_post(self, conn: Connection, ex: Exchange) -> None:
        if self._turned_away(conn, ex, admin=True):
            return
        doc = self._body_object(conn, ex)
        if doc is None:
            return
        key, settings = doc.get("model_key"), doc.get("settings", {})
        if not isinstance(key, str) or not key:
            conn.respond(ex, 400, _error(400, "model_key is required"))
            return
        if not isinstance(settings, dict):
            conn.close()  # §11: a TypeError escapes the handler; the box closes without an answer
            return
        if doc.get("replace"):
            self.pair_settings.pop(key, None)
        conn.respond(ex, 200, _json({"model_key": key, "settings": self._write(key, settings)}))

    def _box_report(self) -> dict[str, Any]:
        row = self.pair_settings.get("*", {})
        return {"settings": {k: v for k, v in row.items() if k in BLANKET_KNOBS},
                "accepts": sorted(BLANKET_KNOBS),
                "box_only": {k: row.get(k) for k in sorted(BOX_ONLY_KNOBS)}}

    def _box_get(self, conn: Connection, ex: Exchange) -> None:
        if not self._turned_away(conn, ex, admin=True):
            conn.respond(ex, 200, _json({**self._box_report(), "box_only_accepts": sorted(BOX_ONLY_KNOBS)}))

    def _box_post(self, conn: Connection, ex: Exchange) -> None:
        if self._turned_away(conn, ex, admin=True):
            return
        doc = self._body_object(conn, ex)
        if doc is None:
            return
        settings = doc.get("settings")
        if not isinstance(settings, dict):
            conn.respond(ex, 400, _error(400, "settings (an object) is required"))
            return
        wrong = sorted(set(settings) - BLANKET_KNOBS - BOX_ONLY_KNOBS)
        if wrong:
            conn.respond(ex, 400, _error(400, f"not box knobs: {', '.join(wrong)}; the box accepts "
                                              f"{', '.join(sorted(BLANKET_KNOBS | BOX_ONLY_KNOBS))}"))
            return
        if doc.get("replace"):
            self.pair_settings.pop("*", None)
        self._write("*", settings)
        conn.respond(ex, 200, _json(self._box_report()))


ROUTES = {
    ("GET", "/v1/verdicts"): PairSettings._verdicts,
    ("GET", "/v1/settings/pair"): PairSettings._pair_get,
    ("POST", "/v1/settings/pair"): PairSettings._pair_post,
    ("GET", "/v1/settings/box"): PairSettings._box_get,
    ("POST", "/v1/settings/box"): PairSettings._box_post,
}
