"""Request lifecycle, reset, shutdown, admission and faults (reference §F.3, 24 and 29-35)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain import (
    BlockStored,
    EmaBackpressure,
    JobId,
    JobResult,
    LookupResult,
    LruPolicy,
    OffloadKey,
    OffloadPolicy,
    PrimaryTier,
    ReqContext,
    TierJob,
)
from kvhex.errors import StateError, TierError
from kvhex.service import OffloadEngine, TieringManager
from tests.service.harness import SLOT_BYTES, World, key, keys

HIT, MISS = LookupResult.HIT, LookupResult.MISS


class RecordingTier(MemoryTierStore):
    """A request-aware in-memory tier that writes what it hears into a shared journal."""

    def __init__(
        self,
        host: MemoryHostBuffer,
        journal: list[tuple[str, str, object]],
        name: str,
        *,
        every_chunk: bool = False,
    ) -> None:
        super().__init__(host, capacity_bytes=64 * SLOT_BYTES, name=name)
        self.journal = journal
        self.every_chunk = every_chunk

    def submit_put(self, job: TierJob) -> None:
        self.journal.append(("put", self.identity.ownership or "", job.ctx))
        super().submit_put(job)

    def wants_every_chunk(self, ctx: ReqContext) -> bool:
        return self.every_chunk

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.journal.append(("touch", self.identity.ownership or "", (tuple(keys), ctx)))

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.journal.append(("finished", self.identity.ownership or "", ctx))


def recording_world(every_chunk: tuple[bool, bool] = (False, False)) -> tuple[World, list]:  # type: ignore[type-arg]
    world = World()
    journal: list[tuple[str, str, object]] = []
    world.tiers = [
        RecordingTier(world.host, journal, f"t{i}", every_chunk=flag)
        for i, flag in enumerate(every_chunk)
    ]
    world.manager = TieringManager(world.primary, world.tiers, host=world.host)
    return world, journal


def test_touch_reaches_the_host_tier_and_every_request_aware_tier() -> None:
    world, journal = recording_world()
    ctx = ReqContext("r")
    world.store([1, 2, 3], ctx)
    world.manager.touch(keys(1, 2), ctx)
    touches = [(who, arg) for kind, who, arg in journal if kind == "touch"]
    assert touches == [("t0", ((key(1), key(2)), ctx)), ("t1", ((key(1), key(2)), ctx))]
    world.step()
    world.lookup([50], ctx)
    plan = world.manager.prepare_store(keys(10, 11, 12, 13, 14, 15, 16), ctx)
    assert plan is not None
    assert plan.evicted == keys(3, 2)  # touch walked [1, 2] in reverse: 1 ends most recent


def test_tiers_hear_finished_only_after_the_last_cascade_was_submitted() -> None:
    world, journal = recording_world()
    ctx = ReqContext("r")
    world.manager.on_new_request(ctx)
    plan = world.manager.prepare_store(keys(1), ctx)
    assert plan is not None
    world.manager.on_request_finished(ctx)
    assert [kind for kind, _, _ in journal] == []
    world.manager.complete_store(plan.keys, ctx)
    assert [(kind, who) for kind, who, _ in journal] == [
        ("put", "t0"),
        ("put", "t1"),
        ("finished", "t0"),
        ("finished", "t1"),
    ]
    assert world.manager.stats().active_requests == 0


def test_a_failed_host_store_still_finalizes_the_request() -> None:
    world, journal = recording_world()
    ctx = ReqContext("r")
    plan = world.manager.prepare_store(keys(1), ctx)
    assert plan is not None
    world.manager.on_request_finished(ctx)
    world.manager.complete_store(plan.keys, ctx, success=False)
    assert [(kind, who) for kind, who, _ in journal] == [("finished", "t0"), ("finished", "t1")]
    assert world.manager.stats().active_requests == 0


def test_a_request_without_pending_stores_finalizes_at_once() -> None:
    world, journal = recording_world()
    ctx = ReqContext("r")
    world.manager.on_new_request(ctx)
    world.manager.on_request_finished(ctx)
    assert [kind for kind, _, _ in journal] == ["finished", "finished"]


def test_reset_finalizes_finished_requests_and_keeps_active_ones() -> None:
    world, journal = recording_world()
    done, active = ReqContext("done"), ReqContext("active")
    for ctx in (done, active):
        world.manager.on_new_request(ctx)
        assert world.manager.prepare_store(keys(1 if ctx is done else 2), ctx) is not None
    world.manager.on_request_finished(done)
    world.manager.reset()
    assert [(k, arg) for k, _, arg in journal if k == "finished"] == [
        ("finished", done),
        ("finished", done),
    ]
    assert world.manager.stats().active_requests == 1
    world.manager.on_request_finished(active)  # its pending store was forgotten by reset
    assert world.manager.stats().active_requests == 0


def test_offload_policy_is_request_level_when_a_tier_wants_every_chunk() -> None:
    world, _ = recording_world()
    assert world.manager.on_new_request(ReqContext("a")) is OffloadPolicy.CHUNK_LEVEL
    world, _ = recording_world((False, True))
    assert world.manager.on_new_request(ReqContext("b")) is OffloadPolicy.REQUEST_LEVEL


def test_request_level_tiers_get_already_present_chunks_too() -> None:
    world, journal = recording_world((False, True))
    first = ReqContext("first")
    world.store([1], first)
    world.step()
    world.lookup([99], first)
    journal.clear()
    ctx = ReqContext("second")
    world.manager.on_new_request(ctx)
    plan = world.manager.prepare_store(keys(1, 2), ctx)
    assert plan is not None
    assert plan.keys == keys(2)
    assert [(kind, who, arg) for kind, who, arg in journal] == [("put", "t1", ctx)]


def test_reset_drains_jobs_drops_unsubmitted_promotions_and_keeps_tiers() -> None:
    world = World(complete_after_polls=5)
    ctx = ReqContext("r")
    world.store([1], ctx)
    assert world.manager.has_pending_work()
    world.manager.reset()
    assert not world.manager.has_pending_work()
    assert world.lookup([1], ctx) == [LookupResult.RETRY]  # host emptied, tiers kept
    assert all(key(1) in t for t in world.tiers)
    assert world.manager.stats().jobs_in_flight == 0


def test_backpressure_drops_cascades_to_a_slow_tier_and_counts_them() -> None:
    host = MemoryHostBuffer(16, SLOT_BYTES)
    primary = PrimaryTier(16, LruPolicy(16))
    slow = MemoryTierStore(host, capacity_bytes=1 << 20, name="slow")
    fast = MemoryTierStore(host, capacity_bytes=1 << 20, name="fast")
    slow.report_latency(2.0)
    fast.report_latency(0.01)
    manager = TieringManager(
        primary,
        [slow, fast],
        host=host,
        admission=lambda _i: EmaBackpressure(high_water_s=1.0, low_water_s=0.5, warmup=2),
    )
    ctx = ReqContext("r")
    for i in range(8):
        plan = manager.prepare_store(keys(i), ctx)
        assert plan is not None
        manager.complete_store(plan.keys, ctx)
        manager.on_schedule_end()
        manager.lookup(key(100), ctx)
    slow_stats, fast_stats = manager.stats().tiers
    assert slow_stats.cascades_dropped > 0
    assert slow_stats.keys_dropped == slow_stats.cascades_dropped
    assert fast_stats.cascades_dropped == 0
    assert (slow_stats.admission_ema_s or 0.0) > 1.0  # the latency averages admission saw
    assert 0.0 < (fast_stats.admission_ema_s or 0.0) < 0.5
    assert len(fast.keys()) == 8
    assert len(slow.keys()) == 8 - slow_stats.cascades_dropped


def test_ema_backpressure_lifts_when_latency_recovers() -> None:
    policy = EmaBackpressure(alpha=1.0, high_water_s=1.0, low_water_s=0.5, warmup=1, probe_every=2)
    policy.on_completed(JobResult(JobId(1), True, seconds=3.0))
    assert policy.under_pressure
    assert not policy.admit(4)
    assert policy.admit(4)  # every 2nd cascade still goes, to measure
    policy.on_completed(JobResult(JobId(2), True, seconds=0.1))
    assert not policy.under_pressure
    assert policy.admit(4)
    assert (policy.dropped_jobs, policy.dropped_keys) == (1, 4)
    with pytest.raises(ValueError, match="alpha"):
        EmaBackpressure(alpha=0.0)
    with pytest.raises(ValueError, match="low_water_s"):
        EmaBackpressure(high_water_s=0.1, low_water_s=0.5)


def test_a_tier_refusing_submission_fails_the_job_and_releases_pins() -> None:
    world = World()
    world.tiers[0].close()
    ctx = ReqContext("r")
    world.store([1], ctx)
    stats = world.manager.stats().tiers
    assert (stats[0].submit_errors, stats[0].puts_failed) == (1, 1)
    assert world.primary.ref_count(key(1)) == 1  # only the healthy tier still reads it


def test_a_failed_put_announces_nothing_and_unpins() -> None:
    world = World(tiers=1)
    world.tiers[0].fail_next_puts()
    ctx = ReqContext("r")
    world.store([1], ctx)
    world.step()
    world.lookup([9], ctx)
    assert world.primary.ref_count(key(1)) == 0
    tier_events = [e for e in world.manager.take_events() if e.tier.ownership]  # type: ignore[union-attr]
    assert tier_events == []
    assert world.manager.stats().tiers[0].puts_failed == 1


def test_a_failed_probe_answers_miss() -> None:
    world = World(tiers=1)
    world.tiers[0].fail_next_probes()
    ctx = ReqContext("r")
    assert world.lookup([1], ctx) == [LookupResult.RETRY]
    world.step()
    assert world.lookup([1], ctx) == [MISS]
    assert world.manager.stats().tiers[0].probes_failed == 1


def test_shutdown_closes_tiers_in_reverse_and_then_the_host_buffer() -> None:
    world, _ = recording_world()
    closed: list[str] = []
    for tier in world.tiers:
        original = tier.close
        tier.close = lambda o=original, n=tier.identity.ownership: (closed.append(n), o())[1]  # type: ignore[method-assign]
    engine = OffloadEngine(world.manager)
    assert engine.slot_bytes == SLOT_BYTES
    engine.shutdown()
    assert closed == ["t1", "t0"]
    assert world.host.closed
    assert engine.slot_bytes == 0  # released
    engine.shutdown()  # idempotent
    assert not engine.has_pending_work()
    with pytest.raises(StateError, match="shut down"):
        engine.lookup(key(1), ReqContext("r"))


@pytest.mark.parametrize("tiers", [0, 2])
def test_after_shutdown_every_call_refuses_naming_itself_the_facades_and_its_calls(
    tiers: int,
) -> None:
    """``calls()`` hands out the manager's own methods (no facade frame): they refuse as the
    facade's methods do, each naming its operation, and change nothing."""
    world = World(tiers=tiers)
    engine = OffloadEngine(world.manager)
    calls = engine.calls()
    ctx = ReqContext("r")
    engine.on_new_request(ctx)
    engine.shutdown()
    args = {
        "lookup": (key(1), ctx),
        "lookup_host": (key(1), ctx),
        "touch": ([key(1)], ctx),
        "prepare_load": ([key(1)], ctx),
        "complete_load": ([key(1)], ctx),
        "prepare_store": ([key(1)], ctx),
        "complete_store": ([key(1)], ctx, True),
        "on_new_request": (ReqContext("s"),),
        "on_request_finished": (ctx,),
    }
    assert set(args) == set(calls._fields)
    for name, call_args in args.items():
        operation = "lookup" if name == "lookup_host" else name
        with pytest.raises(StateError, match=rf"{operation}.*shut down"):
            getattr(calls, name)(*call_args)
        if name != "lookup_host":
            with pytest.raises(StateError, match=rf"{operation}.*shut down"):
                getattr(engine, name)(*call_args)
    with pytest.raises(StateError, match=r"on_schedule_end.*shut down"):
        engine.on_schedule_end()
    with pytest.raises(StateError, match=r"calls.*shut down"):
        engine.calls()
    assert world.manager.stats().active_requests == 1  # nothing changed


