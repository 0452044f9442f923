"""One call's record: what its route_log row and its metrics are made of, written only through
the named facts below as the call goes, and read once when it ends (`RouterApp.observe`).

The facts, in the order a call meets them (each is one method; nothing outside writes a slot):
    body_read   the body is in (its size, and its size as prompt text; router time starts here)
    asked       what the call asks for (`Call`)
    aliased     an alias's call goes to a model of its chain: that model's `Call`, its place
                (the row keeps the alias beside the model served: `AliasedDecision`)
    decided     the decision that dispatches it (or refuses it)
    queued      it waited in the queue this long
    attempting  a box is contacted (the first one stamps the router's overhead)
    attempted   that box's try ended (kept as the row's `attempts`)
    answered    an answer's head goes out: the box's, or the router's own (`turned_away`: no box
                would take the call, row state `refused`)
    ended       the call ended otherwise than its answer said (the box failed mid-answer)
    sent        bytes went to the client
    kept_tail   a whole answer's last chunks, for its token usage (never stored)
    kept_usage  the usage chunk the router asked a stream for and kept from the client
    limited     its key's x-ratelimit-* headers, for the answer's head (tenancy)
    count_tokens  at its end: the tokens its box reported, else an estimate (tenancy, the row)

The row's `state` and `failure` are not written: they follow from how the call's lifecycle
ended (router.core.lifecycle.row_state) and from the facts above.

Times, by suffix, on three clocks: `*_at` is the wall clock in epoch seconds (`time.time()`: what
the route log stores: received_at, first_byte_at); `t_*` is `time.perf_counter()` (the metrics'
durations: t_received, t_body, t_sent, t_first_byte); `*_s` is the event loop's clock
(`loop.time()`, the CallClock's `now`), and a plain `*_s` constant or setting is a duration in
seconds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from router.core.lifecycle import Event, Lifecycle, row_state
from router.core.limits import Tokens, tokens_of
from router.core.refusal import RefusalCode
from router.core.types import Call, Decision, new_tuple
from router.facades.table import Facade, Route
from router.facades.usage import TEXT_ANSWER_ROUTES, reported
from router.serve.edge import Edge
from router.store.route_log import Row

if TYPE_CHECKING:
    from router.boxes.state import BoxState

CLIENT_LEFT = Event.CLIENT_LEFT  # read per row: a module name is cheaper than the Enum's (lifecycle.py)


class AliasedDecision:
    """An alias call's decision in the route log: the decision, and beside it the alias asked
    for and the served model's place in its chain (the `model` column is the served model)."""

    __slots__ = ("decision", "alias", "position")

    def __init__(self, decision: Decision, alias: str, position: int) -> None:
        self.decision = decision
        self.alias = alias
        self.position = position

    def log_doc(self) -> dict:
        """Called by the route log's writer thread."""
        return {**self.decision.log_doc(), "alias": self.alias, "fallback": self.position}


