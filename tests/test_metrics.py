"""`/metrics` follows the Prometheus conventions: parsed with prometheus_client's own parsers
(Prometheus text and OpenMetrics), names, types, units and labels checked; the dashboard's
per-second series read off the same histograms."""

from __future__ import annotations

import http.client
import json

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from router._fastpath import Reservations
from router.boxes.fleet import Fleet
from router.serve.admission import Admission
from router.serve.metrics import LATENCY_BUCKETS_S, Metrics, exposition, quantile, registry
from router.sim import Behavior, SimBox
from router.store.route_log import Row, RouteLogWriter

from conftest import wait_for
from support.calls import request


def get(url: str, path: str, headers: dict | None = None) -> tuple[int, str, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    return resp.status, resp.getheader("content-type"), body


def chat(url: str, model: str) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}]})
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


# name -> (type as Prometheus text reports it, unit as OpenMetrics reports it)
EXPECTED = {
    "router_build_info": ("gauge", ""),
    "router_calls": ("counter", ""),
    "router_failovers": ("counter", ""),
    "router_no_box": ("counter", ""),
    "router_in_flight": ("gauge", ""),
    "router_reservations": ("gauge", ""),
    "router_pressure": ("gauge", ""),
    "router_box_online": ("gauge", ""),
    "router_route_log_queue": ("gauge", ""),
    "router_route_log_dropped_rows": ("counter", ""),
    "router_route_log_write_lag_seconds": ("gauge", "seconds"),
    "router_loop_stall_max_seconds": ("gauge", "seconds"),
    "router_time_to_first_byte_seconds": ("histogram", "seconds"),
    "router_call_duration_seconds": ("histogram", "seconds"),
    "router_overhead_seconds": ("histogram", "seconds"),
    "router_box_full": ("gauge", ""),
    "router_box_cooling_models": ("gauge", ""),
    "router_box_unreachable": ("gauge", ""),
    "router_queue_depth": ("gauge", ""),
    "router_queue_outcomes": ("counter", ""),
    "router_queue_wait_seconds": ("histogram", "seconds"),
    "router_batch_lines": ("counter", ""),
    "router_batch_inflight": ("gauge", ""),
    # the library's own collectors declare no unit (their names carry it)
    "process_cpu_seconds": ("counter", ""),
    "process_resident_memory_bytes": ("gauge", ""),
    "process_open_fds": ("gauge", ""),
    "python_info": ("gauge", ""),
}


