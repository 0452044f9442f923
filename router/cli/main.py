"""The command line: `router serve`, `router boxes ...`, `router aliases ...`, `router keys ...`, `router log`,
`router demo`, `router agent`, `router install | uninstall | status`.

`router` and `hugpy-router` are the same entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from router import __version__
from router.boxes.config import RegistryDown
from router.cli.agent import add_agent_parser, agent_command
from router.cli.aliases import add_aliases_parser, aliases_command
from router.cli.boxes import add_boxes_parser, boxes_command
from router.cli.install import add_install_parsers, install_command
from router.cli.keys import add_keys_parser, keys_command
from router.cli.log import add_log_parser, log_command
from router.cli.store import add_store_parser, store_command
from router.core import bounds
from router.core.affinity import DEFAULT_SLACK
from router.core.errors import ConfigError
from router.core.limits import DEFAULT_ANSWER_TOKENS
from router.serve.affinity import DEFAULT_MEMORY_BYTES

# Above the idle expiry of the common pooled clients (httpx 5 s, aiohttp 15 s), so that they drop
# an idle connection before the router does and never send into one being closed; below nginx's
# 60 s header and 75 s keep-alive timeouts, since an idle connection is what an attacker holds.
DEFAULT_IDLE_TIMEOUT_S = 20.0
# Above what one busy host sends through its own pool (a browser holds 6, an eval harness a few
# hundred concurrent streams), far below a listener's share of the descriptors (thousands).
DEFAULT_MAX_CONNS_PER_CLIENT = 512
# Admin event streams open at once (router.serve.event_feed): a dashboard or two per operator and
# a few schedule watchers; 300 was an attack, not a fleet. The ceiling keeps a typo from meaning
# no cap at all.
DEFAULT_MAX_EVENT_STREAMS = 32
MAX_EVENT_STREAMS = 4096


# A token that may be a secret: a hugpy key anywhere, or any value argparse did not expect.
_KEY_RE = re.compile(r"hpk_[A-Za-z0-9_-]+")
_UNRECOGNIZED = "unrecognized arguments: "
_REQUIRED = "the following arguments are required"
# argparse names a type function in its message ("invalid _port value"): an internal name.
_TYPE_NAME_RE = re.compile(r"invalid _\w+ value")


class Parser(argparse.ArgumentParser):
    """Every parser of the command line (subparsers inherit the class).

    1. No prefix matching (`allow_abbrev=False`): `--key` must never be taken for `--key-file`,
       and a flag added later must not change what an old abbreviation meant.
    2. No secret in an error: a key-shaped token is masked, and of arguments argparse did not
       recognise only the option names are shown (a mistyped `--kye K` must not print K).
    3. A mistyped option is named: argparse reports a missing required argument before the
       arguments it did not recognise, so `serve --prot 8080` said that --port is required.
       Each parser keeps the arguments it was given, and a "required" error where one of them
       is an option it does not know becomes "unrecognized arguments: --prot".
    4. No internal name: "invalid _port value" is said "invalid value".
    5. An error is one line on stderr and exit status 2 (`router serve: error: argument
       --queue-size: invalid value '-1': must be ...`): a unit's journal shows the cause, not a
       page of usage.
    6. A subcommand's option given before the subcommand (`router --port 8080 serve`, which
       argparse reads as the command `8080`) is said so, naming the option only (rule 2):
       `flag_before_command`, which `main` asks first.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.given: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        # A subcommand's parser is called with its own arguments (argparse's _SubParsersAction).
        self.given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def unknown_options(self) -> list[str]:
        """The options among the given arguments that this parser does not know (rule 3)."""
        found = []
        for token in self.given:
            if token == "--":
                break
            name = token.partition("=")[0]
            if token.startswith("-") and not self._negative_number_matcher.match(token) \
                    and name not in self._option_string_actions:
                found.append(name)
        return found

    def flag_before_command(self, argv: list[str]) -> None:
        """Rule 6: exits 2 with one line when an option of the subcommand given (else of `serve`)
        comes before the subcommand's name."""
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        command = next((token for token in argv if token in commands), None)
        meant = command or "serve"
        skip_value = False
        for token in argv:
            if token == command or token == "--":
                return
            name = token.partition("=")[0]
            if skip_value or not token.startswith("-"):
                skip_value = False
                continue
            own = self._option_string_actions.get(name)
            if own is not None:  # the top parser's (`--boxes FILE`): its value is no command
                skip_value = own.nargs != 0 and "=" not in token
            elif name in commands[meant]._option_string_actions:
                self.exit(2, f"{self.prog}: error: {name} is an option of `{self.prog} {meant}`: flags go after "
                          f"the subcommand ({self.prog} {meant} {name} ...)\n")

    def error(self, message: str):
        message = _TYPE_NAME_RE.sub("invalid value", message)
        if message.startswith(_REQUIRED) and self.unknown_options():
            message = _UNRECOGNIZED + " ".join(self.unknown_options())
        if message.startswith(_UNRECOGNIZED):
            shown = (t if t.startswith("-") else "…" for t in message[len(_UNRECOGNIZED):].split())
            message = _UNRECOGNIZED + " ".join(shown)
        self.exit(2, f"{self.prog}: error: {_KEY_RE.sub('hpk_…', message)} (--help lists the options)\n")


