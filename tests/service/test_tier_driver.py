"""``TierDriver`` on its own, over the in-memory tier and its deterministic faults: submit and
poll faults, unknown results, missing keys, partial gets, probes and their ids."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import structlog

from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain import (
    JobId,
    JobKind,
    JobResult,
    LookupResult,
    OffloadKey,
    ReqContext,
    TierJob,
)
from kvhex.domain.events import Cleared, Removed, Stored, TierEvent
from kvhex.service import TierDriver
from kvhex.service.tier_driver import loaded_keys
from tests.service.harness import SLOT_BYTES, key, keys, payload

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class FlakyPollTier(MemoryTierStore):
    """The in-memory tier, whose next ``n`` polls raise before doing anything."""

    failing_polls = 0

    def poll(self) -> list[JobResult]:
        if self.failing_polls:
            self.failing_polls -= 1
            raise OSError("connection reset")
        return super().poll()


class Rig:
    """One host buffer, one in-memory tier and its driver; probes take negative ids."""

    def __init__(self, store: type[MemoryTierStore] = MemoryTierStore) -> None:
        self.host = MemoryHostBuffer(8, SLOT_BYTES)
        self.store = store(self.host, capacity_bytes=64 * SLOT_BYTES, name="mem")
        self.probe_ids: list[JobId] = []
        self.driver = TierDriver(self.store, "mem", probe_ids=self._probe_id)
        self.ctx = ReqContext("r")
        self._ids = itertools.count(1)

    def _probe_id(self) -> JobId:
        self.probe_ids.append(JobId(-1 - len(self.probe_ids)))
        return self.probe_ids[-1]

    def job(self, kind: JobKind, ids: list[int]) -> TierJob:
        """A put (host slots 0.. filled with the chunks' bytes) or a get into slots 0.."""
        slots = tuple(range(len(ids)))
        if kind is JobKind.PUT:
            for slot, k in zip(slots, keys(*ids), strict=True):
                self.host.slot_view(slot)[:] = payload(k)
        return TierJob(JobId(next(self._ids)), kind, tuple(keys(*ids)), slots, self.ctx)

    def run(self, kind: JobKind, ids: list[int]) -> tuple[TierJob, JobResult]:
        """Submit one job and poll until it is reported."""
        job = self.job(kind, ids)
        assert self.driver.submit(job) is None
        (finished,) = self.driver.poll()
        assert finished[0] is job
        return finished

    def lookup(self, ids: list[int], ctx: ReqContext | None = None) -> list[LookupResult]:
        return [self.driver.lookup(k, ctx or self.ctx) for k in keys(*ids)]

    def probe(self, ids: list[int]) -> list[LookupResult]:
        """Ask, send this step's probe, poll its answer, ask again."""
        self.lookup(ids)
        self.driver.submit_probes()
        assert self.driver.poll() == []  # probe results are applied, never returned
        return self.lookup(ids)


def test_a_submission_the_store_refuses_is_a_failed_result_counted_at_once() -> None:
    rig = Rig()
    rig.store.close()
    put = rig.job(JobKind.PUT, [1])
    failed = rig.driver.submit(put)
    assert failed is not None
    assert (failed.job_id, failed.success) == (put.job_id, False)
    assert "TierUnavailable" in (failed.error or "")
    stats = rig.driver.stats
    assert (stats.puts_submitted, stats.submit_errors, stats.puts_failed) == (1, 1, 1)
    assert rig.driver.in_flight == 0
    assert not rig.driver.has_pending_work()
    assert rig.driver.poll() == []  # never reported a second time


def test_a_refused_get_marks_its_keys_missing() -> None:
    rig = Rig()
    rig.run(JobKind.PUT, [1])
    assert rig.probe([1]) == [HIT]
    rig.store.close()
    assert rig.driver.submit(rig.job(JobKind.GET, [1])) is not None
    assert rig.lookup([1]) == [MISS]
    assert rig.driver.stats.gets_failed == 1


def test_a_refused_probe_answers_miss() -> None:
    rig = Rig()
    assert rig.lookup([1]) == [RETRY]
    rig.store.close()
    rig.driver.submit_probes()
    assert rig.lookup([1]) == [MISS]
    stats = rig.driver.stats
    assert (stats.probes_submitted, stats.submit_errors, stats.probes_failed) == (1, 1, 1)
    assert not rig.driver.has_pending_work()


def test_a_poll_that_raises_is_counted_and_the_jobs_arrive_later() -> None:
    rig = Rig(FlakyPollTier)
    assert isinstance(rig.store, FlakyPollTier)
    put = rig.job(JobKind.PUT, [1, 2])
    assert rig.driver.submit(put) is None
    rig.store.failing_polls = 1
    assert rig.driver.poll() == []
    assert rig.driver.stats.poll_errors == 1
    assert rig.driver.in_flight == 1
    assert rig.driver.has_pending_work()
    ((job, result),) = rig.driver.poll()
    assert job is put
    assert result.success
    assert rig.driver.stats.puts_ok == 1
    assert rig.driver.stats.keys_put == 2
    assert rig.driver.in_flight == 0


def test_a_result_for_a_job_the_driver_never_sent_is_logged_and_dropped() -> None:
    rig = Rig()
    stranger = rig.job(JobKind.PUT, [1])
    rig.store.submit_put(stranger)  # behind the driver's back
    mine = rig.job(JobKind.PUT, [2])
    assert rig.driver.submit(mine) is None
    with structlog.testing.capture_logs() as logs:
        finished = rig.driver.poll()
    assert [job for job, _ in finished] == [mine]
    assert [(e["event"], e["job_id"]) for e in logs] == [
        ("tier_reported_unknown_job", stranger.job_id)
    ]
    assert rig.driver.stats.puts_ok == 1


def test_a_failed_get_marks_keys_missing_until_a_put_stores_them_again() -> None:
    rig = Rig()
    rig.run(JobKind.PUT, [1])
    assert rig.probe([1]) == [HIT]
    rig.store.fail_next_gets()
    _, result = rig.run(JobKind.GET, [1])
    assert not result.success
    assert rig.lookup([1]) == [MISS]
    assert rig.lookup([1], ReqContext("another")) == [MISS]  # missing for every request
    rig.store.fail_next_puts()
    rig.run(JobKind.PUT, [1])
    assert rig.lookup([1]) == [MISS]  # a failed put proves nothing
    rig.run(JobKind.PUT, [1])
    assert rig.lookup([1]) == [HIT]  # the put's success also answers the waiting probe
    assert rig.driver.stats.keys_failed_to_promote == 1


def test_a_partial_get_marks_only_the_keys_it_did_not_load() -> None:
    rig = Rig()
    rig.run(JobKind.PUT, [1, 2, 3])
    assert rig.probe([1, 2, 3]) == [HIT, HIT, HIT]
    rig.store.partial_next_get(keys(3, 1))
    job, result = rig.run(JobKind.GET, [1, 2, 3])
    assert not result.success
    assert loaded_keys(job, result) == (keys(1, 3), keys(2))  # in job order
    assert rig.lookup([1, 2, 3]) == [HIT, MISS, HIT]
    stats = rig.driver.stats
    assert (stats.gets_failed, stats.keys_promoted, stats.keys_failed_to_promote) == (1, 2, 1)
    assert bytes(rig.host.slot_view(0)) == payload(key(1))
    assert bytes(rig.host.slot_view(2)) == payload(key(3))


def test_loaded_keys_of_a_whole_success_and_a_whole_failure() -> None:
    job = TierJob(JobId(1), JobKind.GET, tuple(keys(1, 2)), (0, 1))
    assert loaded_keys(job, JobResult(JobId(1), True)) == (keys(1, 2), [])
    assert loaded_keys(job, JobResult(JobId(1), False)) == ([], keys(1, 2))


def test_probes_answer_what_the_tier_holds_with_one_job_per_step() -> None:
    rig = Rig()
    rig.run(JobKind.PUT, [1, 3])
    other = ReqContext("other")
    assert rig.lookup([1, 2, 3]) == [RETRY, RETRY, RETRY]
    assert rig.lookup([2], other) == [RETRY]  # shares the queued probe
    assert rig.driver.has_pending_work()
    rig.driver.submit_probes()
    assert rig.probe_ids == [JobId(-1)]
    assert rig.lookup([1, 2, 3]) == [RETRY, RETRY, RETRY]  # in flight
    assert rig.driver.poll() == []
    assert rig.lookup([1, 2, 3]) == [HIT, MISS, HIT]
    assert rig.lookup([2], other) == [MISS]
    rig.driver.submit_probes()  # nothing queued: no job, no id
    assert rig.probe_ids == [JobId(-1)]
    assert rig.driver.stats.probes_submitted == 1
    assert not rig.driver.has_pending_work()


def test_a_failed_probe_answers_miss_and_is_counted() -> None:
    rig = Rig()
    rig.run(JobKind.PUT, [1])
    rig.store.fail_next_probes()
    assert rig.probe([1]) == [MISS]
    assert rig.driver.stats.probes_failed == 1


def test_answers_live_while_a_request_wants_them_and_clear_forgets_everything() -> None:
    rig = Rig()
    rig.run(JobKind.PUT, [1])
    assert rig.probe([1]) == [HIT]
    rig.driver.on_request_finished(rig.ctx)
    assert rig.lookup([1]) == [RETRY]  # nobody wanted the answer any more: asked again
    assert rig.probe([1]) == [HIT]
    rig.store.fail_next_gets()
    rig.run(JobKind.GET, [1])
    assert rig.lookup([1]) == [MISS]
    rig.driver.clear()
    assert rig.lookup([1]) == [RETRY]  # missing keys and answers forgotten; data kept
    assert key(1) in rig.store


def test_probes_are_the_drivers_own() -> None:
    rig = Rig()
    with pytest.raises(ValueError, match="submit_probes"):
        rig.driver.submit(TierJob(JobId(5), JobKind.PROBE, tuple(keys(1))))
    assert rig.driver.in_flight == 0


def test_busy_time_and_bytes_are_counted_per_direction() -> None:
    rig = Rig()
    rig.store.report_latency(0.5)
    rig.run(JobKind.PUT, [1, 2])
    rig.run(JobKind.GET, [1])
    stats = rig.driver.stats
    assert (stats.bytes_put, stats.bytes_got) == (2 * SLOT_BYTES, SLOT_BYTES)
    assert stats.put_seconds == pytest.approx(0.5)
    assert stats.get_seconds == pytest.approx(0.5)


class AwareTier(MemoryTierStore):
    """A request-aware in-memory tier that notes what it hears."""

    def __init__(self, host: MemoryHostBuffer, *, capacity_bytes: int, name: str) -> None:
        super().__init__(host, capacity_bytes=capacity_bytes, name=name)
        self.heard: list[tuple[str, object]] = []

    def wants_every_chunk(self, ctx: ReqContext) -> bool:
        return ctx.req_id == "all"

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.heard.append(("touch", tuple(keys)))

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.heard.append(("finished", ctx))


def test_the_request_lifecycle_reaches_only_a_request_aware_tier() -> None:
    plain = Rig()
    assert not plain.driver.wants_every_chunk(ReqContext("all"))
    plain.driver.touch(keys(1), plain.ctx)  # nothing to tell, nothing raised
    plain.driver.on_request_finished(plain.ctx)
    rig = Rig(AwareTier)
    assert isinstance(rig.store, AwareTier)
    assert rig.driver.wants_every_chunk(ReqContext("all"))
    assert not rig.driver.wants_every_chunk(rig.ctx)
    rig.driver.touch(keys(1, 2), rig.ctx)
    rig.driver.on_request_finished(rig.ctx)
    assert rig.store.heard == [("touch", (key(1), key(2))), ("finished", rig.ctx)]


class ScriptedEventsTier(MemoryTierStore):
    """The in-memory tier, announcing the events a test hands it instead of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.script: list[TierEvent] = []

    def take_events(self) -> list[TierEvent]:
        events, self.script = self.script, []
        return events


def test_the_store_s_events_pass_through_counted_and_other_instances_blocks_never_count() -> None:
    rig = Rig(ScriptedEventsTier)
    store = rig.store
    assert isinstance(store, ScriptedEventsTier)
    own = rig.driver.identity
    peers = attrs.evolve(own, ownership="mem@peers")
    script = [Stored(keys(1, 2, 3), own), Removed(keys(2), own), Stored(keys(7, 8), peers)]
    store.script = [*script, Removed(keys(1), peers)]
    assert rig.driver.take_events()[:3] == script
    stats = rig.driver.stats
    assert (stats.blocks_stored, stats.blocks_removed, stats.resident_blocks) == (3, 1, 2)
    store.script = [Cleared(own)]
    assert rig.driver.take_events() == [Cleared(own)]
    assert rig.driver.stats.resident_blocks == 0
    assert rig.driver.take_events() == []


def test_drain_close_and_a_snapshot_that_does_not_move_with_the_tier() -> None:
    rig = Rig()
    slow = rig.job(JobKind.PUT, [1])
    rig.store.complete_after_polls = 5
    assert rig.driver.submit(slow) is None
    rig.driver.drain()  # finished now; reported by the next poll
    ((job, result),) = rig.driver.poll()
    assert job is slow
    assert result.success
    snapshot = rig.driver.snapshot(admission_ema_s=0.25)
    assert (snapshot.name, snapshot.puts_ok, snapshot.admission_ema_s) == ("mem", 1, 0.25)
    assert (snapshot.used_bytes, snapshot.capacity_bytes) == (SLOT_BYTES, 64 * SLOT_BYTES)
    assert snapshot.corrupt_blocks is None  # the in-memory tier counts no damage
    rig.driver.count_dropped(3)
    rig.driver.count_no_room()
    rig.store.complete_after_polls = 1
    rig.run(JobKind.PUT, [2])
    assert (snapshot.puts_ok, snapshot.keys_dropped, snapshot.put_latency.count) == (1, 0, 1)
    now = rig.driver.snapshot()
    assert (now.puts_ok, now.cascades_dropped, now.keys_dropped) == (2, 1, 3)
    assert now.promotion_slot_failures == 1
    rig.driver.close()
    assert rig.driver.submit(rig.job(JobKind.GET, [1])) is not None  # closed: refused


def test_a_tier_with_its_own_index_is_asked_at_lookup_without_a_probe() -> None:
    rig = Rig()
    rig.store.indexed = True
    rig.run(JobKind.PUT, [1, 2])
    assert rig.driver.peek(key(1)) is True  # counts nothing, queues nothing
    assert rig.lookup([1, 2, 3]) == [HIT, HIT, MISS]
    stats = rig.driver.snapshot()
    assert (stats.lookups, stats.hits, stats.misses) == (3, 2, 1)
    rig.driver.submit_probes()
    assert rig.probe_ids == []  # nothing to probe
    rig.store.fail_next_gets()
    rig.run(JobKind.GET, [1])
    assert rig.lookup([1]) == [MISS]  # its get failed here: missing, whatever the index says
    assert rig.driver.peek(key(1)) is False


def test_peek_of_a_probed_tier_knows_only_answered_probes() -> None:
    rig = Rig()
    rig.run(JobKind.PUT, [1])
    assert rig.driver.peek(key(1)) is None
    assert rig.lookup([1]) == [RETRY]
    assert rig.driver.peek(key(1)) is None  # queued, not answered
    rig.driver.submit_probes()
    rig.driver.poll()
    assert rig.driver.peek(key(1)) is True
    assert rig.lookup([1]) == [HIT]
