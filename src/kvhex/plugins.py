"""The entry-point registry: how kvhex finds tiers, transfers, sinks and policies.

Built-ins are declared exactly like a third party's: as entry points of the installed ``kvhex``
distribution. Nothing is discovered or imported at import time; a registry is built by an
explicit :meth:`Registry.discover` call, which only reads metadata, and a plugin is imported
by :meth:`Registry.load` (or all of them by :meth:`Registry.load_all`, which reports what it
loaded and from which distribution, and what failed and why).

Rules:

* A name appears once per group. Two distributions declaring the same name are refused with a
  ``PluginError`` naming both, unless replacement is asked for (``replace=True``): then a
  third party's entry point replaces kvhex's built-in, and between two third parties the one
  found later wins; every replacement is reported.
* A failed import raises ``PluginError`` naming the group, the entry point, the distribution
  and an install hint (from the entry point's extras, e.g. ``pip install 'kvhex[s3]'``).
* A loaded object is checked against its group's port before it is handed out.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import attrs

from kvhex.domain.policies.base import EvictionPolicy
from kvhex.errors import MissingPackage, PluginError
from kvhex.ports.codec import BlockCodec
from kvhex.ports.event_sink import EventSink
from kvhex.ports.tier_store import TierStore
from kvhex.ports.transfer import BlockTransfer

__all__ = [
    "CODECS",
    "GROUPS",
    "POLICIES",
    "SINKS",
    "TIERS",
    "TRANSFERS",
    "USER_EXTRAS",
    "LoadReport",
    "LoadedPlugin",
    "PluginSpec",
    "Registry",
    "install_hint_for_module",
    "missing_package",
]

TIERS = "kvhex.tiers"
TRANSFERS = "kvhex.transfers"
SINKS = "kvhex.sinks"
POLICIES = "kvhex.policies"
CODECS = "kvhex.codecs"

OWN_DISTRIBUTION = "kvhex"


def _protocol_methods(protocol: type) -> tuple[str, ...]:
    """Public methods a protocol (and the protocols it extends) declares."""
    names: dict[str, None] = {}
    for base in reversed(protocol.__mro__):
        if base is object or not getattr(base, "_is_protocol", False):
            continue
        for name, member in vars(base).items():
            if not name.startswith("_") and inspect.isfunction(member):
                names[name] = None
    return tuple(names)


Checker = Callable[[Any], "str | None"]


def _factory_of(protocol: type, what: str) -> Checker:
    """Accept a callable; when it is a class, it must have the protocol's methods."""
    methods = _protocol_methods(protocol)

    def check(obj: Any) -> str | None:
        if not callable(obj):
            return f"expected a {what} class or factory, got {type(obj).__name__}"
        if inspect.isclass(obj):
            missing = [m for m in methods if not callable(getattr(obj, m, None))]
            if missing:
                return (
                    f"class {obj.__qualname__} lacks {protocol.__name__} methods: "
                    f"{', '.join(missing)}"
                )
        return None

    return check


GROUPS: Mapping[str, Checker | None] = {
    TIERS: _factory_of(TierStore, "tier"),
    TRANSFERS: _factory_of(BlockTransfer, "transfer"),
    SINKS: _factory_of(EventSink, "event sink"),
    POLICIES: _factory_of(EvictionPolicy, "policy"),
    CODECS: _factory_of(BlockCodec, "codec"),
}
"""Every entry-point group kvhex reads, with the check a loaded object must pass."""


USER_EXTRAS = (
    "torch", "files", "s3", "zmq", "metrics", "valkey", "nixl", "zstd", "lz4", "encryption",
    "vllm",
)  # fmt: skip
"""kvhex's extras for users, in the order a hint prefers them (numpy: ``torch`` first)."""

_MODULE_DISTRIBUTIONS = {"zmq": "pyzmq", "prometheus_client": "prometheus-client"}
"""Top-level modules whose distribution has another name."""


def missing_package(exc: ModuleNotFoundError) -> MissingPackage | None:
    """``exc`` as a :class:`~kvhex.errors.MissingPackage` naming its install hint, when the
    module is one of kvhex's optional packages (else ``None``: a bug, to show whole)."""
    module = exc.name or ""
    hint = install_hint_for_module(module)
    return None if hint is None else MissingPackage(module, hint)


