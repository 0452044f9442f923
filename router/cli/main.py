"""The command line: `router serve`, `router boxes ...`, `router aliases ...`, `router keys ...`,
`router batches ...`, `router log`, `router demo`, `router agent`, `router install | uninstall | status`.

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
from router.cli.batches import add_batches_parser, batches_command
from router.cli.boxes import add_boxes_parser, boxes_command
from router.cli.install import add_install_parsers, install_command
from router.cli.keys import add_keys_parser, keys_command
from router.cli.log import add_log_parser, log_command
from router.cli.store import add_store_parser, store_command
from router.core import bounds
from router.core.errors import ConfigError
from router.serve.settings import SETTINGS, SWITCH, in_range

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


def add_serve_options(parser: argparse.ArgumentParser, *, port_required: bool) -> None:
    """One option per row of router.serve.settings. `port_required`: no port is assumed, and
    `$HUGPY_ROUTER_PORT` (as 0.0.4) stands in for --port; else (`demo`) a free port is picked."""
    for setting in SETTINGS:
        options = {"default": setting.default, "help": setting.help_text()}
        if setting.values is SWITCH:
            options["action"] = "store_true"
        elif isinstance(setting.values, tuple):
            options["choices"] = list(setting.values)
            if not isinstance(setting.values[0], str):
                options["type"] = type(setting.values[0])
        elif setting.values.read is not None:
            options["type"] = setting.values.read
        if setting.env is not None:  # a string default goes through `type`
            options["default"] = os.environ.get(setting.env, "").strip() or setting.default
        if setting.flag == "--port":  # settings rule 2
            options["required"] = port_required and options["default"] is None
            if not port_required:
                options["default"] = 0
        parser.add_argument(setting.flag, **options)


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
    demo.add_argument("--sim-boxes", type=in_range(bounds.positive_int, "count", high=64), default=3, help="simulated boxes (default 3)")

    add_boxes_parser(sub)
    add_aliases_parser(sub)
    add_agent_parser(sub)
    add_keys_parser(sub)
    add_batches_parser(sub)
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
        if args.command == "batches":
            return batches_command(args)
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
