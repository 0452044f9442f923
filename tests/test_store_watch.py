"""The hugpy store watch (router/boxes/store_watch.py): a writer process commits to a store file
shaped like hugpy-wrapper's (tests/hugpy_store_writer.py), the link follows it on uvloop.

Each test names the module rule it pins.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import uvloop

from router.boxes import store_watch
from router.boxes.config import BoxConfig
from router.boxes.state import BoxState, Inventory
from router.boxes.store_watch import HugpyStoreLink
from router.core import pairs
from router.sim import SimBox, SimFleet

from conftest import ROOT, wait_for

WRITER = str(ROOT / "tests" / "hugpy_store_writer.py")
VISIBLE_WITHIN_S = 0.050
COMMITS = 10
WAIT_S = 2.0  # a publish that has not come by then never will


class Writer:
    """The writer process, driven from the test's event loop so that publishing is never held up."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, path: Path, worker: str) -> Writer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, WRITER, str(path), worker,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        assert await proc.stdout.readline() == b"ready\n"
        return cls(proc)

    async def send(self, command: str) -> list[float]:
        """Runs one command; returns the CLOCK_MONOTONIC time of each of its commits."""
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        commits = []
        while (line := await self.proc.stdout.readline()) != b"ok\n":
            assert line.startswith(b"commit "), line
            commits.append(float(line.split()[2]))
        return commits

    async def close(self) -> None:
        self.proc.stdin.write(b"quit\n")
        await self.proc.stdin.drain()
        await self.proc.wait()


class RecordingLink(HugpyStoreLink):
    """The store link, recording the monotonic time of every publish."""

    def __init__(self, box: BoxState) -> None:
        super().__init__(box)
        self.published: list[tuple[float, Inventory]] = []
        self.new = asyncio.Event()

    def publish(self, inventory: Inventory) -> None:
        self.published.append((time.monotonic(), inventory))
        self.new.set()
        super().publish(inventory)

    async def seen(self, predicate) -> float:
        """The time of the first publish whose inventory satisfies `predicate`."""
        async with asyncio.timeout(WAIT_S):
            while True:
                for at, inventory in self.published:
                    if predicate(inventory):
                        return at
                self.new.clear()
                await self.new.wait()


def store_link(name: str, url: str, store: Path) -> RecordingLink:
    return RecordingLink(BoxState(BoxConfig(name, url, store=str(store)), 0, 0))


async def following(link: RecordingLink) -> None:
    """Starts the link (health and inventory loops); returns once its first inventory is in."""
    link.start()
    await link.seen(lambda inventory: True)


def test_a_resident_is_visible_within_50_ms_of_the_commit(tmp_path):
    """Rules 1-3: inotify + data_version re-check; only this worker's rows."""

    async def scenario() -> list[float]:
        store = tmp_path / "fitevict.sqlite3"
        writer = await Writer.start(store, "a")
        await writer.send("model tiny")
        link = store_link("a", "http://127.0.0.1:9", store)
        await following(link)
        assert link.mode == "store watch"
        assert set(link.box.catalog) == {"tiny"}  # the other worker's `not-ours` is filtered out
        latencies = []
        for n in range(COMMITS):
            (committed,) = await writer.send(f"resident m{n}")
            latencies.append(await link.seen(lambda inv, key=f"m{n}": key in inv.residents) - committed)
            await asyncio.sleep(0.02 + 0.005 * n)  # commits apart, at varied phases of the loop
        await writer.send("gpu 123456789")
        await link.seen(lambda inv: inv.free_gpu_bytes == 123456789)
        await writer.send("resident m0 loading")
        await link.seen(lambda inv: (seat := inv.residents.get("m0")) and seat.loading and not seat.healthy)
        await link.stop()
        await writer.close()
        return latencies

    latencies = uvloop.run(scenario())
    print(f"store watch visibility: p50 {statistics.median(latencies) * 1e3:.2f} ms,"
          f" max {max(latencies) * 1e3:.2f} ms over {len(latencies)} commits")
    assert max(latencies) < VISIBLE_WITHIN_S


def test_pair_settings_are_followed_in_the_store(tmp_path):
    """Rules 1, 2, 4: a settings write is a commit the watch publishes; only this worker's rows
    count (the other worker's `blocked` row for the same key does not)."""

    async def scenario() -> None:
        store = tmp_path / "fitevict.sqlite3"
        writer = await Writer.start(store, "a")
        await writer.send("model tiny")
        link = store_link("a", "http://127.0.0.1:9", store)
        await following(link)
        await writer.send('pair tiny {"max_wait_s":30}')
        await link.seen(lambda inv: pairs.effective(inv.pairs, "tiny") == {"max_wait_s": 30})
        assert pairs.blocked_by(link.box.inventory.pairs, "tiny") is None
        await writer.send('pair * {"blocked":"maintenance"}')
        await link.seen(lambda inv: inv.pairs.blanket_blocked)
        await link.stop()
        await writer.close()

    uvloop.run(scenario())


