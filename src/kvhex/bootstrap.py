"""Composition: turning a validated configuration into running domain objects.

Nothing here runs at import time. Everything a configuration names (a policy, later tiers and
sinks) is resolved through a :class:`~kvhex.plugins.Registry`, so built-ins and third-party
plugins are found the same way. Errors a user can fix in their configuration are raised as
``ConfigError`` naming the key; nothing is half-built when one is raised.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from kvhex.config.model import PrimaryConfig
from kvhex.domain.policies.base import EvictionPolicy
from kvhex.domain.primary import PrimaryTier
from kvhex.domain.tiers import Locality, Medium
from kvhex.errors import ConfigError, ConfigIssue, PluginError
from kvhex.plugins import POLICIES, TIERS, Registry
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore

__all__ = ["build_policy", "build_primary_tier", "build_tier"]


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
    if name not in registry.names(TIERS):
        available = ", ".join(registry.names(TIERS)) or "none installed"
        raise ConfigError([(path, f"unknown kvhex tier {name!r}; available: {available}")], source)
    try:
        factory = registry.load(TIERS, name)
    except PluginError as exc:
        raise ConfigError([(path, str(exc))], source) from exc
    kwargs: dict[str, Any] = {}
    issues: list[ConfigIssue] = []
    for key, value in options.items():
        try:
            kwargs[key] = _tier_value(key, value)
        except ValueError as exc:
            issues.append((f"{path}.{key}", str(exc)))
    issues.extend(_signature_issues(factory, kwargs, path))
    if issues:
        raise ConfigError(issues, source)
    try:
        tier = factory(host, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            [(path, f"tier {name!r} rejected its options: {type(exc).__name__}: {exc}")], source
        ) from exc
    if not isinstance(tier, TierStore):
        raise ConfigError(
            [(path, f"tier {name!r} built a {type(tier).__name__}, not a TierStore")], source
        )
    return tier


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


def _signature_issues(factory: Any, kwargs: Mapping[str, Any], path: str) -> list[ConfigIssue]:
    """Options the factory would refuse, each at ``path.<option>``."""
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
        and not (positional and p is positional[0])  # the host buffer
    }
    issues: list[ConfigIssue] = []
    if not takes_any:
        for key in kwargs:
            if key not in named:
                accepted = ", ".join(sorted(named)) or "none"
                issues.append((f"{path}.{key}", f"unknown tier option; accepted: {accepted}"))
    for p in params.values():
        required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if required and p.name in named and p.name not in kwargs:
            issues.append((f"{path}.{p.name}", "required tier option is missing"))
    return issues
