"""Drop-in for hugpy-router 0.0.4: `serve` finds the hugpy layout's files by itself, takes
0.0.4's environment, says which boxes file it read and warns when the fleet is empty; `demo`
touches none of the user's files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import LISTENING_RE, ROOT, wait_for


def isolated_env(tmp_path: Path, **extra: str) -> dict:
    """A user whose home, XDG dirs and temp folder are all under tmp_path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HUGPY_", "XDG_")) and k not in ("STATE_DIRECTORY", "TMPDIR")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env.update(HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"), **extra)
    return env


def start(argv: list[str], env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "router", *argv], stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True, cwd=ROOT, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        match = LISTENING_RE.search(line)
        if match and match.group(1) == "router":
            return proc, match.group(2)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"did not start: {log.read_text()}")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(20)
    finally:
        proc.stdout.close()


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_serve_takes_port_and_host_from_the_environment_and_warns_of_an_empty_fleet(tmp_path):
    env = isolated_env(tmp_path, HUGPY_ROUTER_PORT="auto", HUGPY_ROUTER_HOST="127.0.0.1")
    log = tmp_path / "serve.log"
    proc, url = start(["serve"], env, log)
    try:
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            assert resp.status == 200
    finally:
        assert stop(proc) == 0
    text = log.read_text()
    boxes = tmp_path / "home" / ".config" / "hugpy" / "router" / "boxes.json"
    assert f"boxes file {boxes}: 0 boxes" in text
    assert text.count("the fleet is empty") == 1
    assert (tmp_path / "home" / ".local" / "share" / "hugpy" / "router" / "router.sqlite3").exists()


def test_demo_touches_none_of_the_users_files(tmp_path):
    env = isolated_env(tmp_path)
    proc, url = start(["demo", "--port", "auto", "--sim-boxes", "1"], env, tmp_path / "demo.log")
    try:
        body = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}'
        request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=20) as resp:
            assert resp.status == 200
        demo_dirs = wait_for(lambda: list((tmp_path / "tmp").glob("router-demo-*")))
        assert demo_dirs and (demo_dirs[0] / "boxes.json").exists()
    finally:
        assert stop(proc) == 0
    assert files_under(tmp_path / "tmp") == []
    assert not (tmp_path / "home").exists()
