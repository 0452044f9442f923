"""Batches run on idle capacity (docs/batches.md, router/serve/batches.py): the official `openai`
client end to end, the idle rule, limits, cancel, expiry, restarts, kills and two routers on
PostgreSQL. The boxes are simulated Ollama boxes on loopback; the router is real."""

from __future__ import annotations

import gc
import io
import json
import signal
import threading
import time

import openai
import pytest

from router.serve.batches import BatchRunner
from router.sim import SimFleet, SimOllama
from router.sim.behavior import Behavior

from conftest import RouterProcess, wait_for, write_boxes
from support.calls import bearer, call, new_key, request

pytestmark = pytest.mark.timeout(120)

BATCH_MODEL, CHAT_MODEL = "tiny", "chat"


def lines(n: int, model: str = BATCH_MODEL, **body) -> bytes:
    return b"".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "messages": [{"role": "user", "content": f"q {i}"}],
                                         **body}}).encode() + b"\n" for i in range(n))


def client(router, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=30)


def submit(api: openai.OpenAI, data: bytes, window: str = "24h"):
    uploaded = api.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window=window)


def finished(api: openai.OpenAI, batch_id: str, timeout: float = 60.0, status: str | None = None):
    ends = {"completed", "expired", "cancelled", "failed"} if status is None else {status}
    batch = wait_for(lambda: (b := api.batches.retrieve(batch_id)).status in ends and b, timeout, 0.1)
    assert batch, api.batches.retrieve(batch_id)
    return batch


def read_lines(api: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in api.files.content(file_id).text.splitlines()]


def answers(router, api: openai.OpenAI, batch) -> tuple[list[dict], list[dict]]:
    return read_lines(api, batch.output_file_id), read_lines(api, batch.error_file_id)


def rows(router) -> list[dict]:
    time.sleep(0.15)  # the route-log writer's flush window
    status, _, body = request(router, "GET", "/v1/telemetry?since=0&limit=5000", timeout=10)
    assert status == 200
    return json.loads(body)["rows"]


def runner_of(router) -> BatchRunner:
    home = str(router.boxes_path.parent / "home")
    (found,) = [o for o in gc.get_objects() if isinstance(o, BatchRunner) and home in str(o.store.path)]
    return found


def box(name: str = "o") -> SimOllama:
    return SimOllama(name, tags=[BATCH_MODEL, CHAT_MODEL], loaded=[BATCH_MODEL, CHAT_MODEL])


