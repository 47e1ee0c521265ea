"""vLLM's CPU-manager scenarios (reference §F.2, 1-14), adapted to kvhex's primary tier."""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvhex.domain import (
    ArcPolicy,
    Cleared,
    LookupResult,
    LruPolicy,
    Medium,
    OffloadKey,
    PrimaryTier,
    Removed,
    ReqContext,
    Stored,
)
from tests.domain.conftest import key, keys, make_tier

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def store(tier: PrimaryTier, *ids: int, ctx: ReqContext | None = None) -> list[int]:
    plan = tier.prepare_store(keys(*ids), ctx)
    assert plan is not None
    tier.complete_store(plan.keys, ctx)
    return plan.slots


def key_sets(events: Sequence[object], kind: type) -> list[set[OffloadKey]]:
    return [set(e.keys) for e in events if isinstance(e, kind)]  # type: ignore[attr-defined]


# 1 -----------------------------------------------------------------------------------------
def test_eviction_announced_before_the_store_that_reuses_it(policy_name: str) -> None:
    tier = make_tier(2, policy_name)
    store(tier, 1, 2)
    tier.take_events()
    store(tier, 3)
    events = tier.take_events()
    removed_at = [i for i, e in enumerate(events) if isinstance(e, Removed)]
    stored_at = [i for i, e in enumerate(events) if isinstance(e, Stored)]
    assert removed_at
    assert stored_at
    assert max(removed_at) < min(stored_at)
    assert all(e.tier.medium == Medium.CPU for e in events)  # type: ignore[union-attr]


# 2 -----------------------------------------------------------------------------------------
def test_offered_stored_key_is_never_the_victim(policy_name: str) -> None:
    tier = make_tier(4, policy_name)
    store(tier, 1, 2)
    tier.touch(keys(1))
    plan = tier.prepare_store(keys(2, 3, 4, 5))
    assert plan is not None
    assert plan.keys == keys(3, 4, 5)
    assert plan.slots == [2, 3, 0]
    assert plan.evicted == keys(1)
    tier.complete_store(plan.keys)
    assert tier.lookup(key(2)) is HIT
    assert tier.lookup(key(1)) is MISS


# 3 -----------------------------------------------------------------------------------------
def test_pending_write_reads_hit_pending_and_announces_only_on_completion() -> None:
    tier = make_tier(4)
    ctx = ReqContext("r")
    plan = tier.prepare_store(keys(1, 2), ctx)
    assert plan is not None
    assert tier.lookup(key(1)) is PENDING
    assert tier.take_events() == []
    tier.complete_store(keys(1, 2), ctx)
    events = tier.take_events()
    assert len(events) == 1
    assert isinstance(events[0], Stored)
    assert set(events[0].keys) == set(keys(1, 2))
    assert events[0].ctx is ctx
    assert tier.lookup(key(1)) is HIT


# 4 -----------------------------------------------------------------------------------------
def test_store_without_evictable_capacity_returns_none_and_changes_nothing(
    policy_name: str,
) -> None:
    tier = make_tier(4, policy_name)
    plan = tier.prepare_store(keys(1, 2, 3, 4))  # all four pending
    assert plan is not None
    assert tier.prepare_store(keys(1, 6)) is None
    assert tier.lookup(key(6)) is MISS
    tier.complete_store(keys(1, 2, 3, 4))
    tier.prepare_load(keys(2, 3))
    before = tier.stats()
    assert tier.prepare_store(keys(6, 7, 8)) is None  # only 1 and 4 evictable
    after = tier.stats()
    assert (after.resident, after.evictable, after.pinned) == (
        before.resident,
        before.evictable,
        before.pinned,
    )
    assert [tier.lookup(k) for k in keys(1, 2, 3, 4)] == [HIT] * 4
    assert after.store_allocation_failures == before.store_allocation_failures + 1


# 5 -----------------------------------------------------------------------------------------
def test_prepare_load_returns_slots_co_indexed_with_keys() -> None:
    tier = make_tier(4)
    slots = dict(zip(keys(1, 2, 3), store(tier, 1, 2, 3), strict=True))
    assert tier.prepare_load(keys(2, 3)) == [1, 2]
    for order in ([3, 1, 2], [2, 1], [1]):
        assert tier.prepare_load(keys(*order)) == [slots[k] for k in keys(*order)]


# 6 -----------------------------------------------------------------------------------------
def test_loads_pin_until_complete_then_lru_order_decides() -> None:
    tier = make_tier(4)
    store(tier, 1, 2, 3, 4)
    tier.prepare_load(keys(1, 2))
    plan = tier.prepare_store(keys(5, 6))
    assert plan is not None
    assert plan.evicted == keys(3, 4)  # 1 and 2 pinned although older
    tier.complete_store(plan.keys)
    tier.complete_load(keys(1, 2))
    plan = tier.prepare_store(keys(7))
    assert plan is not None
    assert plan.evicted == keys(1)  # unpinned, and still the oldest
    tier.complete_store(plan.keys)
    # resident, oldest first: 2, 5, 6, 7
    store_plan = tier.prepare_store(keys(8))
    assert store_plan is not None
    assert store_plan.evicted == keys(2)
    tier.complete_store(keys(8))
    tier.touch(keys(5, 6, 7))
    plan = tier.prepare_store(keys(9))
    assert plan is not None
    assert plan.evicted == keys(8)


