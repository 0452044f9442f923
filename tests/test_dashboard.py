"""The dashboard at `GET /ui` in a real browser: Debian's Chromium driven by Playwright, in
front of a real router and simulated boxes. A screenshot lands in tests/artifacts/."""

from __future__ import annotations

import http.client
import json
import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from router.boxes.link import HEALTH_TTL_S
from router.sim import SimBox, SimFleet, SimOllama
from router.sim.prefix_cache import prompt_tokens

from conftest import ROOT, RouterProcess, wait_for

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package: no browser downloads here (scripts/setup)
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ARTIFACTS = ROOT / "tests" / "artifacts"
ADMIN_KEY = "dashboard-admin-key-7f3e"
OUTSIDE = {"X-Forwarded-For": "203.0.113.7"}  # a caller behind a trusted proxy: not loopback
# The page follows the stream (only its keys panel polls, every 5 s). A call shows once the
# route-log writer flushed it (50 ms) and the next tick (1 s) read it.
SEEN_WITHIN_MS = 5000


@pytest.fixture
def browser(tmp_path):
    """open(url, headers=None) -> (page, console errors); one fresh profile per test."""
    assert CHROMIUM.exists(), "Chromium is missing: scripts/setup installs Debian's chromium package"
    with sync_playwright() as playwright:
        contexts = []

        def open_page(url: str, headers: dict | None = None):
            context = playwright.chromium.launch_persistent_context(
                str(tmp_path / f"profile-{len(contexts)}"), executable_path=str(CHROMIUM),
                headless=True, args=CHROMIUM_FLAGS, extra_http_headers=headers or {},
                viewport={"width": 1400, "height": 900},
            )
            contexts.append(context)
            page = context.new_page()
            errors: list[str] = []
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url + "/ui")
            return page, errors

        yield open_page
        for context in contexts:
            context.close()


