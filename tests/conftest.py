"""Shared fixtures: simulated boxes on loopback and a real router in front, either a
`router serve` process (start_fleet) or the same server in this process (start_fleet_in_process,
tests/inproc.py: for every case that needs no process of its own)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from router.sim import SimFleet

from inproc import InProcessRouter

ROOT = Path(__file__).resolve().parent.parent
LISTENING_RE = re.compile(r"(\w+) listening on (https?://\S+)")


class RouterProcess:
    """`python -m router serve` on a free port, reading its boxes file; stopped with SIGTERM.
    `nofile` caps the process's descriptors (soft and hard RLIMIT_NOFILE)."""

    def __init__(self, boxes_path: Path, *extra: str, env: dict | None = None,
                 nofile: int | None = None, module: str = "router") -> None:
        self.boxes_path = boxes_path
        self.log_path = boxes_path.parent / "router.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "serve", "--port", "auto",
             "--boxes-file", str(boxes_path), *extra],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env={**os.environ, "HUGPY_ROUTER_HOME": str(boxes_path.parent / "home"), **(env or {})},
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(
                resource.RLIMIT_NOFILE, (nofile, nofile)
            ),
        )
        self.urls: dict[str, str] = {}  # listener name -> url: router, ollama, lmstudio, health
        listeners = 1 + sum(1 for arg in extra if arg in ("--ollama-port", "--lmstudio-port", "--health-port"))
        for _ in range(listeners):
            line = self.proc.stdout.readline()
            match = LISTENING_RE.search(line)
            if match is None:
                self.stop()
                raise RuntimeError(f"router did not start: {line!r}\n{self.log_path.read_text()}")
            self.urls[match.group(1)] = match.group(2)
        self.url = self.urls["router"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        return self.proc.returncode

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()


def write_boxes(path: Path, boxes: list, **per_box: dict) -> Path:
    entries = []
    for box in boxes:
        entry = {"name": box.name, "url": box.url, "kind": box.kind}
        key = getattr(box, "key", None) or getattr(box, "token", None)
        if key:
            entry["key"] = key
        entry.update(per_box.get(box.name, {}))
        entries.append(entry)
    path.write_text(json.dumps({"boxes": entries}))
    os.chmod(path, 0o600)
    return path


def _fleet_starter(tmp_path, new_router):
    """Yields start(*boxes, extra_args=(), boxes_extra={}, **router_kwargs) -> router; at the
    fixture's end stops every router, then every fleet."""
    fleets: list[SimFleet] = []
    routers: list = []

    def start(*boxes, extra_args=(), boxes_extra=None, **router_kwargs):
        fleet = SimFleet(list(boxes))
        fleet.start()
        fleets.append(fleet)
        path = write_boxes(tmp_path / "boxes.json", list(boxes), **(boxes_extra or {}))
        router = new_router(path, *extra_args, **router_kwargs)
        router.fleet = fleet
        routers.append(router)
        return router

    yield start
    for router in routers:
        router.stop()
    for fleet in fleets:
        fleet.stop()


@pytest.fixture
def start_fleet(tmp_path):
    """start_fleet(*boxes, extra_args=(), boxes_extra={}, env=None, nofile=None, module="router") -> RouterProcess"""
    yield from _fleet_starter(tmp_path, RouterProcess)


@pytest.fixture
def start_fleet_in_process(tmp_path):
    """start_fleet_in_process(*boxes, extra_args=(), boxes_extra={}, env=None) -> InProcessRouter"""
    yield from _fleet_starter(tmp_path, InProcessRouter)


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


async def wait_until(predicate, timeout_s: float) -> float:
    """wait_for inside a running loop: seconds until `predicate()` held; fails the test after
    `timeout_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        if loop.time() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        await asyncio.sleep(0.01)
    return loop.time() - start


@pytest.fixture
def redis_server():
    """A redis-server of this test's own (tests/engines.py)."""
    from engines import RedisServer

    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_cluster():
    """One PostgreSQL cluster for the session; tests take a fresh database of it (`pg_url`)."""
    from engines import PostgresServer

    server = PostgresServer()
    yield server
    server.close()


@pytest.fixture
def pg_url(postgres_cluster, request):
    """A fresh, empty database of the session's cluster."""
    import uuid

    return postgres_cluster.database(f"t_{uuid.uuid4().hex[:12]}")


def pytest_terminal_summary(terminalreporter):
    """A skipped real tier (tests/real/) is said at the end of the run, not only counted."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "REAL TIER SKIPPED" in str(r.longrepr)]
    if skipped:
        reason = str(skipped[0].longrepr[2]).removeprefix("Skipped: ")
        terminalreporter.write_line(f"{len(skipped)} real-tier tests NOT RUN. {reason}", red=True, bold=True)
