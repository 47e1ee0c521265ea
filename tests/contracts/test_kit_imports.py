"""The contract kit's modules import each other without a cycle, counting the imports made
only for type checking: the crash writer knows ``TierKit`` and its ``WriterPlan``, not the
contract that starts it."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import kvhex.testing

PACKAGE = "kvhex.testing"


def _imports(path: Path) -> set[str]:
    """The ``kvhex.testing`` modules that the module at ``path`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith(f"{PACKAGE}.")}
    return found


def test_the_kit_has_no_import_cycle() -> None:
    root = Path(kvhex.testing.__file__).parent
    modules = {f"{PACKAGE}.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    graph = {name: _imports(path) & modules.keys() for name, path in modules.items()}
    assert graph[f"{PACKAGE}.tier_writer"] == {f"{PACKAGE}.tier_kit"}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"kvhex.testing imports in a cycle: {exc.args[1]}") from None
    assert set(order) == set(modules)