def test_metrics_follow_the_conventions_in_both_formats(start_fleet):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a)
    assert chat(router.url, "tiny") == 200
    assert chat(router.url, "nope") == 503  # no box: counted under box ""

    status, content_type, text = get(router.url, "/metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, _) in EXPECTED.items():
        assert families[name].type == kind, name
    for family in families.values():
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
    build = families["router_build_info"].samples[0]
    assert build.value == 1 and set(build.labels) == {"version", "python", "granian"}
    ttfb = families["router_time_to_first_byte_seconds"].samples
    assert {(s.labels["facade"], s.labels["box"]) for s in ttfb} == {("openai", "a"), ("openai", "")}
    counts = {s.labels["box"]: s.value for s in families["router_call_duration_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"a": 1, "": 1}
    dropped = {s.labels["reason"]: s.value for s in families["router_route_log_dropped_rows"].samples}
    assert dropped == {"write_failed": 0, "backlog_full": 0, "database_down": 0}

    status, content_type, text = get(router.url, "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}
    assert families["router_build"].type == "info"
    for name, (kind, unit) in EXPECTED.items():
        if name == "router_build_info":
            continue  # an info family, above
        assert (families[name].type, families[name].unit) == (kind, unit), name


def test_dropped_route_log_rows_are_counted(tmp_path):
    writer = RouteLogWriter(tmp_path / "router.sqlite3")
    writer.start()
    writer.record(Row("c1", "done", received_at=1.0))
    writer.record(Row("c1", "done", received_at=1.0))  # the same call twice: the store refuses the second
    writer.stop()
    fleet = Fleet(tmp_path / "boxes.json", Reservations())
    scraped = registry(Metrics(), fleet, Reservations(), writer, Admission(fleet, 8, 1.0))
    body, _ = exposition(scraped, None)
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    dropped = {s.labels["reason"]: s.value for s in families["router_route_log_dropped_rows"].samples}
    assert dropped == {"write_failed": 1, "backlog_full": 0, "database_down": 0}


def test_quantile_interpolates_inside_its_bucket_as_histogram_quantile():
    bounds = (1.0, 2.0, 4.0)
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.5, bounds, [0, 10, 0, 0]) == 1.5  # halfway through (1, 2]
    assert quantile(0.25, bounds, [10, 10, 0, 0]) == 0.5  # from 0 in the first bucket
    assert quantile(0.99, bounds, [0, 0, 1, 99]) == 4.0  # +Inf: the highest finite bound


def test_the_series_gives_each_box_its_calls_errors_and_percentiles_per_second():
    metrics = Metrics()
    for _ in range(10):
        metrics.calls[("openai", "a", 200)] += 1
        metrics.duration[("openai", "a")].observe(0.004)
        metrics.ttfb[("openai", "a")].observe(0.002)
    metrics.calls[("openai", "a", 502)] += 1
    first = metrics.series.sample(100.0)["boxes"]["a"]
    assert (first["calls"], first["errors"]) == (11, 1)
    assert LATENCY_BUCKETS_S[1] < first["latency_p50_s"] <= LATENCY_BUCKETS_S[2]
    assert LATENCY_BUCKETS_S[0] < first["ttfb_p99_s"] <= LATENCY_BUCKETS_S[1]
    metrics.calls[("ollama", "a", 200)] += 1
    metrics.duration[("ollama", "a")].observe(20.0)
    second = metrics.series.sample(101.0)["boxes"]["a"]  # only what happened since the first point
    assert (second["calls"], second["errors"], second["ttfb_p50_s"]) == (1, 0, None)
    assert 10 < second["latency_p50_s"] <= 30
    assert len(metrics.series.points) == 2


def test_metrics_need_no_key_from_inside_but_one_from_outside(start_fleet):
    router = start_fleet(SimBox("a", catalog=["tiny"]))
    assert wait_for(lambda: get(router.url, "/metrics")[0] == 200, 2)
    status, _, body = get(router.url, "/metrics", {"X-Forwarded-For": "203.0.113.9"})
    assert status == 401 and "router_calls" not in body


def batch_of(router, lines: list[dict]) -> dict:
    """A batch of chat `lines` (bodies) made through the Files and Batch API, as a keyless caller."""
    boundary = "visible-metrics-boundary"
    content = b"".join(json.dumps({"custom_id": f"q-{n}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": body}).encode() + b"\n" for n, body in enumerate(lines))
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/files", body=form, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    resp = conn.getresponse()
    uploaded = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, uploaded
    status, _, body = request(router, "POST", "/v1/batches", {"input_file_id": uploaded["id"],
                                                               "endpoint": "/v1/chat/completions",
                                                               "completion_window": "24h"})
    assert status == 200, body
    return json.loads(body)


def batch_series(url: str) -> dict[str, float]:
    """router_batch_lines_total by state, and router_batch_inflight (as "inflight")."""
    status, _, text = get(url, "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    found = {s.labels["state"]: s.value for s in families["router_batch_lines"].samples}
    found["inflight"] = families["router_batch_inflight"].samples[0].value
    return found


def test_batch_lines_are_counted_by_state_and_the_running_ones_gauged(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    zero = {"completed": 0, "failed": 0, "retried": 0, "waited": 0, "expired": 0, "cancelled": 0, "inflight": 0}
    assert batch_series(router.url) == zero  # every state there before any line ran
    a.script("tiny", Behavior.hang(1.0))  # the first line holds its box a second: in flight meanwhile
    a.script("tiny", Behavior.refuse(400, "invalid_request_error"))  # the box's 4xx: final, the error file
    made = batch_of(router, [{"model": "tiny", "messages": [{"role": "user", "content": "x"}]}] * 3
                    + [{"model": "nobody-has-this", "messages": []}])
    assert wait_for(lambda: batch_series(router.url)["inflight"] >= 1, 5)
    done = wait_for(lambda: get_json_batch(router, made["id"])["status"] == "completed", 15)
    assert done, get_json_batch(router, made["id"])
    counted = batch_series(router.url)
    assert counted["completed"] == 2 and counted["inflight"] == 0
    assert counted["failed"] == 2  # the box's 400, and the model no box has (503) on its last attempt
    assert counted["retried"] == 2  # that 503 twice before: the fleet's failure, run again
    assert counted["expired"] == counted["cancelled"] == 0


def get_json_batch(router, batch_id: str) -> dict:
    status, _, body = request(router, "GET", f"/v1/batches/{batch_id}")
    assert status == 200, body
    return json.loads(body)
