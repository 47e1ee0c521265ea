"""Load or recompute, through the tiering manager's lookups: scans, plans at step end, the
answers that follow, counters; with costs measured from real gets or given."""

from __future__ import annotations

from kvhex.domain import LookupResult, LruPolicy, PrimaryTier, ReqContext
from kvhex.domain.cost import LoadMode, PrefillRate
from kvhex.service import TieringManager
from kvhex.service.loading import LoadDecider
from tests.service.harness import SLOT_BYTES, World, key, keys

HIT, MISS, PENDING, RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)
TOKENS = 16.0  # tokens a key saves
RATE = 1000.0  # prefill tokens per second: a key recomputes in 16 ms


def _decider(mode: LoadMode, **kwargs: object) -> LoadDecider:
    return LoadDecider(
        mode,
        prefill=PrefillRate(configured=RATE),
        tokens_per_key=TOKENS,
        **kwargs,  # type: ignore[arg-type]
    )


def _world(
    mode: LoadMode, tiers: int = 1, *, loading: LoadDecider | None = None, **kwargs: object
) -> World:
    world = World(num_slots=16, tiers=tiers, complete_after_polls=3)  # jobs outlive a lookup
    loading = loading or _decider(mode, **kwargs)
    world.primary = PrimaryTier(16, LruPolicy(16))
    world.manager = TieringManager(world.primary, world.tiers, host=world.host, loading=loading)
    return world


def _settle(world: World) -> None:
    for tier in world.tiers:
        tier.drain()
    world.step(2)


def _offload(world: World, ids: list[int], *, tier: int | None = None) -> None:
    """``ids`` onto every tier (or only ``tier``), not in host memory."""
    ctx = ReqContext("writer")
    world.store(ids, ctx)
    world.manager.on_request_finished(ctx)
    _settle(world)
    world.manager.reset()  # host memory forgets them; the tiers keep them
    for i, store in enumerate(world.tiers):
        if tier is not None and i != tier:
            store.delete(keys(*ids))
    world.manager.take_events()


def _measured(world: World, tier: int, latency_s: float, per_byte: float) -> None:
    cost = world.manager.get_cost(tier)
    for n in (1, 2, 4, 8):
        cost.observe(n * SLOT_BYTES, latency_s + n * SLOT_BYTES * per_byte)


def _ask(world: World, ids: list[int], ctx: ReqContext) -> list[LookupResult]:
    """One scheduler scan: ask in order, stop at the first miss."""
    answers = []
    for answer in world.lookup(ids, ctx):
        answers.append(answer)
        if answer is MISS:
            break
    return answers


def test_a_fast_tier_is_loaded_in_the_step_the_scan_completes() -> None:
    world = _world(LoadMode.AUTO)
    _offload(world, [1, 2, 3])
    _measured(world, 0, latency_s=0.001, per_byte=1e-9)
    ctx = ReqContext("r")
    assert _ask(world, [1, 2, 3], ctx) == [RETRY] * 3  # the probes
    world.step()
    _settle(world)
    assert _ask(world, [1, 2, 3], ctx) == [RETRY] * 3  # found: planned at step end
    gets = world.manager.stats().tiers[0].gets_submitted
    world.step()
    assert world.manager.stats().tiers[0].gets_submitted == gets + 1  # promoted at once
    assert _ask(world, [1, 2, 3], ctx) == [PENDING] * 3
    _settle(world)
    assert _ask(world, [1, 2, 3], ctx) == [HIT] * 3
    loading = world.manager.stats().loading
    assert (loading.loaded_all, loading.chunks_loaded, loading.chunks_recomputed) == (1, 3, 0)
    assert loading.last_load_s < loading.last_recompute_s


def test_a_slow_tier_is_recomputed_and_never_read() -> None:
    world = _world(LoadMode.AUTO)
    _offload(world, [1, 2, 3])
    _measured(world, 0, latency_s=5.0, per_byte=1e-9)  # 5 s a job against 48 ms of prefill
    ctx = ReqContext("r")
    _ask(world, [1, 2, 3], ctx)
    world.step()
    _settle(world)
    assert _ask(world, [1, 2, 3], ctx) == [RETRY] * 3
    world.step()
    assert _ask(world, [1, 2, 3], ctx) == [MISS]  # the engine recomputes from chunk 0
    _settle(world)
    stats = world.manager.stats()
    assert stats.tiers[0].gets_submitted == 0
    assert (stats.loading.recomputed, stats.loading.chunks_recomputed) == (1, 3)
    assert stats.loading.last_load_s == 0


