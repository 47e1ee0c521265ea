"""Building kvhex's engine for vLLM from checked settings (no vLLM import).

The host primary tier lives in memory vLLM owns (its shared offload region, which its workers
copy into); :class:`RegionHostBuffer` lends kvhex's tiers slot views of it. Tiers are built
through the ``kvhex.tiers`` registry like any other kvhex tier, so a third party's tier works
in vLLM with no vLLM-specific code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from kvhex.bootstrap import TierSpec, assemble_engine, build_policy, build_tier, tier_options
from kvhex.bootstrap.routers import (
    AnnouncedTier,
    RouterTarget,
    router_findings,
    warn_router_mismatches,
)
from kvhex.config.vllm import SOURCE
from kvhex.domain.backpressure import AdmissionPolicy, AlwaysAdmit
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.primary import PrimaryTier
from kvhex.domain.routers import Finding
from kvhex.domain.tiers import TierIdentity
from kvhex.domain.translate import EventTranslator
from kvhex.errors import ConfigError
from kvhex.plugins import Registry
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.service.engine import OffloadEngine
from kvhex.vllm.settings import TierSettings, VllmSettings

log = structlog.get_logger(__name__)

DEFAULT_OBJECT_CAPACITY = 1 << 62
"""An object-store tier without ``kvhex.capacity_bytes`` is unbounded, as vLLM's is."""


class RegionHostBuffer:
    """``HostBuffer`` over ``num_slots`` rows of ``slot_bytes`` in a flat writable view.

    The view is vLLM's shared offload region as the scheduler process maps it; the bytes are
    the ones vLLM's workers copy device blocks into. ``close`` calls ``release`` (which unmaps
    the region) once, after the views are dropped.
    """

    __slots__ = ("_release", "_view", "num_slots", "slot_bytes")

    def __init__(
        self,
        view: memoryview,
        num_slots: int,
        slot_bytes: int,
        release: Callable[[], None] | None = None,
    ) -> None:
        flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        if flat.readonly:
            raise ValueError("the host region must be writable")
        if len(flat) < num_slots * slot_bytes:
            raise ValueError(
                f"region of {len(flat)} bytes cannot hold {num_slots} slots of {slot_bytes}"
            )
        self._view: memoryview | None = flat
        self._release = release
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes

    def slot_view(self, slot: int) -> memoryview:
        """A writable view of one slot. ``IndexError`` outside the region or after close."""
        if self._view is None:
            raise IndexError("host region is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")
        start = slot * self.slot_bytes
        return self._view[start : start + self.slot_bytes]

    def close(self) -> None:
        """Drop the view, then release the region (once)."""
        view, self._view = self._view, None
        if view is not None:
            view.release()
        release, self._release = self._release, None
        if release is not None:
            release()


def build_tier_store(
    tier: TierSettings,
    host: HostBuffer,
    registry: Registry,
    namespace: Mapping[str, Any],
) -> TierStore:
    """Build one secondary tier: its plugin with its options, plus the tier's ownership name
    and kvhex's block namespace when the plugin takes them, and a default capacity.

    Raises:
        ConfigError: naming the tier entry or the key its problem came from, a tier that
            cannot start included (see ``bootstrap.build_tier``).
        TierError: the tier failed otherwise while it started.
    """
    options = _tier_options(tier, registry, namespace)
    return build_tier(tier.plugin, host, registry, options, path=tier.paths, source=SOURCE)


def _tier_options(
    tier: TierSettings, registry: Registry, namespace: Mapping[str, Any]
) -> dict[str, Any]:
    options = tier_options(registry, tier.plugin, tier.name, tier.options, namespace)
    if tier.default_capacity:
        url = options.get("url")
        if tier.type == "fs" and isinstance(url, str):
            options["capacity_bytes"] = None  # the file tier takes its root's free space
        else:
            options["capacity_bytes"] = DEFAULT_OBJECT_CAPACITY
    return options