def test_the_openai_client_runs_a_batch_and_every_custom_id_comes_back_once(start_fleet_in_process):
    router = start_fleet_in_process(box())
    key_id, key = new_key(router)
    api = client(router, key)
    batch = finished(api, submit(api, lines(25)).id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (25, 25, 0)
    output, errors = answers(router, api, batch)
    assert errors == []
    assert sorted(line["custom_id"] for line in output) == sorted(f"line-{i}" for i in range(25))
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert batch.usage.input_tokens > 0 and batch.usage.output_tokens > 0
    logged = {row["request_id"]: row for row in rows(router) if row.get("batch_id") == batch.id}
    assert {line["response"]["request_id"] for line in output} <= set(logged)
    assert {row["custom_id"] for row in logged.values()} == {f"line-{i}" for i in range(25)}
    assert {row["key_id"] for row in logged.values()} == {key_id}


@pytest.mark.parametrize("max_inflight", [2, 3], ids=["full", "one-slot-left"])
def test_no_line_starts_on_a_box_full_of_interactive_calls(start_fleet_in_process, max_inflight):
    """Two interactive calls on a box of 2 slots, or of 3: the slot left is kept for the next one."""
    sim = box()
    router = start_fleet_in_process(sim, boxes_extra={"o": {"max_inflight": max_inflight}})
    sim.script(CHAT_MODEL, Behavior.hang(1.5), Behavior.hang(1.5))
    busy = [threading.Thread(target=call, args=(router,), kwargs={"model": CHAT_MODEL}) for _ in range(2)]
    for thread in busy:
        thread.start()
    wait_for(lambda: sum(1 for c in sim.calls if c.model == CHAT_MODEL and c.finished_at is None) == 2)
    api = client(router)
    batch = submit(api, lines(3))
    for thread in busy:
        thread.join()
    interactive_end = max(c.finished_at for c in sim.calls if c.model == CHAT_MODEL)
    assert finished(api, batch.id).status == "completed"
    started = [c.started_at for c in sim.calls if c.model == BATCH_MODEL]
    assert len(started) == 3 and min(started) >= interactive_end - 0.01


def test_an_interactive_call_waits_for_no_line(start_fleet_in_process):
    sim = box()
    router = start_fleet_in_process(sim, boxes_extra={"o": {"max_inflight": 4}})
    sim.script(BATCH_MODEL, *[Behavior.hang(1.0)] * 8)
    api = client(router)
    batch = submit(api, lines(8))
    wait_for(lambda: sum(1 for c in sim.calls if c.model == BATCH_MODEL and c.finished_at is None) >= 1)
    running = sum(1 for c in sim.calls if c.model == BATCH_MODEL and c.finished_at is None)
    assert running == 3  # 4 slots, one kept free: lines take 3, and the call below finds the fourth
    started = time.monotonic()
    status, _, _ = call(router, model=CHAT_MODEL)
    assert status == 200 and time.monotonic() - started < 0.5
    finished(api, batch.id)
    (row,) = [r for r in rows(router) if r["model"] == CHAT_MODEL]
    assert row["waited_ms"] is None


def test_cancel_stops_new_lines_and_writes_what_is_done(start_fleet_in_process):
    sim = box()
    router = start_fleet_in_process(sim, boxes_extra={"o": {"max_inflight": 3}})
    sim.script(BATCH_MODEL, *[Behavior.hang(0.6)] * 10)
    api = client(router)
    batch = submit(api, lines(10))
    wait_for(lambda: any(c.model == BATCH_MODEL for c in sim.calls))
    assert api.batches.cancel(batch.id).status == "cancelling"
    batch = finished(api, batch.id)
    assert batch.status == "cancelled"
    output, errors = answers(router, api, batch)
    ran = sum(1 for c in sim.calls if c.model == BATCH_MODEL)
    assert len(output) == ran and 1 <= ran < 10
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(errors) == 10 - ran
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (10, ran, 10 - ran)


def test_a_window_that_ends_expires_the_lines_not_run(start_fleet_in_process):
    sim = box()
    router = start_fleet_in_process(sim, boxes_extra={"o": {"max_inflight": 2}})
    sim.script(BATCH_MODEL, *[Behavior.hang(0.5)] * 3)
    api = client(router)
    batch = submit(api, lines(6), window="1h")
    wait_for(lambda: any(c.model == BATCH_MODEL for c in sim.calls))
    runner = runner_of(router)
    runner.clock = lambda: time.time() + 3600  # the window's end, an hour early
    batch = finished(api, batch.id)
    assert batch.status == "expired"
    output, errors = answers(router, api, batch)
    assert len(output) + len(errors) == 6 and 1 <= len(output) < 6
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert batch.request_counts.completed == len(output) and batch.request_counts.failed == len(errors)


def test_a_keys_rpm_paces_its_lines_and_a_spent_budget_ends_them_at_the_window(start_fleet_in_process):
    router = start_fleet_in_process(box())
    _, paced = new_key(router, rpm=3)
    api = client(router, paced)
    batch = submit(api, lines(5))
    time.sleep(2.0)
    batch = api.batches.retrieve(batch.id)
    assert batch.status == "in_progress"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 0)  # two wait for the minute

    _, spent = new_key(router, budget_tokens=1, budget_period="day")
    api = client(router, spent)
    assert call(router, headers=bearer(spent))[0] == 200  # the budget is spent by this call
    batch = submit(api, lines(3), window="1h")
    time.sleep(1.0)
    assert api.batches.retrieve(batch.id).request_counts.failed == 0  # waiting, not failing
    runner_of(router).clock = lambda: time.time() + 3600
    batch = finished(api, batch.id)
    assert batch.status == "expired"
    _, errors = answers(router, api, batch)
    assert [e["error"]["code"] for e in errors] == ["budget_exceeded"] * 3


