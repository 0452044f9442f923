"""Start-up failures (issue 11 item 12): a port in use, or any bind error, ends `router serve`
with a non-zero status and one clear line, no backtrace (systemd's Restart=on-failure relies
on it). Every listener: the main port, --ollama-port, --lmstudio-port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, write_boxes


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    boxes = write_boxes(tmp_path / "boxes.json", [])
    return subprocess.run(
        [sys.executable, "-m", "router", "serve", "--boxes-file", str(boxes), *args],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
        env={**os.environ, "HUGPY_ROUTER_HOME": str(tmp_path / "home")},
    )


@pytest.fixture
def taken_port():
    """A port another program listens on, with SO_REUSEPORT as a second router would have it
    (Granian sets it, so a plain bind would succeed and share the port)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def one_line_failure(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "flags, expected",
    [
        (("--port", "{taken}"), "router: port {taken} is in use"),
        (("--port", "auto", "--ollama-port", "{taken}"), "router: port {taken} (--ollama-port) is in use"),
        (("--port", "auto", "--lmstudio-port", "{taken}"), "router: port {taken} (--lmstudio-port) is in use"),
    ],
)
def test_a_port_in_use_is_one_line_and_a_non_zero_exit(tmp_path, taken_port, flags, expected):
    result = serve(tmp_path, *(flag.format(taken=taken_port) for flag in flags))
    assert one_line_failure(result) == expected.format(taken=taken_port)


def test_the_same_port_for_two_listeners_is_refused(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    result = serve(tmp_path, "--port", port, "--ollama-port", port)
    assert one_line_failure(result) == f"router: port {port} (--ollama-port) is in use"


@pytest.mark.parametrize(
    "flags, expected",
    [
        (("--port", "8080", "--host", "localhost"), "router: --host must be an IP address, not 'localhost'"),
        (("--port", "8080", "--host", "192.0.2.1"), "router: 192.0.2.1 is not an address of this machine"),
    ],
)
def test_other_bind_errors_are_one_line(tmp_path, flags, expected):
    assert one_line_failure(serve(tmp_path, *flags)) == expected


def test_a_privileged_port_without_privilege_is_one_line(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root may bind below 1024")
    result = serve(tmp_path, "--port", "80")
    assert one_line_failure(result) == "router: port 80 needs privileges (below 1024: root or CAP_NET_BIND_SERVICE)"
