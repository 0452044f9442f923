"""OpenTelemetry: one span per call with the GenAI and routing attributes, ended when the
stream ends, never carrying a prompt or a body; OTLP export when the endpoint is set; off,
nothing."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import ollama
import openai
import pytest

from router.serve import tracing
from router.sim import Behavior, SimBox, SimOllama

from conftest import wait_for

CANARY = "CANARY-otel-5b1e"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
CHUNKS, CADENCE_S = 5, 0.06


def test_a_span_per_call_with_genai_and_routing_attributes(start_fleet, tmp_path):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    a.script("tiny", Behavior.refuse(503, "insufficient_resources", "won't fit"))
    mac = SimOllama("mac", tags=["llama3:latest"], loaded=["llama3:latest"], chunks=CHUNKS, cadence_s=CADENCE_S)
    spans_path = tmp_path / "spans.json"
    router = start_fleet(a, b, mac, extra_args=("--otel",), module="tests.otel_router",
                         env={"ROUTER_TEST_SPANS": str(spans_path)})
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": CANARY}],
                                   extra_headers={"traceparent": TRACEPARENT})
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="nobody-has-it", messages=[{"role": "user", "content": CANARY}])
    started = time.time()
    parts = list(ollama.Client(host=router.url).chat(
        model="llama3", messages=[{"role": "user", "content": CANARY}], stream=True))
    assert parts[-1]["done"]
    assert router.stop() == 0  # exits after exporting every span
    spans = json.loads(spans_path.read_text())
    assert CANARY not in spans_path.read_text()
    assert len(spans) == 3
    chat, refused, stream = sorted(spans, key=lambda s: s["start_ns"])

    attrs = chat["attributes"]
    assert chat["name"] == "chat tiny" and chat["kind"] == "CLIENT" and chat["status"] == "UNSET"
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.provider.name"] == "hugpy" and attrs["router.box"] == "b"
    assert attrs["router.attempts"] == 2 and attrs["router.refusals"] == ["insufficient_resources"]
    # the box's own count of the prompt (its prefix cache's tokens: router/sim/prefix_cache.py)
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (b.prefix_cache.prompt_tokens, 6)
    assert attrs["http.response.status_code"] == 200 and attrs["router.call_id"].startswith("rt-")
    assert "gen_ai.response.time_to_first_chunk" not in attrs  # not a stream
    assert chat["trace_id"] == TRACE_ID and chat["parent_span_id"] == "00f067aa0ba902b7"

    assert refused["status"] == "ERROR" and refused["attributes"]["error.type"] == "no_box"
    assert refused["attributes"]["router.attempts"] == 0 and "router.box" not in refused["attributes"]
    assert refused["parent_span_id"] is None

    attrs = stream["attributes"]
    assert stream["name"] == "chat llama3" and attrs["router.box"] == "mac" and attrs["gen_ai.provider.name"] == "ollama"
    assert attrs["gen_ai.usage.output_tokens"] == CHUNKS and attrs["gen_ai.usage.input_tokens"] > 0
    duration_s = (stream["end_ns"] - stream["start_ns"]) / 1e9
    assert 0 < attrs["gen_ai.response.time_to_first_chunk"] < duration_s
    # real time (the router's own span stamps): lower bounds, which load cannot break
    assert duration_s >= (CHUNKS - 1) * CADENCE_S  # the span lasted as long as the stream
    assert stream["start_ns"] / 1e9 >= started - 0.01


class Collector(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Collector.received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_otlp_endpoint_turns_tracing_on_and_spans_go_there(start_fleet):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        router = start_fleet(SimBox("a", catalog=["tiny"], residents=["tiny"]), env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
            "OTEL_SERVICE_NAME": "router-under-test",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        })
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": CANARY}])
        assert wait_for(lambda: Collector.received, 5)
        path, content_type, body = Collector.received[0]
        assert path == "/v1/traces" and content_type == "application/x-protobuf"
        assert CANARY.encode() not in body
        request = ExportTraceServiceRequest.FromString(body)
        resource = request.resource_spans[0]
        service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
        span = resource.scope_spans[0].spans[0]
        attrs = {a.key: a.value for a in span.attributes}
        assert service == "router-under-test" and span.name == "chat tiny"
        assert attrs["gen_ai.request.model"].string_value == "tiny"
    finally:
        server.shutdown()


def test_an_unreachable_collector_does_not_hold_up_the_stop(start_fleet):
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        router = start_fleet(SimBox("a", catalog=["tiny"], residents=["tiny"]), env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed.getsockname()[1]}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        })
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(20):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        time.sleep(0.5)  # the exporter is retrying by now
        started = time.monotonic()
        assert router.stop() == 0
        print(f"stopped in {time.monotonic() - started:.1f} s")
        assert time.monotonic() - started < tracing.FLUSH_TIMEOUT_S + 5  # real time: a process's exit


def test_off_without_the_flag_or_an_endpoint():
    assert tracing.start(False, {}) is None
    assert not tracing.wanted(False, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    assert tracing.wanted(False, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318"})
