"""Every command and flag of the command line, rendered from its parser: README.md's "Every
command and flag" list is this output between its markers, so it cannot miss a flag
(tests/test_docs.py fails when the two differ). `python -m router.cli.flags` prints it;
`python -m router.cli.flags --write README.md` puts it between the markers.

1. One entry per parser, depth first in the order the parsers were added: a parser with
   subcommands shows its own flags and its subcommands' names (`add|set|...`); each subcommand
   follows with its own.
2. A flag's value is named by its metavar, else its choices as `a|b`, else what its type takes
   (VALUE_NAMES: `--grace SECONDS`), else the flag's last word (`--database-url URL`); `[...]`
   when it may be left out; flags that exclude each other as `[--a A | --b B]`. `-h` is left out.
3. An entry wraps at WIDTH, continued under its first flag, and ends with the subcommand's help
   as a comment (on a line of its own when it does not fit).
4. It is rendered as without $HUGPY_ROUTER_PORT, which makes serve's --port optional: the
   README must not depend on the shell that rendered it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

WIDTH = 100
BEGIN = "<!-- every command and flag: `python -m router.cli.flags --write README.md` renders it -->"
END = "<!-- end of every command and flag -->"
# the value an argparse `type` (by its name: router.cli.main's checks name theirs) takes (rule 2)
VALUE_NAMES = {"seconds": "SECONDS", "_days": "DAYS", "count": "N", "int": "N", "_limit": "N", "_tail": "N",
               "size": "SIZE", "_port": "PORT", "Path": "FILE"}


def _argument(action: argparse.Action) -> str:
    """One flag or positional, without brackets (rule 2)."""
    if action.metavar is not None:
        value = action.metavar
    elif action.choices is not None:
        value = "|".join(str(choice) for choice in action.choices)
    elif not action.option_strings:
        value = action.dest.upper()
    else:
        value = VALUE_NAMES.get(getattr(action.type, "__name__", ""),
                                action.option_strings[-1].rpartition("-")[2].upper())
    if not action.option_strings:
        if action.nargs == "+":
            return f"{value} [{value} ...]"
        return value
    flag = action.option_strings[-1]  # the long form
    return flag if action.nargs == 0 else f"{flag} {value}"


def _optional(action: argparse.Action) -> bool:
    return not action.required if action.option_strings else action.nargs in ("?", "*")


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _parts(parser: argparse.ArgumentParser) -> list[str]:
    """The parser's flags and positionals in the order they were added (rule 2)."""
    groups = {id(a): group for group in parser._mutually_exclusive_groups for a in group._group_actions}
    parts, done = [], set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or id(action) in done:
            continue
        if isinstance(action, argparse._SubParsersAction):
            parts.append("|".join(action.choices))
            continue
        group = groups.get(id(action))
        members = group._group_actions if group is not None else [action]
        done.update(id(member) for member in members)
        text = " | ".join(_argument(member) for member in members)
        if group is not None:
            parts.append(f"({text})" if group.required else f"[{text}]")
        else:
            parts.append(f"[{text}]" if _optional(action) else text)
    return parts


def _wrapped(name: str, parts: list[str], comment: str) -> list[str]:
    """Rule 3."""
    indent = " " * (len(name) + 1)
    lines, line = [], name
    for part in parts:
        if len(line) + 1 + len(part) > WIDTH:
            lines.append(line)
            line = indent + part
        else:
            line += " " + part
    if comment:
        if len(line) + 3 + len(comment) <= WIDTH:
            line += "   " + comment
        else:
            lines.append(line)
            line = indent + comment
    lines.append(line)
    return lines


def render(parser: argparse.ArgumentParser, name: str = "router", about: str = "") -> str:
    """Every command of `parser` and its flags (rule 1), one entry after another."""
    lines = _wrapped(name, _parts(parser), f"# {about}" if about else "")
    sub = _subcommands(parser)
    if sub is not None:
        helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
        for command, subparser in sub.choices.items():
            lines.append(render(subparser, f"{name} {command}", helps.get(command, "")))
    return "\n".join(lines)


def readme_block() -> str:
    """What README.md holds between BEGIN and END (rule 4)."""
    from router.cli.main import build_parser

    port = os.environ.pop("HUGPY_ROUTER_PORT", None)
    try:
        parser = build_parser()
    finally:
        if port is not None:
            os.environ["HUGPY_ROUTER_PORT"] = port
    return f"```bash\n{render(parser)}\n```"


def between_markers(text: str) -> str:
    """What a document holds between BEGIN and END, stripped; ValueError without them."""
    head, begin, rest = text.partition(BEGIN)
    body, end, _ = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the markers {BEGIN!r} and {END!r} are missing")
    return body.strip()


def write(path: Path) -> None:
    text = path.read_text()
    between_markers(text)  # both markers there
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{readme_block()}\n{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"] and len(sys.argv) == 3:
        write(Path(sys.argv[2]))
    elif len(sys.argv) == 1:
        print(readme_block())
    else:
        sys.exit("usage: python -m router.cli.flags [--write README.md]")
