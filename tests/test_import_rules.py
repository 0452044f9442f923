"""Which room may import which (DESIGN.md "Layout"), read from the source with `ast`: every
module of every room, module-level and function-level imports alike, relative ones resolved.

The rules, per room, as the rooms of the project it may import (its own room always allowed):
- core imports nothing of the project (test_core_purity.py also blocks the stdlib's I/O);
- the compiled `_fastpath` is below every Python room (it imports nothing of the project);
- upstream stands on core alone, store on core and _fastpath (the shared server's RESP
  writer); boxes and telemetry add upstream, store, _fastpath; none of the four imports serve
  or facades;
- facades are tables of routes plus small functions: core, the compiled field scanner
  `_fastpath`, and the package's `__version__`; never the I/O rooms or serve;
- fleetwide (several routers on one shared server: its wire, the keys' tallies, the boxes' leases,
  the affinity bindings) stands on core, _fastpath, store and boxes; serve uses it, never the
  other way;
- serve may import every room but the CLI and the simulated boxes;
- sim shares no rule with the router: a stand-in must not import what it tests;
- cli is the entry point: every room (it starts the simulated fleet as a child process).

Anywhere in router/, within a room or across rooms, no module imports one that imports it back
(directly or through others), even for a type only or inside a function: where two pieces talk
both ways, one side names what it needs as a protocol (serve's proxy.CallHost, admin.AdminApp,
load.SlotFreed; sim's connection.Box), or the piece both need moves below them
(boxes/registry.py picks the registry above the file and the tables).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROUTER = Path(__file__).resolve().parents[1] / "router"
ROOMS = ("core", "_fastpath", "boxes", "telemetry", "upstream", "facades", "fleetwide", "serve", "store", "sim",
         "cli")
PACKAGE = "router"  # router/__init__.py: the version only; importing any room runs it anyway

ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "_fastpath": frozenset(),
    "upstream": frozenset({"core"}),
    "store": frozenset({"core", "_fastpath"}),
    "boxes": frozenset({"core", "_fastpath", "upstream", "store"}),
    "telemetry": frozenset({"core", "_fastpath", "boxes", "upstream", "store"}),
    "facades": frozenset({"core", "_fastpath", PACKAGE}),
    "fleetwide": frozenset({"core", "_fastpath", "boxes", "store"}),
    "serve": frozenset(ROOMS) - {"cli", "sim"} | {PACKAGE},
    "sim": frozenset(),
    "cli": frozenset(ROOMS) | {PACKAGE},
}
_CYTHON_IMPORT_RE = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import|c?import\s+([\w.]+))", re.MULTILINE)


def room_of(module: str) -> str | None:
    """The room a dotted module name belongs to, PACKAGE for `router` itself, None outside."""
    parts = module.split(".")
    if parts[0] != "router":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else PACKAGE


def modules(room: str) -> list[Path]:
    if room == "_fastpath":  # the entry module and the subject files it includes
        return [ROUTER / "_fastpath.pyx", *sorted(ROUTER.glob("_fastpath_*.pxi"))]
    return sorted((ROUTER / room).rglob("*.py"))


def dotted(path: Path) -> str:
    rel = path.relative_to(ROUTER.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted target) for every import in the file; `from a import b` yields `a.b`, so
    that `from router import serve` names the room it reaches."""
    text = path.read_text()
    if path.suffix in (".pyx", ".pxi"):
        return [(text.count("\n", 0, m.start()) + 1, m.group(1) or m.group(2))
                for m in _CYTHON_IMPORT_RE.finditer(text)]
    package = dotted(path) if path.name == "__init__.py" else dotted(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(room: str) -> list[str]:
    allowed = ALLOWED[room] | {room}
    found = []
    for path in modules(room):
        for line, target in imported(path):
            reached = room_of(target)
            if reached is not None and reached not in allowed:
                found.append(f"{path.relative_to(ROUTER.parent)}:{line} imports {target} "
                             f"(room {room!r} may import only {sorted(allowed)})")
    return found


@pytest.mark.parametrize("room", ROOMS)
def test_room_imports_follow_the_layout(room):
    assert modules(room), f"room {room!r} has no modules: the layout and the tree disagree"
    assert not violations(room), "\n".join(violations(room))


def test_every_room_is_covered():
    on_disk = {p.name for p in ROUTER.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert on_disk <= set(ROOMS), f"rooms with no import rule: {sorted(on_disk - set(ROOMS))}"


def test_the_reader_sees_relative_function_level_and_from_package_imports(tmp_path, monkeypatch):
    room = tmp_path / "router" / "store"
    room.mkdir(parents=True)
    (room / "__init__.py").write_text("")
    (room / "bad.py").write_text(
        "from router import serve\n"
        "def later():\n"
        "    from ..facades import body\n"
        "    import router.core.names\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROUTER", tmp_path / "router")
    found = violations("store")
    assert [v.split(" (")[0] for v in found] == [
        "router/store/bad.py:1 imports router.serve",
        "router/store/bad.py:3 imports router.facades.body",
    ]


def module_graph() -> dict[str, set[str]]:
    """module -> the modules of router/ it imports, in its room or another, module-level and
    function-level alike, TYPE_CHECKING blocks included. A package named itself (`from
    router.sim import X`) is its `__init__`."""
    paths = [*sorted(ROUTER.glob("*.py")), *(path for room in ROOMS for path in modules(room))]
    names = {dotted(path) for path in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        reached = set()
        for _, target in imported(path):
            while target and target not in names:
                target = target.rpartition(".")[0]  # `from router.serve.x import Y` reaches x
            if target:
                reached.add(target)
        graph[dotted(path)] = reached - {dotted(path)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_router_has_no_import_circle():
    assert circles(module_graph()) == []


def test_the_graph_sees_a_circle_across_rooms_through_a_function_level_import(tmp_path, monkeypatch):
    for room, text in (("boxes", "from router.store.engines import pick\n"),
                       ("store", "def pick():\n    from router.boxes import fleet\n")):
        (tmp_path / "router" / room).mkdir(parents=True)
        (tmp_path / "router" / room / "__init__.py").write_text("")
        (tmp_path / "router" / room / ("fleet.py" if room == "boxes" else "engines.py")).write_text(text)
    (tmp_path / "router" / "__init__.py").write_text("")
    (tmp_path / "router" / "_fastpath.pyx").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROUTER", tmp_path / "router")
    assert circles(module_graph()) == [["router.boxes.fleet", "router.store.engines"]]


def test_the_circle_finder_sees_a_type_only_circle():
    graph = {"app": {"admin", "proxy"}, "admin": {"app"}, "proxy": set(), "load": {"admission"},
             "admission": {"load"}}
    assert sorted(circles(graph)) == [["admin", "app"], ["admission", "load"]]
