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

from router.core.limits import Tokens, tokens_of
from router.core.refusal import RefusalCode
from router.core.types import Call, Decision
from router.facades.table import Facade, Route
from router.facades.usage import TEXT_ANSWER_ROUTES, reported
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
        "usage_frame",
        "tokens",
        "limit_headers",
        "affinity",
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
        self.tail: tuple[bytes, ...] = ()  # the answer's last two chunks, for its token usage
        self.waited_ms: float | None = None
        self.usage_frame = b""  # the usage chunk the router asked for and kept from the client
        self.tokens: Tokens | None = None  # once counted (`count_tokens`); None: no box served it
        self.limit_headers: tuple[tuple[bytes, bytes], ...] = ()  # its key's x-ratelimit-* (tenancy)
        self.affinity: str | None = None  # how its affinity key placed it (serve/affinity.py)

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

    @property
    def served(self) -> bool:
        """A box answered the call with a success (its tokens count)."""
        return self.box is not None and 200 <= self.status < 300 and self.first_byte_at is not None

    @property
    def text_bytes(self) -> int:
        """The request body's size as text a prompt is made of: a multipart upload (audio, an
        image) is no prompt to estimate tokens from."""
        content_type = self.edge.header("content-type")
        return 0 if content_type is not None and content_type.startswith("multipart/") else self.bytes_in

    def count_tokens(self) -> Tokens | None:
        """The call's tokens, once it ended: what its box reported at the answer's end, else
        estimated from sizes (router.core.limits.tokens_of); None when no box served it."""
        if self.served:
            report = reported(self.usage_frame or b"".join(self.tail)) if self.tail or self.usage_frame else None
            answer_bytes = self.bytes_out if self.route.path in TEXT_ANSWER_ROUTES else 0
            self.tokens = tokens_of(report, self.text_bytes, answer_bytes, self.stream)
        return self.tokens

    def row(self) -> Row:
        """This call's route_log row."""
        call, decision, tokens = self.call, self.decision, self.tokens
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
            key_id=self.edge.key_id,
            prompt_tokens=tokens.prompt if tokens else None,
            completion_tokens=tokens.completion if tokens else None,
            cached_tokens=tokens.cached if tokens else None,
            tokens_estimated=int(tokens.estimated) if tokens else None,
            affinity=self.affinity,
        )
