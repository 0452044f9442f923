"""A hugpy-router 0.0.4 user's world, for the drop-in tests: real 0.0.4 (from `.venv-004`,
made by scripts/setup) and this router, each run as the user would run it, on one HOME.

Nothing is mocked: the box is a simulated hugpy box on loopback (router.sim), 0.0.4 is the
released package, and both routers find their files by themselves from HOME.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import ROOT

OLD = ROOT / ".venv-004" / "bin" / "hugpy-router"
NEW = Path(sys.executable).parent / "hugpy-router"
START_TIMEOUT_S = 30
URL_RE = re.compile(r"(http://127\.0\.0\.1:\d+)")


def require_004() -> None:
    assert OLD.exists(), "hugpy-router 0.0.4 is missing: run scripts/setup (it makes .venv-004)"


def user_env(home: Path, **extra: str) -> dict:
    """A user whose every file is under `home` (no HUGPY_*, XDG_* or systemd state dir)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HUGPY_", "XDG_")) and k != "STATE_DIRECTORY"}
    env.update(HOME=str(home), **extra)
    return env


def cli(exe: Path, env: dict, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(exe), *argv], env=env, capture_output=True, text=True, timeout=60)
    if check:
        assert done.returncode == 0, f"{exe.parent.parent.name} {argv}: {done.stderr[-1500:]}"
    return done


class Served:
    """`<exe> serve --port auto` until stop(); `url` once it announced itself."""

    def __init__(self, exe: Path, env: dict, log: Path) -> None:
        self.log_path = log
        self.proc = subprocess.Popen([str(exe), "serve", "--port", "auto"], env=env, cwd=log.parent,
                                     stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        self.url = ""
        while time.monotonic() < deadline and not self.url:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            match = URL_RE.search(line)
            if match:
                self.url = match.group(1)
        while self.url and time.monotonic() < deadline:  # 0.0.4 prints its URL before it listens
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except urllib.error.HTTPError:  # an answer (401 where every route needs a key)
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise AssertionError(f"{exe} did not start (exit {self.proc.returncode}): {log.read_text()[-2000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        return self.proc.returncode

    def call(self, method: str, path: str, body=None, key: str | None = None) -> tuple[int, object]:
        """(status, JSON body) of one request; errors come back as their status and body."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return exc.code, json.loads(raw)
            except ValueError:
                return exc.code, raw.decode(errors="replace")

    def chat(self, key: str | None = None) -> tuple[int, object]:
        """A chat call, retried while the router's link has not yet read the box (503)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            status, doc = self.call("POST", "/v1/chat/completions", CHAT, key=key)
            if status != 503 or time.monotonic() > deadline:
                return status, doc
            time.sleep(0.1)


CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
