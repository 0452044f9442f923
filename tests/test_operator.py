"""The route log, keys and the operator's API in the running router (issue: store, keys, admin)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.sim import Behavior, SimBox
from router.store import db

from conftest import ROOT, wait_for
from support.url_calls import CANARY, chat_body, request


def route_rows(router) -> list[dict]:
    rows, since = [], 0
    while True:
        status, data = request(router.url, "GET", f"/v1/telemetry?since={since}&limit=5000")
        assert status == 200
        doc = json.loads(data)
        rows += doc["rows"]
        since = doc["next"]
        if not doc["more"]:
            return rows


def store_rows(router) -> int:
    conn = db.open_store(router.boxes_path.parent / "home" / "router.sqlite3")
    try:
        return conn.execute("SELECT count(*) FROM route_log").fetchall()[0][0]
    finally:
        conn.close()


def test_every_call_is_one_row_with_its_decision_and_attempts(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    a.script("tiny", Behavior.refuse(503, "insufficient_resources", "won't fit"))
    router = start_fleet_in_process(a, b)
    assert request(router.url, "POST", "/v1/chat/completions", chat_body(CANARY))[0] == 200
    assert request(router.url, "POST", "/v1/chat/completions", chat_body().replace(b"tiny", b"nope"))[0] == 503
    assert request(router.url, "POST", "/v1/chat/completions", b"{bad")[0] == 400
    rows = wait_for(lambda: (r := route_rows(router)) and len(r) == 3 and r, 3)
    done, refused, bad = rows
    assert done["state"] == "done" and done["box"] == "b" and done["http_status"] == 200
    assert [att.get("refusal") for att in done["attempts"]] == ["insufficient_resources", None]
    assert done["decision"]["boxes"][0] == "a" and done["decision"]["why"]["a"] == "serving"
    assert done["first_byte_at"] >= done["received_at"] and done["bytes_out"] > 0
    assert refused["state"] == "refused" and refused["decision"]["refused"]["a"].startswith("no_model")
    assert bad["state"] == "failed" and bad["http_status"] == 400
    router.stop()
    store = (router.boxes_path.parent / "home" / "router.sqlite3").read_bytes()
    assert CANARY.encode() not in store


def test_ten_thousand_calls_ten_thousand_rows_and_the_loop_never_blocks(start_fleet):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a)
    host, port = router.url.removeprefix("http://").split(":")
    calls, workers = 10_000, 16

    def worker(n: int) -> int:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        ok = 0
        for _ in range(n):
            conn.request("POST", "/v1/chat/completions", body=chat_body(), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            ok += resp.status == 200
        conn.close()
        return ok

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        assert sum(pool.map(worker, [calls // workers] * workers)) == calls
    status, data = request(router.url, "GET", "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(data.decode())}
    stall = families["router_loop_stall_max_seconds"].samples[0].value
    print(f"longest event-loop stall during the burst: {stall * 1000:.1f} ms")
    # real time: the router's own loop-lag gauge over a real burst; a loaded host delays the
    # loop too, and 0.25 s was within its reach
    assert stall < 0.5, f"the event loop stalled {stall * 1000:.0f} ms"
    assert router.stop() == 0  # SIGTERM flushes every row
    assert store_rows(router) == calls


def test_kill_9_mid_burst_reopens_clean(start_fleet):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a)

    def one(_):
        try:
            return request(router.url, "POST", "/v1/chat/completions", chat_body())[0]
        except OSError:
            return 0

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(2000)]
        time.sleep(0.7)
        os.kill(router.pid, signal.SIGKILL)
        concurrent.futures.wait(futures)
    router.proc.wait(5)
    assert store_rows(router) > 0  # open_store ran the integrity check: the file is clean


def run_keys(router, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HUGPY_ROUTER_HOME": str(router.boxes_path.parent / "home")}
    return subprocess.run([sys.executable, "-m", "router", "keys", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=30)


def test_keys_scopes_require_key_and_revoke(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a, env={"HUGPY_ROUTER_REQUIRE_KEY": "always"})
    use_key = run_keys(router, "create", "--name", "laptop").stdout.strip()
    assert use_key.startswith("hpk_")
    client = lambda key: openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)  # noqa: E731
    with pytest.raises(openai.AuthenticationError) as info:
        client("hpk_nope_nope").chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "invalid_api_key"
    assert wait_for(lambda: _works(client(use_key)), 3, 0.2)
    # A use key cannot manage; loopback manages without a key.
    status, _ = request(router.url, "GET", "/v1/router/state", headers={"Authorization": f"Bearer {use_key}"})
    assert status == 200  # loopback: admin routes need no key
    key_id = use_key.split("_")[1]
    assert run_keys(router, "revoke", key_id).returncode == 0
    assert wait_for(lambda: not _works(client(use_key)), 3, 0.2)
    log = router.log_text()
    assert use_key not in log and use_key.split("_", 2)[2] not in log


def _works(client) -> bool:
    try:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    except openai.APIStatusError:
        return False
    return True


def test_a_spoofed_forwarded_for_from_an_untrusted_peer_is_outside(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)  # require-key: outside (default)
    assert request(router.url, "POST", "/v1/chat/completions", chat_body())[0] == 200
    status, data = request(router.url, "POST", "/v1/chat/completions", chat_body(),
                           {"X-Forwarded-For": "127.0.0.1"})
    assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    status, _ = request(router.url, "GET", "/v1/router/state", headers={"X-Forwarded-For": "127.0.0.1"})
    assert status == 401


def test_admin_state_schedule_and_relay(start_fleet_in_process):
    a = SimBox("a", key="hpk_box_relaykey000000000000", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    status, data = request(router.url, "GET", "/v1/router/state")
    doc = json.loads(data)
    assert status == 200 and doc["boxes"][0]["name"] == "a" and [r["key"] for r in doc["boxes"][0]["residents"]] == ["tiny"]
    assert "key" not in json.dumps(json.loads(request(router.url, "GET", "/v1/boxes")[1])).replace('"has_key"', "")
    status, data = request(router.url, "GET", "/v1/boxes/a/v1/telemetry/state")
    assert status == 200 and json.loads(data)["residents"][0]["key"] == "tiny"
    for path in ("/v1/boxes/a/../../etc/passwd", "/v1/boxes/a/v1/keys", "/v1/boxes/a/v1/%2e%2e/v1/keys",
                 "/v1/boxes/a/health"):
        assert request(router.url, "GET", path)[0] in (403, 404), path
    # the schedule stream: two snapshots arrive within ~2 s
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/v1/router/schedule")
    resp = conn.getresponse()
    seen = b""
    while seen.count(b"event: schedule:priority") < 2:
        seen += resp.read1(4096)
    conn.close()
    event = json.loads(seen.split(b"data: ")[1].split(b"\n")[0])
    assert set(event) == {"generation", "order", "pending", "pressure"} and event["order"] == ["a"]


def test_metrics_parse_and_count_calls(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    for _ in range(3):
        request(router.url, "POST", "/v1/chat/completions", chat_body())
    status, data = request(router.url, "GET", "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(data.decode())}
    calls = families["router_calls"].samples
    assert sum(s.value for s in calls if s.labels.get("status") == "200" and s.name.endswith("_total")) == 3
    assert "router_time_to_first_byte_seconds" in families and "router_in_flight" in families


def test_the_relay_never_smuggles_a_second_request(start_fleet_in_process):
    a = SimBox("a", key="hpk_box_relaykey000000000000", catalog=["tiny"])
    router = start_fleet_in_process(a)
    smuggle = ("/v1/boxes/a/v1/models%20HTTP/1.1%0D%0AHost:%20x%0D%0AContent-Length:%200%0D%0A%0D%0A"
               "POST%20/v1/keys")
    status, _ = request(router.url, "GET", smuggle)
    assert status == 403
    assert not [c for c in a.calls if c.path.startswith("/v1/keys")]
