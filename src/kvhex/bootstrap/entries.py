"""Building one plugin entry of a configuration (a tier, a sink) through the registry, with
every error a user can fix raised as ``ConfigError`` at the key that would fix it.

An entry is first *planned*: its entry point resolved and its options checked (against the
factory's signature, and for tiers an empty ``url`` or a ``capacity_bytes`` that holds no
block), so that a composition can check every entry before it builds the first. Building a
plan maps what the factory raises to keys: a ``ValueError`` or ``TypeError`` naming one of its
options goes to that option; a tier that cannot start (``TierUnavailable``) goes to the option
it blames (:attr:`~kvhex.errors.TierUnavailable.option`: the tier's own argument, dotted into a
mapping one), else to the entry. The built-in tiers and third-party ones are mapped alike.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Mapping, Sequence
from types import UnionType
from typing import Any, Union

import attrs

from kvhex.bootstrap.codecs import plan_codecs
from kvhex.config.model import empty_url
from kvhex.domain.tiers import Locality, Medium
from kvhex.errors import ConfigError, ConfigIssue, PluginError, TierUnavailable
from kvhex.plugins import SINKS, TIERS, Registry
from kvhex.ports.event_sink import EventSink
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore


@attrs.frozen
class EntryPaths:
    """Where a plugin entry's settings are in its configuration, for the errors naming them.

    Attributes:
        entry: the entry (``$.tiers[0]``): problems no single key explains.
        plugin: the key naming the plugin (``$.tiers[0].type``).
        options: where the option keys are (``$.tiers[0].options``).
        keys: option -> path of the key that set it, where that is not ``options.<key>``
            (vLLM's ``root_dir`` is the ``url`` option of kvhex's file tier); a dotted
            option (``storage_options.key``) may have a path of its own, else it is under
            its head's.
    """

    entry: str
    plugin: str
    options: str
    keys: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def at(cls, path: str) -> EntryPaths:
        """Everything at ``path``, each option at ``path.<key>``."""
        return cls(path, path, path)

    @classmethod
    def of_table(cls, path: str) -> EntryPaths:
        """A ``{type, options}`` table at ``path`` (``[[tiers]]``, ``[[sinks]]``)."""
        return cls(path, f"{path}.type", f"{path}.options")

    def option(self, key: str) -> str:
        """The path of option ``key``; of a dotted one (``storage_options.key``), its own
        or the rest under its head's (``$.tiers[0].options.storage_options.key``)."""
        path = self.keys.get(key)
        if path is not None:
            return path
        head, dot, rest = key.partition(".")
        if dot and head in self.keys:
            return f"{self.keys[head]}.{rest}"
        return f"{self.options}.{key}"


def build_tier(
    name: str,
    host: HostBuffer,
    registry: Registry,
    options: Mapping[str, Any],
    *,
    path: str | EntryPaths,
    source: str | None = None,
) -> TierStore:
    """Instantiate the ``kvhex.tiers`` entry point ``name`` as ``factory(host, **options)``.

    ``medium`` and ``locality`` options given as strings (``"STORAGE"``, ``"LOCAL"``) become
    ``Medium`` and ``Locality``. Before anything is built the options are checked against
    the factory's signature (an unknown or missing option is reported by its key), a ``url``
    must not be empty and a ``capacity_bytes`` must hold one host slot.

    Args:
        path: where the tier is in its configuration (a string: everything there, each
            option at ``path.<option>``).

    Raises:
        ConfigError: at the tier, its plugin key or one of its options: an unknown tier
            name (listing the installed ones), a plugin that cannot be loaded, a failed
            check above, a value the tier rejects while it is built (``TypeError`` /
            ``ValueError``; at the option the message names, else at the tier), a tier that
            cannot start (``TierUnavailable``; at the option it blames, else at the tier),
            or an object that is not a ``TierStore``.
    """
    plan = plan_tier(name, host, registry, options, _entry_paths(path))
    if plan.issues:
        raise ConfigError(plan.issues, source)
    tier: TierStore = plan.build(source)
    return tier


