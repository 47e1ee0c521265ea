"""kvhex's extras tell the truth, read from the code rather than by hand: every third-party
package a module imports when it is loaded (its top-level imports, and those of every kvhex
module it loads in turn) is a core dependency, or declared by the extra of what needs it:

* the core (``kvhex``, the CLI with every subcommand, domain, ports, service, config,
  plugins, bootstrap): core dependencies only, so ``kvhex --version`` runs on a plain install;
* every entry point kvhex declares: its own extras (``fsspec = "... [files]"``);
* the modules a user imports by name (the torch adapter, the Prometheus collector): the extra
  the docs give them.

A package an extra declares may bring others it depends on (installed metadata, followed
transitively). Imports inside functions are left out: those run when a feature is asked for,
and the command turns a missing one into an install hint (tests/cli/test_missing_packages.py).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections.abc import Iterable
from importlib import metadata

import pytest

from kvhex.plugins import USER_EXTRAS

DIST = "kvhex"
CORE = (
    "kvhex",
    "kvhex.cli",
    "kvhex.domain",
    "kvhex.ports",
    "kvhex.service",
    "kvhex.config",
    "kvhex.plugins",
    "kvhex.bootstrap",
    "kvhex.errors",
)
NAMED_MODULES = {
    "kvhex.adapters.torch": ("torch",),
    "kvhex.adapters.metrics.prometheus": ("metrics",),
}
"""Modules without an entry point that users import, and the extras the docs give them."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _parse(requirement: str) -> tuple[str, str | None, tuple[str, ...]]:
    """A requirement's distribution, the extra whose marker names it, and the extras it asks
    of the distribution itself (``kvhex[torch,files]``)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name is not None, requirement
    marker = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", requirement)
    own = re.match(r"[A-Za-z0-9._-]+\[([^\]]+)\]", requirement)
    extras = tuple(e.strip() for e in own.group(1).split(",")) if own else ()
    return canonical(name.group()), marker.group(1) if marker else None, extras


def declared(extras: Iterable[str]) -> set[str]:
    """The distributions kvhex's core and ``extras`` declare (a self-reference expanded)."""
    wanted, seen, out = set(extras) | {None}, set(), set()
    while wanted - seen:
        extra = (wanted - seen).pop()
        seen.add(extra)
        for requirement in metadata.requires(DIST) or []:
            name, marker, asked = _parse(requirement)
            if marker != extra or "python_version" in requirement:
                continue
            if name == DIST:
                wanted |= set(asked)
            else:
                out.add(name)
    return out


def installed_closure(names: set[str]) -> set[str]:
    """``names`` and every distribution they depend on, as installed here."""
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_parse(r)[0] for r in requirements if "extra ==" not in r]
    return out


def _source(module: str) -> tuple[str, str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    assert spec.origin is not None, module
    with open(spec.origin, encoding="utf-8") as f:
        return f.read(), spec.origin


def load_time_imports(module: str) -> set[str]:
    """Absolute names ``module`` imports at its top level (``if``/``try`` included, an
    ``if TYPE_CHECKING:`` block and function and class bodies left out)."""
    text, origin = _source(module)
    package = module if origin.endswith("__init__.py") else module.rpartition(".")[0]
    found: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    name = f"{base}.{node.module}" if node.module else base
                else:
                    name = node.module or ""
                found.add(name)
                found.update(f"{name}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    walk(node.body)
                    walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for handler in node.handlers:
                    walk(handler.body)

    walk(ast.parse(text).body)
    return found


def third_party(roots: Iterable[str]) -> dict[str, str]:
    """Every third-party top-level package loading ``roots`` imports (transitively through
    kvhex's modules), with the kvhex module that imports it."""
    out: dict[str, str] = {}
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        for i in range(2, len(parts)):  # a module loads its packages first
            todo.append(".".join(parts[:i]))
        for name in load_time_imports(module):
            top = name.split(".")[0]
            if top == "kvhex":
                if importlib.util.find_spec(_module_part(name)) is not None:
                    todo.append(_module_part(name))
            elif top not in sys.stdlib_module_names and top != "__future__":
                out.setdefault(top, module)
    return out


def _module_part(name: str) -> str:
    """``name`` as a module: ``kvhex.a.b.Name`` -> ``kvhex.a.b`` where ``Name`` is no module."""
    while name.count(".") and importlib.util.find_spec(name.rpartition(".")[0]) is not None:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:
            pass
        name = name.rpartition(".")[0]
    return name


def distributions_of(top: str) -> set[str]:
    return {canonical(d) for d in metadata.packages_distributions().get(top, [])}


def undeclared(roots: Iterable[str], extras: Iterable[str]) -> list[str]:
    allowed = installed_closure(declared(extras))
    problems = []
    for top, importer in sorted(third_party(roots).items()):
        dists = distributions_of(top)
        if not dists:
            problems.append(f"{top} (imported by {importer}): not installed here to tell")
        elif not dists & allowed:
            problems.append(f"{top} ({'/'.join(sorted(dists))}, imported by {importer})")
    return problems


def test_the_core_loads_with_the_core_dependencies_alone() -> None:
    from kvhex import cli

    commands = [f"kvhex.cli.{m}" for m in ("run", "bench", "tiers", "events", "fsck")]
    assert all(importlib.util.find_spec(c) for c in commands), cli
    assert undeclared([*CORE, *commands], []) == []


def _entry_points() -> list[tuple[str, str, tuple[str, ...]]]:
    dist = metadata.distribution(DIST)
    return [
        (f"{ep.group} {ep.name}", ep.value.split(":")[0].strip(), tuple(ep.extras))
        for ep in dist.entry_points
        if ep.group.startswith("kvhex.")
    ]


@pytest.mark.parametrize(("entry", "module", "extras"), _entry_points(), ids=str)
def test_every_entry_point_loads_with_its_own_extras(
    entry: str, module: str, extras: tuple[str, ...]
) -> None:
    assert undeclared([module], extras) == [], entry


@pytest.mark.parametrize(("module", "extras"), sorted(NAMED_MODULES.items()))
def test_the_modules_users_import_load_with_their_documented_extras(
    module: str, extras: tuple[str, ...]
) -> None:
    assert undeclared([module], extras) == []


def test_all_installs_every_adapter_and_hints_name_real_extras() -> None:
    everything = declared(["all"])
    for extra in USER_EXTRAS:
        if extra != "vllm":  # its own pinned install (docs/vllm.md)
            assert declared([extra]) <= everything, extra
    provided = set(metadata.metadata(DIST).get_all("Provides-Extra") or [])
    assert set(USER_EXTRAS) <= provided
