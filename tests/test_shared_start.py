"""A router starting on engines that refuse it (issue 38 item 3): real redis-server and
PostgreSQL processes, real `router serve` processes. A shared server that refuses the router (a
wrong password, an unknown database) or a URL that cannot be used ends the start with exit 2 and
one line, the password masked, unless `--shared-down open` is given: then it starts, and says
why at warning level once, with what it does meanwhile (fleetwide/wire.py rules 4, 5 and 8). A
server merely down at start is that warning too, and its coming back another. A PostgreSQL store
that refuses the router's password ends the start the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.fleetwide.wire import shown_url

from conftest import ROOT, RouterProcess, wait_for, write_boxes

pytestmark = pytest.mark.timeout(60)

PASSWORD = "s3cret-shared-pw"
WRONG = "not-the-password"


@pytest.fixture
def locked_redis():
    """A redis-server that wants PASSWORD."""
    from engines import RedisServer

    server = RedisServer(password=PASSWORD)
    yield server
    server.stop()


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    boxes = write_boxes(tmp_path / "boxes.json", [])
    return subprocess.run(
        [sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes), *args],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
        env={**os.environ, "HUGPY_ROUTER_HOME": str(tmp_path / "home")},
    )


def one_line_exit_2(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""  # nothing listened
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def shared_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "shared server" in line]


@pytest.mark.parametrize("flags", [(), ("--shared-down", "closed")], ids=["default", "closed"])
def test_a_wrong_shared_password_ends_the_start_with_one_line(tmp_path, locked_redis, flags):
    url = locked_redis.url.replace(PASSWORD, WRONG)
    line = one_line_exit_2(serve(tmp_path, "--shared-url", url, *flags))
    assert "WRONGPASS" in line and WRONG not in line and ":***@" in line
    assert "--shared-down open" in line  # how to start anyway


@pytest.mark.parametrize(
    "url, said",
    [
        ("redis://:{password}@127.0.0.1:{port}/99", "DB index is out of range"),
        ("redis://127.0.0.1:{port}/0", "NOAUTH"),
        ("http://:{password}@127.0.0.1:{port}/0", "must specify one of the following schemes"),
        ("redis://:{password}@127.0.0.1:port/0", "Port could not be cast"),
    ],
    ids=["unknown-database", "no-password", "not-redis", "bad-port"],
)
def test_a_shared_url_that_cannot_work_ends_the_start_with_one_line(tmp_path, locked_redis, url, said):
    line = one_line_exit_2(serve(tmp_path, "--shared-url", url.format(password=PASSWORD, port=locked_redis.port)))
    assert said in line and PASSWORD not in line


def test_shared_down_open_given_starts_with_one_warning_that_says_why(tmp_path, locked_redis):
    boxes = write_boxes(tmp_path / "boxes.json", [])
    router = RouterProcess(boxes, "--shared-url", locked_redis.url.replace(PASSWORD, WRONG),
                           "--shared-down", "open")
    try:
        log = router.log_text()  # it listens: every start-up line is written
    finally:
        router.stop()
    (line,) = shared_lines(log)
    assert " WARNING " in line and "WRONGPASS" in line and "counting in this router alone" in line
    assert WRONG not in log


def test_a_shared_server_down_at_start_is_a_warning_and_its_return_another(tmp_path, locked_redis):
    """The docs' "down and back are each one log line at warning level", from the start too."""
    locked_redis.stop()
    boxes = write_boxes(tmp_path / "boxes.json", [])
    router = RouterProcess(boxes, "--shared-url", locked_redis.url)
    try:
        locked_redis.start()
        wait_for(lambda: "is up" in router.log_text(), timeout=10)
        log = router.log_text()
    finally:
        router.stop()
    down, back = shared_lines(log)
    assert " WARNING " in down and "is DOWN (ConnectionRefusedError" in down
    assert "counting in this router alone until it is back" in down
    assert " WARNING " in back and "counting across routers again" in back
    assert PASSWORD not in log


def test_a_wrong_database_password_ends_the_start_with_one_line(tmp_path):
    from engines import PostgresServer

    cluster = PostgresServer(password=PASSWORD)
    try:
        url = cluster.database("refused").replace(PASSWORD, WRONG)
        line = one_line_exit_2(serve(tmp_path, "--database-url", url))
    finally:
        cluster.close()
    assert "password authentication failed" in line and WRONG not in line and ":***@" in line


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://:pw@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
        ("redis://user:p@ss@db:6379/0", "redis://user:***@db:6379/0"),
        ("unix:///run/redis.sock?db=1&password=pw", "unix:///run/redis.sock?db=1&password=***"),
        ("redis://:pw@db:port/0", "redis://:***@db:port/0"),  # said in the error that it cannot be used
        ("redis://db:6379/0", "redis://db:6379/0"),
    ],
)
def test_a_shared_url_is_shown_without_its_password(url, shown):
    assert shown_url(url) == shown