def test_a_cheap_leading_run_is_loaded_and_a_slow_tail_recomputed() -> None:
    world = _world(LoadMode.AUTO, tiers=2)
    _offload(world, [1, 2, 3], tier=0)
    _offload(world, [4, 5], tier=1)
    _measured(world, 0, latency_s=0.001, per_byte=1e-9)
    _measured(world, 1, latency_s=5.0, per_byte=1e-9)
    ctx = ReqContext("r")
    ids = [1, 2, 3, 4, 5]
    _ask(world, ids, ctx)
    world.step()
    _settle(world)
    _ask(world, ids, ctx)
    world.step()
    assert _ask(world, ids, ctx) == [PENDING] * 3 + [MISS]
    stats = world.manager.stats()
    assert (stats.loading.loaded_part, stats.loading.chunks_loaded) == (1, 3)
    assert stats.loading.chunks_recomputed == 2
    assert stats.tiers[1].gets_submitted == 0


def test_host_chunks_after_the_first_tier_hit_count_as_free() -> None:
    world = _world(LoadMode.AUTO)
    _offload(world, [1, 2])
    world.store([2], ReqContext("again"))  # 2 back in host memory
    _measured(world, 0, latency_s=0.020, per_byte=1e-9)  # 20 ms: more than key 1 saves
    ctx = ReqContext("r")
    _ask(world, [1, 2], ctx)
    world.step()
    _settle(world)
    assert _ask(world, [1, 2], ctx) == [RETRY, HIT]
    world.step()
    # loading 1 (20 ms) makes 1 and 2 usable (32 ms saved): worth it
    assert _ask(world, [1, 2], ctx) == [PENDING, HIT]


def test_an_unfinished_probe_postpones_the_plan() -> None:
    world = _world(LoadMode.AUTO)
    _offload(world, [1, 2])
    _measured(world, 0, latency_s=5.0, per_byte=1e-9)
    ctx = ReqContext("r")
    _ask(world, [1], ctx)
    world.step()
    _settle(world)
    assert _ask(world, [1, 2], ctx) == [RETRY, RETRY]  # 2's probe goes out only now
    world.step()
    assert world.manager.stats().loading.recomputed == 0  # no plan over half a prefix
    _settle(world)
    _ask(world, [1, 2], ctx)
    world.step()
    assert _ask(world, [1, 2], ctx) == [MISS]
    assert world.manager.stats().loading.recomputed == 1


def test_fixed_mode_loads_only_runs_of_enough_tokens() -> None:
    for ids, want in (([1, 2], [MISS]), ([1, 2, 3], [PENDING] * 3)):
        world = _world(LoadMode.FIXED, min_tokens=48)
        _offload(world, ids)
        ctx = ReqContext("r")
        _ask(world, ids, ctx)
        world.step()
        _settle(world)
        _ask(world, ids, ctx)
        world.step()
        assert _ask(world, ids, ctx) == want, ids


def test_a_tier_judged_slow_is_loaded_again_now_and_then_to_re_measure_it() -> None:
    world = _world(LoadMode.AUTO, explore_every=2)
    _offload(world, [1])
    _measured(world, 0, latency_s=5.0, per_byte=1e-9)
    answers = []
    for n in range(2):
        ctx = ReqContext(f"r{n}")
        _ask(world, [1], ctx)
        world.step()
        _settle(world)
        _ask(world, [1], ctx)
        world.step()
        answers.append(_ask(world, [1], ctx))
        world.manager.on_request_finished(ctx)
        _settle(world)
        world.manager.reset()
    assert answers == [[MISS], [PENDING]]
    assert world.manager.stats().loading.explored == 1


