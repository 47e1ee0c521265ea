"""Domain tests: pure, fast, no heavy packages."""

from __future__ import annotations

import pytest

from kvhex.domain import LruPolicy, OffloadKey, PrimaryTier, make_offload_key
from kvhex.domain.policies import ArcPolicy


def key(i: int, group: int = 0) -> OffloadKey:
    """Key for chunk ``i``: a 32-byte hash (like sha256) plus the group index."""
    return make_offload_key(i.to_bytes(32, "big"), group)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


@pytest.fixture(params=["lru", "arc"])
def policy_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_tier(num_slots: int, policy: str = "lru", **kwargs: object) -> PrimaryTier:
    factory = {"lru": LruPolicy, "arc": ArcPolicy}[policy]
    return PrimaryTier(num_slots, factory(num_slots), **kwargs)  # type: ignore[arg-type]
