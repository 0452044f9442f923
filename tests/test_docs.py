"""The documentation says what the code does: every timeout is in docs/timeouts.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_CONSTANT = re.compile(r"^([A-Z][A-Z_]*(?:TIMEOUT_S|TIMEOUT_MS|_WAIT_S))\s*=", re.MULTILINE)
TIMEOUT_FLAG = re.compile(r'"(--[a-z-]*(?:timeout|grace|keepalive))"')


def test_every_timeout_constant_and_flag_is_in_the_timeouts_table():
    table = (ROOT / "docs" / "timeouts.md").read_text()
    constants, flags = set(), set()
    for path in (ROOT / "router").rglob("*.py"):
        if "sim" in path.relative_to(ROOT / "router").parts:
            continue  # the simulated boxes' own timings are no setting of the router
        text = path.read_text()
        constants |= set(TIMEOUT_CONSTANT.findall(text))
        flags |= set(TIMEOUT_FLAG.findall(text))
    assert constants and flags
    assert [c for c in sorted(constants) if f"`{c}`" not in table] == []
    assert [f for f in sorted(flags) if f"`{f}`" not in table] == []


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


MENTION = re.compile(r"(?<![\w/.-])([\w./-]+\.md)\b")


def relative_links(path: Path) -> list[str]:
    """The targets of the Markdown links and images in `path` that point into the repository,
    and the pages it names in plain text (`DESIGN.md's layout`), which must be there too."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # code blocks hold no links
    text = re.sub(r"`[^`]*`", "", text)  # nor do code spans (`latest.md` is a file bench writes)
    links = [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    named = MENTION.findall(LINK.sub("", text))
    return links + named


def test_every_relative_link_in_the_readme_and_docs_resolves():
    """Issue 27 item 7: the README pointed at a DESIGN.md the repository did not hold."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    dead = []
    for page in pages:
        for target in relative_links(page):
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve()
            if not resolved.exists() and "/" not in target and (ROOT / file).exists():
                resolved = ROOT / file  # a page named by its name alone, at the root
            if not resolved.exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.MULTILINE)
                slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
                if anchor not in slugs:
                    dead.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert dead == []


def test_the_link_check_sees_a_dead_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[design](DESIGN.md) [web](https://example.com) [here](#top)\n```\n[x](nope.md)\n```\n"
                    "as DESIGN2.md's layout says; `latest.md` is written by the bench\n")
    assert relative_links(page) == ["DESIGN.md", "DESIGN2.md"]


def test_the_readme_lists_every_command_and_flag_the_parser_has():
    """README.md's "Every command and flag" is router.cli.flags' rendering of the parser."""
    from router.cli.flags import between_markers, readme_block

    readme = (ROOT / "README.md").read_text()
    assert between_markers(readme) == readme_block(), \
        "README.md's command list differs from the parser: python -m router.cli.flags --write README.md"


def test_the_flag_list_renders_every_subcommand_and_flag():
    """Each parser's own entry names each of its flags (router.cli.flags rule 1)."""
    import argparse

    from router.cli.flags import render
    from router.cli.main import build_parser

    def parsers(parser: argparse.ArgumentParser, name: str):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command, subparser in action.choices.items():
                    yield from parsers(subparser, f"{name} {command}")

    missing = []
    for name, parser in parsers(build_parser(), "router"):
        entry = render(parser, name).split("\nrouter ")[0]  # its own, before its subcommands'
        missing += [f"{name} {action.option_strings[-1]}" for action in parser._actions
                    if action.option_strings and not isinstance(action, argparse._HelpAction)
                    and not re.search(rf"{re.escape(action.option_strings[-1])}(?![\w-])", entry)]
    assert missing == []
    rendered = render(build_parser())
    for command in ("router store export --to URL", "router store import --from URL", "[--shared-down open|closed]",
                    "[--instance INSTANCE]", "[--first-byte-timeout SECONDS]", "[--boxes-file FILE]"):
        assert command in rendered


def test_no_page_or_script_cites_the_contract_notes_by_a_path_the_repository_lacks():
    """The project's contract notes are not shipped: the pages, scripts and bench say so (or name
    the public package), never a `contracts/...md` path a reader cannot open."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "scripts").iterdir(),
             *(ROOT / "bench").glob("*.py")]
    cited = [f"{path.relative_to(ROOT)}: {match}" for path in files if path.is_file()
             for match in re.findall(r"contracts/[\w.-]+\.md", path.read_text(errors="replace"))
             if not (ROOT / match).exists()]
    assert cited == []