def _port(value: str) -> int:
    if value == "auto":
        return 0
    port = int(value)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError("port must be 1-65535 or 'auto'")
    return port


def _in_range(check, name: str, **bounds):
    """An argparse `type` from a router.core.bounds check: its ValueError becomes argparse's
    one-line error, which names the flag and the value (`argument --queue-size: invalid value
    '-1': must be ...`)."""

    def parse(value: str):
        try:
            return check(value, **bounds)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid value {value!r}: {exc}") from None

    parse.__name__ = name
    return parse


_seconds = _in_range(bounds.finite_seconds, "seconds")
_seconds_or_zero = _in_range(bounds.finite_seconds, "seconds", zero_ok=True)
_count = _in_range(bounds.non_negative_int, "count")
_positive = _in_range(bounds.positive_int, "count")
_size = _in_range(bounds.size_bytes, "size")
# Granian takes the idle timeout in whole milliseconds; a day is far above any keep-alive.
_idle_seconds = _in_range(bounds.finite_seconds, "seconds", high=86400.0)
# At most one per descriptor the process may hold.
_conns = _in_range(bounds.non_negative_int, "count", high=1 << 20)
_streams = _in_range(bounds.positive_int, "count", high=MAX_EVENT_STREAMS)


# An instance name goes into log lines, the route log, the state and the shared server's keys:
# letters, digits and `._:-` (the default, host:port, is one), at most 64, never a control character.
INSTANCE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


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