def test_with_no_secondary_tier_a_request_is_finalized_when_it_finishes() -> None:
    """Nothing waits for a request's host stores when no tier cascades them: it is
    finalized at its finish, its stores still pending, and they complete after it."""
    world = World(tiers=0)
    ctx = ReqContext("r")
    world.manager.on_new_request(ctx)
    plan = world.manager.prepare_store([key(1), key(2)], ctx)
    assert plan is not None
    world.manager.on_request_finished(ctx)
    assert world.manager.stats().active_requests == 0
    world.manager.complete_store(plan.keys, ctx)
    assert world.manager.lookup(key(2), ReqContext("s")) is LookupResult.HIT
    assert world.manager.stats().active_requests == 0


def test_a_failed_tier_close_keeps_the_host_buffer_and_reports_the_tier() -> None:
    world = World()

    def broken() -> None:
        raise OSError("disk gone")

    world.tiers[0].close = broken  # type: ignore[method-assign]
    engine = OffloadEngine(world.manager)
    with pytest.raises(TierError, match="mem0") as info:
        engine.shutdown()
    assert "disk gone" in str(info.value)
    assert not world.host.closed
    assert engine.slot_bytes == SLOT_BYTES  # still held: a failed tier may write into it


def test_store_threshold_is_refused_with_secondary_tiers() -> None:
    host = MemoryHostBuffer(4, SLOT_BYTES)
    primary = PrimaryTier(4, LruPolicy(4), store_threshold=2)
    with pytest.raises(ValueError, match="store_threshold"):
        TieringManager(primary, [MemoryTierStore(host, capacity_bytes=1024)])


