"""The counters metrics read: lookups per tier, promotion origins, announced blocks, job
latencies, occupancy and the event pipeline's counts."""

from __future__ import annotations

import attrs

from kvhex.domain import JobKind, LookupResult, ReqContext
from kvhex.domain.events import Cleared, Removed, Stored
from kvhex.domain.histogram import Histogram
from kvhex.ports.tier_store import Occupancy
from kvhex.service import EventPipeline, OffloadEngine
from kvhex.service.tier_driver import TierStats
from kvhex.service.tiering import _count_events
from tests.service.harness import SLOT_BYTES, World, key, keys

HIT, MISS, PENDING, RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)


def _drain(world: World) -> None:
    """Every job done and its result applied (this step's poll may have run already)."""
    for tier in world.tiers:
        tier.drain()
    world.step(2)


def test_lookups_hits_and_misses_are_counted_where_they_were_answered() -> None:
    world = World(num_slots=8, tiers=1)
    a = ReqContext("a")
    world.store([1, 2], a)
    world.manager.on_request_finished(a)
    _drain(world)  # 1 and 2 are in host memory and on mem0
    b = ReqContext("b")
    assert world.lookup([1, 2, 3], b) == [HIT, HIT, RETRY]  # 3: mem0's probe goes out
    world.step()
    _drain(world)
    assert world.lookup([3], b) == [MISS]
    stats = world.manager.stats()
    assert (stats.lookups, stats.host_hits) == (4, 2)
    tier = stats.tiers[0]
    assert (tier.lookups, tier.hits, tier.misses) == (2, 0, 1)  # the RETRY is neither


def test_a_promoted_hit_names_its_tier_until_the_request_is_finalized() -> None:
    world = World(num_slots=2, tiers=2)
    a = ReqContext("a")
    for ids in ([1, 2], [3, 4]):  # 1 and 2 leave host memory for 3 and 4
        world.store(ids, a)
        _drain(world)
    world.manager.on_request_finished(a)
    world.step()
    b = ReqContext("b")
    assert world.lookup([1], b) == [RETRY]
    world.step()
    _drain(world)
    assert world.lookup([1], b) == [PENDING]  # found on mem0 (first in order): promoting
    world.step()
    _drain(world)
    assert world.lookup([1, 4], b) == [HIT, HIT]  # 1 took the room of 3
    assert world.manager.load_source(key(1), b) == world.tiers[0].identity
    assert world.manager.load_source(key(4), b) is None  # host memory held it
    assert world.manager.load_source(key(1), ReqContext("other")) is None
    assert world.manager.stats().tiers[0].keys_promoted == 1
    world.manager.on_request_finished(b)
    world.step()
    assert world.manager.load_source(key(1), b) is None


def test_a_failed_promotion_leaves_no_origin() -> None:
    world = World(num_slots=2, tiers=1)
    a = ReqContext("a")
    for ids in ([1, 2], [3, 4]):
        world.store(ids, a)
        _drain(world)
    b = ReqContext("b")
    assert world.lookup([1], b) == [RETRY]
    world.step()
    _drain(world)
    assert world.lookup([1], b) == [PENDING]  # the promotion goes out at step end
    world.tiers[0].delete(keys(1))  # gone before the promotion reads it
    world.step()
    _drain(world)
    assert world.manager.stats().tiers[0].keys_failed_to_promote == 1
    assert world.manager.load_source(key(1), b) is None


def test_announced_blocks_latencies_and_occupancy_reach_the_snapshot() -> None:
    world = World(num_slots=4, tiers=1, tier_capacity_slots=3)
    a = ReqContext("a")
    for ids in ([1, 2], [3, 4]):
        world.store(ids, a)
        _drain(world)
    world.manager.take_events()
    tier = world.manager.stats().tiers[0]
    assert (tier.blocks_stored, tier.blocks_removed, tier.resident_blocks) == (4, 1, 3)
    assert isinstance(world.tiers[0], Occupancy)
    assert (tier.used_bytes, tier.capacity_bytes) == (3 * SLOT_BYTES, 3 * SLOT_BYTES)
    assert tier.put_latency.count == 2
    assert tier.get_latency.count == 0
    assert tier.put_latency.sum > 0
    snapshot = world.manager.stats().tiers[0]
    world.store([5], a)
    _drain(world)
    assert snapshot.put_latency.count == 2  # a snapshot does not move with the tier


def test_the_driver_reports_each_finished_job_to_its_observer() -> None:
    world = World(num_slots=4, tiers=1)
    seen: list[tuple[JobKind, bool, int, float]] = []
    driver = world.manager._tiers[0].driver
    driver.on_job = lambda job, result, s: seen.append((job.kind, result.success, len(job.keys), s))
    world.store([1, 2], ReqContext("a"))
    _drain(world)
    assert [(k, ok, n) for k, ok, n, _ in seen] == [(JobKind.PUT, True, 2)]
    assert seen[0][3] >= 0


def test_a_clear_zeroes_the_resident_count_and_other_instances_blocks_never_count() -> None:
    stats = TierStats("t")
    tier_id = World(tiers=1).tiers[0].identity
    peers = attrs.evolve(tier_id, ownership="t@peers")
    _count_events(stats, [Stored(keys(1, 2, 3), tier_id), Removed(keys(2), tier_id)], tier_id)
    _count_events(stats, [Stored(keys(7, 8), peers), Removed(keys(1), peers)], tier_id)
    assert (stats.blocks_stored, stats.blocks_removed, stats.resident_blocks) == (3, 1, 2)
    _count_events(stats, [Cleared(tier_id)], tier_id)
    assert stats.resident_blocks == 0


def test_the_pipeline_counts_events_by_type_and_medium_and_batches_per_sink() -> None:
    class Refusing:
        def publish(self, batch: object) -> None:
            raise RuntimeError("closed")

        def close(self) -> None:
            pass

    class Keeping:
        def __init__(self) -> None:
            self.batches: list[object] = []

        def publish(self, batch: object) -> None:
            self.batches.append(batch)

        def close(self) -> None:
            pass

    world = World(num_slots=2, tiers=1)
    keeping = Keeping()
    pipeline = EventPipeline(sinks=[keeping, Refusing()])
    engine = OffloadEngine(world.manager, pipeline)
    a = ReqContext("a")
    for ids in ([1, 2], [3, 4]):
        world.store(ids, a)
        _drain(world)
        engine.take_events()
    counts = pipeline.events_published
    assert counts[("BlockStored", "CPU")] == 4
    assert counts[("BlockRemoved", "CPU")] == 1  # one event per group, both hashes in it
    assert counts[("BlockStored", "STORAGE")] == 4
    assert pipeline.sink_batches == [len(keeping.batches), 0]
    assert pipeline.sink_failures == [0, len(keeping.batches)]
    assert keeping.batches


def test_histogram_buckets_are_prometheus_cumulative() -> None:
    h = Histogram.of([0.0001, 0.0002, 0.003, 100.0], bounds=(0.0001, 0.001, 1.0))
    assert h.cumulative() == [(0.0001, 1), (0.001, 2), (1.0, 3), (float("inf"), 4)]
    assert (h.count, round(h.sum, 4)) == (4, 100.0033)
