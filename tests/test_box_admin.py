"""The box admin API hugpy-core configures the router with (router/serve/admin.py, one code path
with the CLI: router.boxes.config.edit): POST /v1/boxes, PUT and DELETE /v1/boxes/<name>,
POST /v1/boxes/<name>/block|unblock. Edits land in the boxes file atomically and take effect
before the answer; the key is never echoed; concurrent edits never lose one."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from conftest import wait_for
from router.boxes import config
from router.sim import SimBox, SimFleet
from support.url_calls import chat_body, request

KEY = "hpk_box_adminapiboxkey0123456789ab"


def call(router, method: str, path: str, doc=None, raw: bytes | None = None):
    body = raw if raw is not None else (None if doc is None else json.dumps(doc).encode())
    status, data = request(router.url, method, path, body)
    assert KEY.encode() not in data  # never echoed, in an answer or an error
    return status, json.loads(data)


def test_add_replace_update_block_delete_live(start_fleet_in_process, tmp_path):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", key=KEY, catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    others = SimFleet([b])  # a box the router does not know yet
    others.start()
    try:
        status, doc = call(router, "POST", "/v1/boxes", {"name": "b", "url": b.url, "key": KEY, "pool": "lab"})
        assert status == 201, doc
        assert doc["name"] == "b" and doc["pool"] == "lab" and doc["has_key"] is True
        on_file = config.load(router.boxes_path).find("b")
        assert on_file.key == KEY and stat.S_IMODE(os.stat(router.boxes_path).st_mode) == 0o600
        pinned = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                         "alloc": {"worker": "b"}}).encode()
        assert request(router.url, "POST", "/v1/chat/completions", pinned)[0] == 200  # live, with its key
        status, doc = call(router, "POST", "/v1/boxes", {"name": "b", "url": b.url, "key": KEY})
        assert status == 200 and doc["pool"] == ""  # replaced whole
        status, doc = call(router, "PUT", "/v1/boxes/b", {"pool": "gpu", "agent": "http://127.0.0.1:9"})
        assert status == 200, doc
        assert status == 200 and doc["pool"] == "gpu" and doc["agent"] == "http://127.0.0.1:9"
        assert config.load(router.boxes_path).find("b").key == KEY  # an update keeps the key
        status, doc = call(router, "POST", "/v1/boxes/a/block")
        assert status == 200 and doc["blocked"] is True
        status, refusal = call(router, "POST", "/v1/chat/completions", raw=chat_body())
        assert status == 503 and refusal["error"]["reasons"] == {"a": "blocked", "b": "other_pool: gpu"}
        assert call(router, "POST", "/v1/boxes/a/unblock")[1]["blocked"] is False
        assert request(router.url, "POST", "/v1/chat/completions", chat_body())[0] == 200
        assert call(router, "DELETE", "/v1/boxes/b") == (200, {"name": "b", "removed": True})
        assert [box["name"] for box in call(router, "GET", "/v1/boxes")[1]["boxes"]] == ["a"]
    finally:
        others.stop()


def before_inventory(monkeypatch, box: str, step) -> None:
    """The in-process router's hugpy link awaits `step()` each time it starts following `box`'s
    inventory (a step that raises fails every read of it)."""
    from router.boxes.hugpy import HugpyLink

    follow = HugpyLink.follow_inventory

    async def stepped(self):
        if self.box.name == box:
            await step()
        await follow(self)

    monkeypatch.setattr(HugpyLink, "follow_inventory", stepped)


def inventory_late(monkeypatch, box: str, seconds: float) -> None:
    """The in-process router's hugpy link reads `box`'s inventory `seconds` late."""
    import asyncio

    before_inventory(monkeypatch, box, lambda: asyncio.sleep(seconds))


def test_a_box_added_takes_calls_once_its_answer_says_so(start_fleet_in_process, monkeypatch):
    """The answer to POST /v1/boxes waits (bounded) for the new box's first read, so a call
    right after it is served, however slowly the box's inventory comes in (here 0.3 s late;
    before, the call came back 503 no_model whenever it beat the first inventory)."""
    inventory_late(monkeypatch, "b", 0.3)
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]))
    b = SimBox("b", key=KEY, catalog=["tiny"], residents=["tiny"])
    with SimFleet([b]):
        assert call(router, "POST", "/v1/boxes", {"name": "b", "url": b.url, "key": KEY})[0] == 201
        pinned = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                             "alloc": {"worker": "b"}}).encode()
        assert request(router.url, "POST", "/v1/chat/completions", pinned)[0] == 200


def test_edits_of_a_box_whose_inventory_fails_are_answered_without_the_whole_wait(start_fleet_in_process,
                                                                                 monkeypatch):
    """The wait for a box's first read ends with its first inventory read, good or failed: a box
    that answers its health probe but fails every inventory read holds neither its add's answer
    for the whole bound nor that of every later edit (blocking it, what an operator does to such
    a box)."""
    import time

    from router.boxes.link import FIRST_READ_TIMEOUT_S, InventoryError

    async def failing():
        raise InventoryError("/v1/telemetry/state answered 500", 500, "/v1/telemetry/state")

    before_inventory(monkeypatch, "b", failing)
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]))
    b = SimBox("b", key=KEY, catalog=["tiny"], residents=["tiny"])
    with SimFleet([b]):
        for method, path, doc, status in (("POST", "/v1/boxes", {"name": "b", "url": b.url, "key": KEY}, 201),
                                          ("POST", "/v1/boxes/b/block", None, 200),
                                          ("PUT", "/v1/boxes/b", {"pool": "gpu"}, 200)):
            started = time.monotonic()
            assert call(router, method, path, doc)[0] == status
            assert time.monotonic() - started < FIRST_READ_TIMEOUT_S / 2, (method, path)


def test_a_box_added_while_down_is_answered_at_once(start_fleet_in_process):
    """A box that refuses connections fails its first probe at once: its add's answer does not
    wait for a first read that cannot come, nor does the next edit of it."""
    import socket
    import time

    from router.boxes.link import FIRST_READ_TIMEOUT_S

    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]))
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = "http://127.0.0.1:%d" % closed.getsockname()[1]
        for method, path, doc, status in (("POST", "/v1/boxes", {"name": "down", "url": url}, 201),
                                          ("POST", "/v1/boxes/down/block", None, 200)):
            started = time.monotonic()
            assert call(router, method, path, doc)[0] == status
            assert time.monotonic() - started < FIRST_READ_TIMEOUT_S / 2, (method, path)


def test_an_add_waiting_on_a_box_that_is_deleted_meanwhile_is_answered_then(start_fleet_in_process, monkeypatch):
    """The add's wait for the box's first read ends when the box's link stops (another edit
    deleted the box), not at the 5 s bound."""
    import time

    inventory_late(monkeypatch, "b", 60)
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]))
    b = SimBox("b", key=KEY, catalog=["tiny"], residents=["tiny"])
    with SimFleet([b]), ThreadPoolExecutor(1) as pool:
        adding = pool.submit(call, router, "POST", "/v1/boxes", {"name": "b", "url": b.url, "key": KEY})
        assert wait_for(lambda: "b" in [box["name"] for box in call(router, "GET", "/v1/boxes")[1]["boxes"]])
        assert call(router, "DELETE", "/v1/boxes/b") == (200, {"name": "b", "removed": True})
        deleted_s = time.monotonic()
        assert adding.result(10)[0] == 201
        assert time.monotonic() - deleted_s < 2.0  # not the first read's 5 s bound


def test_bad_edits_are_refused_clearly_and_change_nothing(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"]))
    before = router.boxes_path.read_bytes()
    for method, path, doc, raw, status, code in [
        ("POST", "/v1/boxes", None, b'{"name": "x", "key": "' + KEY.encode() + b'"', 400, "invalid_json"),
        ("POST", "/v1/boxes", [1], None, 400, "invalid_request"),  # the admin API's JSON reader
        ("POST", "/v1/boxes", {"name": "x", "key": KEY}, None, 400, "invalid_box"),
        ("POST", "/v1/boxes", {"name": "x y", "url": "http://h:1", "key": KEY}, None, 400, "invalid_box"),
        ("POST", "/v1/boxes", {"name": "x", "url": "ftp://h", "key": KEY}, None, 400, "invalid_box"),
        ("POST", "/v1/boxes", {"name": "x", "url": "http://h:1", "kind": "vllm"}, None, 400, "invalid_box"),
        ("POST", "/v1/boxes", {"name": "x", "url": "http://h:1", "secret": KEY}, None, 400, "invalid_box"),
        ("POST", "/v1/boxes", {"name": "x", "url": "http://h:1", "key": 5}, None, 400, "invalid_box"),
        ("PUT", "/v1/boxes/a", {"url": "http://h:2"}, None, 400, "invalid_box"),
        ("PUT", "/v1/boxes/a", {"kind": "vllm"}, None, 400, "invalid_box"),
        ("PUT", "/v1/boxes/zz", {"pool": "p"}, None, 404, "unknown_box"),
        ("DELETE", "/v1/boxes/zz", None, None, 404, "unknown_box"),
        ("POST", "/v1/boxes/zz/block", None, None, 404, "unknown_box"),
    ]:
        got, answer = call(router, method, path, doc, raw)
        assert (got, answer["error"]["code"]) == (status, code), (method, path, doc, answer)
        assert answer["error"]["message"]
    assert router.boxes_path.read_bytes() == before


def test_concurrent_edits_never_lose_one(start_fleet_in_process, tmp_path):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"]))
    names = [f"n{i}" for i in range(24)]

    def add(name: str):
        return call(router, "POST", "/v1/boxes", {"name": name, "url": "http://127.0.0.1:9", "key": KEY})[0]

    def cli_add(i: int) -> int:  # the CLI takes the same lock from another process
        return subprocess.run(
            [sys.executable, "-m", "router", "--boxes", str(router.boxes_path), "boxes", "add",
             "--name", f"cli{i}", "--url", "http://127.0.0.1:9"], capture_output=True, timeout=30).returncode

    with ThreadPoolExecutor(max_workers=12) as pool:
        blocks = [pool.submit(call, router, "POST", "/v1/boxes/a/block") for _ in range(3)]
        clis = [pool.submit(cli_add, i) for i in range(3)]
        adds = list(pool.map(add, names))
    assert adds == [201] * len(names)
    assert [f.result() for f in clis] == [0] * 3 and all(f.result()[0] == 200 for f in blocks)
    on_file = config.load(router.boxes_path)
    assert {b.name for b in on_file.boxes} == {"a", *names, "cli0", "cli1", "cli2"}
    assert on_file.find("a").blocked and all(on_file.find(n).key == KEY for n in names)
    assert wait_for(lambda: {b["name"] for b in call(router, "GET", "/v1/boxes")[1]["boxes"]}
                    == {b.name for b in on_file.boxes}, 5, 0.1)  # the CLI's edits: the file watch