def test_engine_facade_drives_the_full_cycle() -> None:
    world = World()
    engine = OffloadEngine(world.manager)
    ctx = ReqContext("r")
    assert engine.on_new_request(ctx) is OffloadPolicy.CHUNK_LEVEL
    plan = engine.prepare_store(keys(1), ctx)
    assert plan is not None
    engine.complete_store(plan.keys, ctx)
    assert engine.lookup(key(1), ctx) is HIT
    slots = engine.prepare_load(keys(1), ctx)
    engine.touch(keys(1), ctx)
    engine.complete_load(keys(1), ctx)
    assert slots == plan.slots
    engine.on_request_finished(ctx)
    engine.on_schedule_end()
    assert engine.has_pending_work()
    engine.lookup(key(2), ctx)
    engine.on_schedule_end()
    engine.lookup(key(2), ctx)
    published = engine.take_events()
    assert [type(e) for e in published] == [BlockStored, BlockStored]
    assert [e.medium for e in published] == ["CPU", "STORAGE"]
    assert engine.stats().tiers[0].puts_ok == 1
    engine.reset()
    engine.shutdown()


class _Scheduled(MemoryTierStore):
    """An in-memory tier with work of its own due at ``due`` (``ScheduledWork``)."""

    due: float | None = None

    def next_poll_at(self) -> float | None:
        return self.due


def test_a_tiers_own_work_due_keeps_the_engine_stepping_and_says_when() -> None:
    world = World(tiers=1)
    tier = _Scheduled(world.host, capacity_bytes=1 << 16, name="sched")
    manager = TieringManager(world.primary, [world.tiers[0], tier], host=world.host)
    engine = OffloadEngine(manager)
    assert engine.next_poll_at() is None
    assert not engine.has_pending_work()
    later = time.monotonic() + 60
    tier.due = later
    assert engine.next_poll_at() == later
    assert not engine.has_pending_work()
    tier.due = time.monotonic() - 1  # due (or in flight): step until the tier applies it
    assert engine.has_pending_work()
    tier.due = None
    assert not engine.has_pending_work()
    tier.due = later
    engine.shutdown()
    assert engine.next_poll_at() is None
    assert not engine.has_pending_work()
