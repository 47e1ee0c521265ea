from __future__ import annotations

import gc
import weakref

import attrs
import pytest

from kvhex.domain import (
    Cleared,
    Locality,
    LookupResult,
    Medium,
    Removed,
    ReqContext,
    Stored,
    TierFilter,
    TierIdentity,
    TierMatcher,
)
from tests.domain.conftest import key


def test_lookup_result_has_exactly_four_outcomes() -> None:
    assert {r.name for r in LookupResult} == {"MISS", "HIT", "HIT_PENDING", "RETRY"}


def test_medium_vocabulary_is_vllms_and_open() -> None:
    assert (Medium.CPU.name, Medium.STORAGE.name, Medium.GPU.name) == ("CPU", "STORAGE", "GPU")
    assert Medium("SHARED_STORAGE") == Medium("SHARED_STORAGE")
    assert str(Medium("DISK")) == "DISK"
    for bad in ("cpu", "", "A B", "1X", 5):
        with pytest.raises((ValueError, TypeError)):
            Medium(bad)  # type: ignore[arg-type]


def test_matcher_unset_dimensions_match() -> None:
    m = TierMatcher(medium=Medium.STORAGE)
    assert m.matches(Medium.STORAGE, Locality.LOCAL)
    assert m.matches(Medium.STORAGE, None)
    assert m.matches(None, Locality.REMOTE)
    assert not m.matches(Medium.CPU, None)
    local = TierMatcher(locality=Locality.LOCAL)
    assert local.matches(Medium.STORAGE, Locality.LOCAL)
    assert not local.matches(Medium.STORAGE, Locality.REMOTE)


def test_tier_filter_all_none_and_any() -> None:
    assert TierFilter.ALL.allows(Medium.STORAGE, Locality.REMOTE)
    assert TierFilter.ALL.allows(None, None)
    assert not TierFilter(()).allows(Medium.STORAGE, Locality.LOCAL)
    either = TierFilter(
        (TierMatcher(Medium.STORAGE, Locality.LOCAL), TierMatcher(Medium("DISK"), None))
    )
    assert either.allows(Medium.STORAGE, Locality.LOCAL)
    assert either.allows(Medium("DISK"), Locality.REMOTE)
    assert not either.allows(Medium.STORAGE, Locality.REMOTE)


def test_req_context_compares_by_identity() -> None:
    a, b = ReqContext("req-1"), ReqContext("req-1")
    assert a != b
    assert a == a  # noqa: PLR0124
    assert len({a, b}) == 2
    assert a.tier_filter is TierFilter.ALL


def test_req_context_records_positions_and_is_weakly_referenceable() -> None:
    ctx = ReqContext("r", transfer_params={"kv_load_tiers": []})
    ctx.record_position(key(1), 256)
    assert ctx.position(key(1)) == 256
    assert ctx.position(key(2)) is None
    assert ctx.recorded_keys == 1
    ref = weakref.ref(ctx)
    del ctx
    gc.collect()
    assert ref() is None


def test_req_context_rejects_non_string_id() -> None:
    with pytest.raises(TypeError):
        ReqContext(42)  # type: ignore[arg-type]


def test_raw_events_are_frozen_values() -> None:
    tier = TierIdentity(Medium.STORAGE, Locality.LOCAL, "files")
    ctx = ReqContext("r")
    stored = Stored((key(1),), tier, ctx)
    assert stored.ctx is ctx
    assert Removed((key(1),), tier) == Removed((key(1),), tier)
    assert Cleared(tier).tier.ownership == "files"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stored.keys = ()  # type: ignore[misc]
