"""The peers for bench/run.py's `peers` figure, each started in front of the same simulated box
as the router, on loopback, one at a time:

* HAProxy from Debian (`haproxy`, installed by scripts/bench): one thread (`nbthread 1`), HTTP
  mode, keep-alive to the box (`http-reuse always`), no logging: the C floor;
* hugpy-router 0.0.4, the release this router replaces (`.venv-004`, made by scripts/setup):
  `hugpy-router --boxes <the rig's boxes file> serve`, with a store of its own
  (HUGPY_ROUTER_HOME); it fronts the same eight boxes as the router and picks among them;
* LiteLLM's proxy (`.venv-litellm`, made by scripts/bench when the figure is asked for): one
  worker, one model (`tiny-llama` → `openai/tiny-llama` with `api_base` on the box), no database,
  the local model-cost map (LITELLM_LOCAL_MODEL_COST_MAP: nothing is fetched at start), and no
  master key: LiteLLM refuses to start without one unless told to permit it
  (LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY), and the router too runs with no keys
  here, so both check nothing per call; it listens on loopback only;
* the Rust LLM routers a speed-minded user would pick instead (`.venv-rust-routers`, made by
  scripts/bench when the figure is asked for): sglang-router (SGLang's model gateway, `launch`)
  and vllm-router, each with the one box as its one worker, `--policy round_robin` (a plain
  proxy: the router's policy work is its own), its Prometheus listener on a free port of its
  own, logging at its default level (`info`: a line at start, none per call).

`running(...)` starts one, waits until it answers a chat call with 200, points the CPU meter at
its process tree, and stops its process group on exit. A peer that is not installed is a
reason (`missing`), not an error: the figure records it as not run.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import measure
from measure import BenchError, CpuMeter, Procs

PEERS = ("haproxy", "hugpy-router-0.0.4", "litellm", "sglang-router", "vllm-router")
LABELS = {
    "router": "router", "floor": "bare proxy (bench/floor_proxy.py)", "direct": "direct (the box)",
    "haproxy": "HAProxy (nbthread 1)", "hugpy-router-0.0.4": "hugpy-router 0.0.4",
    "litellm": "LiteLLM proxy (one worker)", "sglang-router": "sglang-router (round robin)",
    "vllm-router": "vllm-router (round robin)",
}
MODEL = "tiny-llama"  # what post.lua asks for; resident on the box the router picks

HUGPY_004 = measure.ROOT / ".venv-004" / "bin" / "hugpy-router"
LITELLM = measure.ROOT / ".venv-litellm" / "bin" / "litellm"
RUST_ROUTERS = measure.ROOT / ".venv-rust-routers" / "bin"
SGLANG = RUST_ROUTERS / "sglang-router"
VLLM = RUST_ROUTERS / "vllm-router"

# The run's environment puts the router snapshot on PYTHONPATH; a peer's venv imports its own only.
OWN_PYTHON = {"PYTHONPATH": ""}
ANSWER_TIMEOUT_S = 60.0  # from the ready line to a first 200 (0.0.4 first reads its boxes)
LITELLM_START_S = 120.0  # importing litellm takes ~10-30 s on a busy 2-core machine

HAPROXY_READY = re.compile(r"Using \w+\(\) as the polling mechanism")
HUGPY_004_READY = re.compile(r"hugpy-router on (http://\S+)")
LITELLM_READY = re.compile(r"Proxy initialized with Config")  # then it binds: wait_answering
SGLANG_READY = re.compile(r"Starting router on")  # then its worker is checked: wait_answering
VLLM_READY = re.compile(r"Router ready")

HAPROXY_CONFIG = """\
global
  nbthread 1
  maxconn 4096
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend peer
  bind 127.0.0.1:{port}
  default_backend box
backend box
  http-reuse always
  server box {box_host}:{box_port}
