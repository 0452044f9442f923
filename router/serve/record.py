"""One call's record: what its route_log row and its metrics are made of, filled in as the call
goes and read once when it ends (`RouterApp.observe`).

Times, by suffix, on three clocks: `*_at` is the wall clock in epoch seconds (`time.time()`: what
the route log stores: received_at, first_byte_at); `t_*` is `time.perf_counter()` (the metrics'
durations: t_received, t_body, t_sent, t_first_byte); `*_s` is the event loop's clock
(`loop.time()`, the CallClock's `now`: started_s, queued_s, last_keepalive_s), and a plain `*_s`
constant or setting is a duration in seconds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from router.core.refusal import RefusalCode
from router.core.types import Call, Decision
from router.facades.table import Facade, Route
from router.serve.edge import Edge
from router.store.route_log import Row

if TYPE_CHECKING:
    from router.boxes.state import BoxState


class CallRecord:
    """Metadata only, never a body, a chunk or a key (the call's `tail` is read by the tracer for
    token usage and never stored)."""

    __slots__ = (
        "call_id",
        "facade",
        "route",
        "edge",
        "call",
        "decision",
        "box",
        "attempts",
        "status",
        "state",
        "failure",
        "stream",
        "received_at",
        "first_byte_at",
        "bytes_in",
        "bytes_out",
        "t_received",
        "t_body",
        "t_sent",
        "t_first_byte",
        "tail",
        "waited_ms",
        "affinity",
        "cached_tokens",
    )

    def __init__(self, call_id: str, facade: Facade, route: Route, edge: Edge) -> None:
        self.call_id = call_id
        self.facade = facade
        self.route = route
        self.edge = edge
        self.call: Call | None = None
        self.decision: Decision | None = None
        self.box: BoxState | None = None  # the box tried last
        self.attempts: list[dict] = []  # {box, status, refusal, ms, error, at} per box tried
        self.status = 0
        self.state = "pending"  # then done | failed | refused | cancelled
        self.failure: str | None = None  # a stable error code, never the box's text
        self.stream = False
        self.received_at = time.time()
        self.first_byte_at: float | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.t_received = time.perf_counter()  # the call arrived
        self.t_body = 0.0  # its body was in: router time starts here
        self.t_sent = 0.0  # the first box was contacted
        self.t_first_byte = 0.0
        self.tail: tuple[bytes, ...] = ()  # the answer's last two chunks, for a trace's token usage
        self.waited_ms: float | None = None
        self.affinity: str | None = None  # how its affinity key placed it (serve/affinity.py)
        self.cached_tokens: int | None = None  # prompt tokens the engine served from its cache

    def answered(self, status: int, state: str, failure: str | None = None) -> None:
        """The answer's head is going out now."""
        self.status, self.state, self.failure = status, state, failure
        self.first_byte_at = time.time()
        self.t_first_byte = time.perf_counter()

    def ended(self, state: str, failure: str) -> None:
        """The call ended otherwise than its answer said (the client left, the box failed)."""
        self.state, self.failure = state, failure

    def attempt_ended(self, box: str, t_started: float, status: int | None, refusal: RefusalCode | None) -> None:
        ms = round((time.perf_counter() - t_started) * 1000, 3)
        if refusal is None:
            entry = {"box": box, "status": status, "ms": ms, "at": time.time()}
        else:  # `error` is 0.0.4's name for why the box was left, `at` its end (epoch s)
            entry = {"box": box, "status": status, "refusal": refusal, "ms": ms, "error": refusal, "at": time.time()}
        self.attempts.append(entry)

    def row(self) -> Row:
        """This call's route_log row."""
        call, decision = self.call, self.decision
        return Row(
            request_id=self.call_id,
            state=self.state if self.state != "pending" else "failed",
            facade=self.facade.name,
            route=self.route.path,
            model=call.model if call else None,
            options=call.settings if call else None,
            pin=call.pin if call else None,
            client=self.edge.caller,
            waited_ms=self.waited_ms,
            stream=int(self.stream),
            path=decision.path.value if decision else None,
            decision=decision,  # encoded by the writer thread, off the loop
            attempts=self.attempts,
            box=self.box.name if self.box else None,
            http_status=self.status or None,
            error=self.failure,
            received_at=self.received_at,
            first_byte_at=self.first_byte_at,
            responded_at=time.time(),
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            affinity=self.affinity,
        )
