"""vLLM's tiering-manager scenarios (reference §F.3, 15-28 and 36-37), adapted to kvhex."""

from __future__ import annotations

from kvhex.domain import (
    Cleared,
    JobKind,
    LookupResult,
    LruPolicy,
    Medium,
    PrimaryTier,
    Removed,
    ReqContext,
    Stored,
    TierFilter,
    TierMatcher,
)
from kvhex.service import TieringManager
from tests.service.harness import World, key, keys, payload

HIT, MISS = LookupResult.HIT, LookupResult.MISS
PENDING, RETRY = LookupResult.HIT_PENDING, LookupResult.RETRY


def secondary_only(world: World, ids: list[int]) -> None:
    """Put ``ids`` into every secondary tier, then empty the host tier."""
    world.store(ids, ReqContext("seed"))
    world.step(2)
    world.manager.reset()
    world.manager.take_events()


def test_events_come_primary_first_then_each_tier_in_order() -> None:
    world = World()
    ctx = ReqContext("r")
    world.store([1], ctx)
    world.step()
    world.lookup([9], ctx)  # next step's first call polls the cascades
    events = world.manager.take_events()
    owners = [e.tier.ownership for e in events]  # type: ignore[union-attr]
    assert owners == [None, "mem0", "mem1"]
    assert all(isinstance(e, Stored) and e.keys == (key(1),) for e in events)
    assert world.manager.take_events() == []


def test_a_completed_store_cascades_to_every_tier() -> None:
    world = World()
    world.store([1, 2], ReqContext("r"))
    world.step()
    world.lookup([9], ReqContext("x"))
    for tier in world.tiers:
        assert set(tier.keys()) == set(keys(1, 2))
        assert tier.block(key(1)) == payload(key(1))
    assert [t.puts_ok for t in world.manager.stats().tiers] == [1, 1]


def test_slots_stay_pinned_once_per_tier_until_the_next_steps_poll() -> None:
    world = World()
    ctx = ReqContext("r")
    world.lookup([9], ctx)  # this step's poll happened
    world.store([1], ctx)
    assert world.primary.ref_count(key(1)) == 2
    world.step()  # already polled this step: no second poll
    assert world.primary.ref_count(key(1)) == 2
    world.lookup([9], ctx)
    assert world.primary.ref_count(key(1)) == 0


def test_secondary_only_keys_are_probed_promoted_and_then_hit() -> None:
    world = World()
    secondary_only(world, [1, 2])
    ctx = ReqContext("r")
    assert world.lookup([1, 2], ctx) == [RETRY, RETRY]
    world.step()  # probe submitted
    assert world.lookup([1, 2], ctx) == [PENDING, PENDING]  # probe answered, slots reserved
    assert world.manager.stats().tiers[0].gets_submitted == 0  # deferred to step end
    world.step()  # one get per (tier, request)
    assert world.lookup([1, 2], ctx) == [HIT, HIT]
    assert world.host_bytes(key(1)) == payload(key(1))
    assert world.host_bytes(key(2)) == payload(key(2))
    stored = [e for e in world.manager.take_events() if isinstance(e, Stored)]
    assert [(e.tier.medium, e.keys, e.ctx) for e in stored] == [(Medium.CPU, (key(1), key(2)), ctx)]


def _promote(world: World, ids: list[int], ctx: ReqContext) -> list[LookupResult]:
    world.lookup(ids, ctx)
    world.step()
    assert world.lookup(ids, ctx) == [PENDING] * len(ids)
    world.step()
    return world.lookup(ids, ctx)


def test_partial_promotion_keeps_loaded_keys_and_drops_the_rest() -> None:
    world = World(tiers=1)
    secondary_only(world, [0, 1, 2])
    world.tiers[0].partial_next_get(keys(0, 2))
    assert _promote(world, [0, 1, 2], ReqContext("r")) == [HIT, MISS, HIT]
    assert world.manager.stats().tiers[0].keys_failed_to_promote == 1


def test_failed_promotion_without_partial_success_loses_every_key() -> None:
    world = World(tiers=1)
    secondary_only(world, [0, 1])
    world.tiers[0].fail_next_gets()
    assert _promote(world, [0, 1], ReqContext("r")) == [MISS, MISS]
    assert len(world.primary) == 0
    assert world.manager.take_events() == []  # a failed promotion announces nothing


def test_a_failed_load_is_never_re_promoted_in_a_loop() -> None:
    world = World(tiers=1)
    secondary_only(world, [0])
    world.tiers[0].fail_next_gets()
    ctx = ReqContext("r")
    assert _promote(world, [0], ctx) == [MISS]
    for _ in range(3):
        world.step()
        assert world.lookup([0], ctx) == [MISS]
    assert world.manager.stats().tiers[0].gets_submitted == 1


def test_a_partial_prefix_hits_only_what_was_stored() -> None:
    world = World()
    ctx = ReqContext("r")
    world.store([1, 2, 3], ctx)
    assert world.lookup([1, 2, 3, 4, 5], ctx) == [HIT, HIT, HIT, RETRY, RETRY]


