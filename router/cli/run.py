"""`router serve` and `router demo`: build the serve config and run it on uvloop."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import uvloop

from router.boxes import config as boxes_config
from router.core.affinity import OFF, Slack
from router.serve.server import serve
from router.serve.settings import SETTINGS, ServeConfig
from router.store import paths as store_paths

log = logging.getLogger("router.cli")


def _config(args: argparse.Namespace, boxes_path: Path, store_path: Path | None = None) -> ServeConfig:
    if args.require_key:
        # The access gate reads its settings from the environment at start; the flag beats it.
        os.environ["HUGPY_ROUTER_REQUIRE_KEY"] = args.require_key
    given = {setting.field: getattr(args, setting.dest) for setting in SETTINGS if setting.field is not None}
    slack = Slack(args.affinity_slack, args.affinity_slack_share) if args.affinity == "on" else OFF
    return ServeConfig(**given, boxes_path=boxes_path, store_path=store_path, affinity_slack=slack)


def _announce(name: str, url: str) -> None:
    print(f"{name} listening on {url}", flush=True)


def run_serve(args: argparse.Namespace) -> int:
    boxes_path = args.boxes_file or boxes_config.default_path()
    if not args.database_url:  # the boxes live in the database otherwise
        boxes_config.load(boxes_path)  # a broken file stops the start with a clear message
    config = dataclasses.replace(_config(args, boxes_path), freeze_gc=True)
    return uvloop.run(serve(config, ready=_announce))


def demo_commands(url: str) -> list[str]:
    """The commands `router demo` prints to try the router at `url`, each whole on its own line,
    so that it runs as printed in a fresh shell: curl, and an `openai` call on this interpreter
    (named by its path: a bare `python` may lack the package) when it has the package."""
    chat = json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]})
    commands = [f"curl -s {url}/v1/models",
                f"curl -s {url}/v1/chat/completions -H 'content-type: application/json' -d '{chat}'"]
    if importlib.util.find_spec("openai") is not None:
        call = ('import openai; print(openai.OpenAI().chat.completions.create(model="tiny-llama", '
                'messages=[{"role": "user", "content": "hi"}]).choices[0].message.content)')
        commands.append(f"OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY=unused {shlex.quote(sys.executable)} "
                        f"-c {shlex.quote(call)}")
    return commands


def run_demo(args: argparse.Namespace) -> int:
    """Starts simulated hugpy boxes in a child process, then the router in front of them.
    The demo touches none of the user's files: its boxes file (with the sim keys) and its
    store live in a temporary folder, removed at exit."""
    workdir = Path(tempfile.mkdtemp(prefix="router-demo-"))
    try:
        return _demo(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _demo(args: argparse.Namespace, workdir: Path) -> int:
    boxes_path = workdir / "boxes.json"
    sim = subprocess.Popen(
        [sys.executable, "-m", "router.sim", "--boxes", str(args.sim_boxes),
         "--boxes-file", str(boxes_path), "--cadence-ms", "30", "--load-ms", "800"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = sim.stdout.readline() if sim.stdout else ""  # "" when the child died
        if "ready" not in line:
            print("router demo: the simulated fleet did not start", file=sys.stderr)
            return 1
        print(f"demo fleet: {args.sim_boxes} simulated hugpy boxes (boxes file {boxes_path})", flush=True)

        def announce(name: str, url: str) -> None:
            _announce(name, url)
            if name == "router":
                print("try it, each line in a shell:", *(f"    {line}" for line in demo_commands(url)),
                      sep="\n", flush=True)

        # A router process, as `serve` runs one: its start-up's objects frozen out of the collector.
        config = dataclasses.replace(_config(args, boxes_path, workdir / "store" / store_paths.DB_FILE), freeze_gc=True)
        return uvloop.run(serve(config, ready=announce))
    finally:
        sim.send_signal(signal.SIGTERM)
        try:
            sim.wait(5)
        except subprocess.TimeoutExpired:
            sim.kill()
