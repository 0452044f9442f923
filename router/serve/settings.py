"""The settings of `router serve` and `router demo`: one row each, the one place a default is written.

A row (`Setting`) is a flag, the environment variable that stands in for it (if any), its default,
unit, range, what it sets and why its default is what it is. Made from the rows:
1. the command line: one argparse option per row, its `--help` the row's words and default
   (router/cli/main.py `add_serve_options`), and so README.md's flag list, which is rendered
   from the parser (router/cli/flags.py);
2. `ServeConfig`'s defaults: a field's default is its row's (`DEFAULT`), and the CLI fills the
   config from the parsed flags by the rows' `field` (router/cli/run.py);
3. docs/timeouts.md's rows for the flags that set a timeout: their default and why cells are
   the rows' (tests/test_settings.py checks the page against the table).

Rules:
1. A row's default is what `router serve` runs with when neither the flag nor its variable is
   given; `None` means "not set", which the row's `shown` says in words (`--queue-per-caller`:
   a quarter of --queue-size).
2. A variable is read once, when the parser is built, and the flag beats it. `--port` is the one
   row whose presence differs: `serve` requires it unless $HUGPY_ROUTER_PORT is set; `demo`
   picks a free port and reads no variable.
3. A value is read once, where it enters (rule 3 of router.core.bounds): a row's `values.read`
   is argparse's `type`, whose ArgumentTypeError is the one line the CLI says. Its `__name__`
   names the value in README's flag list (router/cli/flags.py VALUE_NAMES).
4. The call reads the settings through the one `ServeConfig` that `ProcessState` holds
   (`app.config.first_byte_timeout_s`): no other object copies or restates one.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from router.core import bounds
from router.core.affinity import DEFAULT_SLACK, Slack
from router.core.limits import DEFAULT_ANSWER_TOKENS
from router.serve.affinity import DEFAULT_MEMORY_BYTES

# Admin event streams open at once: at most this many, whatever the flag (a typo must not mean
# no cap at all).
MAX_EVENT_STREAMS = 4096
# An instance name goes into log lines, the route log, the state and the shared server's keys:
# letters, digits and `._:-` (the default, host:port, is one), at most 64, never a control character.
INSTANCE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def in_range(check: Callable[..., Any], name: str, **limits) -> Callable[[str], Any]:
    """An argparse `type` from a router.core.bounds check: its ValueError becomes argparse's
    one-line error, which names the flag and the value (`argument --queue-size: invalid value
    '-1': must be ...`). `name` names the value in the README (rule 3)."""

    def parse(value: str):
        try:
            return check(value, **limits)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid value {value!r}: {exc}") from None

    parse.__name__ = name
    return parse


def _port(value: str) -> int:
    if value == "auto":
        return 0
    port = int(value)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError("port must be 1-65535 or 'auto'")
    return port


def _instance(value: str) -> str:
    if not INSTANCE_RE.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value[:64]!r} is not an instance name: 1-64 letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit")
    return value


def _share(value: str) -> float:
    number = float(value)
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError("must be 0 or more")
    return number


def _days(value: str) -> float:
    days = float(value)
    if not 0 <= days < 1e6:
        raise argparse.ArgumentTypeError("days must be 0 (keep forever) or more, below 1000000")
    return days


@dataclass(frozen=True)
class Values:
    """What a flag takes: `read` turns its text into the value (rule 3; None: the text itself),
    `range` says in words what it accepts ("" where its name says it: a file, a URL)."""

    read: Callable[[str], Any] | None
    range: str


SECONDS = Values(in_range(bounds.finite_seconds, "seconds"), f"more than 0, at most {bounds.MAX_SECONDS:g}")
SECONDS_OR_ZERO = Values(in_range(bounds.finite_seconds, "seconds", zero_ok=True),
                         f"0 to {bounds.MAX_SECONDS:g}")
# Granian takes the idle timeout in whole milliseconds; a day is far above any keep-alive.
IDLE_SECONDS = Values(in_range(bounds.finite_seconds, "seconds", high=86400.0), "more than 0, at most 86400")
COUNT = Values(in_range(bounds.non_negative_int, "count"), f"0 to {bounds.MAX_COUNT}")
POSITIVE = Values(in_range(bounds.positive_int, "count"), f"1 to {bounds.MAX_COUNT}")
# At most one per descriptor the process may hold.
CONNS = Values(in_range(bounds.non_negative_int, "count", high=1 << 20), f"0 to {1 << 20}")
STREAMS = Values(in_range(bounds.positive_int, "count", high=MAX_EVENT_STREAMS), f"1 to {MAX_EVENT_STREAMS}")
SIZE = Values(in_range(bounds.size_bytes, "size"), "1 byte to 1TiB, as 65536, 64MiB or 1.5g")
PORT = Values(_port, "1-65535 or auto")
DAYS = Values(_days, "0 (keep forever) or more, below 1000000")
SHARE = Values(_share, "0 or more")
INSTANCE = Values(_instance, "1-64 letters, digits, '.', '_', ':' or '-'")
FILE = Values(Path, "")
ADDRESS = Values(None, "an IP address")
URL = Values(None, "")
SWITCH = Values(None, "")


@dataclass(frozen=True)
class Setting:
    """One flag of `router serve` (module rules)."""

    flag: str
    default: Any
    unit: str  # of the value: "s", "bytes", ... ("" when it has none)
    values: Values | tuple[Any, ...]  # a tuple: the choices
    help: str  # what it sets: the --help sentence
    why: str = ""  # why the default is what it is, where there is more to say than `help`
    env: str | None = None  # the variable that stands in for the flag (rule 2)
    field: str | None = None  # the ServeConfig field it sets; None: read by the CLI alone
    shown: str | None = None  # the default in words, where the value does not say it (rule 1)
    see: str = ""  # the page that says more

    @property
    def dest(self) -> str:
        """argparse's attribute for the flag: `--first-byte-timeout` -> first_byte_timeout."""
        return self.flag[2:].replace("-", "_")

    def default_text(self) -> str | None:
        """The default as --help and the docs say it: `900 s`, `64MiB`, `$HUGPY_ROUTER_HOST,
        else 127.0.0.1`; None where there is nothing to say (a switch, an unset listener)."""
        if self.shown is not None:
            said = self.shown
        elif self.default is None or self.values is SWITCH:
            said = None
        elif self.unit == "bytes":
            said = f"{self.default >> 20}MiB"
        elif isinstance(self.default, (int, float)):
            said = f"{self.default:g}" + (f" {self.unit}" if self.unit else "")
        else:
            said = str(self.default)
        if self.env is None:
            return said
        return f"${self.env}" + (f", else {said}" if said else "")

    def help_text(self) -> str:
        """The --help text: what it sets, then its default, its range (argparse shows choices
        itself) and the page that says more."""
        said = self.default_text()
        limits = "" if isinstance(self.values, tuple) else self.values.range
        notes = "; ".join(note for note in (said and f"default {said}", limits, self.see) if note)
        return f"{self.help} ({notes})" if notes else self.help


