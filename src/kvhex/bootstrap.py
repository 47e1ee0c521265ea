"""Composition: turning a validated configuration into running domain objects.

Nothing here runs at import time. Everything a configuration names (a policy, later tiers and
sinks) is resolved through a :class:`~kvhex.plugins.Registry`, so built-ins and third-party
plugins are found the same way. Errors a user can fix in their configuration are raised as
``ConfigError`` naming the key; nothing is half-built when one is raised.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import structlog

from kvhex.config.model import KvhexConfig, PrimaryConfig
from kvhex.domain.backpressure import AdmissionPolicy, AlwaysAdmit
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.policies.base import EvictionPolicy
from kvhex.domain.primary import PrimaryTier
from kvhex.domain.tiers import Locality, Medium
from kvhex.domain.translate import EventTranslator
from kvhex.errors import ConfigError, ConfigIssue, PluginError
from kvhex.plugins import POLICIES, SINKS, TIERS, Registry
from kvhex.ports.event_sink import EventSink
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.service.engine import OffloadEngine
from kvhex.service.events import EventPipeline
from kvhex.service.tiering import TieringManager

__all__ = [
    "TierSpec",
    "assemble_engine",
    "build_engine",
    "build_policy",
    "build_primary_tier",
    "build_sink",
    "build_tier",
    "tier_options",
]

log = structlog.get_logger(__name__)


@attrs.frozen
class TierSpec:
    """A secondary tier to build: its plugin, ownership name, factory options, the config
    path errors name, and its admission policy (default: always admit)."""

    plugin: str
    name: str
    options: Mapping[str, Any]
    path: str
    admission: Callable[[], AdmissionPolicy] = AlwaysAdmit


def build_policy(name: str, capacity: int, registry: Registry, *, path: str) -> EvictionPolicy:
    """Instantiate the ``kvhex.policies`` entry point ``name`` for ``capacity`` slots.

    Raises:
        ConfigError: at ``path`` when the name is unknown (listing the available ones) or the
            plugin cannot be loaded or built.
    """
    if name not in registry.names(POLICIES):
        available = ", ".join(registry.names(POLICIES)) or "none installed"
        raise ConfigError([(path, f"unknown eviction policy {name!r}; available: {available}")])
    try:
        factory = registry.load(POLICIES, name)
    except PluginError as exc:
        raise ConfigError([(path, str(exc))]) from exc
    try:
        policy = factory(capacity)
    except Exception as exc:
        raise ConfigError(
            [(path, f"policy {name!r} failed to build: {type(exc).__name__}: {exc}")]
        ) from exc
    if not isinstance(policy, EvictionPolicy):
        raise ConfigError(
            [(path, f"policy {name!r} built a {type(policy).__name__}, not an EvictionPolicy")]
        )
    return policy


def build_primary_tier(
    config: PrimaryConfig, slot_bytes: int, registry: Registry, *, path: str = "$.primary"
) -> PrimaryTier:
    """The host primary tier for ``config``, with ``capacity_bytes // slot_bytes`` slots.

    ``slot_bytes`` is the engine's bytes per chunk (all layers and groups of one chunk).

    Raises:
        ConfigError: the capacity holds no slot, or the policy is unknown or broken.
        ValueError: ``slot_bytes`` is not a positive int (a programming error, not config).
    """
    if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be a positive int, got {slot_bytes!r}")
    num_slots = config.capacity_bytes // slot_bytes
    if num_slots == 0:
        raise ConfigError(
            [
                (
                    f"{path}.capacity_bytes",
                    f"{config.capacity_bytes} bytes hold no chunk of {slot_bytes} bytes",
                )
            ]
        )
    policy = build_policy(config.policy, num_slots, registry, path=f"{path}.policy")
    return PrimaryTier(
        num_slots,
        policy,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
    )


def build_tier(
    name: str,
    host: HostBuffer,
    registry: Registry,
    options: Mapping[str, Any],
    *,
    path: str,
    source: str | None = None,
) -> TierStore:
    """Instantiate the ``kvhex.tiers`` entry point ``name`` as ``factory(host, **options)``.

    ``medium`` and ``locality`` options given as strings (``"STORAGE"``, ``"LOCAL"``) become
    ``Medium`` and ``Locality``. The options are checked against the factory's signature
    before anything is built, so an unknown or missing option is reported by its key.

    Raises:
        ConfigError: at ``path`` (the tier) or ``path.<option>``: an unknown tier name
            (listing the installed ones), a plugin that cannot be loaded, an option the
            factory does not take or a required one missing, a value the tier rejects
            (``TypeError`` / ``ValueError``), or an object that is not a ``TierStore``.
        TierError: the tier was configured correctly but cannot run (e.g. an unwritable
            root); it names the tier.
    """
    kwargs: dict[str, Any] = {}
    issues: list[ConfigIssue] = []
    for key, value in options.items():
        try:
            kwargs[key] = _tier_value(key, value)
        except ValueError as exc:
            issues.append((f"{path}.{key}", str(exc)))
    tier: TierStore = _build_plugin(
        TIERS,
        "kvhex tier",
        TierStore,
        name,
        registry,
        options=kwargs,
        args=(host,),
        issues=issues,
        path=path,
        source=source,
    )
    return tier


def _build_plugin(
    group: str,
    label: str,
    port: type[Any],
    name: str,
    registry: Registry,
    *,
    options: Mapping[str, Any],
    args: tuple[Any, ...],
    issues: list[ConfigIssue],
    path: str,
    source: str | None,
) -> Any:
    """Load entry point ``name`` of ``group``, check ``options`` against its signature (with
    ``args`` passed first), build it and check it implements ``port``; every failure a
    ``ConfigError`` at ``path`` naming the plugin (``issues`` already found come first)."""
    if name not in registry.names(group):
        available = ", ".join(registry.names(group)) or "none installed"
        raise ConfigError([(path, f"unknown {label} {name!r}; available: {available}")], source)
    try:
        factory = registry.load(group, name)
    except PluginError as exc:
        raise ConfigError([(path, str(exc))], source) from exc
    issues = [*issues, *_signature_issues(factory, options, path, takes_host=bool(args))]
    if issues:
        raise ConfigError(issues, source)
    try:
        built = factory(*args, **options)
    except ConfigError as exc:  # the plugin judged a value (e.g. a path it cannot open)
        raise ConfigError([(path, m) for _, m in exc.issues], source) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            [(path, f"{label} {name!r} rejected its options: {type(exc).__name__}: {exc}")],
            source,
        ) from exc
    if not isinstance(built, port):
        raise ConfigError(
            [(path, f"{label} {name!r} built a {type(built).__name__}, not a {port.__name__}")],
            source,
        )
    return built


def _tier_value(key: str, value: Any) -> Any:
    """Strings for the two enum-like options become their values (``ValueError`` if bad)."""
    if key == "medium" and isinstance(value, str):
        return Medium(value.upper())
    if key == "locality" and isinstance(value, str):
        try:
            return Locality(value.upper())
        except ValueError:
            raise ValueError(f"must be 'LOCAL' or 'REMOTE', got {value!r}") from None
    return value


def _signature_issues(
    factory: Any, kwargs: Mapping[str, Any], path: str, *, takes_host: bool
) -> list[ConfigIssue]:
    """Options the factory would refuse, each at ``path.<option>`` (its first positional
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
                issues.append((f"{path}.{key}", f"unknown option; accepted: {accepted}"))
    for p in params.values():
        required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if required and p.name in named and p.name not in kwargs:
            issues.append((f"{path}.{p.name}", "required option is missing"))
    return issues


def build_sink(
    name: str,
    registry: Registry,
    options: Mapping[str, Any],
    *,
    path: str,
    source: str | None = None,
) -> EventSink:
    """Instantiate the ``kvhex.sinks`` entry point ``name`` as ``factory(**options)``.

    Raises:
        ConfigError: at ``path`` or ``path.<option>``, as for :func:`build_tier`.
        OSError: the sink cannot open what it writes to (a path, a port).
    """
    sink: EventSink = _build_plugin(
        SINKS,
        "event sink",
        EventSink,
        name,
        registry,
        options=options,
        args=(),
        issues=[],
        path=path,
        source=source,
    )
    return sink


def assemble_engine(
    primary: PrimaryTier,
    tiers: Sequence[TierSpec],
    host: HostBuffer,
    registry: Registry,
    *,
    sinks: Sequence[EventSink] = (),
    translator: EventTranslator | None = None,
    source: str | None = None,
) -> tuple[OffloadEngine, list[TierStore]]:
    """The engine over ``primary`` and the secondary tiers of ``tiers``, built in order, with
    events published to ``sinks``. Returns the engine and its secondary tiers. If a tier
    fails to build, the ones already built are closed: nothing half-built stays open.

    Raises:
        ConfigError: a tier is misconfigured (paths name the keys).
        TierError: a tier cannot run (e.g. an unwritable root).
    """
    stores: list[TierStore] = []
    try:
        for spec in tiers:
            stores.append(
                build_tier(spec.plugin, host, registry, spec.options, path=spec.path, source=source)
            )
    except BaseException:
        for store in reversed(stores):
            try:
                store.close()
            except Exception as exc:
                log.warning("tier_close_failed", tier=store.identity.ownership, error=repr(exc))
        raise
    manager = TieringManager(
        primary,
        stores,
        host=host,
        admission=lambda i: tiers[i].admission(),
        names=[t.name for t in tiers],
    )
    pipeline = EventPipeline(translator or EventTranslator(), sinks)
    return OffloadEngine(manager, pipeline), stores


def build_engine(
    config: KvhexConfig,
    host: HostBuffer,
    registry: Registry,
    *,
    geometry: KvGeometry | None = None,
    namespace: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> tuple[OffloadEngine, list[TierStore]]:
    """The whole engine a ``KvhexConfig`` describes, over ``host`` (one slot per chunk):
    primary tier, secondary tiers (each given its ``name`` and, when its factory takes one,
    kvhex's block ``namespace``), and the configured sinks. Every sink is built before any
    tier, and everything built is closed again if a later part fails.

    Raises:
        ConfigError: naming the key (``$.primary...``, ``$.tiers[i]...``, ``$.sinks[i]...``).
        TierError: a tier cannot run.
    """
    primary = build_primary_tier(config.primary, host.slot_bytes, registry)
    if config.primary.capacity_bytes // host.slot_bytes != host.num_slots:
        raise ValueError("the host buffer must hold capacity_bytes // slot_bytes slots")
    sinks: list[EventSink] = []
    try:
        for i, sink in enumerate(config.sinks):
            sinks.append(
                build_sink(sink.type, registry, sink.options, path=f"$.sinks[{i}]", source=source)
            )
        specs = [
            TierSpec(
                tier.type,
                tier.name or tier.type,
                tier_options(registry, tier.type, tier.name or tier.type, tier.options, namespace),
                f"$.tiers[{i}].options",
            )
            for i, tier in enumerate(config.tiers)
        ]
        return assemble_engine(
            primary,
            specs,
            host,
            registry,
            sinks=sinks,
            translator=EventTranslator(geometry),
            source=source,
        )
    except BaseException:
        for built in sinks:
            try:
                built.close()
            except Exception as exc:
                log.warning("sink_close_failed", error=repr(exc))
        raise


def tier_options(
    registry: Registry,
    plugin: str,
    name: str,
    options: Mapping[str, Any],
    namespace: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """``options`` plus the tier's ownership ``name`` and kvhex's block ``namespace``, each
    where the tier's factory takes it and the options do not set it already."""
    out = dict(options)
    accepted = _accepted(registry, plugin)
    if accepted is None or "name" in accepted:
        out.setdefault("name", name)
    if namespace is not None and (accepted is None or "namespace" in accepted):
        out.setdefault("namespace", dict(namespace))
    return out


def _accepted(registry: Registry, plugin: str) -> set[str] | None:
    """Keyword names a tier factory takes (``None``: any, or not resolvable here)."""
    try:
        params = inspect.signature(registry.load(TIERS, plugin)).parameters
    except (PluginError, TypeError, ValueError):
        return None  # build_tier reports an unknown or broken plugin with its path
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)
