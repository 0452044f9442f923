"""Running the router: Granian embedded in our own uvloop loop, one process.

Why embedded: the fleet links, the reservation table and the app live in this one loop, so every
listener of the process shares them (DESIGN.md: reservations are process-wide). `--workers N`
would split that state N ways; `--workers 1` is the supported setting.

Start: every listener's address is checked before anything else starts, so a port in use (or any
bind error) ends the process with one line and a non-zero status (systemd's Restart=on-failure
relies on it), never a backtrace.

Connections (issue 11 item 1):
1. Granian's accept loop holds one permit per open connection (a semaphore of `backpressure`
   permits); with every permit taken it stops calling accept(), and new clients wait in the
   kernel's backlog until they give up. That, with a fixed 4,096, is what stopped a process at
   about 4,096 idle connections. The permits now come from the file-descriptor budget: the soft
   RLIMIT_NOFILE is raised to the hard one at start (systemd's default soft limit is 1,024), and
   each listener gets an equal share of it, two descriptors per client connection (its own and
   the box connection a call opens).
2. A connection that has not sent a whole request head within `idle_timeout_s` of opening, or of
   its last answer, is closed (hyper's header_read_timeout covers both; measured).
3. No address holds more than `max_conns_per_client` idle connections, and a listener near its
   permits closes its longest-idle connections: router.serve.conn_cap.
4. TLS (`ssl_certfile`/`ssl_keyfile`) is Granian's (rustls) on every listener, HTTP/1.1 only.
5. The health listener (`--health-port`) serves `GET|HEAD /health` only, on loopback whatever
   `--host` is, with HEALTH_CONNS permits of its own: Granian takes connections in the kernel's
   order and hears none before its request head, so no listener can keep permits for probes
   while a flood reopens idle sockets as fast as the drain closes them (docs/connections.md); a
   port of their own can. It is out of the cap and the drain (rule 3): only this machine reaches
   it, and a probe holds a connection for milliseconds.

Stop (SIGTERM or SIGINT): stop accepting, let calls in flight finish for up to the grace period,
then stop the links and exit 0. Reload (SIGHUP, a unit's ExecReload): re-read the boxes file and
the keys now. Under systemd `Type=notify` the server says READY=1 once it serves (serve/notify.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import ipaddress
import logging
import resource
import signal
import socket
import ssl
import time
from typing import NamedTuple

from granian.constants import HTTPModes, Interfaces, SSLProtocols
from granian.http import HTTP1Settings
from granian.log import LogLevels
from granian.server.embed import Server

from router._fastpath import Reservations
from router.boxes import listeners as own_listeners
from router.boxes.fleet import Fleet
from router.boxes.registry import registry_for
from router.core.errors import ConfigError
from router.facades import mounts
from router.facades.mounts import Mount
from router.fleetwide.leases import OPEN
from router.fleetwide.seam import ONE_ROUTER_BINDINGS
from router.fleetwide.several import SeveralRouters
from router.fleetwide.wire import SharedDown, SharedServer, shown_url
from router.serve import tracing
from router.serve.affinity import Affinity
from router.serve.app import ProcessState, RouterApp
from router.serve.batches import BatchRunner
from router.serve.conn_cap import ConnCap, port_numbers
from router.serve.limits import Tenancy
from router.serve.metrics import BatchCollector, sample_calls, watch_loop
from router.serve.notify import notify
from router.serve.settings import ServeConfig
from router.store import engines
from router.store import paths as store_paths
from router.store.keys import KeyStore
from router.telemetry.agents import AgentLinks
from router.telemetry.cache import TelemetryCache
from router.telemetry.local import LocalScanTask, is_loopback_url
from router.telemetry.scheduler import Scheduler

log = logging.getLogger("router.serve")

# Descriptors kept out of the client connections' share (rule 1): the store, the listeners, box
# links and telemetry, pipes, and the per-client cap's own look-ups.
FD_RESERVE = 1024
# A listener's connections whatever the descriptor budget: at least enough for a small front
# door; at most 64 Ki, whose idle connections cost the router ~160 MB (~2.5 KB each, ~14 KB once
# each has had an answer: tests/test_edge_capacity.py), which is still more than the 65,535
# connections one IPv4 address can open to one port.
MIN_CONNS_PER_LISTENER = 256
MAX_CONNS_PER_LISTENER = 65536
# The health listener's connections (rule 5), whatever the budget: a probe holds one for
# milliseconds and opens no box connection, so one descriptor each.
HEALTH_CONNS = 64


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def raise_fd_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a sandbox may refuse: keep what we have
            pass
    return soft


def conns_per_listener(fd_limit: int, listeners: int, *, reserved: int = 0) -> int:
    """Granian's `backpressure` per listener: an equal share of the descriptor budget (rule 1),
    less `reserved` descriptors (the health listener's, rule 5)."""
    share = (fd_limit - FD_RESERVE - reserved) // (2 * listeners)
    return max(MIN_CONNS_PER_LISTENER, min(MAX_CONNS_PER_LISTENER, share))


def check_listeners(ports: list[tuple[str, str, int]]) -> None:
    """Binds every (flag, host, port) once, all at the same time, and releases them.

    Raises ConfigError with one line when one cannot be bound. Granian binds with SO_REUSEPORT,
    so a second router on the same port (or the same port given twice) would bind too and split
    the traffic without a word; these probes bind without it, so they fail on both.
    """
    with contextlib.ExitStack() as probes:
        for flag, host, port in ports:
            try:
                family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
            except ValueError:
                raise ConfigError(f"--host must be an IP address, not {host!r}") from None
            sock = probes.enter_context(socket.socket(family, socket.SOCK_STREAM))
            # A previous run's connections in TIME_WAIT are no conflict.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                sock.listen(1)  # two bound, non-listening sockets may share a port
            except OSError as exc:
                raise ConfigError(_bind_failure(exc, host, port, flag)) from None


def _bind_failure(exc: OSError, host: str, port: int, flag: str) -> str:
    what = f"port {port}" if flag == "--port" else f"port {port} ({flag})"
    if exc.errno == errno.EADDRINUSE:
        return f"{what} is in use"
    if exc.errno == errno.EACCES:
        return f"{what} needs privileges (below 1024: root or CAP_NET_BIND_SERVICE)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def check_tls(config: ServeConfig) -> None:
    """Raises ConfigError with one line when the certificate or key cannot be used."""
    if config.ssl_certfile is None and config.ssl_keyfile is None:
        return
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        raise ConfigError("TLS needs both --ssl-certfile and --ssl-keyfile")
    try:
        # An empty password: an encrypted key fails here rather than prompt on a terminal.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            config.ssl_certfile, config.ssl_keyfile, password=b""
        )
    except ssl.SSLError as exc:  # before OSError: it is one
        reason = "not a PEM certificate with its unencrypted private key" + (
            f" ({exc.reason})" if exc.reason else ""
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
    else:
        return
    raise ConfigError(
        f"cannot use TLS certificate {config.ssl_certfile} with key {config.ssl_keyfile}: {reason}"
    )


class Listener(NamedTuple):
    name: str  # "router" (the main port, first), "ollama", "lmstudio", "health"
    flag: str
    host: str
    port: int
    mount: Mount


def health_host(host: str) -> str:
    """The health listener's address (rule 5): this machine's loopback, in `host`'s family."""
    return "::1" if ":" in host else "127.0.0.1"


def bound_listeners(config: ServeConfig) -> list[Listener]:
    """Every listener, `auto` ports chosen. Raises ConfigError when one cannot be bound or the
    TLS certificate cannot be used: before anything starts."""
    host = config.host
    listeners = [Listener("router", "--port", host, config.port, mounts.main)]
    if config.ollama_port is not None:
        listeners.append(Listener("ollama", "--ollama-port", host, config.ollama_port, mounts.ollama_port))
    if config.lmstudio_port is not None:
        listeners.append(Listener("lmstudio", "--lmstudio-port", host, config.lmstudio_port, mounts.lmstudio_port))
    if config.health_port is not None:
        listeners.append(Listener("health", "--health-port", health_host(host), config.health_port,
                                  mounts.health_port))
    listeners = [listener._replace(port=listener.port or free_port(listener.host)) for listener in listeners]
    check_listeners([(flag, host, port) for _, flag, host, port, _ in listeners])
    check_tls(config)
    return listeners


class Running:
    """What a router process runs besides its listeners: the fleet and its links, the telemetry
    scan, the scheduler, the store (keys, route-log writer), the process state and its background
    tasks. `start` brings them up in order; `stop` takes them down in reverse, the route log
    flushed."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.reservations = Reservations()
        self.database_url = engines.database_url(config.database_url)
        self.fleet = Fleet(config.boxes_path, self.reservations,
                           registry_for(config.boxes_path, self.database_url))
        self.telemetry = TelemetryCache()
        self.agents = AgentLinks(self.fleet, self.telemetry)
        self.store_path = config.store_path or store_paths.db_path()
        self.instance = config.instance  # serve() names it host:port when the config does not
        self.tasks: list[asyncio.Task] = []
        self.shared_server: SharedServer | None = None  # --shared-url: `reach_shared`

    async def start(self, tracer) -> ProcessState:
        config, fleet, url = self.config, self.fleet, self.database_url
        loop = asyncio.get_running_loop()
        if url is not None:
            await loop.run_in_executor(None, engines.open_database, url)
        if config.shared_url:
            self.shared_server = await self.reach_shared(config.shared_url)
        await fleet.start()
        # After the listeners' check: a start that fails says one line and nothing else.
        log.info("%s: %d boxes; store %s", fleet.registry.where, len(fleet.ordered()),
                 self.store_path if url is None else "in the database")
        if not fleet.ordered():
            log.warning(
                "the fleet is empty: no boxes in the %s, so every call is refused until one is added "
                "(`hugpy-router boxes add`, or --boxes FILE / HUGPY_ROUTER_BOXES for another file)",
                fleet.registry.where,
            )
        self.scanner = LocalScanTask(
            self.telemetry,
            lambda: [box.name for box in fleet.ordered() if is_loopback_url(box.config.url)],
        )
        self.scanner.start()
        self.scheduler = Scheduler(fleet, self.reservations, self.telemetry)
        self.scheduler.start()
        self.keys = engines.keys(self.store_path, url)
        self.route_log = engines.route_log(self.store_path, url, config.log_retention_days * 86400 or None,
                                           self.instance)
        self.route_log.start()
        several = (None if self.shared_server is None  # the boxes' slots, keys' tallies, bindings across routers
                   else SeveralRouters(self.shared_server, self.instance, fleet, config.shared_down or OPEN))
        self.process = process = ProcessState(
            fleet,
            self.reservations,
            self.scheduler,
            store_path=self.store_path,
            route_log=self.route_log,
            keys=self.keys,
            config=config,
            affinity=Affinity(config.affinity_slack, config.affinity_memory_bytes, fleet,
                              ONE_ROUTER_BINDINGS if several is None else several.bindings),
            several=several,
        )
        self.route_log.loop_calls = lambda: process.in_flight  # its writer's let-gos (route_log rule 10)
        process.tracer = tracer
        log.info("%s", process.access.describe())
        if several is not None:
            await several.start()
        process.tenancy.seed(await loop.run_in_executor(None, process.tenancy.seeds))  # budgets from the store
        self.tasks = [
            loop.create_task(_key_upkeep(self.keys, process.tenancy), name="keys"),
            loop.create_task(watch_loop(process.metrics), name="loop-watch"),
            loop.create_task(sample_calls(process.metrics), name="call-series"),
        ]
        if url is not None:  # changes from any router, live here (router.store.pg.listen)
            from router.store.pg.listen import Listener

            process.database = Listener(url, {"keys": lambda: loop.run_in_executor(None, self.keys.reload),
                                             "boxes": fleet.reload})
            process.scraped.register(process.database)
            self.tasks.append(loop.create_task(process.database.run(), name="database-listen"))
        process.batches = BatchRunner(RouterApp(process, mounts.main), engines.batches(self.store_path, url),
                                      self.instance or "router", config.batch_per_box, config.batch_lease_s,
                                      config.log_retention_days * 86400 or None, process.stopping)
        process.scraped.register(BatchCollector(process.batches))
        await process.batches.start()
        process.clock.start()
        return process

    async def reach_shared(self, url: str) -> SharedServer:
        """The shared server, asked once before anything starts. A URL that cannot be used, or a
        server that refuses this router (a wrong password, an unknown database: fleetwide/wire.py
        rule 8), ends the start with one line: waiting would not heal it, and meanwhile the
        fleet-wide limits would quietly be per router. `--shared-down open`, given, starts
        anyway (`share` says it at warning level)."""
        try:
            server = SharedServer(url)
        except ImportError:
            raise ConfigError("--shared-url needs the shared extra: pip install 'hugpy-router[shared]'") from None
        except ValueError as exc:  # redis-py's parse_url: a scheme, a port or an option
            raise ConfigError(f"--shared-url {shown_url(url)}: {exc}") from None
        try:
            await server.call(None, "PING")
        except SharedDown:
            if server.refused and self.config.shared_down != "open":
                await server.close()
                raise ConfigError(f"shared server {server.url}: {server.why_down} (fix --shared-url, or give "
                                  "--shared-down open to start counting in this router alone)") from None
        return server

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        await self.process.clock.stop()
        await self.process.batches.stop()
        self.process.batches.store.close()
        if self.process.several is not None:
            await self.process.several.stop()
        for task in self.tasks:
            task.cancel()
        await loop.run_in_executor(None, self.route_log.stop)  # flushes every row
        if self.process.tracer is not None:
            await loop.run_in_executor(None, self.process.tracer.flush)  # exports what is queued, bounded
        await loop.run_in_executor(None, self.keys.flush_last_used, time.time())
        self.keys.close()
        await self.scheduler.stop()
        await self.scanner.stop()
        await self.agents.stop()
        await self.fleet.stop()


async def serve(config: ServeConfig, *, ready=None, started=None) -> int:
    """Serves until SIGTERM/SIGINT. `started(process)` is called once the process state is up
    (tests/inproc.py ticks its CallClock ahead through it); `ready(name, url)` once each
    listener is up.

    Raises ConfigError before anything starts when a listener cannot be bound or the TLS
    certificate cannot be used."""
    listeners = bound_listeners(config)
    # The listeners that take calls; the health listener is none (rule 5): a box naming it loops
    # nothing, and the cap and the drain leave it alone.
    calls = [listener for listener in listeners if listener.name != "health"]
    max_conns = conns_per_listener(raise_fd_limit(), len(calls),
                                   reserved=HEALTH_CONNS * (len(listeners) - len(calls)))
    tracer = tracing.start(config.otel)  # first: a missing extra stops the start at once
    running = Running(config)
    ports = [listener.port for listener in calls]
    running.instance = config.instance or f"{config.host}:{ports[0]}"
    running.fleet.listening = own_listeners.Listening(config.host, frozenset(ports))
    process = await running.start(tracer)
    process.ports = {listener.name: listener.port for listener in listeners}
    process.scheme = "https" if config.ssl_certfile else "http"
    if started is not None:
        started(process)
    own_listeners.write_record(config.boxes_path, config.host, ports)
    permits = {listener.name: HEALTH_CONNS if listener.name == "health" else max_conns for listener in listeners}
    servers = [
        (listener, granian_server(RouterApp(process, listener.mount), config, listener.port,
                                  max_conns=permits[listener.name], host=listener.host))
        for listener in listeners
    ]
    conn_cap = ConnCap(
        config.host, ports, config.max_conns_per_client, process.access.proxies,
        limit=max_conns, working_ports=lambda: port_numbers(process.working_ports),
    )
    loop = asyncio.get_running_loop()
    registry = running.fleet.registry  # several routers: this one's listeners, for the others (listeners.py rule 4)
    try:
        await loop.run_in_executor(None, lambda: registry.announce(
            own_listeners.this_peer(running.instance, config.host, ports)))
    except OSError as exc:
        log.warning("%s: this router's listeners not announced (%s): the others cannot refuse a box "
                    "that names them", registry.where, exc)
    conn_cap_task = loop.create_task(conn_cap.run(), name="conn-cap")
    stopping = process.stopping
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    serving = [loop.create_task(server.serve()) for _, server in servers]
    for (listener, _), task in zip(servers, serving):
        await wait_listening(listener.host, listener.port, task)
        host = f"[{listener.host}]" if ":" in listener.host else listener.host
        url = f"{config.scheme}://{host}:{listener.port}"
        log.info("%s listening on %s (%s, up to %d connections)", listener.name, url, config.interface,
                 permits[listener.name])
        if ready is not None:
            ready(listener.name, url)
    loop.add_signal_handler(signal.SIGHUP, _reloader(running.fleet, running.keys))
    if config.freeze_gc:
        settle_collector()
    notify(f"READY=1\nSTATUS=serving {len(running.fleet.ordered())} boxes")
    stop_wait = loop.create_task(stopping.wait())
    await asyncio.wait({*serving, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping: %d calls in flight, grace %.0f s", process.in_flight, config.grace_s)
    notify("STOPPING=1")
    for _, server in servers:
        server.stop()
    try:  # asyncio.timeout: Python 3.11's wait_for can swallow a cancel (telemetry/scheduler.py)
        async with asyncio.timeout(config.grace_s):
            await process.idle.wait()
    except TimeoutError:
        log.warning("grace period over with %d calls in flight", process.in_flight)
    await asyncio.wait(serving, timeout=config.grace_s)
    stop_wait.cancel()
    conn_cap_task.cancel()
    await running.stop()
    own_listeners.remove_record(config.boxes_path)
    with contextlib.suppress(OSError):  # a database down: the row stays until this instance starts again
        await loop.run_in_executor(None, registry.withdraw, running.instance)
    return 0


def _reloader(fleet: Fleet, keys: KeyStore):
    """SIGHUP's handler: a reload task, held until done (the loop keeps only weak references)."""
    reloads: set[asyncio.Task] = set()

    def on_hup() -> None:
        task = asyncio.get_running_loop().create_task(_reload(fleet, keys), name="reload")
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    return on_hup


def granian_server(app, config: ServeConfig, port: int, *, max_conns: int, host: str | None = None) -> Server:
    """Granian embedded, as every router listener runs it (bench/floor_proxy.py reuses it).

    HTTP/1.1 only, with TLS too. HTTP/2 over ALPN works with Granian 2.8 (tried with curl
    --http2: calls and streams through the router), but the idle timeout (header_read_timeout)
    and the slow-reader bound are HTTP/1.1's here, and one HTTP/2 connection would carry up to
    200 calls past the per-client connection cap. `host`: the address, if not --host's."""
    tls = config.ssl_certfile is not None
    return Server(
        app,
        address=host or config.host,
        port=port,
        interface=Interfaces.RSGI if config.interface == "rsgi" else Interfaces.ASGINL,
        http=HTTPModes.http1,
        websockets=False,
        backlog=1024,
        backpressure=max_conns,
        http1_settings=HTTP1Settings(
            header_read_timeout=round(config.idle_timeout_s * 1000), keep_alive=True
        ),
        log_enabled=False,
        log_level=LogLevels.warning,
        ssl_cert=config.ssl_certfile if tls else None,
        ssl_key=config.ssl_keyfile if tls else None,
        # TLS 1.2 and up, as Mozilla's "intermediate" profile (Granian's default is 1.3 only).
        ssl_protocol_min=SSLProtocols.tls12,
    )


KEY_REFRESH_S = 1.0


async def _reload(fleet: Fleet, keys: KeyStore) -> None:
    """SIGHUP: the boxes file and the keys, read again now (notify.py rule 2)."""
    notify("RELOADING=1")
    applied = await fleet.reload()
    await asyncio.get_running_loop().run_in_executor(None, keys.reload)
    log.info("reloaded: boxes file %s (%d boxes%s) and keys", fleet.path, len(fleet.ordered()),
             "" if applied else ", the file not applied")
    notify("READY=1")


async def _key_upkeep(keys: KeyStore, tenancy: Tenancy) -> None:
    """Off the loop: reload keys changed by `router keys` or the API; note last use lazily; count
    a budget set or changed since from the store (serve/limits.py rule 5)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(KEY_REFRESH_S)
        await loop.run_in_executor(None, keys.refresh_if_changed)
        await loop.run_in_executor(None, keys.flush_last_used, time.time())
        try:
            tenancy.seed(await loop.run_in_executor(None, tenancy.seeds))
        except keys.errors:  # the store unreadable now (a database down): the next look tries again
            pass


# Calls in flight hold ~100 tracked objects each, so at 64 at once the youngest generation's
# count swings by thousands while barely growing: at CPython's 700 it was collected ~10 times a
# call batch and promoted live calls' objects, which then paid for full passes.
YOUNG_GC_THRESHOLD = 20_000


def settle_collector() -> None:
    """What start-up made lives as long as the process (modules, the fleet, the app): frozen,
    the collector's full passes skip it. The youngest generation is collected when 20,000
    tracked objects are net new, not 700. bench/callpath_cpu.py, timing the collector under load
    (gc.callbacks, c=64): 17-20 µs a call before the freeze, 9-13 after it, 0-2 with the
    threshold (~3 young passes per 10,000 calls)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD)


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
