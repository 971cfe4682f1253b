"""Imports run one way: ``tp_launch`` -> ``rendezvous``, never back.

Read from the source (ast), so an import inside a function or under TYPE_CHECKING
counts too: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

RENDEZVOUS = Path(__file__).resolve().parent.parent / "rendezvous"


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_rendezvous_never_imports_tp_launch():
    files = sorted(RENDEZVOUS.glob("*.py"))
    assert files
    back = [f"{p.name} imports {name}" for p in files for name in sorted(_imported(p))
            if name == "tp_launch" or name.startswith("tp_launch.")]
    assert not back, back


def test_the_walk_sees_imports():
    # Guards the test above against a walker that finds nothing.
    assert "rendezvous.kv" in _imported(RENDEZVOUS / "conf.py")
    assert "torch.distributed" in _imported(RENDEZVOUS / "torchrun_handler.py")