def test_sensor_writes_publish_nothing_and_last_used_counts_past_a_second(tmp_path, monkeypatch):
    """Rule 4: the 4 Hz sensor writes and call_log rows are re-read but not published; last_used
    moves count only beyond LAST_USED_SLACK_S; a busy flip is published at once."""
    reads = []
    parse = store_watch.parse_state
    monkeypatch.setattr(store_watch, "parse_state", lambda doc: reads.append(1) or parse(doc))

    async def scenario() -> None:
        store = tmp_path / "fitevict.sqlite3"
        writer = await Writer.start(store, "a")
        await writer.send("resident tiny")
        link = store_link("a", "http://127.0.0.1:9", store)
        await following(link)
        published, read = len(link.published), len(reads)
        commits = await writer.send("sensor 4 2")
        commits += await writer.send("call")  # call_log noise moves data_version too
        await asyncio.sleep(0.1)
        assert len(commits) == 9
        assert len(reads) - read >= len(commits) - 1  # seen (two may coalesce), ...
        assert len(link.published) == published  # ... and not published
        before_s = link.published[-1][1].residents["tiny"].last_used_s
        await writer.send("used tiny")  # moved > 1 s: the seat was last used 2 s ago
        await link.seen(lambda inv: inv.residents["tiny"].last_used_s > before_s + 1)
        published = len(link.published)
        await writer.send("used tiny")  # moved < 1 s: no publish
        await asyncio.sleep(0.1)
        assert len(link.published) == published
        await writer.send("busy tiny 1")
        await link.seen(lambda inv: inv.residents["tiny"].busy)
        await link.stop()
        await writer.close()

    uvloop.run(scenario())


def test_a_recreated_store_is_reopened(tmp_path):
    """Rule 6: hugpy renames a corrupt store away and creates a new one at the same path."""

    async def scenario() -> None:
        store = tmp_path / "fitevict.sqlite3"
        old = await Writer.start(store, "a")
        await old.send("resident old")
        link = store_link("a", "http://127.0.0.1:9", store)
        await following(link)
        await old.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(f"{store}{suffix}"):
                os.rename(f"{store}{suffix}", f"{store}.corrupt-1{suffix}")
        new = await Writer.start(store, "a")
        await new.send("resident fresh")
        await link.seen(lambda inv: set(inv.residents) == {"fresh"})
        await link.stop()
        await new.close()

    uvloop.run(scenario())


@pytest.mark.parametrize("case", ["missing", "not a database", "another worker's store"])
def test_an_unusable_store_falls_back_to_the_api_long_poll(tmp_path, caplog, case):
    """Rule 7: logged once, and the API long-poll keeps the inventory."""
    store = tmp_path / "fitevict.sqlite3"
    if case == "not a database":
        store.write_bytes(b"this is not an SQLite file\n" * 100)
    elif case == "another worker's store":
        subprocess.run([sys.executable, WRITER, str(store), "zzz"], input="model tiny\nquit\n",
                       text=True, check=True, capture_output=True)
    box = SimBox("a", catalog=["from-api"])

    async def scenario() -> None:
        link = store_link("a", box.url, store)
        await following(link)
        assert link.mode == "api long-poll"
        assert set(link.box.catalog) == {"from-api"}
        await link.stop()

    with SimFleet([box]):
        uvloop.run(scenario())
        assert box.state_polls >= 1
    (warning,) = [r for r in caplog.records if "unusable" in r.getMessage()]
    assert "following the API long-poll" in warning.getMessage()


def test_router_serves_a_model_resident_in_the_store_as_serving_tier(tmp_path, start_fleet):
    """End to end: `router serve` with `store` on box a. The sims hold `tiny` in their catalogs
    only; the store says a holds it resident, so a ranks first, in the serving tier, ahead of b
    (which the boxes file lists first)."""
    store = tmp_path / "box-a" / "fitevict.sqlite3"
    store.parent.mkdir()
    subprocess.run([sys.executable, WRITER, str(store), "a"], input="model tiny\nresident tiny\nquit\n",
                   text=True, check=True, capture_output=True)
    b, a = SimBox("b", catalog=["tiny"]), SimBox("a", catalog=["tiny"])
    router = start_fleet(b, a, boxes_extra={"a": {"store": str(store)}})
    host, port = router.url.removeprefix("http://").split(":")

    def request(method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, data

    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()
    assert request("POST", "/v1/chat/completions", body)[0] == 200
    rows = wait_for(lambda: json.loads(request("GET", "/v1/telemetry?since=0")[1])["rows"], 3)
    (row,) = rows
    assert row["decision"]["boxes"] == ["a", "b"] and row["decision"]["why"] == {"a": "serving", "b": "load"}
    assert row["box"] == "a"
    assert "watching store" in router.log_text()
