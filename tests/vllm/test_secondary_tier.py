"""``KvhexSecondaryTier`` inside vLLM's own ``TieringOffloadingSpec`` and its manager.

vLLM's ``TieringOffloadingManager`` drives a kvhex file tier (``fsspec`` on a temporary
directory) through store, cascade, existence probes, promotion and events, with real bytes in
vLLM's shared offload region.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (make test runs this in .venv-vllm)")

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvhex.adapters.memory import MemoryTierStore
from kvhex.adapters.storage.tier import BlockTierStore
from kvhex.errors import ConfigError
from kvhex.vllm import KvhexSecondaryTier, register
from kvhex.vllm._compat import SIGNALS_RESET_FLUSHED
from tests.vllm.helpers import PAGE, key, offloading_config

STEP = ScheduleEndContext((), ())


def _tier_entry(root: Path, **more: Any) -> dict[str, Any]:
    return {
        "type": "KvhexSecondaryTier",
        "module_path": "kvhex.vllm",
        "tier": "fsspec",
        "url": str(root),
        "capacity_bytes": 64 * 2 * PAGE,
        "enable_kv_events": True,
        "locality": "LOCAL",
        **more,
    }


@pytest.fixture
def tiering(tmp_path: Path) -> Iterator[TieringOffloadingManager]:
    extra = {"cpu_bytes_to_use": 4 * PAGE, "secondary_tiers": [_tier_entry(tmp_path / "kv")]}
    manager = TieringOffloadingSpec(offloading_config(extra)).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    yield manager
    manager.shutdown()


def _steps_until(manager: TieringOffloadingManager, done: Any, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "the tier did not finish in time"
        manager.on_schedule_end(STEP)
        time.sleep(0.002)


def test_vllm_factory_builds_the_tier_from_its_registered_type(tmp_path: Path) -> None:
    register()
    spec = TieringOffloadingSpec(offloading_config({"cpu_bytes_to_use": 2 * PAGE}))
    view = memoryview(np.zeros((2, PAGE), dtype=np.int8))
    entry = _tier_entry(tmp_path)
    del entry["module_path"]  # the general plugin registered the type
    tier = SecondaryTierFactory.create_secondary_tier(entry, view, spec)
    try:
        assert isinstance(tier, KvhexSecondaryTier)
        assert tier.medium is Medium.STORAGE
        assert tier.locality is not None
        assert tier.locality.value == "LOCAL"
    finally:
        tier.shutdown()


def test_the_old_module_path_still_builds_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``secondary_tiers`` entry written for kvhex before the move names
    ``kvhex.adapters.vllm``; for a release it builds the same class (and warns)."""
    spec = TieringOffloadingSpec(offloading_config({"cpu_bytes_to_use": 2 * PAGE}))
    view = memoryview(np.zeros((2, PAGE), dtype=np.int8))
    entry = _tier_entry(tmp_path, module_path="kvhex.adapters.vllm")
    # vLLM prefers a registered type (kvhex's general plugin registers it) to the module path
    monkeypatch.delitem(SecondaryTierFactory._registry, "KvhexSecondaryTier", raising=False)
    sys.modules.pop("kvhex.adapters.vllm", None)
    with pytest.warns(DeprecationWarning, match="kvhex.adapters.vllm is now kvhex.vllm"):
        tier = SecondaryTierFactory.create_secondary_tier(entry, view, spec)
    try:
        assert type(tier) is KvhexSecondaryTier
    finally:
        tier.shutdown()


def test_a_bad_tier_option_fails_start_up_naming_the_key(tmp_path: Path) -> None:
    spec = TieringOffloadingSpec(offloading_config({"cpu_bytes_to_use": 2 * PAGE}))
    view = memoryview(np.zeros((2, PAGE), dtype=np.int8))
    with pytest.raises(ConfigError) as err:
        SecondaryTierFactory.create_secondary_tier(
            _tier_entry(tmp_path, capacity_byte=5), view, spec
        )
    assert err.value.paths == ("$.secondary_tiers[KvhexSecondaryTier:fsspec].capacity_byte",)
    with pytest.raises(ConfigError, match=r"unknown kvhex tier 'nosuch'"):
        SecondaryTierFactory.create_secondary_tier(
            {**_tier_entry(tmp_path), "tier": "nosuch"}, view, spec
        )


