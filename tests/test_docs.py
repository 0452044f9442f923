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