def build_sink(
    name: str,
    registry: Registry,
    options: Mapping[str, Any],
    *,
    path: str | EntryPaths,
    source: str | None = None,
) -> EventSink:
    """Instantiate the ``kvhex.sinks`` entry point ``name`` as ``factory(**options)``.

    Raises:
        ConfigError: at the entry, its plugin key or an option, as for :func:`build_tier`.
        OSError: the sink cannot open what it writes to (a path, a port).
    """
    plan = plan_sink(name, registry, options, _entry_paths(path))
    if plan.issues:
        raise ConfigError(plan.issues, source)
    sink: EventSink = plan.build(source)
    return sink


def _entry_paths(path: str | EntryPaths) -> EntryPaths:
    return path if isinstance(path, EntryPaths) else EntryPaths.at(path)


@attrs.frozen
class Plan:
    """A plugin entry, checked: ready to build when ``issues`` is empty (``factory`` is
    ``None`` when the entry point cannot even be loaded)."""

    label: str
    name: str
    port: type[Any]
    factory: Any
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    paths: EntryPaths
    issues: tuple[ConfigIssue, ...]

    def build(self, source: str | None) -> Any:
        """Call the factory; every failure a ``ConfigError`` at the entry or an option."""
        what, paths = f"{self.label} {self.name!r}", self.paths
        try:
            built = self.factory(*self.args, **self.kwargs)
        except ConfigError as exc:  # the plugin judged a value (e.g. a path it cannot open)
            issues = [
                (paths.option(k) if k in self.kwargs else paths.entry, m) for k, m in exc.issues
            ]
            raise ConfigError(issues, source) from exc
        except TierUnavailable as exc:  # a tier's start-up: at the option it blames
            where = paths.entry if exc.option is None else paths.option(exc.option)
            raise ConfigError([(where, f"{what} cannot start: {exc.problem}")], source) from exc
        except (TypeError, ValueError) as exc:
            key = _named_option(str(exc), self.kwargs)
            if key is None:
                problem = f"{what} rejected its options: {type(exc).__name__}: {exc}"
                raise ConfigError([(paths.entry, problem)], source) from exc
            problem = f"rejected by {what}: {exc}"
            raise ConfigError([(paths.option(key), problem)], source) from exc
        if not isinstance(built, self.port):
            problem = f"{what} built a {type(built).__name__}, not a {self.port.__name__}"
            raise ConfigError([(paths.entry, problem)], source)
        return built


def _plan(
    group: str,
    label: str,
    port: type[Any],
    name: str,
    registry: Registry,
    *,
    options: Mapping[str, Any],
    args: tuple[Any, ...],
    paths: EntryPaths,
    issues: Sequence[ConfigIssue] = (),
) -> Plan:
    """Entry point ``name`` of ``group`` with ``options`` checked against its signature
    (``args`` passed first); ``issues`` already found come first."""
    factory = None
    found = list(issues)
    if name not in registry.names(group):
        available = ", ".join(registry.names(group)) or "none installed"
        found.append((paths.plugin, f"unknown {label} {name!r}; available: {available}"))
    else:
        try:
            factory = registry.load(group, name)
        except PluginError as exc:
            found.append((paths.plugin, str(exc)))
        else:
            found += _signature_issues(factory, options, paths, takes_host=bool(args))
            at = {path for path, _ in found}
            found += [i for i in _type_issues(factory, options, paths) if i[0] not in at]
    return Plan(label, name, port, factory, args, options, paths, tuple(found))