def add_serve_options(parser: argparse.ArgumentParser, *, port_required: bool) -> None:
    """`port_required`: no port is assumed; `$HUGPY_ROUTER_PORT` (as 0.0.4) stands in for --port."""
    env_port = os.environ.get("HUGPY_ROUTER_PORT", "").strip() if port_required else ""
    parser.add_argument(
        "--port",
        type=_port,
        required=port_required and not env_port,
        default=(env_port or None) if port_required else 0,  # a string default goes through `type`
        help="port to listen on, or 'auto' to pick a free one (printed at start); default $HUGPY_ROUTER_PORT",
    )
    parser.add_argument("--host", default=os.environ.get("HUGPY_ROUTER_HOST", "").strip() or "127.0.0.1",
                        help="address to bind (default $HUGPY_ROUTER_HOST, else 127.0.0.1)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        choices=[1],
        help="worker processes. Only 1: the reservation table, the box links and the "
        "settings contracts are per process, so two workers would each route blind to "
        "the other's load",
    )
    parser.add_argument(
        "--interface",
        choices=["asgi", "rsgi"],
        default="asgi",
        help="Granian interface. asgi (default) bounds what a slow reader makes the router "
        "buffer; rsgi has no write backpressure (a stalled reader grew the router by 45 MiB "
        "in the bench; Granian's RSGI response stream is still an unbounded channel: its "
        "backpressure change, emmett-framework/granian#898, covered ASGI and WSGI only), so "
        "keep it for trusted, fast clients",
    )
    parser.add_argument("--max-body", type=_size, default=64 << 20, help="largest request body (default 64MiB)")
    parser.add_argument(
        "--first-byte-timeout",
        type=_seconds,
        default=900.0,
        help="seconds to wait for a box's first byte (a cold load can take minutes; default 900)",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        type=_seconds,
        default=300.0,
        help="seconds a box may stay silent mid-answer, after its first byte (default 300); "
        "then the stream ends with an error frame in its own format, or a sized body is cut",
    )
    parser.add_argument("--ollama-port", type=_port, default=None,
                        help="also listen here as an Ollama server (every path is Ollama's; 'auto' picks one)")
    parser.add_argument("--lmstudio-port", type=_port, default=None,
                        help="also listen here as an LM Studio server (every path is LM Studio's)")
    parser.add_argument("--health-port", type=_port, default=None,
                        help="also listen here for local health probes (systemd, a container healthcheck, "
                        "a balancer on this machine): GET|HEAD /health and nothing else, bound to loopback "
                        "(127.0.0.1, or ::1 with an IPv6 --host) whatever --host is, with connections of its "
                        "own that a flood on the other ports cannot take ('auto' picks one; docs/connections.md)")
    parser.add_argument("--queue-size", type=_count, default=1024,
                        help="calls that may wait for a full box, in all (default 1024; more get 429)")
    parser.add_argument("--queue-per-caller", type=_positive, default=None,
                        help="places of the queue one caller (a key, else an address) may hold; "
                        "more get 429 (default: a quarter of --queue-size, at least 1; docs/queue.md)")
    parser.add_argument("--queue-timeout", type=_seconds, default=120.0,
                        help="seconds a call may wait for a full box before a 503 (default 120)")
    parser.add_argument("--stream-keepalive", type=_seconds_or_zero, default=15.0,
                        help="a streamed OpenAI call waiting this long (queue, cold load) gets its "
                        "stream head and an SSE comment every this many seconds (default 15; 0: never)")
    parser.add_argument("--max-event-streams", type=_streams, default=DEFAULT_MAX_EVENT_STREAMS,
                        help="admin event streams (/v1/router/events, /v1/router/schedule) open at "
                        f"once; more get 429 (1-{MAX_EVENT_STREAMS}, default {DEFAULT_MAX_EVENT_STREAMS})")
    parser.add_argument("--grace", type=_seconds_or_zero, default=30.0, help="seconds in-flight calls get at stop")
    parser.add_argument("--default-rpm", type=_count, default=0,
                        help="requests a minute for each caller without a key, per resolved address "
                        "(default 0: no limit; docs/tenancy.md)")
    parser.add_argument("--default-tpm", type=_count, default=0,
                        help="tokens a minute for each caller without a key, per resolved address (default 0: no limit)")
    parser.add_argument("--default-max-tokens", type=_positive, default=DEFAULT_ANSWER_TOKENS,
                        help="the answer's bound in tokens the router gives a call counted against token limits "
                        "(tpm, a budget) that states none: written into the body it sends the box (max_tokens, "
                        f"max_output_tokens, num_predict) and reserved (default {DEFAULT_ANSWER_TOKENS}; docs/tenancy.md)")
    parser.add_argument("--log-retention-days", type=_days, default=30.0,
                        help="route-log rows older than this are deleted (default 30; 0 keeps every row)")
    parser.add_argument(
        "--idle-timeout",
        type=_idle_seconds,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds a connection may stay without a whole request head, after it opens or "
        f"after its last answer, before it is closed (default {DEFAULT_IDLE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--max-conns-per-client",
        type=_conns,
        default=DEFAULT_MAX_CONNS_PER_CLIENT,
        help="most idle connections one client address may hold; over it, its longest-idle ones are "
        "closed (a connection with a call in flight never is). "
        "Trusted proxies (HUGPY_ROUTER_TRUSTED_PROXIES) are exempt; 0 = no cap "
        f"(default {DEFAULT_MAX_CONNS_PER_CLIENT})",
    )
    parser.add_argument("--ssl-certfile", type=Path, default=None,
                        help="serve HTTPS on every listener with this PEM certificate (chain)")
    parser.add_argument("--ssl-keyfile", type=Path, default=None,
                        help="the PEM private key of --ssl-certfile")
    parser.add_argument(
        "--require-key",
        choices=["never", "outside", "always"],
        default=None,
        help="who needs a key on the use routes: never; outside (the default: callers outside "
        "the trusted nets); always. Beats $HUGPY_ROUTER_REQUIRE_KEY. In every mode, always "
        "included, a caller on loopback manages the router (admin routes) without a key, as "
        "hugpy does: keep the port on loopback or behind a proxy that sends its own address",
    )
    parser.add_argument("--otel", action="store_true",
                        help="export an OpenTelemetry span per call over OTLP (needs the otel extra; "
                        "also on when OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    parser.add_argument("--affinity", choices=["on", "off"], default="on",
                        help="send a conversation back to the box that holds its prefix (docs/affinity.md; "
                        "off: the seeds' strict order, for comparison)")
    parser.add_argument("--affinity-slack", type=_share, default=DEFAULT_SLACK.absolute,
                        help="how much more load (pending + pressure + reservations) the bound box may carry "
                        f"than the best one and still be chosen (default {DEFAULT_SLACK.absolute:g})")
    parser.add_argument("--affinity-slack-share", type=_share, default=DEFAULT_SLACK.relative,
                        help="and, on top, this share of the best box's load "
                        f"(default {DEFAULT_SLACK.relative:g}; both 0: off)")
    parser.add_argument("--affinity-memory", type=_size, default=DEFAULT_MEMORY_BYTES,
                        help=f"memory for bindings and the prefix index, LRU (default {DEFAULT_MEMORY_BYTES >> 20}m)")
    parser.add_argument("--instance", type=_instance, default=None,
                        help="this router's name among several (route log `router` column, "
                        "/v1/router/state); default host:port")
    parser.add_argument("--database-url", default=os.environ.get("HUGPY_ROUTER_DATABASE_URL", "").strip() or None,
                        help="postgresql://... : keep the store (route log, keys, boxes, aliases) in "
                        "PostgreSQL, shared by several routers (default $HUGPY_ROUTER_DATABASE_URL; "
                        "unset: the SQLite store; docs/several-routers.md)")
    parser.add_argument("--shared-url", default=os.environ.get("HUGPY_ROUTER_SHARED_URL", "").strip() or None,
                        help="redis://... : count box slots and key limits on a Redis-protocol server, "
                        "exact across several routers (default $HUGPY_ROUTER_SHARED_URL)")
    # None: not given (open), which `router serve` tells from a given open: a server that refuses
    # the router at start (a wrong password) stops the start unless open was asked for
    parser.add_argument("--shared-down", choices=["open", "closed"], default=None,
                        help="when the shared server is unreachable: open (default) counts per router, "
                        "loudly; closed refuses calls that need a shared count with 503 shared_store_down. "
                        "A server that refuses the router at start (a wrong password, an unknown database) "
                        "stops the start (exit 2) unless open is given")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    # `python -m router` would be called "__main__.py" in every message: an internal name.
    prog = os.path.basename(sys.argv[0]).replace("__main__.py", "router")
    parser = Parser(description=__doc__, prog=prog)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--boxes", type=Path, default=None, dest="boxes_top",
                        help="boxes file for serve and boxes (0.0.4's option; as their --boxes-file)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the router")
    add_serve_options(serve, port_required=True)
    serve.add_argument("--boxes-file", type=Path, default=None, help="boxes file (default: $HUGPY_ROUTER_BOXES or <config dir>/router/boxes.json)")

    demo = sub.add_parser("demo", help="run the router in front of a fleet of simulated boxes")
    add_serve_options(demo, port_required=False)
    demo.add_argument("--sim-boxes", type=_in_range(bounds.positive_int, "count", high=64), default=3, help="simulated boxes (default 3)")

    add_boxes_parser(sub)
    add_aliases_parser(sub)
    add_agent_parser(sub)
    add_keys_parser(sub)
    add_log_parser(sub)
    add_store_parser(sub)
    add_install_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.flag_before_command(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if hasattr(args, "boxes_file") and args.boxes_file is None:
        args.boxes_file = args.boxes_top
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "boxes":
            return boxes_command(args)
        if args.command == "aliases":
            return aliases_command(args)
        if args.command == "agent":
            return agent_command(args)
        if args.command == "keys":
            return keys_command(args)
        if args.command == "log":
            return log_command(args)
        if args.command == "store":
            return store_command(args)
        if args.command in ("install", "uninstall", "status"):
            return install_command(args)
        from router.cli.run import run_demo, run_serve

        if args.command == "serve":
            return run_serve(args)
        return run_demo(args)
    except ConfigError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    except RegistryDown as exc:  # the boxes registry's database is down
        print(f"router: {exc}", file=sys.stderr)
        return 1