def test_real_gets_feed_the_tiers_cost_and_decisions_end_with_the_request() -> None:
    loading = _decider(LoadMode.AUTO)
    world = _world(LoadMode.AUTO, loading=loading)
    _offload(world, [1, 2])
    ctx = ReqContext("r")
    _ask(world, [1, 2], ctx)
    world.step()
    _settle(world)
    _ask(world, [1, 2], ctx)  # unmeasured tier: loaded, which measures it
    world.step()
    _settle(world)
    cost = world.manager.get_cost(0)
    assert cost.samples == 1
    estimate = cost.estimate()
    assert estimate is not None
    assert estimate.seconds(2 * SLOT_BYTES) > 0
    assert loading.note_tier(key(1), ctx, 0) is HIT  # decided: load it
    world.manager.on_request_finished(ctx)
    world.step()
    assert loading.note_tier(key(1), ctx, 0) is RETRY  # forgotten: a new scan


def test_off_promotes_at_the_first_lookup_as_before() -> None:
    world = _world(LoadMode.OFF)
    _offload(world, [1])
    ctx = ReqContext("r")
    _ask(world, [1], ctx)
    world.step()
    _settle(world)
    assert _ask(world, [1], ctx) == [PENDING]
    assert world.manager.stats().loading.loaded_all == 0  # no plans in OFF


def _indexed(world: World) -> None:
    """The tiers answer lookups from their own index (``Indexed``), as a file tier does."""
    for store in world.tiers:
        store.indexed = True


def test_an_indexed_tier_planned_ahead_promotes_at_the_first_lookup() -> None:
    world = _world(LoadMode.AUTO)
    _offload(world, [1, 2, 3])
    _indexed(world)
    _measured(world, 0, latency_s=0.001, per_byte=1e-9)
    ctx = ReqContext("r")
    world.manager.plan_ahead([keys(1, 2, 3)], ctx)
    assert _ask(world, [1, 2, 3], ctx) == [PENDING] * 3  # no probe, no step for a plan
    world.step()
    stats = world.manager.stats()
    assert (stats.tiers[0].gets_submitted, stats.tiers[0].probes_submitted) == (1, 0)
    _settle(world)
    assert _ask(world, [1, 2, 3], ctx) == [HIT] * 3
    assert (stats.loading.loaded_all, stats.loading.chunks_loaded) == (1, 3)


def test_a_slow_indexed_tier_planned_ahead_is_recomputed_at_the_first_lookup() -> None:
    world = _world(LoadMode.AUTO)
    _offload(world, [1, 2, 3])
    _indexed(world)
    _measured(world, 0, latency_s=5.0, per_byte=1e-9)
    ctx = ReqContext("r")
    world.manager.plan_ahead([keys(1, 2, 3)], ctx)
    assert _ask(world, [1, 2, 3], ctx) == [MISS]  # the engine recomputes in this very step
    world.step()
    stats = world.manager.stats()
    assert stats.tiers[0].gets_submitted == 0
    assert (stats.loading.recomputed, stats.loading.chunks_recomputed) == (1, 3)


def test_a_plan_ahead_needing_a_probe_leaves_the_plan_to_step_end() -> None:
    world = _world(LoadMode.AUTO)  # the tiers answer through probes only
    _offload(world, [1, 2, 3])
    _measured(world, 0, latency_s=5.0, per_byte=1e-9)
    ctx = ReqContext("r")
    world.manager.plan_ahead([keys(1, 2, 3)], ctx)
    assert _ask(world, [1, 2, 3], ctx) == [RETRY] * 3
    assert world.manager.stats().loading.recomputed == 0  # nothing decided yet
    world.step()
    _settle(world)
    world.manager.plan_ahead([keys(1, 2, 3)], ctx)  # the probe answered: known now
    assert _ask(world, [1, 2, 3], ctx) == [MISS]
    assert world.manager.stats().loading.recomputed == 1


def test_plan_ahead_changes_nothing_with_decisions_off() -> None:
    world = _world(LoadMode.OFF)
    _offload(world, [1, 2])
    _indexed(world)
    _measured(world, 0, latency_s=5.0, per_byte=1e-9)
    ctx = ReqContext("r")
    world.manager.plan_ahead([keys(1, 2)], ctx)
    assert _ask(world, [1, 2], ctx) == [PENDING] * 2  # every hit promoted, as vLLM does