SETTINGS: tuple[Setting, ...] = (
    Setting("--port", None, "", PORT, "port to listen on, or 'auto' to pick a free one, printed at start",
            env="HUGPY_ROUTER_PORT", field="port"),
    Setting("--host", "127.0.0.1", "", ADDRESS, "address to bind", env="HUGPY_ROUTER_HOST", field="host"),
    Setting("--workers", 1, "", (1,),
            "worker processes. Only 1: the reservation table, the box links and the settings contracts are "
            "per process, so two workers would each route blind to the other's load"),
    Setting("--interface", "asgi", "", ("asgi", "rsgi"),
            "Granian interface. asgi bounds what a slow reader makes the router buffer; rsgi has no write "
            "backpressure (a stalled reader grew the router by 45 MiB in the bench; Granian's RSGI response "
            "stream is still an unbounded channel: its backpressure change, emmett-framework/granian#898, "
            "covered ASGI and WSGI only), so keep it for trusted, fast clients", field="interface"),
    Setting("--max-body", 64 << 20, "bytes", SIZE, "largest request body", field="max_body_bytes"),
    Setting("--first-byte-timeout", 900.0, "s", SECONDS, "seconds to wait for a box's first byte",
            why="a cold load of a large model can take minutes", field="first_byte_timeout_s"),
    Setting("--stream-idle-timeout", 300.0, "s", SECONDS,
            "seconds a box may stay silent mid-answer, after its first byte; then the stream ends with an "
            "error frame in its own format, or a sized body is cut",
            why="long enough for a box thinking between tokens, short enough that a stuck box frees its client",
            field="stream_idle_timeout_s"),
    Setting("--ollama-port", None, "", PORT,
            "also listen here as an Ollama server (every path is Ollama's; 'auto' picks one)", field="ollama_port"),
    Setting("--lmstudio-port", None, "", PORT,
            "also listen here as an LM Studio server (every path is LM Studio's)", field="lmstudio_port"),
    Setting("--health-port", None, "", PORT,
            "also listen here for local health probes (systemd, a container healthcheck, a balancer on this "
            "machine): GET|HEAD /health and nothing else, bound to loopback (127.0.0.1, or ::1 with an IPv6 "
            "--host) whatever --host is, with connections of its own that a flood on the other ports cannot "
            "take ('auto' picks one; docs/connections.md)", field="health_port"),
    Setting("--queue-size", 1024, "calls", COUNT, "calls that may wait for a full box, in all; more get 429",
            field="queue_size"),
    Setting("--queue-per-caller", None, "calls", POSITIVE,
            "places of the queue one caller (a key, else an address) may hold; more get 429",
            shown="a quarter of --queue-size, at least 1", see="docs/queue.md", field="queue_per_caller"),
    Setting("--queue-timeout", 120.0, "s", SECONDS, "seconds a call may wait for a full box before a 503",
            why="a cold load of a large model takes a minute or two", field="queue_timeout_s"),
    Setting("--batch-per-box", 2, "lines", POSITIVE,
            "batch lines at once on a box that states no max_inflight (a box that states one takes lines "
            "only under it, leaving room for interactive calls)",
            why="Ollama serves 4 calls at once by default (OLLAMA_NUM_PARALLEL): 2 lines keep half of it busy "
            "and half free for people, whose calls never wait for a line there", see="docs/batches.md",
            field="batch_per_box"),
    Setting("--batch-lease", 30.0, "s", SECONDS,
            "seconds a router holds a batch line it runs, renewed while it runs: a dead router's lines run "
            "again within this", why="long enough that a busy store's renewal never lapses, short enough that "
            "a dead router's lines are back within a minute", see="docs/batches.md", field="batch_lease_s"),
    Setting("--batch-max-file-bytes", 200_000_000, "bytes", SIZE,
            "largest file a client may upload for a batch (POST /v1/files); larger gets 413",
            shown="200000000 bytes, OpenAI's cap", see="docs/batches.md", field="batch_max_file_bytes"),
    Setting("--batch-max-lines", 50_000, "lines", POSITIVE,
            "most lines (requests) one batch's input file may hold; a file with more fails its batch",
            why="OpenAI's cap", see="docs/batches.md", field="batch_max_lines"),
    Setting("--stream-keepalive", 15.0, "s", SECONDS_OR_ZERO,
            "a streamed OpenAI call waiting this long (queue, cold load) gets its stream head and an SSE "
            "comment every this many seconds; 0: never",
            why="below the 30-60 s idle timeouts of proxies and SDKs between the client and the router",
            field="stream_keepalive_s"),
    Setting("--max-event-streams", 32, "streams", STREAMS,
            "admin event streams (/v1/router/events, /v1/router/schedule) open at once; more get 429",
            why="a dashboard or two per operator and a few schedule watchers; 300 was an attack, not a fleet",
            field="max_event_streams"),
    Setting("--grace", 30.0, "s", SECONDS_OR_ZERO, "seconds in-flight calls get at stop",
            why="a typical answer ends well within it; systemd's default stop timeout is 90 s", field="grace_s"),
    Setting("--default-rpm", 0, "requests/min", COUNT,
            "requests a minute for each caller without a key, per resolved address; 0: no limit",
            see="docs/tenancy.md", field="default_rpm"),
    Setting("--default-tpm", 0, "tokens/min", COUNT,
            "tokens a minute for each caller without a key, per resolved address; 0: no limit",
            field="default_tpm"),
    Setting("--default-max-tokens", DEFAULT_ANSWER_TOKENS, "tokens", POSITIVE,
            "the answer's bound in tokens the router gives a call counted against token limits (tpm, a budget) "
            "that states none: written into the body it sends the box (max_tokens, max_output_tokens, "
            "num_predict) and reserved", see="docs/tenancy.md", field="default_max_tokens"),
    Setting("--log-retention-days", 30.0, "days", DAYS,
            "route-log rows older than this are deleted; 0 keeps every row", field="log_retention_days"),
    Setting("--idle-timeout", 20.0, "s", IDLE_SECONDS,
            "seconds a connection may stay without a whole request head, after it opens or after its last "
            "answer, before it is closed",
            why="above the pooled clients' idle expiry (httpx 5 s, aiohttp 15 s), below nginx's 60 s header and "
                "75 s keep-alive: an idle connection is what an attacker holds", field="idle_timeout_s"),
    Setting("--max-conns-per-client", 512, "connections", CONNS,
            "most idle connections one client address may hold; over it, its longest-idle ones are closed "
            "(a connection with a call in flight never is). Trusted proxies (HUGPY_ROUTER_TRUSTED_PROXIES) "
            "are exempt; 0 = no cap",
            why="above what one busy host sends through its own pool (a browser holds 6, an eval harness a few "
                "hundred concurrent streams), far below a listener's share of the descriptors (thousands)",
            field="max_conns_per_client"),
    Setting("--ssl-certfile", None, "", FILE, "serve HTTPS on every listener with this PEM certificate (chain)",
            field="ssl_certfile"),
    Setting("--ssl-keyfile", None, "", FILE, "the PEM private key of --ssl-certfile", field="ssl_keyfile"),
    Setting("--require-key", None, "", ("never", "outside", "always"),
            "who needs a key on the use routes: never; outside (callers outside the trusted nets); always. "
            "Beats $HUGPY_ROUTER_REQUIRE_KEY. In every mode, always included, a caller on loopback manages the "
            "router (admin routes) without a key, as hugpy does: keep the port on loopback or behind a proxy "
            "that sends its own address", shown="outside"),
    Setting("--otel", False, "", SWITCH,
            "export an OpenTelemetry span per call over OTLP (needs the otel extra; also on when "
            "OTEL_EXPORTER_OTLP_ENDPOINT is set)", field="otel"),
    Setting("--affinity", "on", "", ("on", "off"),
            "send a conversation back to the box that holds its prefix; off: the seeds' strict order, for "
            "comparison", see="docs/affinity.md"),
    Setting("--affinity-slack", DEFAULT_SLACK.absolute, "", SHARE,
            "how much more load (pending + pressure + reservations) the bound box may carry than the best one "
            "and still be chosen"),
    Setting("--affinity-slack-share", DEFAULT_SLACK.relative, "", SHARE,
            "and, on top, this share of the best box's load; both 0: off"),
    Setting("--affinity-memory", DEFAULT_MEMORY_BYTES, "bytes", SIZE,
            "memory for bindings and the prefix index, LRU", field="affinity_memory_bytes"),
    Setting("--instance", None, "", INSTANCE,
            "this router's name among several, in the route log's `router` column and /v1/router/state",
            shown="host:port", field="instance"),
    Setting("--database-url", None, "", URL,
            "postgresql://... : keep the store (route log, keys, boxes, aliases) in PostgreSQL, shared by "
            "several routers; unset: the SQLite store", env="HUGPY_ROUTER_DATABASE_URL",
            see="docs/several-routers.md", field="database_url"),
    Setting("--shared-url", None, "", URL,
            "redis://... : count box slots and key limits on a Redis-protocol server, exact across several "
            "routers", env="HUGPY_ROUTER_SHARED_URL", field="shared_url"),
    # None: not given (open), which `router serve` tells from a given open: a server that refuses
    # the router at start (a wrong password) stops the start unless open was asked for
    Setting("--shared-down", None, "", ("open", "closed"),
            "when the shared server is unreachable: open counts per router, loudly; closed refuses calls that "
            "need a shared count with 503 shared_store_down. A server that refuses the router at start (a wrong "
            "password, an unknown database) stops the start (exit 2) unless open is given",
            shown="open", field="shared_down"),
    Setting("--log-level", "info", "", ("debug", "info", "warning", "error"), "what the router logs"),
)
BY_FLAG = {setting.flag: setting for setting in SETTINGS}
# ServeConfig field -> its default (rule 1)
DEFAULT = {setting.field: setting.default for setting in SETTINGS if setting.field is not None}