def install_hint_for_module(module: str) -> str | None:
    """``pip install 'kvhex[EXTRA]'`` for the first of :data:`USER_EXTRAS` whose requirements
    (kvhex's installed metadata) provide the top-level package of ``module``; ``None`` when
    no extra does (not an optional dependency of kvhex's: a bug, not a missing install)."""
    top = module.split(".", 1)[0]
    wanted = _canonical(_MODULE_DISTRIBUTIONS.get(top, top))
    try:
        requirements = metadata.requires(OWN_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    extras = set()
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", requirement)
        if name and extra and _canonical(name.group()) == wanted:
            extras.add(extra.group(1))
    chosen = next((e for e in USER_EXTRAS if e in extras), None)
    return None if chosen is None else f"pip install '{OWN_DISTRIBUTION}[{chosen}]'"


@attrs.frozen
class PluginSpec:
    """One discovered entry point, not imported yet."""

    group: str
    name: str
    value: str
    distribution: str | None
    version: str | None
    extras: tuple[str, ...] = ()

    @property
    def builtin(self) -> bool:
        """True for kvhex's own entry points."""
        return self.distribution == OWN_DISTRIBUTION

    def install_hint(self) -> str:
        """The command most likely to make this entry point importable."""
        dist = self.distribution or "the package that declares it"
        if self.extras:
            return f"pip install '{dist}[{','.join(self.extras)}]'"
        return f"pip install --force-reinstall '{dist}'"


@attrs.frozen
class LoadedPlugin:
    """A plugin that imported and passed its group's check."""

    spec: PluginSpec
    obj: Any


@attrs.frozen
class LoadReport:
    """What :meth:`Registry.load_all` did: loaded plugins, failures, and replacements made at
    discovery (``(replaced, replacement)`` pairs)."""

    loaded: tuple[LoadedPlugin, ...]
    failed: tuple[PluginError, ...]
    replaced: tuple[tuple[PluginSpec, PluginSpec], ...]

    def lines(self) -> list[str]:
        """One human-readable line per plugin, for logs and ``kvhex tiers``."""
        out = [
            f"{p.spec.group} {p.spec.name}: loaded from {p.spec.distribution} {p.spec.version}"
            for p in self.loaded
        ]
        out.extend(f"FAILED {err}" for err in self.failed)
        out.extend(
            f"{new.group} {new.name}: {new.distribution} replaced {old.distribution}"
            for old, new in self.replaced
        )
        return out


class Registry:
    """Entry points per group, imported on demand. Build one with :meth:`discover`."""

    def __init__(self) -> None:
        self._specs: dict[str, dict[str, PluginSpec]] = {group: {} for group in GROUPS}
        self._objects: dict[tuple[str, str], Any] = {}
        self._replaced: list[tuple[PluginSpec, PluginSpec]] = []

    @classmethod
    def discover(
        cls,
        groups: Iterable[str] = tuple(GROUPS),
        *,
        replace: bool = False,
        found: Iterable[EntryPoint] | None = None,
    ) -> Registry:
        """Read the installed distributions' entry points for ``groups`` (no imports).

        ``found`` replaces the installed entry points (for tests and embedding).

        Raises:
            PluginError: an unknown group, or a name declared twice without ``replace``.
        """
        registry = cls()
        wanted = list(groups)
        for group in wanted:
            _check_group(group)
        if found is None:
            eps = [ep for group in wanted for ep in entry_points(group=group)]
        else:
            eps = [ep for ep in found if ep.group in wanted]
        for ep in eps:
            registry._add(_spec_of(ep), replace=replace)
        return registry

    def _add(self, spec: PluginSpec, *, replace: bool) -> None:
        known = self._specs[spec.group]
        old = known.get(spec.name)
        if old is not None:
            if (old.value, old.distribution) == (spec.value, spec.distribution):
                return  # the same distribution seen twice on sys.path
            if not replace:
                raise PluginError(
                    f"name already declared by distribution {old.distribution!r} "
                    f"({old.value}); pass replace=True to let one replace the other",
                    group=spec.group,
                    name=spec.name,
                    distribution=spec.distribution,
                    hint="uninstall one of the two distributions, or load with replace=True",
                )
            if spec.builtin and not old.builtin:
                self._replaced.append((spec, old))
                return
            self._replaced.append((old, spec))
        known[spec.name] = spec
        self._objects.pop((spec.group, spec.name), None)

    def register(self, group: str, name: str, obj: Any, *, replace: bool = False) -> None:
        """Add an object directly (no entry point), checked against the group's port.

        Raises:
            PluginError: unknown group, a name already present without ``replace``, or an
                object that fails the group's check.
        """
        _check_group(group)
        spec = PluginSpec(group, name, f"<registered {obj!r}>", None, None)
        _check_object(spec, obj)
        if name in self._specs[group] and not replace:
            old = self._specs[group][name]
            raise PluginError(
                f"name already declared by distribution {old.distribution!r}",
                group=group,
                name=name,
                hint="pass replace=True to replace it",
            )
        if name in self._specs[group]:
            self._replaced.append((self._specs[group][name], spec))
        self._specs[group][name] = spec
        self._objects[(group, name)] = obj

    def names(self, group: str) -> list[str]:
        """The names declared in ``group``, sorted."""
        _check_group(group)
        return sorted(self._specs[group])

    def specs(self, group: str | None = None) -> list[PluginSpec]:
        """Discovered entry points, of one group or all, sorted by group and name."""
        groups = [group] if group is not None else list(self._specs)
        return [self._specs[g][n] for g in groups for n in sorted(self._specs[g])]

    def load(self, group: str, name: str) -> Any:
        """Import (once) and return the object behind ``group``/``name``.

        Raises:
            PluginError: the name is unknown (the message lists the available ones), the
                import failed (with an install hint), or the object fails the group's check.
        """
        _check_group(group)
        cached = self._objects.get((group, name), _MISSING)
        if cached is not _MISSING:
            return cached
        spec = self._specs[group].get(name)
        if spec is None:
            available = ", ".join(self.names(group)) or "none"
            raise PluginError(
                f"unknown name; available: {available}",
                group=group,
                name=name,
                hint="install the distribution that provides it",
            )
        try:
            obj = EntryPoint(spec.name, spec.value, spec.group).load()
        except Exception as exc:
            raise PluginError(
                f"import failed: {type(exc).__name__}: {exc}",
                group=group,
                name=name,
                distribution=spec.distribution,
                hint=spec.install_hint(),
            ) from exc
        _check_object(spec, obj)
        self._objects[(group, name)] = obj
        return obj

    def load_all(self, group: str | None = None) -> LoadReport:
        """Try to load every discovered plugin (of one group or all); never raises for a
        single plugin's failure, which is reported instead."""
        loaded: list[LoadedPlugin] = []
        failed: list[PluginError] = []
        for spec in self.specs(group):
            try:
                loaded.append(LoadedPlugin(spec, self.load(spec.group, spec.name)))
            except PluginError as exc:
                failed.append(exc)
        return LoadReport(tuple(loaded), tuple(failed), tuple(self._replaced))


_MISSING = object()


def _check_group(group: str) -> None:
    if group not in GROUPS:
        raise PluginError(
            f"unknown entry-point group; kvhex reads {', '.join(GROUPS)}",
            group=group,
            name="*",
        )


def _check_object(spec: PluginSpec, obj: Any) -> None:
    checker = GROUPS[spec.group]
    problem = checker(obj) if checker is not None else None
    if problem is not None:
        raise PluginError(
            problem,
            group=spec.group,
            name=spec.name,
            distribution=spec.distribution,
            hint=f"fix or uninstall {spec.distribution or 'the object registered'}",
        )


def _spec_of(ep: EntryPoint) -> PluginSpec:
    dist = ep.dist
    name = dist.metadata["Name"] if dist is not None else None
    version = dist.version if dist is not None else None
    return PluginSpec(
        group=ep.group,
        name=ep.name,
        value=ep.value,
        distribution=_canonical(name) if name else None,
        version=version,
        extras=tuple(ep.extras),
    )


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