def call(url: str, model: str, headers: dict | None = None) -> tuple[int, str]:
    """A chat call; returns (status, the router's request id)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "CANARY-prompt"}]})
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, resp.getheader("x-hugpy-router-request-id")


def test_the_page_shows_every_box_residents_and_a_new_call_live(start_fleet, browser):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], free_gpu_bytes=6 << 30)
    b = SimBox("b", catalog=["tiny", "big"])
    c = SimBox("c", catalog=["big"])
    router = start_fleet(a, b, c, boxes_extra={"c": {"pool": "lab"}})
    page, errors = browser(router.url)
    boxes = page.locator("#boxes tbody tr")
    expect(boxes).to_have_count(3)
    for name in ("a", "b", "c"):
        expect(page.locator(f'#boxes tr[data-box="{name}"]')).to_contain_text("online")
    expect(page.locator('#boxes tr[data-box="c"]')).to_contain_text("lab")
    expect(page.locator("#link")).to_have_text("live")

    # after the page loaded: a call that sets the resident's settings, and a refused one
    status, call_id = call(router.url, "tiny@ram-only", {"X-Router-Box": "a"})
    assert status == 200 and call_id
    refused_status, refused_id = call(router.url, "nobody-has-this")
    assert refused_status == 503
    row = page.locator(f'#calls tr[data-call-id="{call_id}"]')
    expect(row).to_contain_text("tiny", timeout=SEEN_WITHIN_MS)
    expect(row).to_contain_text("200")
    expect(page.locator(f'#calls tr[data-call-id="{refused_id}"]')).to_contain_text("503", timeout=SEEN_WITHIN_MS)
    resident = page.locator('#boxes tr[data-box="a"] [data-model="tiny"]')
    expect(resident.locator(".settings")).to_contain_text("ram-only", timeout=SEEN_WITHIN_MS)
    expect(page.locator('#models tr[data-model="tiny"]')).to_contain_text("a")
    expect(page.locator('#series tr[data-box="a"] svg polyline').first).to_be_attached(timeout=SEEN_WITHIN_MS)
    expect(page.locator("#schedule li").first).to_contain_text("order")
    # affinity: the pinned call and an unpinned one of one message have no key: both counted as none
    assert call(router.url, "tiny")[0] == 200
    expect(page.locator("#affinity-summary")).to_contain_text("on: slack")
    expect(page.locator('#affinity tr[data-box="a"][data-model="tiny"]')).to_contain_text("0 / 0 / 2", timeout=SEEN_WITHIN_MS)
    # each call's affinity has a column of its own, a title, and a legend entry
    expect(row.locator("td.affinity")).to_have_text("none")
    expect(row.locator("td.affinity")).to_have_attribute("title", "affinity: no key")
    legend = page.locator("#calls-legend")
    legend.locator("summary").click()
    expect(legend.locator("dt", has_text="affinity")).to_be_visible()
    expect(legend).to_contain_text("hit:<kind>: the call went to the box its affinity key pointed to")
    assert "CANARY-prompt" not in page.content()

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert errors == []


def test_the_keys_panel_shows_usage_against_limits(start_fleet, browser):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a)
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/keys", json.dumps({"name": "team-a", "limits": {"rpm": 60, "budget_tokens": 5000}}),
                 {"Content-Type": "application/json"})
    created = json.loads(conn.getresponse().read())
    conn.close()
    assert call(router.url, "tiny", {"Authorization": f"Bearer {created['key']}"})[0] == 200
    page, errors = browser(router.url)
    row = page.locator(f'#keys tr[data-key="{created["id"]}"]')
    expect(row).to_contain_text("team-a", timeout=8000)
    expect(row).to_contain_text("/ 60")  # rpm left / limit
    spent = prompt_tokens({"messages": [{"role": "user", "content": "CANARY-prompt"}]}) + 6  # the sim's counts
    expect(row).to_contain_text(f"{spent} / 5000")  # the call's prompt and answer tokens of the budget
    assert created["key"] not in page.content()
    assert errors == []


def test_a_stopped_box_is_shown_offline(start_fleet, browser):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    router = start_fleet(a, b)
    page, errors = browser(router.url)
    expect(page.locator('#boxes tr[data-box="b"]')).to_have_attribute("data-status", "online")
    router.fleet.stop_box(b)
    # The link marks the box offline once its last good answer is HEALTH_TTL_S old (plus one
    # health interval); the page shows it within its next tick.
    offline = page.locator('#boxes tr[data-box="b"]')
    expect(offline).to_have_attribute("data-status", "offline", timeout=(HEALTH_TTL_S + 5) * 1000)
    expect(offline.locator(".tag.offline")).to_have_text("offline")
    expect(offline.locator(".down")).to_have_text("connection refused")  # and says why
    expect(page.locator('#boxes tr[data-box="a"]')).to_have_attribute("data-status", "online")
    assert errors == []


def test_from_outside_the_page_asks_for_a_key_once_and_sends_it_as_a_bearer(start_fleet, browser):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a, env={"HUGPY_ROUTER_KEY": ADMIN_KEY, "HUGPY_ROUTER_TRUSTED_PROXIES": "127.0.0.1"})
    page, _ = browser(router.url, OUTSIDE)  # 401s are console errors in Chromium: not checked here
    requests: list = []
    page.on("request", lambda request: requests.append(request))
    form = page.locator("#key-form")
    expect(form).to_be_visible()
    expect(page.locator("#boxes")).to_be_hidden()

    page.fill("#key-input", "not-the-key")
    page.press("#key-input", "Enter")
    expect(page.locator("#key-reason")).to_contain_text("invalid")
    expect(form).to_be_visible()

    page.fill("#key-input", ADMIN_KEY)
    page.press("#key-input", "Enter")
    expect(page.locator('#boxes tr[data-box="a"]')).to_contain_text("online")
    expect(form).to_be_hidden()
    assert page.evaluate("sessionStorage.getItem('router.adminKey')") == ADMIN_KEY
    page.reload()  # typed once: the tab keeps it
    expect(page.locator('#boxes tr[data-box="a"]')).to_contain_text("online")
    expect(form).to_be_hidden()

    events = [r for r in requests if r.url.endswith("/v1/router/events")]
    assert events and events[-1].headers.get("authorization") == f"Bearer {ADMIN_KEY}"
    assert all(ADMIN_KEY not in r.url for r in requests)
    status, call_id = call(router.url, "tiny", {"Authorization": f"Bearer {ADMIN_KEY}", **OUTSIDE})
    assert status == 200
    expect(page.locator(f'#calls tr[data-call-id="{call_id}"]')).to_be_visible(timeout=SEEN_WITHIN_MS)
    assert ADMIN_KEY not in router.log_text()


def test_the_page_itself_carries_no_data_and_the_stream_needs_the_admin_rule(start_fleet):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a, env={"HUGPY_ROUTER_KEY": ADMIN_KEY, "HUGPY_ROUTER_TRUSTED_PROXIES": "127.0.0.1"})
    host, port = router.url.removeprefix("http://").split(":")

    def get(path: str, headers: dict) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        status, head = resp.status, {k.lower(): v for k, v in resp.getheaders()}
        body = b"" if head.get("content-type") == "text/event-stream" else resp.read()
        conn.close()
        return status, head, body

    status, head, body = get("/ui", OUTSIDE)
    assert status == 200 and head["content-type"].startswith("text/html")
    assert "script-src 'self'" in head["content-security-policy"] and b'src="/ui/app.js"' in body
    assert get("/v1/router/events", OUTSIDE)[0] == 401
    assert get("/v1/router/events", {**OUTSIDE, "Authorization": f"Bearer {ADMIN_KEY}"})[0] == 200


def test_open_event_streams_do_not_hold_up_a_stop(start_fleet):
    router = start_fleet(SimBox("a", catalog=["tiny"]))
    host, port = router.url.removeprefix("http://").split(":")
    streams = []
    for path in ("/v1/router/events", "/v1/router/schedule"):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read1(4096)
        streams.append((conn, resp))
    started = time.monotonic()
    assert router.stop() == 0
    # real time: a router process stopping on SIGTERM; half the 30 s grace it would wait out
    assert time.monotonic() - started < 15  # not the 30 s grace for calls in flight
    for conn, resp in streams:
        while resp.read1(4096):  # each stream ended cleanly
            pass
        conn.close()


def test_the_queue_and_each_boxs_limit_show_live(start_fleet, browser):
    from concurrent.futures import ThreadPoolExecutor

    from router.sim import Behavior

    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    a.script("tiny", Behavior.hang(4.0), Behavior.hang(0.1))
    router = start_fleet(a, boxes_extra={"a": {"max_inflight": 1}})
    page, errors = browser(router.url)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(call, router.url, "tiny")
        time.sleep(0.5)
        waiting = pool.submit(call, router.url, "tiny")
        box = page.locator('#boxes tr[data-box="a"]')
        expect(box).to_contain_text("1 / 1", timeout=SEEN_WITHIN_MS)
        expect(box).to_contain_text("full")
        row = page.locator("#queue tbody tr")
        expect(row).to_have_count(1, timeout=SEEN_WITHIN_MS)
        expect(row).to_contain_text("normal")
        expect(page.locator("#queue-summary")).to_contain_text("1 waiting (room for 1024")
        assert first.result()[0] == 200 and waiting.result()[0] == 200
    expect(page.locator("#queue tbody tr")).to_have_count(0, timeout=SEEN_WITHIN_MS)
    # an empty queue still has a Retry-After: the summary says what it is
    summary = page.locator("#queue-summary")
    expect(summary).to_contain_text("Nobody waiting")
    expect(summary).to_contain_text("A call turned away now would be told Retry-After:")
    assert errors == []


def test_the_page_shows_aliases_their_first_available_model_and_unlisted_ones(start_fleet_in_process, browser):
    a = SimBox("a", residents=["big"])
    router = start_fleet_in_process(a)
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("PUT", "/v1/aliases/coder", body=json.dumps({"chain": ["ghost", "big"]}),
                 headers={"Content-Type": "application/json"})
    assert conn.getresponse().status == 201
    conn.close()
    page, errors = browser(router.url)
    row = page.locator('#aliases tr[data-alias="coder"]')
    # no box lists ghost: it is tagged
    expect(row.locator("td").nth(1)).to_have_text("ghost unlisted → big", timeout=SEEN_WITHIN_MS)
    expect(row.locator("td").nth(1).locator(".tag")).to_have_count(1)
    expect(row.locator("td").nth(2)).to_have_text("big")
    assert errors == []


def test_the_routers_on_the_shared_server_show_with_their_calls(start_fleet, browser, redis_server):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a, extra_args=("--shared-url", redis_server.url, "--instance", "front-1"))
    page, errors = browser(router.url)
    assert call(router.url, "tiny")[0] == 200
    row = page.locator('#routers tr[data-router="front-1"]')
    expect(row).to_have_count(1, timeout=SEEN_WITHIN_MS)
    expect(row.locator("td").nth(1)).to_have_text("1", timeout=SEEN_WITHIN_MS)  # its calls, from the heartbeat
    expect(page.locator("#routers-summary")).to_contain_text("counting fleet-wide")
    assert errors == []


def test_one_router_shows_no_routers_section(start_fleet, browser):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a)
    page, errors = browser(router.url)
    expect(page.locator('#boxes tr[data-box="a"]')).to_have_count(1, timeout=SEEN_WITHIN_MS)
    expect(page.locator("#routers")).to_be_hidden()
    status, call_id = call(router.url, "tiny")
    assert status == 200
    expect(page.locator(f'#calls tr[data-call-id="{call_id}"]')).to_be_visible(timeout=SEEN_WITHIN_MS)
    expect(page.locator("#calls th.router")).to_be_hidden()  # one router: no router column
    assert errors == []


def test_at_1400_px_the_keys_fit_and_the_routers_sit_by_the_boxes(start_fleet, browser, redis_server):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a, extra_args=("--shared-url", redis_server.url, "--instance", "front-1"))
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    limits = {"rpm": 600, "tpm": 200000, "budget_tokens": 5000000, "max_parallel": 8,
              "models": ["tiny", "qwen3-8b", "llama3.2:3b"]}
    conn.request("POST", "/v1/keys", json.dumps({"name": "team-research", "limits": limits}),
                 {"Content-Type": "application/json"})
    created = json.loads(conn.getresponse().read())
    conn.close()
    for _ in range(3):
        assert call(router.url, "tiny", {"Authorization": f"Bearer {created['key']}"})[0] == 200
    page, errors = browser(router.url)
    expect(page.locator(f'#keys tr[data-key="{created["id"]}"]')).to_contain_text("team-research", timeout=8000)
    expect(page.locator('#routers tr[data-router="front-1"]')).to_have_count(1, timeout=SEEN_WITHIN_MS)
    widths = page.evaluate("""() => ({
        keys: [document.querySelector("#keys").scrollWidth, document.querySelector("#keys").clientWidth],
        page: [document.documentElement.scrollWidth, document.documentElement.clientWidth]})""")
    assert widths["keys"][0] <= widths["keys"][1] and widths["page"][0] <= widths["page"][1], widths
    top = lambda selector: page.locator(selector).bounding_box()["y"]  # noqa: E731
    boxes = page.locator("#boxes").bounding_box()
    assert top("#routers") < top("#series") < top("#calls")  # above the plots and the recent calls
    assert top("#routers") - (boxes["y"] + boxes["height"]) < 100  # right under the boxes (and their legend)
    assert errors == []


def test_with_several_routers_on_one_route_log_each_call_names_its_router(tmp_path, pg_url, browser):
    box = SimOllama("o", tags=["tiny"], loaded=["tiny"])
    sims = SimFleet([box])
    sims.start()
    routers = []
    try:
        for n in (1, 2):
            folder = tmp_path / f"front-{n}"
            folder.mkdir()
            (folder / "boxes.json").write_text('{"boxes": []}')  # not read: the boxes live in the database
            routers.append(RouterProcess(folder / "boxes.json", "--database-url", pg_url, "--instance", f"front-{n}"))
        front_1, front_2 = routers
        host, port = front_1.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/boxes", json.dumps({"name": "o", "url": box.url, "kind": "ollama"}),
                     {"Content-Type": "application/json"})
        assert conn.getresponse().status == 201
        conn.close()
        assert wait_for(lambda: call(front_2.url, "tiny")[0] == 200, timeout=10)  # front-2 knows the box
        page, errors = browser(front_1.url)
        served = {call(r.url, "tiny")[1]: name for r, name in ((front_1, "front-1"), (front_2, "front-2"))}
        for call_id, name in served.items():
            cell = page.locator(f'#calls tr[data-call-id="{call_id}"] td.router')
            expect(cell).to_have_text(name, timeout=SEEN_WITHIN_MS)
            expect(cell).to_be_visible()
        expect(page.locator("#calls th.router")).to_be_visible()
        assert errors == []
    finally:
        for router in routers:
            router.stop()
        sims.stop()


def test_an_ollama_boxs_name_and_another_boxs_that_ollama_reads_alike_are_one_model(start_fleet_in_process, browser):
    hugpy = SimBox("h", catalog=["tiny-llama", "qwen3-8b"], residents=["tiny-llama"])
    ollama = SimOllama("o", tags=["tiny-llama", "qwen3:8b"], loaded=["tiny-llama"])  # listed as tiny-llama:latest
    router = start_fleet_in_process(hugpy, ollama)
    page, errors = browser(router.url)
    row = page.locator('#models tr[data-model="tiny-llama"]')
    expect(row).to_contain_text("also tiny-llama:latest", timeout=SEEN_WITHIN_MS)
    expect(row.locator("td").nth(1)).to_have_text("h, o")  # resident on both
    expect(row.locator("td").nth(2)).to_have_text("h, o")
    expect(page.locator('#models tr[data-model="tiny-llama:latest"]')).to_have_count(0)
    # `qwen3-8b` is `qwen3-8b:latest` to Ollama, not `qwen3:8b`: two models
    expect(page.locator("#models tbody tr")).to_have_count(3)
    expect(page.locator('#models tr[data-model="qwen3-8b"] td').nth(2)).to_have_text("h")
    expect(page.locator('#models tr[data-model="qwen3:8b"] td').nth(2)).to_have_text("o")
    assert errors == []


def make_batch(url: str, bodies: list[dict]) -> dict:
    """A chat batch of `bodies` through the Files and Batch API, as a keyless (loopback) caller."""
    boundary = "dashboard-batch-boundary"
    content = b"".join(json.dumps({"custom_id": f"q-{n}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": body}).encode() + b"\n" for n, body in enumerate(bodies))
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n"
            ).encode() + content + f"\r\n--{boundary}--\r\n".encode()
    host, port = url.removeprefix("http://").split(":")
    answers = []
    for path, body, content_type in (("/v1/files", form, f"multipart/form-data; boundary={boundary}"),
                                     ("/v1/batches", None, "application/json")):
        if body is None:
            body = json.dumps({"input_file_id": answers[-1]["id"], "endpoint": "/v1/chat/completions",
                               "completion_window": "24h"})
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        answers.append(json.loads(resp.read()))
        conn.close()
        assert resp.status == 200, answers[-1]
    return answers[-1]


def test_the_batches_panel_shows_progress_pace_and_status_live(start_fleet, browser):
    from router.sim import Behavior

    lines = 20
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    a.script("tiny", *[Behavior.hang(1.0)] * lines)  # two lines at once (--batch-per-box): about 10 s in all
    router = start_fleet(a)
    page, errors = browser(router.url)
    expect(page.locator("#link")).to_have_text("live")
    made = make_batch(router.url, [{"model": "tiny", "messages": [{"role": "user", "content": "CANARY-line"}]}] * lines)
    row = page.locator(f'#batches tr[data-batch="{made["id"]}"]')
    expect(row).to_have_attribute("data-status", "in_progress", timeout=SEEN_WITHIN_MS)
    expect(row.locator(".tag")).to_have_text("in progress")
    expect(row.locator("td.batch-rate")).to_have_text(re.compile(r"^[0-9]+\.[0-9]/s$"), timeout=SEEN_WITHIN_MS)
    expect(row.locator(".batch-counts")).to_contain_text(f"of {lines}")
    summary = page.locator("#batches-summary")
    expect(summary).to_contain_text("1 running; this router runs 2 of their lines now", timeout=SEEN_WITHIN_MS)
    rate = float(row.locator("td.batch-rate").inner_text().removesuffix("/s"))
    assert 0 < rate <= 4  # two lines a second, read off whole polls

    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", f"/v1/batches/{made['id']}/cancel")
    assert conn.getresponse().status == 200
    conn.close()
    expect(row).to_have_attribute("data-status", "cancelled", timeout=SEEN_WITHIN_MS)
    bar = row.locator("svg.batch-bar")
    expect(bar).to_have_attribute("data-done", str(lines))  # run and cancelled lines: all done
    expect(bar.locator("rect.failed")).to_have_attribute("width", re.compile(r"^[1-9]"))  # the cancelled ones
    expect(row.locator("td.batch-rate")).to_have_text("—")
    expect(summary).to_contain_text("0 running; this router runs 0 of their lines now", timeout=SEEN_WITHIN_MS)
    expect(summary).to_contain_text("cancelled")  # the runner's lines by state, since it started
    assert "CANARY-line" not in page.content()
    assert errors == []