@dataclass(frozen=True)
class ServeConfig:
    """What `serve` runs with. Every field a flag sets takes its default from that flag's row."""

    host: str
    port: int  # 0 = pick a free one
    boxes_path: Path
    interface: str = DEFAULT["interface"]
    max_body_bytes: int = DEFAULT["max_body_bytes"]
    first_byte_timeout_s: float = DEFAULT["first_byte_timeout_s"]
    stream_idle_timeout_s: float = DEFAULT["stream_idle_timeout_s"]
    grace_s: float = DEFAULT["grace_s"]
    ollama_port: int | None = DEFAULT["ollama_port"]  # a dedicated Ollama listener (0 = pick a free port)
    lmstudio_port: int | None = DEFAULT["lmstudio_port"]  # a dedicated LM Studio listener
    health_port: int | None = DEFAULT["health_port"]  # the loopback health listener (server.py rule 5)
    queue_size: int = DEFAULT["queue_size"]  # calls waiting for a full box, in all
    queue_timeout_s: float = DEFAULT["queue_timeout_s"]
    queue_per_caller: int | None = DEFAULT["queue_per_caller"]  # None: router.core.admission.fair_share(queue_size)
    batch_per_box: int = DEFAULT["batch_per_box"]  # serve/batches.py rule 1
    batch_lease_s: float = DEFAULT["batch_lease_s"]  # serve/batches.py rule 5
    batch_max_file_bytes: int = DEFAULT["batch_max_file_bytes"]  # an upload's file, for a batch (POST /v1/files)
    batch_max_lines: int = DEFAULT["batch_max_lines"]  # lines of one batch's input file
    stream_keepalive_s: float = DEFAULT["stream_keepalive_s"]  # 0: never
    max_event_streams: int = DEFAULT["max_event_streams"]  # admin event streams open at once
    log_retention_days: float = DEFAULT["log_retention_days"]  # 0 = keep every route_log row
    default_rpm: int = DEFAULT["default_rpm"]  # callers without a key, per resolved address; 0: no limit
    default_tpm: int = DEFAULT["default_tpm"]
    default_max_tokens: int = DEFAULT["default_max_tokens"]  # a limited call's answer bound when it states none
    store_path: Path | None = None  # None: the store of `router.store.paths` (`router demo` has its own)
    idle_timeout_s: float = DEFAULT["idle_timeout_s"]
    max_conns_per_client: int = DEFAULT["max_conns_per_client"]  # 0 = no cap
    ssl_certfile: Path | None = DEFAULT["ssl_certfile"]
    ssl_keyfile: Path | None = DEFAULT["ssl_keyfile"]
    otel: bool = DEFAULT["otel"]  # export a span per call (also on with OTEL_EXPORTER_OTLP_ENDPOINT)
    # Freeze what start-up made once every listener is up (`router serve`; a process that embeds
    # serve() owns its collector and leaves this off).
    freeze_gc: bool = False
    affinity_slack: Slack = DEFAULT_SLACK  # OFF: --affinity off
    affinity_memory_bytes: int = DEFAULT["affinity_memory_bytes"]
    instance: str | None = DEFAULT["instance"]  # this router's name among several; None: host:port
    database_url: str | None = DEFAULT["database_url"]  # postgresql://...; None: the SQLite store
    shared_url: str | None = DEFAULT["shared_url"]  # redis://...; None: counts in this process
    # open | closed: what a call meets while the shared server is down. None: not given, which is
    # open, except that a server refusing this router at start ends the start (`reach_shared`)
    shared_down: str | None = DEFAULT["shared_down"]

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"
