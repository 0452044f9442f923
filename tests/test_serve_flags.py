"""`router serve` flags are range-checked (issue 20 item 10, first half): a value out of range
is exit 2 with one line naming the flag, and nothing accepted makes `/v1/router/state` fail.
The ranges are router.core.bounds's."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from router.cli.main import main
from router.core import bounds
from router.sim import SimBox

from conftest import ROOT

BAD = [
    ("--queue-size", "-1"),
    ("--queue-size", "1.5"),
    ("--queue-size", str(1 << 70)),
    ("--queue-per-caller", "0"),
    ("--queue-timeout", "nan"),
    ("--queue-timeout", "inf"),
    ("--queue-timeout", "-1"),
    ("--queue-timeout", "0"),
    ("--max-body", "-1"),
    ("--max-body", "inf"),
    ("--max-body", "nan"),
    ("--max-body", "0"),
    ("--first-byte-timeout", "nan"),
    ("--first-byte-timeout", "1e309"),
    ("--stream-idle-timeout", "-5"),
    ("--grace", "-1"),
    ("--grace", "nan"),
    ("--stream-keepalive", "inf"),
    ("--stream-keepalive", "-1"),
    ("--idle-timeout", "1e300"),
    ("--max-conns-per-client", "-3"),
    ("--log-retention-days", "nan"),
    ("--port", "70000"),
    ("--max-event-streams", "0"),
    ("--max-event-streams", "nan"),
]


@pytest.mark.parametrize("flag, value", BAD)
def test_out_of_range_is_exit_2_with_one_line_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", "auto", flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {flag}:" in err, err


def test_the_command_says_one_line_and_no_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--port", "auto", "--queue-timeout", "inf"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--queue-timeout" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, flag, command", [
    (["--port", "8080", "serve"], "--port", "serve"),
    (["--port=8080", "serve", "--host", "0.0.0.0"], "--port", "serve"),
    (["--boxes", "b.json", "--ollama-port", "11434", "serve", "--port", "8080"], "--ollama-port", "serve"),
    (["--port", "8080"], "--port", "serve"),  # no subcommand: serve's flag all the same
    (["--router-port", "8080", "keys", "list"], "--router-port", "keys"),
])
def test_a_subcommands_flag_before_it_says_flags_go_after_the_subcommand(argv, flag, command, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    prog = err.partition(":")[0]  # `router`, as the test runner's argv[0] makes it
    assert err == (f"{prog}: error: {flag} is an option of `{prog} {command}`: flags go after the subcommand "
                   f"({prog} {command} {flag} ...)\n"), err
    assert "8080" not in err  # the option only, never its value (Parser rule 2)


def test_state_answers_at_every_accepted_extreme(start_fleet_in_process):
    """The largest value of each flag is accepted and `/v1/router/state` still answers 200 (with
    `--queue-timeout inf` it answered 500: orjson refused the Retry-After it made)."""
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(box, extra_args=(
        "--queue-size", str(bounds.MAX_COUNT), "--queue-per-caller", str(bounds.MAX_COUNT),
        "--queue-timeout", str(bounds.MAX_SECONDS), "--first-byte-timeout", str(bounds.MAX_SECONDS),
        "--stream-idle-timeout", str(bounds.MAX_SECONDS), "--grace", "0",
        "--stream-keepalive", str(bounds.MAX_SECONDS), "--idle-timeout", "86400",
        "--max-body", "1TiB", "--max-conns-per-client", str(1 << 20),
    ))
    with urllib.request.urlopen(router.url + "/v1/router/state", timeout=10) as answer:
        assert answer.status == 200
        queue = json.loads(answer.read())["queue"]
    assert queue["capacity"] == bounds.MAX_COUNT and queue["timeout_s"] == bounds.MAX_SECONDS


def test_the_range_helpers():
    assert bounds.positive_int("7") == 7 and bounds.positive_int(7) == 7
    assert bounds.non_negative_int(" 0 ") == 0
    assert bounds.finite_seconds("0", zero_ok=True) == 0.0 and bounds.finite_seconds(2) == 2.0
    assert bounds.size_bytes("64MiB") == 64 << 20 and bounds.size_bytes("1.5k") == 1536
    for check, value in [
        (bounds.positive_int, "0"), (bounds.positive_int, True), (bounds.positive_int, 1.0),
        (bounds.positive_int, "٣"), (bounds.positive_int, "+-3"), (bounds.non_negative_int, "-1"),
        (bounds.positive_int, str(bounds.MAX_COUNT + 1)), (bounds.finite_seconds, "0"),
        (bounds.finite_seconds, "nan"), (bounds.finite_seconds, float("inf")),
        (bounds.finite_seconds, "-0.5"), (bounds.finite_seconds, None), (bounds.size_bytes, "2TiB"),
        (bounds.size_bytes, "k"), (bounds.size_bytes, ""),
    ]:
        with pytest.raises(ValueError, match="must be"):
            check(value)