def test_a_key_revoked_mid_batch_stops_its_lines(start_fleet_in_process):
    sim = box()
    router = start_fleet_in_process(sim, boxes_extra={"o": {"max_inflight": 2}})
    sim.script(BATCH_MODEL, *[Behavior.hang(0.5)] * 6)
    key_id, key = new_key(router)
    api = client(router, key)
    batch = submit(api, lines(6))
    wait_for(lambda: any(c.model == BATCH_MODEL for c in sim.calls))
    assert request(router, "POST", f"/v1/keys/{key_id}/revoke")[0] == 200
    admin_view = client(router)  # keyless loopback: an admin, who sees every owner's batch
    batch = finished(admin_view, batch.id)
    output, errors = answers(router, admin_view, batch)
    ran = sum(1 for c in sim.calls if c.model == BATCH_MODEL)
    assert len(output) == ran < 6 and {e["error"]["code"] for e in errors} == {"invalid_api_key"}
    assert batch.request_counts.failed == 6 - ran


def test_lines_wait_for_a_blocked_box_instead_of_failing(start_fleet_in_process):
    """The one box with the lines' model is blocked while another box has room: they wait for it."""
    sim = box()
    router = start_fleet_in_process(sim, SimOllama("p", tags=[CHAT_MODEL], loaded=[CHAT_MODEL]))
    assert request(router, "POST", "/v1/boxes/o/block")[0] == 200
    api = client(router)
    batch = submit(api, lines(3))
    time.sleep(1.0)
    held = api.batches.retrieve(batch.id)
    assert held.status == "in_progress" and held.request_counts.failed == 0
    assert not any(c.model == BATCH_MODEL for c in sim.calls)
    assert request(router, "POST", "/v1/boxes/o/unblock")[0] == 200
    batch = finished(api, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3


def test_no_line_body_answer_or_key_reaches_the_log_the_route_log_or_the_metrics(start_fleet_in_process):
    """A batch's lines are calls: their prompts, the boxes' answers and the key stay out of the
    log (at debug), the route log and /metrics, as a client's call's do; only the batch's own
    tables hold them (docs/batches.md)."""
    canary = "CANARY-batch-5e2c"
    sim = box()
    sim.script(BATCH_MODEL, Behavior.refuse(400, "invalid_request_error", f"{canary} refusal text"))
    router = start_fleet_in_process(sim, extra_args=("--log-level", "debug"))
    _, key = new_key(router)
    api = client(router, key)
    data = b"".join(json.dumps({"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": BATCH_MODEL, "messages": [{"role": "user", "content": f"{canary}-{i}"}],
                                         "user": f"{canary}-user"}}).encode() + b"\n" for i in range(3))
    batch = finished(api, submit(api, data).id)
    assert batch.request_counts.total == 3 and batch.request_counts.failed == 1  # the refusal, with its text
    _, errors = answers(router, api, batch)
    assert canary in json.dumps(errors)  # the answer is the batch's to keep, in its error file
    logged = json.dumps([r for r in rows(router) if r.get("batch_id") == batch.id])
    metrics = request(router, "GET", "/metrics")[2].decode()
    for text in (router.log_text(), logged, metrics):
        assert canary not in text and key not in text and key.split("_")[-1] not in text


def test_a_runner_forgets_the_batches_that_ended_elsewhere(start_fleet_in_process):
    """What a router keeps per batch (a wait, the code it waits on, a mark) goes once the batch is
    no longer live in the store, however it ended: it does not grow with the batches seen."""
    router = start_fleet_in_process(box())
    runner = runner_of(router)
    runner.blocked_until["batch_ended_elsewhere"] = 1e12
    runner.held_by["batch_ended_elsewhere"] = "rate_limited"
    runner.drained.add("batch_ended_elsewhere")
    assert wait_for(lambda: not (runner.blocked_until or runner.held_by or runner.drained), timeout=5)


def test_another_keys_batch_is_not_found(start_fleet_in_process):
    router = start_fleet_in_process(box())
    _, mine = new_key(router)
    _, theirs = new_key(router)
    batch = submit(client(router, mine), lines(1))
    with pytest.raises(openai.NotFoundError):
        client(router, theirs).batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        client(router, theirs).files.retrieve(batch.input_file_id)