def test_host_eviction_works_once_cascades_released_their_pins() -> None:
    world = World(num_slots=5)
    ctx = ReqContext("r")
    world.store([1, 2, 3, 4, 5], ctx)
    assert world.manager.prepare_store(keys(6, 7), ctx) is None  # all pinned by cascades
    world.step()
    world.lookup([99], ctx)  # polls: cascades done, pins released
    plan = world.manager.prepare_store(keys(6, 7), ctx)
    assert plan is not None
    assert plan.evicted == keys(1, 2)
    removed = [e for e in world.manager.take_events() if isinstance(e, Removed)]
    assert [e.keys for e in removed] == [(key(1), key(2))]


def test_a_failed_device_store_never_cascades() -> None:
    world = World()
    world.store([1], ReqContext("r"), success=False)
    world.step(2)
    assert all(t.puts_submitted == 0 for t in world.manager.stats().tiers)
    world.store([2], ReqContext("r"))
    assert all(t.puts_submitted == 1 for t in world.manager.stats().tiers)
    assert all(t.keys() == [] for t in world.tiers)


def test_promotions_are_one_get_per_request_carrying_its_context() -> None:
    world = World(tiers=1)
    secondary_only(world, [1, 2, 3])
    a, b = ReqContext("a"), ReqContext("b")
    world.lookup([1, 2], a)
    world.lookup([3], b)
    world.step()
    world.lookup([1, 2], a)
    world.lookup([3], b)
    world.step()
    world.lookup([9], a)
    assert world.manager.stats().tiers[0].gets_submitted == 2
    stored = {e.keys: e.ctx for e in world.manager.take_events() if isinstance(e, Stored)}
    assert stored == {(key(1), key(2)): a, (key(3),): b}


def test_a_key_two_requests_want_is_promoted_once_for_the_first() -> None:
    world = World(tiers=1)
    secondary_only(world, [1])
    a, b = ReqContext("same-id"), ReqContext("same-id")
    world.lookup([1], a)
    world.lookup([1], b)
    world.step()
    assert world.lookup([1], a) == [PENDING]
    assert world.lookup([1], b) == [PENDING]  # sees the reserved slot
    world.step()
    assert world.lookup([1], b) == [HIT]
    stored = [e for e in world.manager.take_events() if isinstance(e, Stored)]
    assert len(stored) == 1
    assert stored[0].ctx is a


def test_cascades_carry_the_exact_request_context() -> None:
    world = World()
    ctx = ReqContext("r")
    world.store([1], ctx)
    world.step()
    world.lookup([9], ReqContext("other"))
    tier_events = [e for e in world.manager.take_events() if e.tier.ownership]  # type: ignore[union-attr]
    assert len(tier_events) == 2
    assert all(isinstance(e, Stored) and e.ctx is ctx for e in tier_events)


def test_tier_filter_excludes_tiers_without_asking_them() -> None:
    world = World()
    secondary_only(world, [1])
    world.store([2], ReqContext("w"))
    only_cpu = ReqContext("r", tier_filter=TierFilter((TierMatcher(medium=Medium.CPU),)))
    nothing = ReqContext("n", tier_filter=TierFilter(()))
    for ctx in (only_cpu, nothing):
        assert world.lookup([1, 2], ctx) == [MISS, HIT]
    world.step()
    assert all(t.probes_submitted == 0 for t in world.manager.stats().tiers)
    storage = ReqContext("s", tier_filter=TierFilter((TierMatcher(medium=Medium.STORAGE),)))
    assert world.lookup([1], storage) == [RETRY]


def test_works_with_no_secondary_tier() -> None:
    primary = PrimaryTier(4, LruPolicy(4))
    manager = TieringManager(primary)
    ctx = ReqContext("r")
    assert manager.lookup(key(1), ctx) is MISS
    plan = manager.prepare_store(keys(1), ctx)
    assert plan is not None
    manager.complete_store(plan.keys, ctx)
    manager.on_schedule_end()
    assert manager.lookup(key(1), ctx) is HIT
    assert not manager.has_pending_work()
    manager.reset()
    assert [type(e) for e in manager.take_events()] == [Stored, Cleared]
    manager.shutdown()


def test_job_kinds_cover_cascade_promotion_and_probe() -> None:
    assert {k.value for k in JobKind} == {"put", "get", "probe"}


def test_a_promotion_never_evicts_a_chunk_answered_hit_in_the_same_step() -> None:
    world = World(num_slots=2, tiers=1)
    secondary_only(world, [5])
    ctx = ReqContext("r")
    world.store([1, 2], ctx)
    world.step()
    world.lookup([99], ctx)  # cascades done: 1 and 2 evictable
    assert world.lookup([5], ctx) == [RETRY]
    world.step()
    assert world.lookup([1, 2, 5], ctx) == [HIT, HIT, MISS]  # no slot may be taken from 1, 2
    assert world.manager.prepare_load(keys(1, 2), ctx) == [0, 1]
    world.manager.complete_load(keys(1, 2), ctx)
    world.step()
    assert world.lookup([5], ctx) == [PENDING]  # next step the LRU chunk may go
