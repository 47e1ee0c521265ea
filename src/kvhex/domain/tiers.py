"""Where a tier lives: its medium and locality, and the per-request filter over them.

``Medium`` is an open vocabulary: vLLM's names (``CPU``, ``STORAGE``, ``GPU``) are provided as
constants, and a tier may announce another (``SHARED_STORAGE`` for llm-d, ``DISK``) because
consumers differ in what they expect. ``Locality`` says whether storage is local to the
publishing engine instance, remote, or shared by every instance of a pool; ``None`` means
unspecified and is never inferred.
"""

from __future__ import annotations

import enum
import re
from typing import ClassVar

import attrs

_MEDIUM_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


def _check_medium_name(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _MEDIUM_NAME.fullmatch(value):
        raise ValueError(
            f"{attribute.name} must be an upper-case identifier such as 'CPU' or "
            f"'SHARED_STORAGE', got {value!r}"
        )


@attrs.frozen(slots=True)
class Medium:
    """A storage medium as announced in KV events (``BlockStored.medium``)."""

    name: str = attrs.field(validator=_check_medium_name)

    GPU: ClassVar[Medium]
    CPU: ClassVar[Medium]
    STORAGE: ClassVar[Medium]

    def __str__(self) -> str:
        return self.name


Medium.GPU = Medium("GPU")
Medium.CPU = Medium("CPU")
Medium.STORAGE = Medium("STORAGE")


class Locality(enum.Enum):
    """Placement of a tier's storage relative to the publishing engine instance."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"
    SHARED = "SHARED"
    """Storage every instance of a pool reads (a shared root or bucket). Not one of vLLM's
    localities, and Dynamo's indexer credits only ``LOCAL`` (or none): see docs/tiers.md."""


class LookupResult(enum.Enum):
    """Answer to "is this chunk offloaded and readable?"."""

    MISS = "miss"
    """Not present (as far as this tier knows)."""
    HIT = "hit"
    """Present and readable now."""
    HIT_PENDING = "hit_pending"
    """Present but not readable yet: its write or promotion is still in flight."""
    RETRY = "retry"
    """Unknown yet (an existence probe is in flight); ask again on a later step."""


class OffloadPolicy(enum.Enum):
    """Which chunks of a request are offered for offloading (vLLM's names)."""

    CHUNK_LEVEL = "chunk_level"
    """Only newly computed chunks (prefix hits are skipped)."""
    REQUEST_LEVEL = "request_level"
    """Every chunk, prefix hits included: some tier needs the complete context."""


@attrs.frozen(slots=True, cache_hash=True)  # a dict key on every step's events
class TierIdentity:
    """What a tier announces about itself in every event: medium, locality, ownership.

    ``ownership`` names the tier instance that owns the residency (``None`` for the host
    primary tier), so two tiers holding the same key are two independent residencies.
    """

    medium: Medium
    locality: Locality | None = None
    ownership: str | None = None


@attrs.frozen(slots=True)
class TierMatcher:
    """Matches tiers on medium and locality; an unset dimension (here or on the tier) matches."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | None, locality: Locality | None) -> bool:
        """True when each dimension is unset on either side, or equal."""
        return (self.medium is None or medium is None or self.medium == medium) and (
            self.locality is None or locality is None or self.locality == locality
        )


@attrs.frozen(slots=True)
class TierFilter:
    """Which secondary tiers a request may load from. The primary tier is never filtered.

    ``TierFilter.ALL`` allows every tier; ``TierFilter(())`` allows none; otherwise a tier is
    allowed when any matcher matches it.
    """

    matchers: tuple[TierMatcher, ...] = ()

    ALL: ClassVar[TierFilter]

    def allows(self, medium: Medium | None, locality: Locality | None) -> bool:
        """True when some matcher matches ``(medium, locality)``."""
        return any(m.matches(medium, locality) for m in self.matchers)


TierFilter.ALL = TierFilter((TierMatcher(),))
