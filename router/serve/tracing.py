"""OpenTelemetry traces, optional: one span per call, following the GenAI semantic conventions.

Rules:
1. Off unless `router serve --otel`, or `OTEL_EXPORTER_OTLP_ENDPOINT` (or its `_TRACES_` form)
   is set. Off, a call pays one `is None` check (app.observe; ~0.05 µs). On without the `otel`
   extra installed, the start fails with a ConfigError naming the extra. On, `record` costs
   ~28 µs a call on the loop (timeit; most of it the SDK's span and attribute handling), and
   the OTLP export ~150 µs of CPU a call in the SDK's thread (wrk, c=16: 419 against 244 µs of
   router CPU a call), so tracing is for fleets whose calls take milliseconds, not a proxy
   benchmark.
2. A span is built when the call's route-log row is (app.observe), after the answer's last
   byte: it starts when the call arrived and ends at the row's `done_at`, so a stream's span
   ends when the stream ends. The SDK's BatchSpanProcessor exports from its own thread, never
   on the event loop.
3. Attributes are metadata only: the GenAI conventions' `gen_ai.operation.name`,
   `gen_ai.request.model`, `gen_ai.provider.name` (the box kind),
   `gen_ai.response.time_to_first_chunk` (streams), `gen_ai.usage.input_tokens` and
   `gen_ai.usage.output_tokens` when the box's last frame carries them (facades.genai); the
   route (`router.call_id`, `router.facade`, `router.box`, `router.attempts`,
   `router.refusals`, `router.decision`, `router.state`); `http.response.status_code`,
   `server.address`/`server.port` of the box, `error.type`. Never a prompt, a body, a chunk or
   a key.
4. A W3C `traceparent` on the call makes its span a child of the caller's; nothing new is sent
   to the box.
5. A tracer provider the process already set (a program embedding the router; the tests'
   in-memory exporter) is used as it is. Otherwise the router sets its own, exporting OTLP over
   `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf` by default, as the OTLP spec says, or
   `grpc`), its resource from `OTEL_SERVICE_NAME` (default "router") and
   `OTEL_RESOURCE_ATTRIBUTES`.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Mapping

import router
from router.core.errors import ConfigError
from router.facades.genai import OPERATIONS

if TYPE_CHECKING:
    from router.serve.record import CallRecord
    from router.store.route_log import Row

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
SPAN_KIND_NAME = "CLIENT"  # GenAI conventions: an inference span is a client span
# At stop, queued spans get this long to reach the collector. Not the SDK's shutdown(): it
# waits 30 s for an export stuck retrying an unreachable collector, and a stop should not.
# Whatever is left then is dropped when the process exits.
FLUSH_TIMEOUT_S = 5.0


def wanted(forced: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Tracing is on: `--otel`, or an OTLP endpoint in the environment (rule 1)."""
    return forced or any(environ.get(name) for name in ENDPOINT_VARIABLES)


def start(forced: bool, environ: Mapping[str, str] = os.environ) -> "CallTracer | None":
    """The call tracer, or None when tracing is off. Raises ConfigError without the extra."""
    if not wanted(forced, environ):
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError(
            "tracing is on (--otel or OTEL_EXPORTER_OTLP_ENDPOINT) but OpenTelemetry is not "
            "installed: pip install 'hugpy-router[otel]'"
        ) from None
    provider = trace.get_tracer_provider()
    owned = not isinstance(provider, TracerProvider)
    if owned:  # rule 5
        resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or "router"})
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # flush() bounds the stop
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(environ)))
        trace.set_tracer_provider(provider)
    return CallTracer(provider, owned)


def _otlp_exporter(environ: Mapping[str, str]):
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol in (None, "", "http/protobuf"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: the router speaks grpc or http/protobuf")
    except ImportError:
        raise ConfigError("the OTLP exporter is not installed: pip install 'hugpy-router[otel]'") from None
    return OTLPSpanExporter()  # endpoint, headers and timeout from the OTEL_EXPORTER_OTLP_* variables


class CallTracer:
    """Turns a finished call into one span (rules 2-4)."""

    def __init__(self, provider, owned: bool) -> None:
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self.provider = provider
        self.owned = owned
        self.tracer = provider.get_tracer("router", router.__version__)
        self._extract = extract
        self._kind = SpanKind[SPAN_KIND_NAME]
        self._error = Status(StatusCode.ERROR)

    def record(self, call: CallRecord, row: Row) -> None:
        """One span for `call`, whose route-log `row` is final. Never raises for a call's data."""
        operation = OPERATIONS.get(call.route.path)
        attributes = self.attributes(call, row, operation)
        failed = row.state in ("failed", "refused") or (row.http_status or 0) >= 500
        if row.error is not None:
            attributes["error.type"] = row.error
        elif failed:
            attributes["error.type"] = str(row.http_status)
        parent = None
        traceparent = call.edge.header("traceparent")
        if traceparent is not None:
            parent = self._extract({"traceparent": traceparent, "tracestate": call.edge.header("tracestate") or ""})
        name = f"{operation} {row.model}" if operation and row.model else f"{call.edge.method} {row.route}"
        span = self.tracer.start_span(
            name, context=parent, kind=self._kind, attributes=attributes, start_time=int(row.received_at * 1e9)
        )
        if failed:
            span.set_status(self._error)
        span.end(end_time=int(row.responded_at * 1e9))

    @staticmethod
    def attributes(call: CallRecord, row: Row, operation: str | None) -> dict:
        """The span's attributes: the router's own and the GenAI conventions' (box, model,
        time to first chunk, token usage read off a whole answer's end)."""
        attributes: dict = {
            "router.call_id": row.request_id,
            "router.facade": row.facade,
            "router.route": row.route,
            "router.state": row.state,
            "router.attempts": len(row.attempts),
            "router.refusals": [a["refusal"] for a in row.attempts if a.get("refusal")],
        }
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
        if row.model is not None:
            attributes["gen_ai.request.model"] = row.model
        if row.path is not None:
            attributes["router.decision"] = row.path
        if row.http_status is not None:
            attributes["http.response.status_code"] = row.http_status
        box = call.box
        if box is not None:
            attributes["router.box"] = box.name
            attributes["gen_ai.provider.name"] = box.config.kind.value
            attributes["server.address"] = box.config.host
            attributes["server.port"] = box.config.port
        if call.stream and call.t_first_byte:
            attributes["gen_ai.response.time_to_first_chunk"] = call.t_first_byte - call.t_received
        tokens = call.tokens
        if tokens is not None and not tokens.estimated and row.state == "done":  # as the box reported
            attributes["gen_ai.usage.input_tokens"] = tokens.prompt
            attributes["gen_ai.usage.output_tokens"] = tokens.completion
        return attributes

    def flush(self) -> None:
        """Exports what is queued, waiting at most FLUSH_TIMEOUT_S (blocking: off the event loop).

        The SDK's force_flush exports in the calling thread and ignores its timeout (1.45: an
        unreachable collector holds it for the exporter's retries, 10 s), so it runs in a daemon
        thread of its own that a stopping process does not wait for."""
        if self.owned:
            flushing = threading.Thread(target=self.provider.force_flush, name="otel-flush", daemon=True)
            flushing.start()
            flushing.join(FLUSH_TIMEOUT_S)
