"""A newcomer's first hour (issue 38): every command `scripts/demo` prints runs as printed in a
fresh shell; two `python -m router.sim` runs name their boxes apart; the demo's set-up builds
the router's own environment only, the tests' set-up the rest."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import ROOT

# A fresh shell: none of this process's environment (no active venv, no PATH to it).
FRESH_PATH = "/usr/bin:/bin"


def fresh_shell(command: str, home: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env={"PATH": FRESH_PATH, "HOME": str(home)}, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """The process's stdout lines as they come, read on a thread so a wait for one is bounded."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def printed_until(lines: queue.Queue, last: str, timeout_s: float) -> list[str]:
    """The lines printed up to and including the first that contains `last`."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not seen or last not in seen[-1]:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, "ended early:\n" + "\n".join(seen)
        seen.append(line)
    return seen


def test_every_command_the_demo_prints_runs_as_printed_in_a_fresh_shell(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "tmp").mkdir()
    demo = subprocess.Popen([str(ROOT / "scripts" / "demo"), "--port", "auto", "--sim-boxes", "1"],
                            env={"PATH": FRESH_PATH, "HOME": str(home), "TMPDIR": str(tmp_path / "tmp")},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        printed = printed_until(lines_of(demo), "OPENAI_BASE_URL", timeout_s=120)
        commands = [line.strip() for line in printed if line.startswith("    ")]
        activate = next(c for c in commands if c.startswith("source ") and c.endswith("/.venv/bin/activate"))
        curls = [c for c in commands if c.startswith("curl ")]
        assert len(curls) == 2 and any("OPENAI_BASE_URL" in c for c in commands), printed
        for command in commands:  # each one whole, on its own line: nothing joined by a pipe
            done = fresh_shell(command, home, tmp_path)
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            if command in curls:
                assert "error" not in json.loads(done.stdout), (command, done.stdout)
        # The printed line is what makes `router` (and `python -m router.sim`) a command.
        done = fresh_shell(f"{activate} && router --version && python -m router.sim --help", home, tmp_path)
        assert done.returncode == 0, done.stderr
    finally:
        demo.send_signal(signal.SIGTERM)  # scripts/demo execs `router demo`: this stops it and its fleet
        demo.wait(30)


def sim_lines(proc: subprocess.Popen, boxes: int) -> list[str]:
    assert proc.stdout.readline().startswith(f"sim fleet ready: {boxes} boxes")
    return [proc.stdout.readline().strip() for _ in range(boxes)]


def test_two_sims_print_boxes_add_lines_that_go_into_one_fleet(tmp_path):
    argv = [sys.executable, "-m", "router.sim", "--kind", "ollama", "--kind", "hugpy"]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    second = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        lines = sim_lines(first, 2) + sim_lines(second, 2)
        names = [line.split()[4] for line in lines]  # each box's --name
        assert len(set(names)) == 4, names
        env = {**os.environ, "HUGPY_ROUTER_HOME": str(tmp_path / "store")}
        for line in lines:  # pasted as they are, into one boxes file
            done = subprocess.run([sys.executable, "-m", "router", "--boxes", str(tmp_path / "boxes.json"),
                                   *line.split()[1:]], env=env, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
    finally:
        for proc in (first, second):
            proc.terminate()
            proc.wait(10)


STUB_PYTHON = """#!/bin/bash
# A stand-in interpreter: logs each call; `-m venv D` makes D/bin/python (this stub), `-m pip
# install` makes the commands a package would and talks as pip does, `-m pip show` finds nothing.
echo "$0 $*" >> "$SETUP_LOG"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$STUB" "$3/bin/python"; exit 0; fi
if [ "$1 $2 $3" = "-m pip show" ]; then exit 1; fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "WARNING: Running pip as the 'root' user"; echo "WARNING: a newer pip is out" >&2
  for cmd in router hugpy-router fitevict-serve; do printf '#!/bin/sh\\n' > "$(dirname "$0")/$cmd"; done
  chmod +x "$(dirname "$0")"/*
fi
"""


def fake_checkout(tmp_path: Path) -> tuple[Path, dict]:
    """A checkout with this scripts/setup, its stamped sources and a compiled module, an
    interpreter that logs what it is asked, and apt-get and sudo that log their calls."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup", repo / "scripts" / "setup")
    (repo / "router").mkdir()
    for name in ("pyproject.toml", "setup.py", "router/_fastpath.pyx", "router/_fastpath_x.pxi",
                 "router/_fastpath.cpython-311-x86_64-linux-gnu.so"):
        (repo / name).write_text(name)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "python3").write_text(STUB_PYTHON)
    for cmd in ("apt-get", "sudo"):
        (stubs / cmd).write_text(f'#!/bin/bash\necho "{cmd} $*" >> "$SETUP_LOG"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:{FRESH_PATH}", "HOME": str(tmp_path), "SETUP_LOG": str(tmp_path / "log"),
           "STUB": str(stubs / "python3"), "PYTHON": str(stubs / "python3"),
           "HUGPY_ROUTER_SKIP_REAL_ENGINE": "1"}  # no llama-server build from a fake checkout
    return repo, env


def set_up(repo: Path, env: dict, *args: str) -> tuple[str, list[str]]:
    """Runs scripts/setup; returns what it printed and the calls it made (then forgets them)."""
    done = subprocess.run([str(repo / "scripts" / "setup"), *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    log = Path(env["SETUP_LOG"])
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return done.stdout + done.stderr, [call.replace(str(repo) + "/", "") for call in calls]


def test_the_demos_setup_builds_the_routers_environment_only_and_quietly(tmp_path):
    repo, env = fake_checkout(tmp_path)
    out, calls = set_up(repo, env, "--demo")
    assert [call.split(" ", 1)[1] for call in calls] == [
        "-m venv .venv",
        "-m pip install --upgrade pip setuptools wheel Cython",
        "-m pip show -q router",
        "-m pip install -e . openai>=1.50",
    ]
    assert not (repo / ".venv-004").exists() and not (repo / ".venv-wrapper").exists()
    assert "WARNING" not in out  # pip's talk is shown only when it fails
    assert "real engine" not in out  # the demo never builds, nor skips, the tests' engine
    assert out.splitlines()[-1] == f"    source {repo}/.venv/bin/activate"
    assert set_up(repo, env, "--demo")[1] == []  # set up already: nothing runs again
    # The tests' set-up adds their extras to the demo's venv, and their own venvs beside it.
    out, calls = set_up(repo, env)
    assert "real engine: skipped (HUGPY_ROUTER_SKIP_REAL_ENGINE=1)" in out
    assert ".venv/bin/python -m pip install -e .[test]" in calls
    assert ".venv-004/bin/python -m pip install hugpy-router==0.0.4" in calls
    assert ".venv-wrapper/bin/python -m pip install hugpy-wrapper==0.1.182" in calls
    assert "WARNING" not in out
    assert set_up(repo, env, "--demo")[1] == []  # a venv with the test extras serves the demo as it is