def fleet_with_slow_lines(tmp_path, lines_n: int, seconds: float):
    sim = box()
    sim.script(BATCH_MODEL, *[Behavior.hang(seconds)] * lines_n)
    fleet = SimFleet([sim])
    fleet.start()
    return sim, fleet, write_boxes(tmp_path / "boxes.json", [sim], o={"max_inflight": 6})


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["restart", "kill-9"])
def test_a_router_stopped_mid_batch_loses_no_line_and_writes_none_twice(tmp_path, how):
    sim, fleet, boxes = fleet_with_slow_lines(tmp_path, 12, 0.8)
    routers = [RouterProcess(boxes, "--instance", "r1", "--batch-lease", "2")]
    try:
        api = client(routers[0])
        batch = submit(api, lines(12))
        wait_for(lambda: sum(1 for c in sim.calls if c.model == BATCH_MODEL) >= 3)
        routers[0].proc.send_signal(how)
        routers[0].proc.wait(20)
        routers.append(RouterProcess(boxes, "--instance", "r1", "--batch-lease", "2"))
        api = client(routers[1])
        batch = finished(api, batch.id, timeout=60)
        assert batch.status == "completed"
        output, errors = answers(routers[1], api, batch)
        assert errors == [] and sorted(line["custom_id"] for line in output) == sorted(f"line-{i}" for i in range(12))
        assert batch.request_counts.completed == 12
        logged = [r for r in rows(routers[1]) if r.get("batch_id") == batch.id]
        assert {r["custom_id"] for r in logged} == {f"line-{i}" for i in range(12)}
        assert len(logged) >= 12  # a row for every attempt the routers lived to write
    finally:
        for router in routers:
            router.stop()
        fleet.stop()


def test_a_box_killed_mid_line_runs_the_line_again(start_fleet_in_process):
    sim = box()
    router = start_fleet_in_process(sim)
    sim.script(BATCH_MODEL, Behavior.drop(0.2), Behavior.drop(0.2, clean=False))
    api = client(router)
    batch = finished(api, submit(api, lines(4)).id)
    output, errors = answers(router, api, batch)
    assert batch.status == "completed" and errors == []
    assert sorted(line["custom_id"] for line in output) == [f"line-{i}" for i in range(4)]
    assert sum(1 for c in sim.calls if c.model == BATCH_MODEL) == 6  # two lines twice, each written once
    logged = [r for r in rows(router) if r.get("batch_id") == batch.id]
    assert len(logged) == 6 and sorted(r["state"] for r in logged).count("done") == 4  # a row for every attempt


def test_two_routers_on_postgresql_run_one_batch_and_one_killed_loses_no_line(tmp_path, pg_url):
    sim = box()
    sim.script(BATCH_MODEL, *[Behavior.hang(0.5)] * 16)
    fleet = SimFleet([sim])
    fleet.start()
    routers = []
    try:
        for n in range(2):
            folder = tmp_path / f"r{n}"
            folder.mkdir()
            boxes = folder / "boxes.json"
            boxes.write_text('{"boxes": []}')  # not read: the boxes live in the database
            routers.append(RouterProcess(boxes, "--database-url", pg_url, "--instance", f"r{n}",
                                         "--batch-lease", "2"))
        status, _, body = request(routers[0], "POST", "/v1/boxes",
                                  {"name": "o", "url": sim.url, "kind": "ollama", "max_inflight": 8})
        assert status == 201, body
        wait_for(lambda: call(routers[1])[0] == 200, timeout=10)
        api = client(routers[0])
        batch = submit(api, lines(16))
        wait_for(lambda: api.batches.retrieve(batch.id).request_counts.completed >= 6, timeout=30)
        time.sleep(0.2)  # the route-log rows of what it finished are written
        routers[0].proc.send_signal(signal.SIGKILL)
        routers[0].proc.wait(20)
        api = client(routers[1])
        batch = finished(api, batch.id, timeout=60)
        assert batch.status == "completed" and batch.request_counts.completed == 16
        output, errors = answers(routers[1], api, batch)
        assert errors == [] and sorted(line["custom_id"] for line in output) == sorted(f"line-{i}" for i in range(16))
        by_router = {r["router"] for r in rows(routers[1]) if r.get("batch_id") == batch.id}
        assert by_router == {"r0", "r1"}  # both ran lines
    finally:
        for router in routers:
            router.stop()
        fleet.stop()