# 7 -----------------------------------------------------------------------------------------
def test_failed_store_frees_only_pending_keys_and_announces_nothing() -> None:
    tier = make_tier(4)
    store(tier, 1, 2, 3)
    plan = tier.prepare_store(keys(3, 4, 5))
    assert plan is not None
    tier.complete_store(plan.keys)
    plan = tier.prepare_store(keys(6, 7, 8))
    assert plan is not None
    assert plan.evicted == keys(2, 3, 4)
    tier.complete_store(keys(6, 7, 8))
    plan = tier.prepare_store(keys(9))
    assert plan is not None
    tier.complete_store(keys(7, 9), success=False)
    assert tier.lookup(key(7)) is HIT
    assert tier.lookup(key(9)) is MISS
    events = tier.take_events()
    assert key_sets(events, Stored) == [
        {key(1), key(2), key(3)},
        {key(4), key(5)},
        set(keys(6, 7, 8)),
    ]
    assert key_sets(events, Removed) == [{key(1)}, set(keys(2, 3, 4)), {key(5)}]
    assert tier.stats().stores_failed == 1


# 8, 9 --------------------------------------------------------------------------------------
def test_zero_capacity_tier_reports_zero_usage_and_stores_nothing() -> None:
    tier = make_tier(0)
    assert tier.stats().usage == 0.0
    assert tier.prepare_store(keys(1)) is None
    assert tier.lookup(key(1)) is MISS


def test_usage_counts_pending_and_pinned_slots_split_by_direction() -> None:
    tier = make_tier(4)
    plan = tier.prepare_store(keys(1, 2))
    assert plan is not None
    s = tier.stats()
    assert (s.usage, s.write_usage, s.read_usage) == (0.5, 0.5, 0.0)
    tier.prepare_store(keys(3, 4))
    assert tier.stats().usage == 1.0
    tier.complete_store(keys(1, 2))
    s = tier.stats()
    assert (s.usage, s.write_usage, s.read_usage) == (0.5, 0.5, 0.0)
    tier.prepare_load(keys(1))
    s = tier.stats()
    assert (s.usage, s.write_usage, s.read_usage) == (0.75, 0.5, 0.25)
    tier.complete_store(keys(3, 4), success=False)
    s = tier.stats()
    assert (s.usage, s.write_usage, s.read_usage) == (0.25, 0.0, 0.25)


# 10 ----------------------------------------------------------------------------------------
def test_allocation_size_histogram_counts_each_prepare_with_candidates() -> None:
    tier = make_tier(2)
    tier.prepare_store(keys(1, 2))
    tier.prepare_store(keys(1))  # nothing new: no sample
    assert tier.prepare_store(keys(3, 4, 5)) is None  # fails, still sampled
    assert tier.stats().allocation_sizes == {2: 1, 3: 1}


# 11 ----------------------------------------------------------------------------------------
def test_store_threshold_admits_on_the_second_offer() -> None:
    tier = make_tier(8, store_threshold=2, max_tracker_size=3)
    plan = tier.prepare_store(keys(1, 2, 3))
    assert plan is not None
    assert plan.keys == []
    assert tier.stats().stores_skipped == 3
    assert tier.lookup(key(1)) is MISS  # lookups do not count as offers
    plan = tier.prepare_store(keys(1, 2))
    assert plan is not None
    assert plan.keys == keys(1, 2)
    assert tier.stats().stores_skipped == 3
    tier.prepare_store(keys(4))  # tracker full: 3 is its oldest entry and ages out
    plan = tier.prepare_store(keys(3))
    assert plan is not None
    assert plan.keys == []  # restarted at one
    plan = tier.prepare_store(keys(3))
    assert plan is not None
    assert plan.keys == keys(3)


# 12 ----------------------------------------------------------------------------------------
class NoEvictPolicy(LruPolicy):
    """Fails loudly if asked to evict: the tier must short-circuit before that."""

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        raise AssertionError("evict must not be called when nothing is evictable")


def test_evictable_count_bookkeeping() -> None:
    tier = PrimaryTier(3, NoEvictPolicy(3))
    plan = tier.prepare_store(keys(1, 2, 3))
    assert plan is not None
    assert tier.stats().evictable == 0
    assert tier.prepare_store(keys(4)) is None  # nothing evictable: no policy call
    tier.complete_store(keys(1, 2, 3))
    assert tier.stats().evictable == 3
    tier.prepare_load(keys(1))
    tier.prepare_load(keys(1))  # a second reader of the same key: one decrement
    assert tier.stats().evictable == 2
    tier.complete_load(keys(1))
    assert tier.stats().evictable == 2
    tier.complete_load(keys(1))
    assert tier.stats().evictable == 3
    tier.reset()
    assert tier.stats().evictable == 0