def test_store_cascade_promotion_and_events(tiering: TieringOffloadingManager) -> None:
    tier = tiering.secondary_tiers[0]
    assert isinstance(tier, KvhexSecondaryTier)
    rows = np.asarray(tiering.primary_tier.get_kv_memoryview())
    k0, k1 = key(1), key(2)
    writer = ReqContext("writer")
    tiering.on_new_request(writer)
    out = tiering.prepare_store([k0, k1], writer)
    assert out is not None
    slots = out.store_spec.block_ids.tolist()
    for slot, fill in zip(slots, (7, 9), strict=True):
        rows[slot, :] = fill  # what a GPU -> host store would have written
    tiering.complete_store([k0, k1], writer)  # cascades to the kvhex tier
    _steps_until(tiering, lambda: not tiering.has_pending_work())
    tiering.on_request_finished(writer)
    events = list(tiering.take_events())
    assert [(e.medium, e.removed, list(e.keys)) for e in events] == [
        (Medium.CPU, False, [k0, k1]),
        (Medium.STORAGE, False, [k0, k1]),
    ]
    assert events[1].ownership == "fsspec"
    assert events[1].locality is not None
    assert events[1].removal_expected  # the tier announces its removals too
    counted = tier.stats()  # kvhex's own counters count inside vLLM's spec too
    assert (counted.name, counted.puts_ok, counted.keys_put) == ("fsspec", 1, 2)
    assert (counted.blocks_stored, counted.resident_blocks) == (2, 2)
    assert (counted.used_bytes, counted.corrupt_blocks) == (2 * 2 * PAGE, 0)

    # the host tier forgets everything; the file tier keeps both chunks
    tiering.reset_cache()
    if SIGNALS_RESET_FLUSHED:  # vLLM 0.33's tiering manager holds promotions until then
        tiering.on_reset_flushed()
    rows[:, :] = 0
    reader = ReqContext("reader")
    tiering.on_new_request(reader)
    # the file tier's own index answers at once (no existence probe): promotion reserved
    assert tiering.lookup(k0, reader) is LookupResult.HIT_PENDING
    _steps_until(tiering, lambda: tiering.lookup(k0, reader) is LookupResult.HIT)
    spec = tiering.prepare_load([k0], reader)
    (slot,) = spec.block_ids.tolist()
    assert set(rows[slot].tolist()) == {7}  # the bytes came back from the file
    tiering.complete_load([k0], reader)
    tiering.on_request_finished(reader)
    promoted = [(e.medium, e.removed, list(e.keys)) for e in tiering.take_events()]
    assert promoted == [(Medium.CPU, False, [k0])]


def test_a_missing_block_fails_the_promotion_and_is_never_retried(
    tiering: TieringOffloadingManager,
) -> None:
    tier = tiering.secondary_tiers[0]
    assert isinstance(tier, KvhexSecondaryTier)
    ctx = ReqContext("w")
    tiering.on_new_request(ctx)
    out = tiering.prepare_store([key(5)], ctx)
    assert out is not None
    tiering.complete_store([key(5)], ctx)
    _steps_until(tiering, lambda: not tiering.has_pending_work())
    tiering.reset_cache()
    if SIGNALS_RESET_FLUSHED:  # vLLM 0.33's tiering manager holds promotions until then
        tiering.on_reset_flushed()
    reader = ReqContext("r")
    tiering.on_new_request(reader)
    tiering.lookup(key(5), reader)
    _steps_until(tiering, lambda: tiering.lookup(key(5), reader) is not LookupResult.RETRY)
    files = tier.tier_store
    assert isinstance(files, BlockTierStore)
    path, offset = files.location(key(5))
    os.truncate(path, offset)  # the block's bytes are gone from its slab file meanwhile
    _steps_until(
        tiering,
        lambda: tiering.lookup(key(5), reader) in (LookupResult.MISS, LookupResult.HIT),
    )
    assert tiering.lookup(key(5), reader) is LookupResult.MISS
    tiering.on_schedule_end(STEP)
    assert tiering.lookup(key(5), reader) is LookupResult.MISS


def test_refused_jobs_partial_loads_and_probes_reach_vllm_as_its_results() -> None:
    from vllm.v1.kv_offload.tiering.base import TransferJob

    spec = TieringOffloadingSpec(offloading_config({"cpu_bytes_to_use": 4 * PAGE}))
    rows = np.zeros((4, PAGE), dtype=np.int8)
    entry = {"type": "KvhexSecondaryTier", "tier": "memory", "capacity_bytes": 16 * PAGE}
    tier = SecondaryTierFactory.create_secondary_tier(entry, memoryview(rows), spec)
    assert isinstance(tier, KvhexSecondaryTier)
    ctx = ReqContext("r")
    tier.on_new_request(ctx)

    def job(job_id: int, ids: list[int], promotion: bool) -> TransferJob:
        slots = np.arange(len(ids), dtype=np.int64)
        return TransferJob(job_id, [key(i) for i in ids], slots, promotion, ctx)

    try:
        rows[0], rows[1] = 3, 4
        tier.submit_store(job(0, [1, 2], promotion=False))
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(0, True)]
        assert tier.lookup(key(1), ctx) is LookupResult.RETRY
        tier.on_schedule_end(STEP)  # one probe job, under a negative id vLLM never sees
        assert list(tier.get_finished_jobs()) == []
        assert tier.lookup(key(1), ctx) is LookupResult.HIT
        rows[:] = 0
        store = tier.tier_store
        assert isinstance(store, MemoryTierStore)
        store.partial_next_get([key(2)])
        tier.submit_load(job(1, [1, 2], promotion=True))
        (partial,) = tier.get_finished_jobs()
        assert (partial.job_id, partial.success, partial.successful_keys) == (1, False, [key(2)])
        assert set(rows[1].tolist()) == {4}
        assert tier.lookup(key(1), ctx) is LookupResult.MISS  # never promoted again from here
        store.close()
        tier.submit_store(job(2, [3], promotion=False))
        assert tier.has_pending_work()  # the refusal is reported by the next poll
        (refused,) = tier.get_finished_jobs()
        assert (refused.job_id, refused.success, refused.transfer_bytes) == (2, False, None)
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()
