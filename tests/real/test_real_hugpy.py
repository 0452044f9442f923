"""The real tier, hugpy kind: a `router serve` process in front of two real hugpy-wrapper 0.1.182
boxes (tests/real/real_engine.py) that run the model through a real llama-server, each followed
through its real store file (added with `router boxes add --store`: the store watch). Box `a` holds a
truncated copy of `flaky-llama`, box `b` a whole one."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from conftest import RouterProcess, wait_for
from real_engine import ALIAS, FLAKY, WrapperBox, get, post, real_tier, route_rows

pytestmark = [*real_tier, pytest.mark.timeout(240)]

IGNORE_EOS = {"ignore_eos": True}  # passed through to llama-server: a fixed completion count


@pytest.fixture(scope="module")
def hugpy_fleet(tmp_path_factory):
    """(router, {name: box}): boxes a (broken flaky-llama) and b, then the router, a first in its
    boxes file: the load tier's last tie-break (router.core.decide rule 4), once both boxes'
    verdicts are read and neither was picked yet (the module's first test relies on it)."""
    workdir = tmp_path_factory.mktemp("hugpy")
    started: list = []
    try:
        for name in "ab":
            started.append(WrapperBox(workdir, name, key=f"hpk_box_{name}secret0123456789", broken=name == "a"))
        boxes = {box.name: box for box in started}
        assert wait_for(lambda: all(any(b.store_dir.rglob("fitevict.sqlite3")) for b in boxes.values()), 30)
        path = workdir / "boxes.json"
        for box in boxes.values():  # as an operator adds them: the CLI checks each store file is a wrapper's
            added = subprocess.run([sys.executable, "-m", "router", "boxes", "--boxes-file", str(path), "add",
                                    "--name", box.name, "--url", box.url, "--key", box.key,
                                    "--store", str(box.store_file)], capture_output=True, text=True, timeout=60)
            assert added.returncode == 0, added.stderr
        router = RouterProcess(path)
        started.insert(0, router)

        def ready():  # each box online through its store, its verdicts priced (an unread one ranks first)
            state = get(router.url, "/v1/router/state")[1]["boxes"]
            return all(b["online"] and b["link"] == "store watch" and b["models"] >= 2
                       and set(b["verdicts"]["fits"].values()) == {"ram"} for b in state)
        assert wait_for(ready, 30), get(router.url, "/v1/router/state")[1]
        yield router, boxes
    finally:
        for proc in started:
            proc.stop()


def chat(router, model: str, **extra) -> tuple[int, dict, bytes]:
    return post(router.url, "/v1/chat/completions",
                {"model": model, "messages": [{"role": "user", "content": "Tell me about routers."}],
                 "max_tokens": 6, **IGNORE_EOS, **extra}, timeout=120)


def frames(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


def resident_on(router, model: str) -> set[str]:
    return {b["name"] for b in get(router.url, "/v1/router/state")[1]["boxes"]
            for r in b["residents"] if r["key"] == model and r["state"] in ("idle", "serving")}


def test_a_model_that_fails_to_load_answers_load_error_and_the_router_fails_over(hugpy_fleet):
    router, boxes = hugpy_fleet
    status, head, body = chat(router, FLAKY)
    (row,) = route_rows(router, head["x-hugpy-router-request-id"])
    assert status == 200 and head["x-hugpy-box"] == "b", (body, row)
    assert [(a["box"], a["status"]) for a in row["attempts"]] == [("a", 503), ("b", 200)], json.dumps(row)
    # what box a answered, asked directly: its load_error
    status, _, direct = post(boxes["a"].url, "/v1/chat/completions",
                             {"model": FLAKY, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                             headers={"Authorization": f"Bearer {boxes['a'].key}"}, timeout=120)
    assert status == 503 and json.loads(direct)["error"]["type"] == "load_error", direct


def test_a_cold_load_then_warm_calls_where_it_is_resident_charged_and_logged_by_parent_id(hugpy_fleet):
    router, boxes = hugpy_fleet
    status, head, body = chat(router, ALIAS)
    assert status == 200, body
    home = head["x-hugpy-box"]
    assert json.loads(body)["usage"]["completion_tokens"] == 6
    # the store watch shows the seat; every later call with the same settings is served there
    assert wait_for(lambda: resident_on(router, ALIAS) == {home}, 15), get(router.url, "/v1/router/state")[1]
    status, asked_head, asked = chat(router, ALIAS, stream=True, stream_options={"include_usage": True})
    assert status == 200 and asked_head["x-hugpy-box"] == home
    (usage_frame,) = [f for f in frames(asked) if f.get("usage")]
    assert usage_frame["choices"] == [] and usage_frame["usage"]["completion_tokens"] == 6
    status, plain_head, plain = chat(router, ALIAS, stream=True)
    assert status == 200 and plain_head["x-hugpy-box"] == home
    # a hugpy box sends its own accounting frame whether asked or not (its contract, §8): the
    # router reads it and passes it on as it is (it asks, and strips, only other kinds' streams)
    (plain_usage,) = [f for f in frames(plain) if f.get("usage")]
    assert [plain_usage["usage"][k] for k in ("prompt_tokens", "completion_tokens")] == [
        usage_frame["usage"][k] for k in ("prompt_tokens", "completion_tokens")] and b"data: [DONE]" in plain

    # each call charged as the box reported it: the whole answer's usage, each stream's usage frame
    ids = [h["x-hugpy-router-request-id"] for h in (head, asked_head, plain_head)]
    rows = route_rows(router, *ids)
    reports = [(doc["usage"]["prompt_tokens"], doc["usage"]["completion_tokens"], doc["timings"]["cache_n"])
               for doc in (json.loads(body), usage_frame, plain_usage)]
    assert [(r["box"], r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"], r["tokens_estimated"])
            for r in rows] == [(home, *report, 0) for report in reports]
    assert reports[2][2] > 0  # a warm call's prompt came from the engine's cache
    other = ({"a", "b"} - {home}).pop()
    assert [r["decision"]["why"] for r in rows] == [{home: "load", other: "load"}] + [
        {home: "serving", other: "load"}] * 2  # the warm calls: the serving tier first

    # the box's own call log names each call by the router's id (X-Hugpy-Parent-Request-Id)
    with sqlite3.connect(f"file:{boxes[home].store_file}?mode=ro", uri=True) as conn:
        params = [json.loads(p or "{}") for (p,) in conn.execute("SELECT request_params FROM call_log")]
    assert ids and set(ids) <= {p.get("parent_request_id") for p in params}, params
