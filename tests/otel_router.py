"""`router` with the OpenTelemetry SDK's in-memory exporter installed as the process's tracer
provider (tracing.py rule 5): `python -m tests.otel_router serve ...`. At exit it writes the
finished spans as JSON to $ROUTER_TEST_SPANS."""

from __future__ import annotations

import json
import os
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.cli.main import main


def _value(value):
    return list(value) if isinstance(value, tuple) else value


def dump(spans) -> list[dict]:
    return [
        {
            "name": span.name,
            "kind": span.kind.name,
            "start_ns": span.start_time,
            "end_ns": span.end_time,
            "status": span.status.status_code.name,
            "trace_id": format(span.context.trace_id, "032x"),
            "parent_span_id": format(span.parent.span_id, "016x") if span.parent else None,
            "attributes": {key: _value(value) for key, value in span.attributes.items()},
        }
        for span in spans
    ]


if __name__ == "__main__":
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    code = main(sys.argv[1:])
    with open(os.environ["ROUTER_TEST_SPANS"], "w") as out:
        json.dump(dump(exporter.get_finished_spans()), out)
    sys.exit(code)
