from __future__ import annotations

import pytest

from kvhex.domain import LookupResult, PrimaryTier
from kvhex.errors import InvalidKeyError, StateError
from tests.domain.conftest import key, keys, make_tier


@pytest.mark.parametrize("bad", [-1, 2.5, True, None])
def test_bad_slot_counts_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="num_slots"):
        make_tier(bad)  # type: ignore[arg-type]


def test_new_keys_must_be_bytes_of_the_tier_length() -> None:
    tier = make_tier(4)
    with pytest.raises(InvalidKeyError, match="expected bytes, got str"):
        tier.prepare_store(["abc"])  # type: ignore[list-item]
    tier.prepare_store(keys(1))  # fixes the length at 36
    with pytest.raises(InvalidKeyError, match="expected 36 bytes, got 20"):
        tier.prepare_store([b"x" * 20])  # type: ignore[list-item]
    assert len(tier) == 1


def test_configured_key_length_is_enforced_from_the_start() -> None:
    tier = make_tier(4, key_length=12)
    with pytest.raises(InvalidKeyError, match="expected 12 bytes, got 36"):
        tier.prepare_store(keys(1))
    with pytest.raises(InvalidKeyError, match="shorter"):
        make_tier(4, key_length=3)


def test_bad_key_in_a_batch_stores_nothing() -> None:
    tier = make_tier(4)
    with pytest.raises(InvalidKeyError):
        tier.prepare_store([key(1), b"short"])  # type: ignore[list-item]
    assert len(tier) == 0
    assert tier.stats().pending == 0


def test_lookup_of_a_never_storable_key_is_a_miss_and_unhashable_is_typed() -> None:
    tier = make_tier(4)
    assert tier.lookup("nonsense") is LookupResult.MISS  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError, match="unhashable"):
        tier.lookup([1, 2])  # type: ignore[arg-type]


def test_prepare_load_of_absent_or_pending_keys_is_refused_atomically() -> None:
    tier = make_tier(4)
    plan = tier.prepare_store(keys(1, 2))
    assert plan is not None
    tier.complete_store(keys(1))
    with pytest.raises(StateError, match="write pending"):
        tier.prepare_load(keys(1, 2))
    with pytest.raises(StateError, match="not stored"):
        tier.prepare_load(keys(1, 9))
    assert tier.ref_count(key(1)) == 0
    with pytest.raises(InvalidKeyError):
        tier.prepare_load(["x"])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError, match="unhashable"):
        tier.prepare_load([[1]])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError, match="expected bytes, got list"):
        tier.prepare_store([[1]])  # type: ignore[list-item]


def test_complete_load_of_unpinned_key_is_refused_atomically() -> None:
    tier = make_tier(4)
    plan = tier.prepare_store(keys(1, 2))
    assert plan is not None
    tier.complete_store(keys(1, 2))
    tier.prepare_load(keys(1))
    with pytest.raises(StateError, match="not pinned"):
        tier.complete_load(keys(1, 2))
    assert tier.ref_count(key(1)) == 1  # the unpin of 1 was rolled back
    with pytest.raises(StateError, match="not pinned"):
        tier.complete_load(keys(1, 1))  # pinned once, listed twice
    assert tier.ref_count(key(1)) == 1
    with pytest.raises(StateError, match="not stored"):
        tier.complete_load(keys(7))
    tier.complete_load(keys(1))
    assert tier.ref_count(key(1)) == 0
    assert isinstance(StateError("x", b"k", "y"), RuntimeError)


def test_policy_ignores_nothing_it_was_not_told(policy_name: str) -> None:
    tier = make_tier(1, policy_name)
    plan = tier.prepare_store(keys(1))
    assert plan is not None
    tier.complete_store(keys(1))
    tier.prepare_load(keys(1))
    tier.prepare_load(keys(1))
    tier.complete_load(keys(1, 1))
    plan = tier.prepare_store(keys(2))
    assert plan is not None
    assert plan.evicted == keys(1)
    assert isinstance(tier, PrimaryTier)
