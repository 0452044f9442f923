"""The suite's own layout: a helper that several test files share lives in a support module
(tests/support/, or tests/conftest.py for the fixtures and waits any file may use), never in a
test file that others import: there it hides who depends on it, and a change made for one test
file's cases breaks files that never mention them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "bench")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in the file, module-level and function-level."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_no_module_of_the_suite_or_the_benches_imports_a_test_module():
    test_modules = {path.stem for path in (ROOT / "tests").rglob("test_*.py")}
    offending, support_imports = [], 0
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, module in imports(path):
                if module in test_modules:
                    offending.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
                support_imports += module == "support"
    assert support_imports, "no import of tests/support/ found: the scan reads nothing"
    assert not offending, "move the helper into tests/support/:\n" + "\n".join(offending)
