"""Running the router: Granian embedded in our own uvloop loop, one process.

Why embedded: the fleet links, the reservation table and the app live in this one loop, so every
listener of the process shares them (DESIGN.md: reservations are process-wide). `--workers N`
would split that state N ways; `--workers 1` is the supported setting.

Stop (SIGTERM or SIGINT): stop accepting, let calls in flight finish for up to the grace period,
then stop the links and exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.log import LogLevels
from granian.server.embed import Server

from router._fastpath import Reservations
from router.boxes.fleet import Fleet
from router.facades import mounts
from router.serve import tracing
from router.serve.app import RouterApp, Shared
from router.serve.metrics import sample_calls, watch_loop
from router.store import paths as store_paths
from router.store.keys import KeyStore
from router.store.route_log import RouteLogWriter
from router.telemetry.agents import AgentLinks
from router.telemetry.cache import TelemetryCache
from router.telemetry.local import LocalScanTask, is_loopback_url
from router.telemetry.scheduler import Scheduler

log = logging.getLogger("router.serve")

# Granian's accept loop counts connections, not requests (stack-notes §1.3): keep it well above
# the keep-alive client connections a busy front door holds.
BACKPRESSURE_CONNECTIONS = 4096


@dataclass(frozen=True)
class ServeConfig:
    host: str
    port: int  # 0 = pick a free one
    boxes_path: Path
    interface: str = "asgi"
    max_body_bytes: int = 64 << 20
    first_byte_timeout_s: float = 900.0
    grace_s: float = 30.0
    ollama_port: int | None = None  # a dedicated Ollama listener (0 = pick a free port)
    lmstudio_port: int | None = None  # a dedicated LM Studio listener
    otel: bool = False  # export a span per call (also on with OTEL_EXPORTER_OTLP_ENDPOINT)


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


async def serve(config: ServeConfig, *, ready=None) -> int:
    """Serves until SIGTERM/SIGINT. `ready(name, url)` is called once each listener is up."""
    loop = asyncio.get_running_loop()
    tracer = tracing.start(config.otel)  # first: a missing extra stops the start at once
    reservations = Reservations()
    fleet = Fleet(config.boxes_path, reservations)
    telemetry = TelemetryCache()
    agents = AgentLinks(fleet, telemetry)
    await fleet.start()
    scanner = LocalScanTask(
        telemetry,
        lambda: [box.name for box in fleet.ordered() if is_loopback_url(box.config.url)],
    )
    scanner.start()
    scheduler = Scheduler(fleet, reservations, telemetry)
    scheduler.start()
    store_path = store_paths.db_path()
    keys = KeyStore(store_path)
    route_log = RouteLogWriter(store_path)
    route_log.start()
    key_upkeep = loop.create_task(_key_upkeep(keys), name="keys")
    shared = Shared(
        fleet,
        reservations,
        scheduler,
        store_path=store_path,
        route_log=route_log,
        keys=keys,
        max_body_bytes=config.max_body_bytes,
        first_byte_timeout_s=config.first_byte_timeout_s,
    )
    shared.tracer = tracer
    loop_watch = loop.create_task(watch_loop(shared.metrics), name="loop-watch")
    call_series = loop.create_task(sample_calls(shared.metrics), name="call-series")
    shared.clock.start()
    listeners = [("router", config.port, mounts.main)]
    if config.ollama_port is not None:
        listeners.append(("ollama", config.ollama_port, mounts.ollama_port))
    if config.lmstudio_port is not None:
        listeners.append(("lmstudio", config.lmstudio_port, mounts.lmstudio_port))
    servers = []
    for name, port, mount in listeners:
        port = port or free_port(config.host)
        servers.append((name, port, granian_server(RouterApp(shared, mount), config, port)))
    stopping = shared.stopping
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    serving = [loop.create_task(server.serve()) for _, _, server in servers]
    for (name, port, _), task in zip(servers, serving):
        await wait_listening(config.host, port, task)
        url = f"http://{config.host}:{port}"
        log.info("%s listening on %s (%s)", name, url, config.interface)
        if ready is not None:
            ready(name, url)
    stop_wait = loop.create_task(stopping.wait())
    await asyncio.wait({*serving, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping: %d calls in flight, grace %.0f s", shared.in_flight, config.grace_s)
    for _, _, server in servers:
        server.stop()
    try:
        await asyncio.wait_for(shared.idle.wait(), config.grace_s)
    except asyncio.TimeoutError:
        log.warning("grace period over with %d calls in flight", shared.in_flight)
    await asyncio.wait(serving, timeout=config.grace_s)
    await shared.clock.stop()
    stop_wait.cancel()
    key_upkeep.cancel()
    loop_watch.cancel()
    call_series.cancel()
    await loop.run_in_executor(None, route_log.stop)  # flushes every row
    if tracer is not None:
        await loop.run_in_executor(None, tracer.flush)  # exports what is queued, bounded
    await loop.run_in_executor(None, keys.flush_last_used, time.time())
    keys.close()
    await scheduler.stop()
    await scanner.stop()
    await agents.stop()
    await fleet.stop()
    return 0


def granian_server(app, config: ServeConfig, port: int) -> Server:
    """Granian embedded, as every router listener runs it (bench/floor_proxy.py reuses it)."""
    return Server(
        app,
        address=config.host,
        port=port,
        interface=Interfaces.RSGI if config.interface == "rsgi" else Interfaces.ASGINL,
        http=HTTPModes.http1,
        websockets=False,
        backlog=1024,
        backpressure=BACKPRESSURE_CONNECTIONS,
        http1_settings=HTTP1Settings(header_read_timeout=30_000, keep_alive=True),
        log_enabled=False,
        log_level=LogLevels.warning,
    )


KEY_REFRESH_S = 1.0


async def _key_upkeep(keys: KeyStore) -> None:
    """Off the loop: reload keys changed by `router keys` or the API; note last use lazily."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(KEY_REFRESH_S)
        await loop.run_in_executor(None, keys.refresh_if_changed)
        await loop.run_in_executor(None, keys.flush_last_used, time.time())


async def wait_listening(host: str, port: int, serving: asyncio.Task) -> None:
    """Returns once the port accepts connections; raises if the server task died first."""
    for _ in range(200):
        if serving.done():
            serving.result()
            raise RuntimeError("server stopped during start")
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.025)
            continue
        writer.close()
        return
    raise RuntimeError(f"nothing listening on {host}:{port} after 5 s")
