"""`router.core` is sans-I/O and stdlib only: it imports with the rest of the router and every
I/O module blocked (STYLE.md §1, DESIGN.md "Layout")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import sys

    REPO = sys.argv[1]
    BLOCKED = ("socket", "asyncio", "sqlite3", "_sqlite3", "apsw", "logging", "ssl", "select",
               "selectors")
    ALLOWED_ROUTER = ("router", "router.core")

    def blocked(name):
        if name.startswith("router."):
            return not any(name == a or name.startswith(a + ".") for a in ALLOWED_ROUTER[1:])
        return any(name == b or name.startswith(b + ".") for b in BLOCKED)

    already = [m for m in sys.modules if blocked(m)]
    assert not already, f"imported before the test started: {already}"

    class Blocker:
        attempts = []

        def find_spec(self, name, path=None, target=None):
            if blocked(name):
                Blocker.attempts.append(name)
                raise ImportError(f"blocked import of {name!r} from router.core")
            return None

    sys.meta_path.insert(0, Blocker())
    sys.path.insert(0, REPO)

    import router.core
    import router.core.types
    import router.core.names
    import router.core.decide
    import router.core.refusal
    import router.core.errors
    import importlib, os
    # and whatever else lives in the room
    core_dir = os.path.join(REPO, "router", "core")
    for entry in sorted(os.listdir(core_dir)):
        if entry.endswith(".py") and entry != "__init__.py":
            importlib.import_module("router.core." + entry[:-3])

    assert not Blocker.attempts, Blocker.attempts
    leaked = [m for m in sys.modules if blocked(m)]
    assert not leaked, leaked
    assert router.core.__file__.startswith(REPO), router.core.__file__

    # the blocker works: a forbidden import really fails
    for name in ("socket", "router._fastpath", "router.facades.body"):
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise AssertionError(f"{name} was not blocked")

    # and the core still does its job with everything else blocked
    from router.core.decide import decide
    from router.core.types import BoxFacts, BoxKind, Call
    box = BoxFacts(id="a", kind=BoxKind.OLLAMA, order=0, catalog=frozenset({"llama3:latest"}))
    assert decide(Call(model="llama3", kinds=frozenset(BoxKind)), [box]).boxes == ("a",)
    print("ok")
    """
)


def test_core_imports_with_everything_else_blocked():
    # -I: no user site, no PYTHON* env, no cwd on the path; -S: no site (and no .pth finders)
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", SCRIPT, str(REPO)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
