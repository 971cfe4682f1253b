"""The package's import graph: `tp_launch` -> `rendezvous`, never back, and no circle.

Read from the source (ast), so imports inside functions and under TYPE_CHECKING count
too: a deferred import is still a dependency, and a circle hidden in a function is
still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tp_launch", "rendezvous")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports (a package's own __init__ excluded: importing
    `a.b` runs `a/__init__`, which is not an edge of the design)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            # The longest known module the target names (`pkg.mod.Class` -> `pkg.mod`).
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_rendezvous_never_imports_tp_launch():
    back = sorted(f"{m} -> {d}" for m, deps in _graph().items() if m.startswith("rendezvous")
                  for d in deps if d.startswith("tp_launch"))
    assert not back, back


def test_no_import_circle():
    graph = _graph()
    # Edges into a package's __init__ only re-export; a circle through one is not a
    # circle between the modules that define things.
    edges = {m: {d for d in deps if d not in PACKAGES and not _is_package(d)}
             for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                circles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not circles, [" -> ".join(c) for c in circles]


def _is_package(name: str) -> bool:
    return (ROOT / name.replace(".", "/") / "__init__.py").exists()


def test_the_graph_is_read():
    # Guards the two tests above against a walker that finds nothing.
    graph = _graph()
    assert "rendezvous.kv" in graph["rendezvous.membership"]
    assert any(d.startswith("rendezvous") for d in graph["tp_launch.agent.node_agent"])
