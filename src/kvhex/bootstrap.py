"""Composition: turning a validated configuration into running domain objects.

Nothing here runs at import time. Everything a configuration names (a policy, later tiers and
sinks) is resolved through a :class:`~kvhex.plugins.Registry`, so built-ins and third-party
plugins are found the same way. Errors a user can fix in their configuration are raised as
``ConfigError`` naming the key; nothing is half-built when one is raised.
"""

from __future__ import annotations

from kvhex.config.model import PrimaryConfig
from kvhex.domain.policies.base import EvictionPolicy
from kvhex.domain.primary import PrimaryTier
from kvhex.errors import ConfigError, PluginError
from kvhex.plugins import POLICIES, Registry

__all__ = ["build_policy", "build_primary_tier"]


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
