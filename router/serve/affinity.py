"""Affinity on the call path (router.core.affinity holds the rules), one object that chooses and
learns, driven by the call (serve/proxy.py) at each step: its key from its headers and body
(`key`), the decision's steer (`steer`), what its answer teaches as it goes to the client (`took`:
the binding moves to the box that took the call, its prefix is recorded there, and how the key
placed it is said), and what its end teaches (`ended`: the outcome's figures, a Responses id).

Rules:
1. Off (`--affinity off`, or a slack of 0): nothing is computed, no header is sent, the route log's
   `affinity` is NULL, and decisions are the seeds' order.
2. The scope of a key is the caller: the id of the API key it sent, when the access gate found
   that key valid (`edge.key_id`), else its resolved address (`edge.caller`): a key's id alone,
   without its secret, never joins its holder's scope. The chain's seed mixes this process's random salt, the
   scope and the model, so no two callers or models share a node and no hash means anything
   outside this process.
3. The prompt is hashed only when no header or body field gave a key (first match wins), by the
   compiled scan over its raw bytes; nothing of it is decoded or kept.
4. An answer judged fit (2xx) teaches: the binding or prefix moves to its box. The outcome
   (`hit:<kind>`, `miss:<kind>`, `none`) goes out as X-Router-Affinity and into the route log
   and the metrics (per box and model, with the engine-cached tokens the answer reports).
5. A Responses answer's id is bound to its box, so a call that names it as
   `previous_response_id` goes back there.
6. Other routers' bindings (`bindings`, fleetwide/seam.py): a bound key with no binding here is
   looked up there before the decision (`steer` answers a coroutine then: several routers, a
   round trip to the shared server), and a binding made or moved here is written there. One
   router: its own index is every binding (ONE_ROUTER_BINDINGS finds none).
Its cost on a call with a key: the headers' look-up, one chain hash of the prompt at several GB/s,
a few dict look-ups in the index and one insert per element (bench/callpath_cpu.py `affinity`).
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router._fastpath import AffinityIndex, prefix_chain
from router.core.affinity import (
    BOUND_DEPTH,
    DEFAULT_SLACK,
    MIN_PULL_DEPTH,
    PREFIX,
    RESPONSE,
    ENTRY_BYTES,
    Key,
    Pull,
    Slack,
    Steer,
    bound_key,
    prefix_key,
    response_key,
)
from router.core.kinds import CALL_KEYS
from router.core.types import new_tuple
from router.facades.usage import response_id
from router.fleetwide.seam import ONE_ROUTER_BINDINGS, Bindings

if TYPE_CHECKING:
    from router.boxes.fleet import Fleet
    from router.boxes.state import BoxState
    from router.facades.body import Inspected
    from router.serve.edge import Edge
    from router.serve.record import CallRecord

DEFAULT_MEMORY_BYTES = 64 << 20  # ~330k entries: 64 conversations × 256 elements × 20 boxes fit
_SEED_MASK = (1 << 64) - 1
RESPONSES_PATH = "/v1/responses"
HEADER = b"x-router-affinity"
_NO_BOXES: dict = {}  # no fleet yet: every node is stale


class Affinity:
    """One per process (every facade's calls share it)."""

    def __init__(self, slack: Slack = DEFAULT_SLACK, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 fleet: Fleet | None = None, bindings: Bindings = ONE_ROUTER_BINDINGS) -> None:
        self.slack = slack
        self.on = not slack.off
        self.index = AffinityIndex(memory_bytes // ENTRY_BYTES, MIN_PULL_DEPTH, BOUND_DEPTH)
        self.fleet = fleet
        self._salt = int.from_bytes(os.urandom(8), "little")  # rule 2
        self._spin = random.getrandbits
        self.bindings = bindings  # rule 6
        # per (box, model) for the metrics (rule 4)
        self.outcomes: dict[tuple[str, str, str], int] = defaultdict(int)
        self.cached_tokens: dict[tuple[str, str], int] = defaultdict(int)

    # -- before the decision -------------------------------------------------------------------
    def key(self, edge: Edge, inspected: Inspected, body: bytes) -> Key | None:
        """The call's key (rules 2 and 3), or None."""
        scope = scope_of(edge)
        model = inspected.call.model
        key = bound_key(edge.headers, inspected.key_fields, scope, model)
        prompt = inspected.prompt
        if key is not None or prompt is None:
            return key
        start, end = prompt
        return prefix_key(prefix_chain(body, start, end, hash((self._salt, scope, model)) & _SEED_MASK))

    def steer(self, key: Key) -> Steer | Awaitable[Steer]:
        """What the decision applies for `key`; for a bound key with no binding here, the other
        routers' binding, maybe a round trip away (rule 6)."""
        boxes = self.fleet.boxes if self.fleet is not None else _NO_BOXES  # their cache epochs
        steer = new_tuple(Steer, (self.index.pull(key, boxes), True, self.slack, self._spin(32)))
        if steer.pull is not None or key.kind == PREFIX:
            return steer
        found = self.bindings.find(key.scoped)
        if found is None:
            return steer
        return self._bound_elsewhere(key, steer, found)  # type: ignore[arg-type]

    async def _bound_elsewhere(self, key: Key, steer: Steer, finding: Awaitable[str | None]) -> Steer:
        box = await finding
        if box is None or self.fleet is None or self.fleet.get(box) is None:
            return steer
        self.index.bind(key.bound, box)  # type: ignore[arg-type]
        return steer._replace(pull=(box, BOUND_DEPTH))

    # -- the answer ----------------------------------------------------------------------------
    def took(self, key: Key | None, steer: Steer | None, box: BoxState, record: CallRecord) -> None:
        """`box`'s answer is going to the client: learn, and say how the key placed it (rule 4)."""
        if key is None:
            record.placed("none")
            return
        pull: Pull | None = steer.pull if steer is not None else None
        name = box.name
        hit = pull is not None and pull[0] == name
        record.placed(("hit:" if hit else "miss:") + key.kind)
        call = record.call
        named = CALL_KEYS[(box.config.kind, call.model, call.settings)]  # type: ignore[union-attr]
        if named is not None:
            self.index.learn(key, name, named[0], box.cache_epoch(named[0]), pull[1] if hit else 0)  # type: ignore[union-attr]
        if not hit and key.kind != PREFIX:
            self.bindings.keep(key.scoped, name)  # made or moved here (rule 6)

    def ended(self, record: CallRecord, state: str) -> None:
        """A call placed by its key ended (`took` said how) in row state `state`: done, its outcome
        and the engine's cached tokens per (box, model: the box's own key for it, so the labels
        are bounded by what the boxes hold), and a Responses answer's id bound to its box (rules 4
        and 5)."""
        box, call = record.box, record.call
        if box is None or call is None or state != "done":
            return
        named = CALL_KEYS[(box.config.kind, call.model, call.settings)]
        label = (box.name, named[0] if named is not None else call.model)
        self.outcomes[label + (record.affinity.partition(":")[0],)] += 1
        tokens = record.tokens  # the box's own counts (facades.usage), counted before this
        if tokens is not None and tokens.cached:
            self.cached_tokens[label] += tokens.cached
        if record.tail and record.route.path == RESPONSES_PATH:
            answered = response_id(b"".join(record.tail))
            if answered is not None:
                scope = scope_of(record.edge)
                self.index.bind(response_key(scope, call.model, answered), box.name)
                self.bindings.keep((scope, call.model, RESPONSE, answered), box.name)

    # -- the operator's view ------------------------------------------------------------------
    def view(self) -> dict:
        """The dashboard's and GET /v1/router/state's `affinity`: on or off, the slack, the index's
        size, and per box and model the outcomes, the hit ratio and the engine-cached tokens."""
        rows: dict[tuple[str, str], dict] = {}
        for (box, model, outcome), count in self.outcomes.items():
            row = rows.setdefault((box, model), {"box": box, "model": model, "hit": 0, "miss": 0, "none": 0})
            row[outcome] = count
        for (box, model), tokens in self.cached_tokens.items():
            rows.setdefault((box, model), {"box": box, "model": model, "hit": 0, "miss": 0, "none": 0})
        for (box, model), row in rows.items():
            keyed = row["hit"] + row["miss"]
            row["hit_ratio"] = round(row["hit"] / keyed, 3) if keyed else None
            row["cached_tokens"] = self.cached_tokens.get((box, model), 0)
        return {"on": self.on, "slack": {"absolute": self.slack.absolute, "relative": self.slack.relative},
                "index_entries": len(self.index), "index_capacity": self.index.capacity,
                "by_box": [rows[k] for k in sorted(rows)]}

    # -- /metrics ------------------------------------------------------------------------------
    def collect(self):
        """The hit ratio per box and model, the outcomes behind it, and the engine-cached tokens."""
        calls = CounterMetricFamily("router_affinity_calls", "Calls with an affinity key, by the box that "
                                    "took them, model and outcome (hit: it went where its key pointed).",
                                    labels=["box", "model", "outcome"])
        ratio = GaugeMetricFamily("router_affinity_hit_ratio", "Share of keyed calls that went where their key "
                                  "pointed, per box and model (none and miss count against).", labels=["box", "model"])
        totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for (box, model, outcome), count in sorted(self.outcomes.items()):
            calls.add_metric([box, model, outcome], count)
            if outcome != "none":
                totals[(box, model)][0] += count if outcome == "hit" else 0
                totals[(box, model)][1] += count
        for (box, model), (hits, keyed) in sorted(totals.items()):
            ratio.add_metric([box, model], hits / keyed)
        cached = CounterMetricFamily("router_engine_cached_tokens", "Prompt tokens the boxes served from their "
                                     "own cache, as they reported them, per box and model.", labels=["box", "model"])
        for (box, model), count in sorted(self.cached_tokens.items()):
            cached.add_metric([box, model], count)
        return [calls, ratio, cached, GaugeMetricFamily(
            "router_affinity_index_entries", "Bindings and prefix nodes held (LRU, --affinity-memory).",
            value=len(self.index))]


def scope_of(edge: Edge) -> tuple[str, str | None]:
    """The caller a key is scoped to (rule 2): its valid API key's id, else its resolved address."""
    return ("key", edge.key_id) if edge.key_id is not None else ("addr", edge.caller)
