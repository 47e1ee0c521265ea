"""Composition: turning a validated configuration into running domain objects.

Nothing here runs at import time. Everything a configuration names (a policy, tiers, sinks)
is resolved through a :class:`~kvhex.plugins.Registry`, so built-ins and third-party plugins
are found the same way. Errors a user can fix in their configuration are raised as
``ConfigError`` naming the key, the file when known, and what would be right; that includes
what a plugin's factory refuses while it is built (a ``ValueError`` or ``TypeError`` naming
one of its options, a tier that cannot start on its URL or object store). Every entry is
checked before the first is built, and nothing is half-built when an error is raised.
One entry is built by :mod:`kvhex.bootstrap.entries`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import structlog

from kvhex.bootstrap.entries import (
    EntryPaths,
    Plan,
    build_sink,
    build_tier,
    plan_sink,
    plan_tier,
)
from kvhex.bootstrap.routers import config_findings, warn_router_mismatches
from kvhex.config.model import KvhexConfig, LoadingConfig, PrimaryConfig, TierConfig
from kvhex.domain.backpressure import AdmissionPolicy, AlwaysAdmit
from kvhex.domain.cost import LoadMode, PrefillRate
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.policies.base import EvictionPolicy
from kvhex.domain.primary import PrimaryTier
from kvhex.domain.translate import EventTranslator
from kvhex.errors import ConfigError, PluginError
from kvhex.plugins import POLICIES, TIERS, Registry
from kvhex.ports.event_sink import EventSink
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.service.engine import OffloadEngine, announcer_for
from kvhex.service.events import EventPipeline
from kvhex.service.loading import LoadDecider
from kvhex.service.tiering import TieringManager

__all__ = [
    "EntryPaths",
    "TierSpec",
    "assemble_engine",
    "build_engine",
    "build_policy",
    "build_primary_tier",
    "build_sink",
    "build_tier",
    "load_decider",
    "tier_options",
]

log = structlog.get_logger(__name__)


@attrs.frozen
class TierSpec:
    """A secondary tier to build: its plugin, name, factory options, where errors point in
    the configuration, its admission policy (default: always admit), and whether its events
    name it as their ``ownership`` (default: they name none, as routers expect)."""

    plugin: str
    name: str
    options: Mapping[str, Any]
    paths: EntryPaths
    admission: Callable[[], AdmissionPolicy] = AlwaysAdmit
    announce_ownership: bool = False


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


def assemble_engine(
    primary: PrimaryTier,
    tiers: Sequence[TierSpec],
    host: HostBuffer,
    registry: Registry,
    *,
    sinks: Sequence[EventSink] = (),
    translator: EventTranslator | None = None,
    source: str | None = None,
    loading: LoadingConfig | None = None,
) -> tuple[OffloadEngine, list[TierStore]]:
    """The engine over ``primary`` and the secondary tiers of ``tiers``, built in order, with
    events published to ``sinks`` and load-or-recompute decisions as ``loading`` says
    (default: ``LoadingConfig()``, mode ``auto``). Returns the engine and its secondary tiers.
    Every tier is checked before the first is built (all problems in one ``ConfigError``);
    if one fails to build, the ones already built are closed: nothing half-built stays open.

    Raises:
        ConfigError: a tier is misconfigured or cannot start (paths name the keys).
        TierError: a tier failed otherwise while it started.
    """
    plans = [plan_tier(t.plugin, host, registry, t.options, t.paths) for t in tiers]
    issues = [issue for plan in plans for issue in plan.issues]
    if issues:
        raise ConfigError(issues, source)
    return _assemble(
        primary,
        tiers,
        plans,
        host,
        sinks=sinks,
        translator=translator,
        source=source,
        loading=loading,
    )


def _assemble(
    primary: PrimaryTier,
    tiers: Sequence[TierSpec],
    plans: Sequence[Plan],
    host: HostBuffer,
    *,
    sinks: Sequence[EventSink],
    translator: EventTranslator | None,
    source: str | None,
    loading: LoadingConfig | None = None,
) -> tuple[OffloadEngine, list[TierStore]]:
    stores: list[TierStore] = []
    try:
        for plan in plans:
            stores.append(plan.build(source))
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
        loading=load_decider(loading or LoadingConfig()),
    )
    pipeline = EventPipeline(translator or EventTranslator(), sinks)
    owned = [s.identity for s, t in zip(stores, tiers, strict=True) if t.announce_ownership]
    announcer = announcer_for(stores, owned)
    return OffloadEngine(manager, pipeline, announcer), stores


def load_decider(config: LoadingConfig) -> LoadDecider:
    """A new load-or-recompute decider with ``config``'s settings (one per engine)."""
    return LoadDecider(
        LoadMode(config.mode),
        min_tokens=config.min_tokens,
        prefill=PrefillRate(configured=config.prefill_tokens_per_s),
        explore_every=config.explore_every,
    )


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
    kvhex's block ``namespace``, and its ``backpressure``), and the configured sinks. Every
    tier and sink is checked before anything is built (all problems in one ``ConfigError``),
    every sink is built before any tier, and everything built is closed again if a later
    part fails. With ``[events] router``, every setting whose events that router would drop
    or miscredit is logged once built (``router_config_mismatch``, :mod:`.routers`).

    Args:
        source: the configuration's file, named by every ``ConfigError``.

    Raises:
        ConfigError: naming the key (``$.primary...``, ``$.tiers[i]...``, ``$.sinks[i]...``),
            a tier's start-up failure included (at its ``url``, or at what an object store's
            failure names: its endpoint, access key or secret).
        TierError: a tier failed otherwise while it started.
    """
    try:
        primary = build_primary_tier(config.primary, host.slot_bytes, registry)
    except ConfigError as exc:
        raise ConfigError(exc.issues, source) from exc
    if config.primary.capacity_bytes // host.slot_bytes != host.num_slots:
        raise ValueError("the host buffer must hold capacity_bytes // slot_bytes slots")
    specs = [_tier_spec(tier, i, registry, namespace) for i, tier in enumerate(config.tiers)]
    tier_plans = [plan_tier(t.plugin, host, registry, t.options, t.paths) for t in specs]
    sink_plans = [
        plan_sink(sink.type, registry, sink.options, EntryPaths.of_table(f"$.sinks[{i}]"))
        for i, sink in enumerate(config.sinks)
    ]
    issues = [issue for plan in (*tier_plans, *sink_plans) for issue in plan.issues]
    if issues:
        raise ConfigError(issues, source)
    sinks: list[EventSink] = []
    try:
        for plan in sink_plans:
            sinks.append(plan.build(source))
        translator = EventTranslator(geometry, int_hashes=config.events.int_block_hashes)
        engine, stores = _assemble(
            primary,
            specs,
            tier_plans,
            host,
            sinks=sinks,
            translator=translator,
            source=source,
            loading=config.loading,
        )
        engine.set_geometry(geometry)  # load decisions count the tokens a chunk saves
        findings = config_findings(config, [s.identity for s in stores], geometry)
        warn_router_mismatches(findings, source=source)
        return engine, stores
    except BaseException:
        for built in sinks:
            try:
                built.close()
            except Exception as exc:
                log.warning("sink_close_failed", error=repr(exc))
        raise


def _tier_spec(
    tier: TierConfig, index: int, registry: Registry, namespace: Mapping[str, Any] | None
) -> TierSpec:
    name = tier.name or tier.type
    return TierSpec(
        tier.type,
        name,
        tier_options(registry, tier.type, name, tier.options, namespace),
        EntryPaths.of_table(f"$.tiers[{index}]"),
        AlwaysAdmit if tier.backpressure is None else tier.backpressure.policy,
        tier.announce_ownership,
    )


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
