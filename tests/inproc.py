"""The real router, in the test process: `router.serve.server.serve` with Granian embedded, on
its own uvloop loop in a background thread, configured from the same command line as
`router serve`. It has the surface tests use on a `RouterProcess` (url, urls, boxes_path,
log_text(), stop()) and skips the process start, which is most of a fault case's time. Its
call clock can be stepped ahead (`advance_clock`): a deadline test sets a long timeout and
steps past it, instead of waiting out a short one on real time.

What it cannot stand in for stays with RouterProcess: signals (only the main thread may install
handlers, so this loop holds them and stop() calls SIGTERM's), exit codes and start-up errors
printed by the CLI, RLIMIT_NOFILE, stderr written outside the logging module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from pathlib import Path

import uvloop

from router.boxes import config as boxes_config
from router.cli.main import build_parser
from router.cli.run import _config
from router.serve.server import serve

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # router.cli.main's
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 20.0


class HeldSignalsLoop(uvloop.Loop):
    """uvloop for a loop outside the main thread: signal handlers are kept, not installed."""

    def __init__(self) -> None:
        super().__init__()
        self.signal_handlers: dict[int, tuple] = {}

    def add_signal_handler(self, sig, callback, *args) -> None:
        self.signal_handlers[sig] = (callback, args)

    def remove_signal_handler(self, sig) -> bool:
        return self.signal_handlers.pop(sig, None) is not None


class _RouterRecords(logging.Handler):
    """The lines the router would write to stderr: its own loggers and Granian's, not the
    simulated boxes' nor the clients' of the test."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.lines: list[str] = []  # emit() runs under the handler's own lock

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        ours = name == "router" or (name.startswith("router.") and not name.startswith("router.sim"))
        return (ours or "granian" in name) and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class InProcessRouter:
    """`router serve --port auto --boxes-file BOXES *extra` in a thread of this process, with
    `HUGPY_ROUTER_HOME` (and `env`) set in os.environ while it runs."""

    def __init__(self, boxes_path: Path, *extra: str, env: dict | None = None) -> None:
        self.boxes_path = boxes_path
        args = build_parser().parse_args(
            ["serve", "--port", "auto", "--boxes-file", str(boxes_path), *extra]
        )
        boxes_config.load(boxes_path)
        self._saved_env = {}
        for name, value in {"HUGPY_ROUTER_HOME": str(boxes_path.parent / "home"), **(env or {})}.items():
            self._saved_env[name] = os.environ.get(name)
            os.environ[name] = value
        level = getattr(logging, args.log_level.upper())
        self._records = _RouterRecords(level)
        self._router_logger = logging.getLogger("router")
        self._saved_level = self._router_logger.level
        self._router_logger.setLevel(level)
        logging.getLogger().addHandler(self._records)

        listeners = 1 + sum(1 for arg in extra if arg in ("--ollama-port", "--lmstudio-port", "--health-port"))
        self.urls: dict[str, str] = {}  # listener name -> url: router, ollama, lmstudio, health
        self.returncode: int | None = None
        self._failure: BaseException | None = None
        self._up = threading.Event()
        self._loop: HeldSignalsLoop | None = None
        self._clock = None  # the router's CallClock, for advance_clock

        def started(process) -> None:
            self._clock = process.clock

        def ready(name: str, url: str) -> None:
            self.urls[name] = url
            if len(self.urls) == listeners:
                self._up.set()

        def run() -> None:
            try:
                with asyncio.Runner(loop_factory=self._new_loop) as runner:
                    self.returncode = runner.run(serve(_config(args, boxes_path), ready=ready, started=started))
            except BaseException as exc:  # reported by __init__ or stop()
                self._failure = exc
            finally:
                self._up.set()

        self._thread = threading.Thread(target=run, name=f"router-{boxes_path.parent.name}", daemon=True)
        self._thread.start()
        if not self._up.wait(START_TIMEOUT_S) or len(self.urls) < listeners:
            self.stop()
            raise RuntimeError(f"router did not start: {self._failure!r}\n{self.log_text()}")
        self.url = self.urls["router"]

    def _new_loop(self) -> HeldSignalsLoop:
        self._loop = HeldSignalsLoop()
        return self._loop

    def advance_clock(self, seconds: float) -> None:
        """One tick of the router's CallClock as if `seconds` more had passed, on the router's
        loop: the deadlines of the calls in flight that fall due by then fire now, without the
        wait (the real ticks go on meanwhile). Set long timeouts, then step past them."""

        async def tick() -> None:
            self._clock.tick_all(asyncio.get_running_loop().time() + seconds)

        asyncio.run_coroutine_threadsafe(tick(), self._loop).result(STOP_TIMEOUT_S)

    def signal(self, signum: int) -> None:
        """Runs the handler `serve` set for `signum`, on the router's loop."""
        callback, args = self._loop.signal_handlers[signum]
        self._loop.call_soon_threadsafe(callback, *args)

    def stop(self) -> int | None:
        """SIGTERM's handler, then waits for `serve` to return; its return value (0), as the
        process's exit code would be."""
        if self._thread.is_alive() and self._loop is not None and signal.SIGTERM in self._loop.signal_handlers:
            self.signal(signal.SIGTERM)
        self._thread.join(STOP_TIMEOUT_S)
        if self._records in logging.getLogger().handlers:
            logging.getLogger().removeHandler(self._records)
            self._router_logger.setLevel(self._saved_level)
            for name, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if self._thread.is_alive():
            raise RuntimeError(f"router did not stop within {STOP_TIMEOUT_S} s\n{self.log_text()}")
        if self._failure is not None and self._up.is_set() and self.urls:
            raise RuntimeError(f"router failed: {self._failure!r}\n{self.log_text()}") from self._failure
        return self.returncode

    def log_text(self) -> str:
        return "".join(line + "\n" for line in list(self._records.lines))
