"""The counters metrics read: lookups per tier, promotion origins, announced blocks, job
latencies, occupancy, damage, admission and the event pipeline's counts, all through the
engine's ``stats()``."""

from __future__ import annotations

from kvhex.adapters.memory import MemoryEventSink, MemoryTierStore
from kvhex.domain import JobKind, JobResult, LookupResult, ReqContext, TierJob
from kvhex.domain.cost import LoadMode
from kvhex.domain.events import BlockStored
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.histogram import Histogram
from kvhex.domain.tiers import Medium
from kvhex.ports.tier_store import Occupancy
from kvhex.service import EventPipeline, OffloadEngine, TieringManager
from kvhex.service.loading import LoadDecider
from tests.domain.requests import chunk_key, make_request
from tests.service.harness import SLOT_BYTES, World, key, keys

GROUP = KvGroup(0, tokens_per_block=4, blocks_per_chunk=2)
GEO = KvGeometry((GROUP,), tokens_per_hash=4)

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


def test_the_engine_reports_each_finished_job_to_its_observer_with_the_tier_index() -> None:
    world = World(num_slots=4, tiers=2)
    engine = OffloadEngine(world.manager)
    seen: list[tuple[int, JobKind, bool, int, float]] = []

    def observe(tier: int, job: TierJob, result: JobResult, seconds: float) -> None:
        seen.append((tier, job.kind, result.success, len(job.keys), seconds))

    engine.observe_jobs(observe)
    world.store([1, 2], ReqContext("a"))
    _drain(world)
    assert sorted(s[:4] for s in seen) == [(0, JobKind.PUT, True, 2), (1, JobKind.PUT, True, 2)]
    assert all(s[4] >= 0 for s in seen)


def test_each_tier_names_its_medium_and_an_uncounted_damage_is_none() -> None:
    world = World(tiers=1)
    tier = OffloadEngine(world.manager).stats().tiers[0]
    assert (tier.name, tier.medium) == ("mem0", Medium.STORAGE)
    assert (tier.corrupt_blocks, tier.lost_blocks, tier.io_errors) == (None, None, None)
    assert tier.admission_ema_s is None  # admits every cascade: no latency average


def test_a_tiers_damage_counts_reach_the_snapshot() -> None:
    class Checking(MemoryTierStore):
        """An in-memory tier that counts damage as a ``TierHealth`` tier does."""

        corrupt_blocks = 2
        lost_blocks = 3
        io_errors = 1

    world = World(tiers=0)
    tier = Checking(world.host, capacity_bytes=SLOT_BYTES, name="checked")
    manager = TieringManager(world.primary, [tier], host=world.host)
    stats = OffloadEngine(manager).stats().tiers[0]
    assert (stats.corrupt_blocks, stats.lost_blocks, stats.io_errors) == (2, 3, 1)


def test_load_mode_and_prefill_speed_are_in_the_snapshot_and_set_through_the_engine() -> None:
    world = World(tiers=1)
    loading = LoadDecider(LoadMode.AUTO, tokens_per_key=16.0)
    engine = OffloadEngine(TieringManager(world.primary, world.tiers, loading=loading))
    assert (engine.stats().load_mode, engine.stats().prefill_tokens_per_s) == (LoadMode.AUTO, None)
    engine.set_load_mode(LoadMode.OFF)
    engine.observe_prefill(4000, 2.0)
    assert (engine.stats().load_mode, engine.stats().prefill_tokens_per_s) == (LoadMode.OFF, 2000)


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
    events = engine.stats().events
    assert events.published == counts
    assert [(s.name, s.batches_sent, s.batches_dropped) for s in events.sinks] == [
        ("Keeping", len(keeping.batches), 0),
        ("Refusing", 0, len(keeping.batches)),
    ]
    assert (events.batches_published, events.publish_failures) == (len(keeping.batches),) * 2
    # no geometry: the engine cannot describe any store in full
    assert (events.full_stores, events.placeholder_stores) == (0, 8)


def test_full_and_placeholder_stores_are_counted_and_a_sink_added_later_hears_next() -> None:
    world = World(num_slots=4, tiers=0)
    engine = OffloadEngine(world.manager)
    engine.set_geometry(GEO)
    world.store([1], ReqContext("external"))  # no tokens to describe it with
    engine.take_events()
    sink = MemoryEventSink()
    engine.add_sink(sink)
    described = make_request("a", list(range(16)), GEO)
    chunks = [chunk_key(described, c, GROUP) for c in range(2)]
    plan = engine.prepare_store(chunks, described)
    assert plan is not None
    engine.complete_store(plan.keys, described)
    stored = engine.take_events()
    assert [type(e) for e in stored] == [BlockStored]  # one chain of both chunks
    events = engine.stats().events
    assert (events.full_stores, events.placeholder_stores) == (2, 1)
    assert [(s.name, s.batches_sent) for s in events.sinks] == [("MemoryEventSink", 1)]
    assert [e for batch in sink.batches for e in batch.events] == stored


def test_histogram_buckets_are_prometheus_cumulative() -> None:
    h = Histogram.of([0.0001, 0.0002, 0.003, 100.0], bounds=(0.0001, 0.001, 1.0))
    assert h.cumulative() == [(0.0001, 1), (0.001, 2), (1.0, 3), (float("inf"), 4)]
    assert (h.count, round(h.sum, 4)) == (4, 100.0033)
