"""Start-up warnings: where a configuration contradicts the KV-aware router it serves.

A configuration may name the router that reads its events (TOML ``[events] router``, vLLM's
``kvhex.router``). Once the tiers are built (their identities exact, plugin defaults
included), every setting whose events that router would silently drop or miscredit is logged
as one ``router_config_mismatch`` warning per finding, with the key to change and the fix: a
tier's medium, locality or ``announce_ownership``, bytes hashes, a ZMQ topic, a block size.
The facts and their wording are :mod:`kvhex.domain.routers`' (the same ``kvhex events
--router`` reports from a stream). Nothing is refused: the router may be configured in ways
kvhex cannot see, and serving goes on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import structlog

from kvhex.config.model import KvhexConfig
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.routers import (
    PROFILES,
    Finding,
    RouterProfile,
    check_block_size,
    check_hash_form,
    check_residency,
    check_topic,
)
from kvhex.domain.tiers import TierIdentity

log = structlog.get_logger(__name__)


@attrs.frozen
class AnnouncedTier:
    """A tier as a router reads its events, and the keys that set what it announces.

    Attributes:
        identity: medium, locality and ownership as published (the ownership only where the
            tier announces it).
        medium_key, locality_key, ownership_key: where each is set in the configuration.
    """

    identity: TierIdentity
    medium_key: str
    locality_key: str
    ownership_key: str


@attrs.frozen
class RouterTarget:
    """The router a configuration serves: its profile, the block size it reads if the
    configuration says (``None``: its default), and the key that says it."""

    profile: RouterProfile
    block_size: int | None
    block_size_key: str

    @classmethod
    def named(cls, name: str, block_size: int | None, block_size_key: str) -> RouterTarget:
        """The target for the router ``name`` (a key of ``PROFILES``, checked by the
        configuration model)."""
        return cls(PROFILES[name], block_size, block_size_key)


def router_findings(
    router: RouterTarget,
    tiers: Iterable[AnnouncedTier],
    *,
    int_hashes: bool,
    int_hashes_key: str,
    int_hashes_value: str = "true",
    topics: Iterable[tuple[str, str]] = (),
    block_sizes: Iterable[int] = (),
) -> list[Finding]:
    """Everything ``router`` would drop or miscredit of what this configuration publishes.

    Args:
        tiers: the announced secondary tiers (the host tier announces ``CPU``, which every
            known router credits).
        int_hashes: block hashes are published as ints; else (bytes) ``int_hashes_key`` =
            ``int_hashes_value`` is the fix.
        topics: each ZMQ topic the events go out under, with the key that sets it.
        block_sizes: the block sizes the events carry (each KV group's).
    """
    profile = router.profile
    found: list[Finding] = []
    for tier in tiers:
        identity = tier.identity
        found += [
            f
            for f in check_residency(
                profile,
                identity.medium.name,
                identity.locality.value if identity.locality is not None else None,
                identity.ownership,
                medium_key=tier.medium_key,
                locality_key=tier.locality_key,
                ownership_key=tier.ownership_key,
            )
            if f.mismatch
        ]
    if not int_hashes:
        hashes = check_hash_form(profile, key=int_hashes_key, value=int_hashes_value)
        found += [hashes] if hashes is not None else []
    for topic, key in topics:
        dropped = check_topic(profile, topic, key=key)
        found += [dropped] if dropped is not None else []
    expected = router.block_size or profile.default_block_size
    if expected is not None:
        told = (
            router.block_size_key
            if router.block_size is not None
            else f"{profile.block_size_setting} default; {router.block_size_key} not set"
        )
        for size in sorted(set(block_sizes)):
            other = check_block_size(profile, size, expected, key=router.block_size_key, told=told)
            found += [other] if other is not None else []
    return found


def warn_router_mismatches(findings: Sequence[Finding], *, source: str | None = None) -> None:
    """Log one ``router_config_mismatch`` warning per finding."""
    for finding in findings:
        log.warning(
            "router_config_mismatch",
            router=finding.router,
            rule=finding.rule.value,
            effect=finding.effect.value,
            key=finding.key,
            fix=finding.fix,
            finding=finding.line(),
            source=source,
        )


def config_findings(
    config: KvhexConfig,
    identities: Sequence[TierIdentity],
    geometry: KvGeometry | None,
) -> list[Finding]:
    """What ``config``'s router (``[events] router``) would drop or miscredit of what it
    publishes; ``identities`` are its built tiers' (in ``[[tiers]]`` order), ``geometry``
    the engine's KV groups (their block sizes). Empty without a router."""
    events = config.events
    if events.router is None:
        return []
    tiers = [
        AnnouncedTier(
            identity if tier.announce_ownership else attrs.evolve(identity, ownership=None),
            f"$.tiers[{i}].options.medium",
            f"$.tiers[{i}].options.locality",
            f"$.tiers[{i}].announce_ownership",
        )
        for i, (tier, identity) in enumerate(zip(config.tiers, identities, strict=True))
    ]
    return router_findings(
        RouterTarget.named(events.router, events.router_block_size, "$.events.router_block_size"),
        tiers,
        int_hashes=events.int_block_hashes,
        int_hashes_key="$.events.int_block_hashes",
        topics=_topics((f"$.sinks[{i}].options", s.options) for i, s in enumerate(config.sinks)),
        block_sizes=[g.tokens_per_block for g in geometry.groups] if geometry else (),
    )


def _topics(sinks: Iterable[tuple[str, Mapping[str, object]]]) -> list[tuple[str, str]]:
    return [
        (topic, f"{path}.topic")
        for path, options in sinks
        if isinstance(topic := options.get("topic"), str)
    ]