class CallRecord:
    """Metadata only, never a body, a chunk or a key (the call's `tail` is read by the tracer for
    token usage and never stored)."""

    __slots__ = (
        # who the call is
        "call_id", "facade", "route", "edge", "life",
        # facts
        "call", "decision", "box", "attempts", "waited_ms", "status", "answer_failure", "turned_away",
        "end_failure", "stream", "tail", "usage_frame", "limit_headers", "tokens", "alias", "fallback", "affinity",
        # sizes and times
        "bytes_in", "text_bytes", "bytes_out", "received_at", "first_byte_at", "t_received", "t_body", "t_sent",
        "t_first_byte",
    )

    def __init__(self, call_id: str, facade: Facade, route: Route, edge: Edge, life: Lifecycle) -> None:
        self.call_id = call_id
        self.facade = facade
        self.route = route
        self.edge = edge
        self.life = life  # how the call ended says the row's state
        self.call: Call | None = None
        self.decision: Decision | None = None
        self.box: BoxState | None = None  # the box tried last
        self.attempts: list[dict] = []  # {box, status, refusal, ms, error, at} per box tried
        self.waited_ms: float | None = None
        self.status = 0  # the answer's status; 0 until one goes out
        self.answer_failure: str | None = None  # the answer's stable error code, never the box's text
        self.turned_away = False  # the router's own answer: no box would take the call
        self.end_failure: str | None = None  # why a call failed after its answer went out
        self.stream = False
        self.tail: tuple[bytes, ...] = ()  # the answer's last two chunks, for its token usage
        self.usage_frame = b""  # the usage chunk the router asked for and kept from the client
        self.limit_headers: tuple[tuple[bytes, bytes], ...] = ()  # its key's x-ratelimit-* (tenancy)
        self.tokens: Tokens | None = None  # once counted (`count_tokens`); None: no box served it
        self.alias: str | None = None  # the alias asked for; `call` is then the model served
        self.fallback = 0  # the served model's place in the alias's chain
        self.affinity: str | None = None  # how its affinity key placed it (serve/affinity.py)
        self.bytes_in = 0
        # the body's size as text a prompt is made of: a multipart upload (audio, an image) is
        # no prompt to estimate tokens from (tenancy's reservation, count_tokens)
        self.text_bytes = 0
        self.bytes_out = 0
        self.received_at = time.time()
        self.first_byte_at: float | None = None
        self.t_received = time.perf_counter()  # the call arrived
        self.t_body = 0.0  # its body was in: router time starts here
        self.t_sent = 0.0  # the first box was contacted
        self.t_first_byte = 0.0

    # -- the facts -----------------------------------------------------------------------------
    def body_read(self, size: int) -> None:
        self.t_body = time.perf_counter()
        self.bytes_in = size
        content_type = self.edge.header("content-type")
        self.text_bytes = 0 if content_type is not None and content_type.startswith("multipart/") else size

    def asked(self, call: Call) -> None:
        self.call = call

    def aliased(self, alias: str, position: int, call: Call) -> None:
        self.alias, self.fallback, self.call = alias, position, call
    def placed(self, affinity: str) -> None:
        """How the call's affinity key placed it (serve/affinity.py): `hit:<kind>`, `miss:<kind>`
        or `none`."""
        self.affinity = affinity

    def decided(self, decision: Decision) -> None:
        self.decision = decision

    def queued(self, waited_ms: float) -> None:
        self.waited_ms = waited_ms

    def attempting(self, box: BoxState) -> float:
        """`box` is about to be contacted; returns the attempt's start (perf_counter)."""
        t_started = time.perf_counter()
        self.box = box
        if not self.attempts:
            self.t_sent = t_started
        return t_started

    def attempted(self, box: str, t_started: float, status: int | None, refusal: RefusalCode | None) -> None:
        ms = round((time.perf_counter() - t_started) * 1000, 3)
        if refusal is None:
            entry = {"box": box, "status": status, "ms": ms, "at": time.time()}
        else:  # `error` is 0.0.4's name for why the box was left, `at` its end (epoch s)
            entry = {"box": box, "status": status, "refusal": refusal, "ms": ms, "error": refusal, "at": time.time()}
        self.attempts.append(entry)

    def answered(self, status: int, failure: str | None = None, *, stream: bool = False,
                 turned_away: bool = False) -> None:
        """The answer's head is going out now; `failure` names an answer that is an error."""
        self.status, self.answer_failure, self.stream, self.turned_away = status, failure, stream, turned_away
        self.first_byte_at = time.time()
        self.t_first_byte = time.perf_counter()

    def ended(self, failure: str) -> None:
        """The answer went out but the call failed after it (the box failed mid-answer)."""
        self.end_failure = failure

    def sent(self, size: int) -> None:
        self.bytes_out += size

    def kept_tail(self, tail: tuple[bytes, ...]) -> None:
        self.tail = tail

    def kept_usage(self, frame: bytes) -> None:
        self.usage_frame = frame

    def limited(self, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        self.limit_headers = headers

    def count_tokens(self) -> Tokens | None:
        """The call's tokens, once it ended: what its box reported at the answer's end, else
        estimated from sizes (router.core.limits.tokens_of); None when no box served it (a box
        answered with a success: its tokens count)."""
        if self.box is not None and 200 <= self.status < 300 and self.first_byte_at is not None:
            report = reported(self.usage_frame or b"".join(self.tail)) if self.tail or self.usage_frame else None
            answer_bytes = self.bytes_out if self.route.path in TEXT_ANSWER_ROUTES else 0
            self.tokens = tokens_of(report, self.text_bytes, answer_bytes, self.stream)
        return self.tokens

    # -- what follows from them ----------------------------------------------------------------
    @property
    def state(self) -> str:
        """done | failed | refused | cancelled: from how the lifecycle ended (row_state)."""
        return row_state(self.life.ended_by, self.status, self.failure, self.turned_away)

    @property
    def failure(self) -> str | None:
        """A stable error code: the client left, the box failed mid-answer, or the answer's own."""
        if self.life.ended_by is CLIENT_LEFT:
            return "client_left"
        return self.end_failure or self.answer_failure

    def row(self) -> Row:
        """This call's route_log row."""
        call, decision, tokens, failure = self.call, self.decision, self.tokens, self.failure
        # Positional, in Row's order, each line naming its column: a NamedTuple built by keyword
        # goes through a dict of them (~15,000 instructions more for its 27 fields, a call).
        return new_tuple(Row, (
            self.call_id,  # request_id
            row_state(self.life.ended_by, self.status, failure, self.turned_away),  # state
            self.facade.name,  # facade
            self.route.path,  # route
            call.model if call else None,  # model
            call.settings if call else None,  # options
            call.pin if call else None,  # pin
            self.edge.caller,  # client
            int(self.stream),  # stream
            decision.path._value_ if decision else None,  # path (`value` is a property: two frames)
            # decision: encoded by the writer thread, off the loop
            decision if self.alias is None or decision is None
            else AliasedDecision(decision, self.alias, self.fallback),
            self.attempts,  # attempts
            self.box.name if self.box else None,  # box
            self.status or None,  # http_status
            failure,  # error
            self.received_at,  # received_at
            self.first_byte_at,  # first_byte_at
            time.time(),  # responded_at
            self.bytes_in,  # bytes_in
            self.bytes_out,  # bytes_out
            self.waited_ms,  # waited_ms
            self.edge.key_id,  # key_id
            tokens.prompt if tokens else None,  # prompt_tokens
            tokens.completion if tokens else None,  # completion_tokens
            tokens.cached if tokens else None,  # cached_tokens
            int(tokens.estimated) if tokens else None,  # tokens_estimated
            self.affinity,  # affinity
            None,  # router: the route-log writer's to fill
            self.edge.batch_id,  # batch_id: a batch line's (serve/batches.py), else None
            self.edge.custom_id,  # custom_id
        ))
