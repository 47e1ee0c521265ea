"""The in-memory adapters keep real bytes, bound their capacity and fault deterministically."""

from __future__ import annotations

import time

import pytest

from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain import JobId, JobKind, Removed, Stored, TierJob
from kvhex.errors import TierUnavailable
from tests.service.harness import keys


def put(store: MemoryTierStore, host: MemoryHostBuffer, ids: list[int], job: int) -> bool:
    for slot, i in enumerate(ids):
        host.slot_view(slot)[:] = bytes([i % 256]) * host.slot_bytes
    store.submit_put(TierJob(JobId(job), JobKind.PUT, tuple(keys(*ids)), tuple(range(len(ids)))))
    (result,) = store.poll()
    return result.success


def test_host_buffer_views_are_zero_copy_and_bounded() -> None:
    host = MemoryHostBuffer(2, 8)
    view = host.slot_view(1)
    view[:] = b"abcdefgh"
    assert bytes(host.slot_view(1)) == b"abcdefgh"
    assert bytes(host.slot_view(0)) == bytes(8)
    with pytest.raises(IndexError):
        host.slot_view(2)
    host.close()
    with pytest.raises(IndexError, match="closed"):
        host.slot_view(0)
    with pytest.raises(ValueError, match="slot_bytes"):
        MemoryHostBuffer(2, 0)


def test_capacity_evicts_least_recent_blocks_and_announces_them_first() -> None:
    host = MemoryHostBuffer(4, 16)
    store = MemoryTierStore(host, capacity_bytes=48)
    assert put(store, host, [1, 2, 3], 1)
    store.take_events()
    assert put(store, host, [4, 5], 2)
    events = store.take_events()
    assert [type(e) for e in events] == [Removed, Stored]
    assert events[0].keys == tuple(keys(1, 2))
    assert store.keys() == keys(3, 4, 5)
    assert store.used_bytes == 48
    assert store.block(keys(4)[0]) == bytes([4]) * 16


def test_a_job_larger_than_the_tier_fails_and_stores_nothing() -> None:
    host = MemoryHostBuffer(4, 16)
    store = MemoryTierStore(host, capacity_bytes=32)
    assert not put(store, host, [1, 2, 3], 1)
    assert store.keys() == []
    assert store.take_events() == []


def test_jobs_complete_only_after_the_configured_polls_in_order() -> None:
    host = MemoryHostBuffer(2, 8)
    store = MemoryTierStore(host, capacity_bytes=64, complete_after_polls=3)
    store.submit_probe(TierJob(JobId(1), JobKind.PROBE, tuple(keys(1))))
    assert store.poll() == []
    assert store.poll() == []
    (result,) = store.poll()
    assert result.job_id == 1
    assert result.found == frozenset()


def test_a_throttled_tier_reports_no_get_before_its_delay_and_drain_waits_it_out() -> None:
    host = MemoryHostBuffer(2, 8)
    store = MemoryTierStore(host, capacity_bytes=64, get_delay_s=0.2)
    assert put(store, host, [1], 1)  # puts are not delayed
    store.submit_probe(TierJob(JobId(2), JobKind.PROBE, tuple(keys(1))))
    (probe,) = store.poll()  # nor are probes
    assert probe.found == frozenset(keys(1))
    submitted = time.perf_counter()
    store.submit_get(TierJob(JobId(3), JobKind.GET, tuple(keys(1)), (1,)))
    assert store.poll() == []  # polled at once: too early
    store.drain()
    assert time.perf_counter() - submitted >= 0.2
    (result,) = store.poll()
    assert (result.job_id, result.success) == (3, True)
    assert result.seconds is not None
    assert result.seconds >= 0.2
    assert bytes(host.slot_view(1)) == bytes([1]) * 8
    for bad in (-1.0, float("inf"), float("nan"), "1"):
        with pytest.raises(ValueError, match="get_delay_s"):
            MemoryTierStore(host, capacity_bytes=64, get_delay_s=bad)  # type: ignore[arg-type]


def test_closed_store_fails_queued_jobs_and_refuses_new_ones() -> None:
    host = MemoryHostBuffer(2, 8)
    store = MemoryTierStore(host, capacity_bytes=64, complete_after_polls=5)
    store.submit_probe(TierJob(JobId(1), JobKind.PROBE, tuple(keys(1))))
    store.close()
    (result,) = store.poll()
    assert not result.success
    assert result.error == "tier closed"
    with pytest.raises(TierUnavailable):
        store.submit_probe(TierJob(JobId(2), JobKind.PROBE, tuple(keys(1))))


def test_jobs_must_match_the_submission_kind_and_slots() -> None:
    host = MemoryHostBuffer(2, 8)
    store = MemoryTierStore(host, capacity_bytes=64)
    with pytest.raises(ValueError, match="not a put"):
        store.submit_put(TierJob(JobId(1), JobKind.GET, tuple(keys(1)), (0,)))
    with pytest.raises(ValueError, match="1 keys but 0 slots"):
        TierJob(JobId(2), JobKind.PUT, tuple(keys(1)))
    with pytest.raises(ValueError, match="capacity_bytes"):
        MemoryTierStore(host, capacity_bytes=0)
