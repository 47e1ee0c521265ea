"""The one import rule, checked from source: the domain imports only the standard library,
attrs and kvhex.errors; ports only the domain; the service never adapters. (import-linter
enforces the same in CI; this test also catches a library import-linter cannot see.)"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src" / "kvhex"

ALLOWED = {
    "domain": {"attrs", "kvhex.domain", "kvhex.errors"},
    "ports": {"attrs", "kvhex.domain", "kvhex.errors", "kvhex.ports"},
    "service": {
        "attrs",
        "structlog",
        "kvhex.domain",
        "kvhex.errors",
        "kvhex.ports",
        "kvhex.service",
    },
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _allowed(name: str, allowed: set[str]) -> bool:
    top = name.split(".", maxsplit=1)[0]
    if top in sys.stdlib_module_names and top != "kvhex":
        return True
    return any(name == a or name.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports(layer: str) -> None:
    bad = [
        f"{path.relative_to(SRC)}: {name}"
        for path in sorted((SRC / layer).rglob("*.py"))
        for name in _imports(path)
        if not _allowed(name, ALLOWED[layer])
    ]
    assert bad == []


def test_the_rule_itself_rejects_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("import torch\nfrom kvhex.adapters import y\nimport collections\n")
    names = _imports(sample)
    assert [n for n in names if not _allowed(n, ALLOWED["domain"])] == ["torch", "kvhex.adapters"]


def test_errors_module_imports_nothing_from_kvhex() -> None:
    assert not [n for n in _imports(SRC / "errors.py") if n.startswith("kvhex")]