"""


def litellm_config(box_url: str) -> dict:
    """One model, served by the box as an OpenAI-compatible backend (the box ignores the key of a
    caller on loopback, but LiteLLM's OpenAI client wants one)."""
    return {
        "model_list": [{"model_name": MODEL, "litellm_params": {
            "model": f"openai/{MODEL}", "api_base": f"{box_url}/v1", "api_key": "unused-on-loopback"}}],
        "litellm_settings": {"set_verbose": False, "telemetry": False},
    }


def missing(name: str) -> str | None:
    """Why `name` cannot run here, or None."""
    if name == "haproxy" and not shutil.which("haproxy"):
        return "haproxy is not installed (scripts/bench installs Debian's)"
    if name == "hugpy-router-0.0.4" and not HUGPY_004.exists():
        return f"{HUGPY_004.relative_to(measure.ROOT)} is missing (scripts/setup makes it)"
    if name == "litellm" and not LITELLM.exists():
        return (f"{LITELLM.relative_to(measure.ROOT)} is missing (scripts/bench makes it when the peers "
                "figure is asked for; see its log for why pip failed)")
    exe = {"sglang-router": SGLANG, "vllm-router": VLLM}.get(name)
    if exe is not None and not exe.exists():
        return (f"{exe.relative_to(measure.ROOT)} is missing (scripts/bench makes it when the peers "
                "figure is asked for; see its log for why pip failed)")
    return None


def versions() -> dict[str, str]:
    """The peers' versions, for the run's record ("-" where one is missing)."""
    out = {}
    done = subprocess.run(["haproxy", "-v"], capture_output=True, text=True) if shutil.which("haproxy") else None
    out["haproxy"] = done.stdout.split()[2] if done and done.returncode == 0 else "-"
    for name, exe, dist in (("hugpy-router-0.0.4", HUGPY_004, "hugpy-router"), ("litellm", LITELLM, "litellm"),
                            ("sglang-router", SGLANG, "sglang-router"), ("vllm-router", VLLM, "vllm-router")):
        python = exe.parent / "python"
        # -I: not the working folder's own metadata (this checkout is hugpy-router too)
        done = subprocess.run([str(python), "-I", "-c", f"from importlib import metadata; print(metadata.version({dist!r}))"],
                              capture_output=True, text=True) if python.exists() else None
        out[name] = done.stdout.strip() if done and done.returncode == 0 else "-"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_haproxy(procs: Procs, box_url: str, _boxes_file: Path) -> tuple[measure.Started, str]:
    box = urlsplit(box_url)
    port = free_port()
    config = procs.workdir / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(port=port, box_host=box.hostname, box_port=box.port))
    # -db: foreground, no daemon; -V: prints the polling line once the configuration is loaded
    started, _ = procs.start("haproxy", ["haproxy", "-db", "-V", "-f", str(config)], HAPROXY_READY, proxy=True)
    return started, f"http://127.0.0.1:{port}"


def start_hugpy_004(procs: Procs, _box_url: str, boxes_file: Path) -> tuple[measure.Started, str]:
    store = procs.workdir / "store-hugpy-router-0.0.4"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(mode=0o700)
    started, match = procs.start("hugpy-router-0.0.4", [
        str(HUGPY_004), "--boxes", str(boxes_file), "serve", "--host", "127.0.0.1", "--port", "auto",
    ], HUGPY_004_READY, env={"HUGPY_ROUTER_HOME": str(store), **OWN_PYTHON}, proxy=True)
    return started, match.group(1)


def start_litellm(procs: Procs, box_url: str, _boxes_file: Path) -> tuple[measure.Started, str]:
    config = procs.workdir / "litellm.json"  # YAML is a superset of JSON: litellm reads it as YAML
    config.write_text(json.dumps(litellm_config(box_url), indent=1))
    port = free_port()
    started, _ = procs.start("litellm", [
        str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1",
    ], LITELLM_READY, env={**OWN_PYTHON, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
                           "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"},
       timeout_s=LITELLM_START_S, proxy=True)
    return started, f"http://127.0.0.1:{port}"


def start_rust_router(name: str, exe: Path, ready: re.Pattern, extra: tuple[str, ...] = ()) -> Callable:
    """A starter for one of the Rust routers: the box as its one worker, round robin."""

    def start(procs: Procs, box_url: str, _boxes_file: Path) -> tuple[measure.Started, str]:
        port = free_port()
        started, _ = procs.start(name, [
            str(exe), *extra, "--worker-urls", box_url, "--host", "127.0.0.1", "--port", str(port),
            "--policy", "round_robin", "--prometheus-port", str(free_port()),
        ], ready, env=OWN_PYTHON, proxy=True)
        return started, f"http://127.0.0.1:{port}"

    return start


STARTERS = {"haproxy": start_haproxy, "hugpy-router-0.0.4": start_hugpy_004, "litellm": start_litellm,
            "sglang-router": start_rust_router("sglang-router", SGLANG, SGLANG_READY, ("launch",)),
            "vllm-router": start_rust_router("vllm-router", VLLM, VLLM_READY)}


def wait_answering(base_url: str, timeout_s: float = ANSWER_TIMEOUT_S) -> None:
    """Until a chat call through the peer is answered 200."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            status, _headers, body = measure.chat_once(base_url, timeout_s=10.0)
        except OSError as exc:
            status, body = 0, str(exc).encode()
        if status == 200:
            return
        last = f"{status} {body[:300]!r}"
        time.sleep(0.2)
    raise BenchError(f"{base_url} never answered a chat call with 200 in {timeout_s:.0f} s; last: {last}")


@contextmanager
def running(name: str, procs: Procs, meter: CpuMeter, box_url: str, boxes_file: Path) -> Iterator[str]:
    """The peer `name` serving in front of `box_url` (or the fleet in `boxes_file`): its base URL,
    with the meter on its process tree; stopped on exit."""
    started, url = STARTERS[name](procs, box_url, boxes_file)
    try:
        wait_answering(url)
        meter.peer_pid = started.pid
        yield url
    finally:
        meter.peer_pid = None
        procs.stop(started)
