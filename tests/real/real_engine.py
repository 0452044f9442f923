"""The real tier's engines (tests/real/): llama-server processes and hugpy-wrapper boxes that run
the 9 MB random-weight model through llama-server, built once by scripts/setup into
$REAL_ENGINE_HOME (default ~/.cache/real-engine; scripts/real_engine/build.sh). Its text is
noise; its tokens, prompt cache, slots, `usage` and `timings` are llama-server's own.

Where the engine is not built (HUGPY_ROUTER_SKIP_REAL_ENGINE=1, or a set-up that predates it),
every test of the tier is skipped with SKIP_REASON, and tests/conftest.py prints it again at the
end of the run: a skipped tier never reads as a passed one.

Every process here is started on a free loopback port and stopped by its own pid.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from conftest import wait_for

import psutil
import pytest

ENGINE_HOME = Path(os.environ.get("REAL_ENGINE_HOME") or Path.home() / ".cache" / "real-engine")
LLAMA_SERVER = ENGINE_HOME / "llama-server"
MODEL_FILE = ENGINE_HOME / "tiny-llama-F16.gguf"
FITEVICT_SERVE = ENGINE_HOME / "wrapper" / "bin" / "fitevict-serve"
ALIAS = "tiny-llama"
FLAKY = "flaky-llama"  # a hugpy box's second model key: a truncated copy on a `broken` box
START_TIMEOUT_S = 60.0  # a loaded 2-core machine: the 9 MB model loads in well under a second idle


def missing() -> str | None:
    for path in (LLAMA_SERVER, MODEL_FILE, FITEVICT_SERVE):
        if not path.exists():
            return str(path)
    return None


SKIP_REASON = (f"REAL TIER SKIPPED: the real engine is not built ({missing()} is missing): run scripts/setup "
               "without HUGPY_ROUTER_SKIP_REAL_ENGINE=1 (it builds llama-server once, ~11 min on 2 cores)")
# the tier's modules: `pytestmark = real_tier` (the `real` marker: `-m real` runs the tier alone)
real_tier = [pytest.mark.real, pytest.mark.skipif(missing() is not None, reason=SKIP_REASON)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, path: str, headers: dict | None = None, timeout: float = 10) -> tuple[int | None, object]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        body = resp.read()
        try:
            return resp.status, json.loads(body or b"null")
        except ValueError:
            return resp.status, body
    except OSError:
        return None, None
    finally:
        conn.close()


def post(url: str, path: str, doc: object | bytes, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, dict, bytes]:
    """(status, lower-cased headers, raw body) of one POST; `doc` bytes are sent as they are."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def route_rows(router, *request_ids: str) -> list[dict]:
    """The router's route-log rows of these calls (their `x-hugpy-router-request-id`), in this
    order, once its writer has flushed them all."""
    def rows():
        got = {r["request_id"]: r for r in get(router.url, "/v1/telemetry?tail=200")[1]["rows"]}
        return [got[i] for i in request_ids] if all(i in got for i in request_ids) else None
    found = wait_for(rows, 5)
    assert found, f"no route-log rows for {request_ids}"
    return found


class Engine:
    """A process of this tier: its log file, stopped (or killed) by its pid."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, size: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-size:]

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to anyone."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class LlamaServer(Engine):
    """`llama-server -m tiny-llama-F16.gguf --alias tiny-llama` on a free port: `parallel` slots
    sharing a `ctx`-token context, one thread (two engines to a core on a 2-core machine)."""

    def __init__(self, workdir: Path, name: str, *, parallel: int = 2, ctx: int = 8192,
                 extra: tuple[str, ...] = ()) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(LLAMA_SERVER), "-m", str(MODEL_FILE), "--host", "127.0.0.1", "--port", str(self.port),
             "-c", str(ctx), "--parallel", str(parallel), "--alias", ALIAS, "-t", "1", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        # /health is 503 while the model loads, 200 once it serves
        if not wait_for(lambda: self.proc.poll() is None and get(self.url, "/health")[0] == 200,
                          START_TIMEOUT_S, 0.1):
            self.stop()
            raise RuntimeError(f"llama-server {name} did not start:\n{self.log_tail()}")

    def stop(self) -> None:
        super().stop()
        self._log.close()

    def slots(self) -> list[dict]:
        return get(self.url, "/slots")[1]


class WrapperBox(Engine):
    """A hugpy-wrapper 0.1.182 box (worker `name`, key `key`) whose catalog holds the model as
    `tiny-llama` and as `flaky-llama`, the latter a truncated copy (its load fails: `load_error`)
    when `broken`; it runs them with the tier's llama-server. Its store file is `store_file`."""

    def __init__(self, workdir: Path, name: str, *, key: str, broken: bool = False) -> None:
        self.name, self.key = name, key
        root = workdir / name
        env = {"PATH": os.environ["PATH"], "HOME": str(root / "home"), "HUGPY_DATA_DIR": str(root / "data"),
               "HUGPY_CONFIG_DIR": str(root / "config"), "HUGPY_CACHE_DIR": str(root / "cache"),
               "FITEVICT_HOME": str(root / "store"), "MODELS_HOME": str(root / "models"),
               "FITEVICT_MODEL_PATHS_ONLY": "1", "FITEVICT_WORKER": name, "FITEVICT_TOKEN": key,
               # a busy 2-core machine is not too loaded to serve (contract §11.4 step 3)
               "FITEVICT_CPU_BUSY": "1.01", "LLAMA_SERVER_BIN": str(LLAMA_SERVER), "PYTHONUNBUFFERED": "1"}
        for folder in ("home", "data", "config", "cache", "store"):
            (root / folder).mkdir(parents=True)
        models = root / "models" / "gguf" / "testorg"
        for key in (ALIAS, FLAKY):
            (models / key).mkdir(parents=True)
            shutil.copyfile(MODEL_FILE, models / key / f"{key}-F16.gguf")
        if broken:
            with open(models / FLAKY / f"{FLAKY}-F16.gguf", "r+b") as gguf:
                gguf.truncate(1 << 20)
        self.store_dir = root / "store"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(FITEVICT_SERVE), "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if not wait_for(lambda: self.proc.poll() is None and get(self.url, "/health")[0] == 200,
                          START_TIMEOUT_S, 0.1):
            self.stop()
            raise RuntimeError(f"hugpy-wrapper {name} did not start:\n{self.log_tail()}")

    @property
    def store_file(self) -> Path:
        return next(self.store_dir.rglob("fitevict.sqlite3"))

    def stop(self) -> None:
        children = psutil.Process(self.proc.pid).children(recursive=True) if self.proc.poll() is None else []
        super().stop()  # its SIGTERM handler evicts the llama-server children it started
        for child in children:  # any it left behind, by pid
            if child.is_running():
                child.kill()
        self._log.close()


def write_boxes(path: Path, engines: list[LlamaServer]) -> Path:
    """A boxes file naming these llama-servers (OpenAI kind, no key)."""
    path.write_text(json.dumps({"boxes": [{"name": e.name, "url": e.url, "kind": "openai"} for e in engines]}))
    os.chmod(path, 0o600)
    return path