def build_engine(
    settings: VllmSettings,
    host: HostBuffer,
    *,
    registry: Registry,
    namespace: Mapping[str, Any],
    record_events: bool,
    geometry: KvGeometry | None = None,
    int_hashes: bool = False,
) -> tuple[OffloadEngine, list[TierStore]]:
    """The host primary tier over ``host`` (one slot per chunk), the configured secondary
    tiers in order, and the event pipeline; nothing half-built stays open on failure.
    Returns the engine and its secondary tiers (in configured order).

    Raises:
        ConfigError: the host budget holds no chunk, the policy or a tier is misconfigured or
            a tier cannot start (paths name the keys); every tier is checked before the first
            is built.
        TierError: a tier failed otherwise while it started.
    """
    if host.num_slots < 1:
        raise ConfigError(
            [
                (
                    "$.cpu_bytes_to_use",
                    f"{settings.cpu_bytes_to_use} bytes hold no chunk of {host.slot_bytes} bytes",
                )
            ],
            SOURCE,
        )
    try:
        policy = build_policy(settings.policy, host.num_slots, registry, path=settings.policy_path)
    except ConfigError as exc:
        raise ConfigError(exc.issues, SOURCE) from exc
    primary = PrimaryTier(
        host.num_slots,
        policy,
        store_threshold=settings.store_threshold,
        max_tracker_size=settings.max_tracker_size,
        record_events=record_events,
    )
    specs = [
        TierSpec(
            tier.plugin,
            tier.name,
            _tier_options(tier, registry, namespace),
            tier.paths,
            _admission(tier),
            tier.announce_ownership,
        )
        for tier in settings.tiers
    ]
    return assemble_engine(
        primary,
        specs,
        host,
        registry,
        translator=EventTranslator(geometry, int_hashes=int_hashes),
        source=SOURCE,
        loading=settings.loading,
    )


def _admission(tier: TierSettings) -> Callable[[], AdmissionPolicy]:
    return AlwaysAdmit if tier.backpressure is None else tier.backpressure.policy


INT_HASHES_VARIABLE = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
"""vLLM's environment variable that decides the hash form of every event inside vLLM."""

TOPIC_KEY = "vLLM's kv_events_config.topic (--kv-events-config)"
"""Where vLLM's publisher is given its ZMQ topic."""


def check_router(
    settings: VllmSettings,
    stores: Sequence[TierStore],
    *,
    int_hashes: bool,
    topic: str | None,
    block_sizes: Sequence[int],
    published: Callable[[TierIdentity], TierIdentity] = lambda identity: identity,
) -> list[Finding]:
    """Log, and return, everything ``settings.router`` (``kvhex.router``) would drop or
    miscredit of what this engine publishes: each announced tier (``enable_kv_events``) as
    ``published`` says vLLM's events name it, the hash form (vLLM's variable), vLLM's
    publisher topic (``None``: unknown here, not checked) and the engine's block sizes.
    Empty without a router.

    Args:
        stores: the built tiers, in ``settings.tiers`` order.
    """
    if settings.router is None:
        return []
    tiers = []
    for tier, store in zip(settings.tiers, stores, strict=True):
        if not tier.enable_kv_events:
            continue  # its events are never published: nothing to drop
        identity = store.identity
        if not tier.announce_ownership:
            identity = TierIdentity(identity.medium, identity.locality, None)
        tiers.append(
            AnnouncedTier(
                published(identity),
                tier.paths.option("medium"),
                tier.paths.option("locality"),
                f"{tier.paths.entry}.kvhex.announce_ownership",
            )
        )
    findings = router_findings(
        RouterTarget.named(
            settings.router, settings.router_block_size, "$.kvhex.router_block_size"
        ),
        tiers,
        int_hashes=int_hashes,
        int_hashes_key=INT_HASHES_VARIABLE,
        int_hashes_value="1",
        topics=[(topic, TOPIC_KEY)] if topic is not None else [],
        block_sizes=block_sizes,
    )
    warn_router_mismatches(findings, source=SOURCE)
    return findings