def test_a_short_host_prefix_is_recomputed_once_a_loads_step_costs_more() -> None:
    world = _world(LoadMode.AUTO)
    writer = ReqContext("writer")
    world.store(list(range(1, 11)), writer)
    world.manager.on_request_finished(writer)
    _settle(world)
    short, long = ReqContext("short"), ReqContext("long")
    world.manager.plan_ahead([keys(1, 2)], short)
    assert _ask(world, [1, 2], short) == [HIT] * 2  # no wait measured yet: loaded
    # a load's wait measured at 100 ms: two chunks recompute in 32 ms, ten in 160 ms
    world.manager.observe_load_wait(ReqContext("past"), 0.1, promoted=False)
    short = ReqContext("short-2")
    world.manager.plan_ahead([keys(1, 2)], short)
    assert _ask(world, [1, 2], short) == [MISS]
    world.manager.plan_ahead([keys(*range(1, 11))], long)
    assert _ask(world, list(range(1, 11)), long) == [HIT] * 10
    loading = world.manager.stats().loading
    assert (loading.recomputed, loading.loaded_all) == (1, 1)
    assert (loading.chunks_recomputed, loading.chunks_loaded) == (2, 10)
    world.manager.on_request_finished(short)
    assert _ask(world, [1, 2], ReqContext("later")) == [HIT] * 2  # the decision was its own


def test_a_promoting_loads_wait_counts_beyond_its_planned_gets() -> None:
    world = _world(LoadMode.AUTO)
    _offload(world, [1, 2, 3])
    _indexed(world)
    _measured(world, 0, latency_s=0.001, per_byte=1e-9)
    first = ReqContext("first")
    world.manager.plan_ahead([keys(1, 2, 3)], first)
    assert _ask(world, [1, 2, 3], first) == [PENDING] * 3
    # that load took 2 s to reach its compute step: promotions cost more than 3 chunks save
    world.manager.observe_load_wait(first, 2.0, promoted=True)
    world.manager.on_request_finished(first)
    world.step()
    _settle(world)
    world.manager.reset()
    second = ReqContext("second")
    world.manager.plan_ahead([keys(1, 2, 3)], second)
    assert _ask(world, [1, 2, 3], second) == [MISS]


def test_a_busy_engine_counts_no_loads_wait() -> None:
    """With other requests in the engine its steps run for them anyway: a load's measured
    wait is theirs, and recomputing would cost the whole batch its prefill, so plans count
    only the gets (a short host prefix is loaded, a promotion too)."""
    world = _world(LoadMode.AUTO)
    writer = ReqContext("writer")
    world.store([1, 2], writer)
    world.manager.on_request_finished(writer)
    _settle(world)
    world.manager.observe_load_wait(ReqContext("past"), 0.1, promoted=False)
    busy, idle = ReqContext("busy"), ReqContext("idle")
    world.manager.plan_ahead([keys(1, 2)], busy, busy=True)
    assert _ask(world, [1, 2], busy) == [HIT] * 2
    world.manager.plan_ahead([keys(1, 2)], idle, busy=False)
    assert _ask(world, [1, 2], idle) == [MISS]


def test_a_snapshot_copies_every_counter_and_the_measured_waits_field_by_field() -> None:
    """``snapshot`` builds the copy by position (vLLM asks every step): each field lands in
    its own place, and later changes do not move the copy."""
    import attrs

    decider = LoadDecider(LoadMode.AUTO)
    names = [f.name for f in attrs.fields(type(decider.stats))]
    for i, name in enumerate(names):
        setattr(decider.stats, name, i + 1)
    snapshot = decider.snapshot()
    expected = attrs.evolve(
        decider.stats, wait_host_s=decider.waits.host_s, wait_promote_s=decider.waits.promote_s
    )
    assert snapshot == expected
    assert [getattr(snapshot, n) for n in names if not n.startswith("wait_")] == [
        i + 1 for i, n in enumerate(names) if not n.startswith("wait_")
    ]
    decider.stats.loaded_all += 1
    assert snapshot.loaded_all == 1