def plan_tier(
    name: str, host: HostBuffer, registry: Registry, options: Mapping[str, Any], paths: EntryPaths
) -> Plan:
    """The ``kvhex.tiers`` entry point ``name`` with ``options`` checked, nothing built (see
    :func:`build_tier`)."""
    kwargs: dict[str, Any] = {}
    issues = empty_url(options, paths.option("url"))
    for key, value in options.items():
        if key == "codec":  # names -> a chain, built now: a bad one never half-starts
            kwargs[key], found = plan_codecs(
                registry, value, options.get("namespace"), paths.option(key)
            )
            issues += found
            continue
        try:
            kwargs[key] = _tier_value(key, value)
        except ValueError as exc:
            issues.append((paths.option(key), str(exc)))
    capacity = options.get("capacity_bytes")
    if type(capacity) is int and capacity < host.slot_bytes:
        issues.append(
            (
                paths.option("capacity_bytes"),
                f"{capacity} bytes hold no block of {host.slot_bytes} bytes (one host slot); "
                "give at least that, plus the tier's own per-block overhead",
            )
        )
    return _plan(
        TIERS,
        "kvhex tier",
        TierStore,
        name,
        registry,
        options=kwargs,
        args=(host,),
        paths=paths,
        issues=issues,
    )


def plan_sink(name: str, registry: Registry, options: Mapping[str, Any], paths: EntryPaths) -> Plan:
    """The ``kvhex.sinks`` entry point ``name`` with ``options`` checked, nothing built."""
    return _plan(
        SINKS, "event sink", EventSink, name, registry, options=options, args=(), paths=paths
    )


def _named_option(message: str, options: Mapping[str, Any]) -> str | None:
    """The option a factory's error names (the first one the message mentions), if any."""
    found = [
        (m.start(), key) for key in options if (m := re.search(rf"\b{re.escape(key)}\b", message))
    ]
    return min(found)[1] if found else None


def _tier_value(key: str, value: Any) -> Any:
    """Strings for the two enum-like options become their values (``ValueError`` if bad)."""
    if key == "medium" and isinstance(value, str):
        return Medium(value.upper())
    if key == "locality" and isinstance(value, str):
        try:
            return Locality(value.upper())
        except ValueError:
            raise ValueError(f"must be 'LOCAL', 'REMOTE' or 'SHARED', got {value!r}") from None
    return value


_SIMPLE = (bool, int, float, str)


def _type_issues(factory: Any, kwargs: Mapping[str, Any], paths: EntryPaths) -> list[ConfigIssue]:
    """Options whose value the factory's annotation refuses, where that annotation is a plain
    ``bool``, ``int``, ``float`` or ``str`` (or a union of them and ``None``): checked as
    strictly as the configuration model (an ``int`` refuses ``true`` and ``1.5``)."""
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:
        return []  # annotations this module cannot resolve: let the call judge
    issues: list[ConfigIssue] = []
    for key, value in kwargs.items():
        hint = hints.get(key)
        allowed = (
            typing.get_args(hint) if typing.get_origin(hint) in (Union, UnionType) else (hint,)
        )
        if not allowed or not all(a in _SIMPLE or a is type(None) for a in allowed):
            continue
        if value is None and type(None) in allowed:
            continue
        kind = type(value)
        if kind in allowed or (kind is int and float in allowed):
            continue
        names = " or ".join("None" if a is type(None) else a.__name__ for a in allowed)
        issues.append((paths.option(key), f"expected {names}, got {kind.__name__} {value!r}"))
    return issues


def _signature_issues(
    factory: Any, kwargs: Mapping[str, Any], paths: EntryPaths, *, takes_host: bool
) -> list[ConfigIssue]:
    """Options the factory would refuse, each at its path (the factory's first positional
    parameter is the host buffer when ``takes_host``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return []  # a builtin or C factory: let the call itself judge
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {
        p.name
        for p in params.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and not (takes_host and positional and p is positional[0])  # the host buffer
    }
    issues: list[ConfigIssue] = []
    if not takes_any:
        for key in kwargs:
            if key not in named:
                accepted = ", ".join(sorted(named)) or "none"
                issues.append((paths.option(key), f"unknown option; accepted: {accepted}"))
    for p in params.values():
        required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if required and p.name in named and p.name not in kwargs:
            issues.append((paths.option(p.name), "required option is missing"))
    return issues