def test_evictable_count_follows_evictions_and_failures() -> None:
    tier = make_tier(2)
    store(tier, 1, 2)
    plan = tier.prepare_store(keys(3))
    assert plan is not None
    assert tier.stats().evictable == 1
    tier.complete_store(keys(3), success=False)
    s = tier.stats()
    assert (s.evictable, s.resident, s.pending) == (1, 1, 0)


# 13 ----------------------------------------------------------------------------------------
class CtxRecordingPolicy(LruPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.seen: list[ReqContext | None] = []

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        self.seen.append(ctx)
        super().touch(keys, ctx)


def test_touch_forwards_the_exact_request_context() -> None:
    policy = CtxRecordingPolicy(2)
    tier = PrimaryTier(2, policy)
    ctx = ReqContext("r")
    tier.touch(keys(1), ctx)
    assert policy.seen[0] is ctx


# 14 ----------------------------------------------------------------------------------------
def test_arc_new_keys_land_in_t1_and_a_touch_of_a_ready_key_moves_it_to_t2() -> None:
    policy = ArcPolicy(4)
    tier = PrimaryTier(4, policy)
    tier.prepare_store(keys(1, 2))
    tier.touch(keys(1))  # pending: stays in T1
    assert policy.t1 == (key(2), key(1))
    tier.complete_store(keys(1, 2))
    tier.touch(keys(1))
    assert policy.t1 == (key(2),)
    assert policy.t2 == (key(1),)


def test_arc_ghost_hit_raises_target_and_t1_lru_goes_to_b1() -> None:
    policy = ArcPolicy(2)
    tier = PrimaryTier(2, policy)
    store(tier, 1, 2)
    plan = tier.prepare_store(keys(3))
    assert plan is not None
    assert plan.evicted == keys(1)
    assert policy.b1 == (key(1),)
    tier.complete_store(keys(3))
    tier.touch(keys(1))  # B1 ghost hit
    assert policy.target_t1_size == 1.0


def test_arc_batch_eviction_preserves_order_and_falls_back_to_t2() -> None:
    policy = ArcPolicy(4)
    tier = PrimaryTier(4, policy)
    store(tier, 1, 2, 3, 4)
    tier.touch(keys(3, 4))  # T2: 4, 3 (3 most recent); T1: 1, 2
    policy.target_t1_size = 3.0  # prefer T2 while |T1| < 3
    plan = tier.prepare_store(keys(5, 6, 7))
    assert plan is not None
    assert plan.evicted == keys(4, 3, 1)  # T2 in order, then back to T1
    assert policy.b2 == (key(4), key(3))
    assert policy.b1 == (key(1),)


def test_arc_pinned_keys_survive_and_failed_batch_changes_nothing() -> None:
    policy = ArcPolicy(3)
    tier = PrimaryTier(3, policy)
    store(tier, 1, 2, 3)
    tier.prepare_load(keys(1, 2))
    snapshot = (policy.t1, policy.t2, policy.b1, policy.b2)
    assert tier.prepare_store(keys(4, 5)) is None
    assert (policy.t1, policy.t2, policy.b1, policy.b2) == snapshot
    plan = tier.prepare_store(keys(4))
    assert plan is not None
    assert plan.evicted == keys(3)


def test_arc_failed_store_leaves_key_out_while_victim_stays_a_ghost() -> None:
    policy = ArcPolicy(2)
    tier = PrimaryTier(2, policy)
    store(tier, 1, 2)
    plan = tier.prepare_store(keys(3))
    assert plan is not None
    tier.complete_store(keys(3), success=False)
    assert key(3) not in policy.t1 + policy.t2
    assert policy.b1 == (key(1),)


def test_arc_ghost_lists_never_exceed_capacity() -> None:
    policy = ArcPolicy(2)
    tier = PrimaryTier(2, policy)
    for i in range(0, 20, 2):
        store(tier, i, i + 1)
        assert len(policy.b1) <= 2
        assert len(policy.b2) <= 2


# reset and bad input -----------------------------------------------------------------------
def test_reset_clears_announces_and_keeps_untaken_events() -> None:
    tier = make_tier(2)
    store(tier, 1)
    tier.reset()
    events = tier.take_events()
    assert [type(e) for e in events] == [Stored, Cleared]
    assert tier.lookup(key(1)) is MISS
    assert store(tier, 2, 3) == [0, 1]


def test_completing_a_store_twice_is_a_no_op() -> None:
    tier = make_tier(2)
    store(tier, 1)
    tier.complete_store(keys(1))
    tier.complete_store(keys(1), success=False)
    assert tier.lookup(key(1)) is HIT
    assert len(tier.take_events()) == 1
    assert tier.stats().evictable == 1


def test_duplicate_offered_keys_take_one_slot() -> None:
    tier = make_tier(2)
    plan = tier.prepare_store(keys(1, 1, 2))
    assert plan is not None
    assert plan.keys == keys(1, 2)
    assert plan.slots == [0, 1]
