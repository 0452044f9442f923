"""The settings table (router/serve/settings.py) is where each `router serve` default is written:
the parser, ServeConfig and docs/timeouts.md say what its rows say."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from router.cli.main import build_parser
from router.cli.run import _config
from router.serve.settings import BY_FLAG, SETTINGS, ServeConfig

ROOT = Path(__file__).resolve().parents[1]
VARIABLES = [setting.env for setting in SETTINGS if setting.env is not None]


def serve_options(parser):
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    return {action.option_strings[-1]: action for action in serve._actions if action.option_strings}


def test_the_parser_has_one_option_per_row_with_the_rows_default_and_help(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    options = serve_options(build_parser())
    assert [flag for flag in options if flag in BY_FLAG] == [setting.flag for setting in SETTINGS]
    for setting in SETTINGS:
        action = options[setting.flag]
        assert action.default == setting.default, setting.flag
        assert action.help == setting.help_text()
    assert options["--port"].required  # settings rule 2: serve has no port without its variable


def test_a_variable_stands_in_for_its_flag_and_the_flag_beats_it(monkeypatch):
    monkeypatch.setenv("HUGPY_ROUTER_PORT", "8123")
    monkeypatch.setenv("HUGPY_ROUTER_HOST", "10.1.2.3")
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.host) == (8123, "10.1.2.3")
    assert build_parser().parse_args(["serve", "--host", "127.0.0.2"]).host == "127.0.0.2"
    assert build_parser().parse_args(["demo"]).port == 0  # demo picks a free port, whatever the variable


def test_the_config_of_no_flags_is_serveconfigs_defaults(monkeypatch):
    """What the CLI fills in from the rows and what ServeConfig defaults to are the same values."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["serve", "--port", "auto"])
    built = _config(args, Path("boxes.json"))
    assert built == ServeConfig(host="127.0.0.1", port=0, boxes_path=Path("boxes.json"))
    fields = {field.name for field in dataclasses.fields(ServeConfig)}
    assert {setting.field for setting in SETTINGS if setting.field} <= fields


def timeout_rows() -> dict[str, list[str]]:
    """docs/timeouts.md's table rows by the flag in their flag column."""
    rows = {}
    for line in (ROOT / "docs" / "timeouts.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 6 and cells[2].startswith("`--"):
            rows[cells[2].split("`")[1]] = cells
    return rows


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.unit == "s"], ids=lambda s: s.flag)
def test_each_timeout_flag_is_its_row_in_docs_timeouts(setting):
    rows = timeout_rows()
    assert setting.flag in rows, f"docs/timeouts.md has no row for {setting.flag}"
    _, default, _, _, why, constant = rows[setting.flag]
    assert setting.default_text() in default, (setting.flag, default)
    assert why == setting.why, f"docs/timeouts.md's why for {setting.flag} is not the table's"
    assert constant == "`SETTINGS` (serve/settings.py)"


def test_every_flag_row_of_docs_timeouts_is_a_timeout_setting():
    assert set(timeout_rows()) == {setting.flag for setting in SETTINGS if setting.unit == "s"}


def test_a_docs_row_that_differs_from_the_table_is_seen(monkeypatch, tmp_path):
    page = tmp_path / "docs" / "timeouts.md"
    page.parent.mkdir()
    page.write_text("| a box's first byte | 90 s | `--first-byte-timeout` | fails over | another why | "
                    "`SETTINGS` (serve/settings.py) |\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError):
        test_each_timeout_flag_is_its_row_in_docs_timeouts(BY_FLAG["--first-byte-timeout"])
