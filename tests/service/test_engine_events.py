"""Provenance end to end through the engine: late completions, promotions, resets, and no
request context left behind once a workload drains."""

from __future__ import annotations

import gc
import weakref

from kvhex.adapters.memory import MemoryEventSink, MemoryHostBuffer, MemoryTierStore
from kvhex.domain import LookupResult, LruPolicy, PrimaryTier, ReqContext
from kvhex.domain.events import BlockRemoved, BlockStored
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.translate import EventTranslator
from kvhex.service import EventPipeline, OffloadEngine, TieringManager
from tests.domain.requests import chunk_key, make_request

GROUP = KvGroup(0, tokens_per_block=4, blocks_per_chunk=2)
GEO = KvGeometry((GROUP,), tokens_per_hash=4)
SLOT = 32


def engine(
    slots: int = 8, polls: int = 3
) -> tuple[OffloadEngine, MemoryEventSink, list[MemoryTierStore]]:
    host = MemoryHostBuffer(slots, SLOT)
    tiers = [
        MemoryTierStore(host, capacity_bytes=64 * SLOT, name="mem", complete_after_polls=polls)
    ]
    sink = MemoryEventSink()
    manager = TieringManager(PrimaryTier(slots, LruPolicy(slots)), tiers, host=host)
    pipeline = EventPipeline(EventTranslator(GEO), [sink], clock=lambda: 1.0)
    return OffloadEngine(manager, pipeline), sink, tiers


def store_all(eng: OffloadEngine, ctx: ReqContext, chunks: int) -> list[bytes]:
    keys = [chunk_key(ctx, c, GROUP) for c in range(chunks)]
    plan = eng.prepare_store(keys, ctx)
    assert plan is not None
    eng.complete_store(plan.keys, ctx)
    return keys


def published(sink: MemoryEventSink) -> list[object]:
    return [e for b in sink.batches for e in b.events]


def test_a_cascade_completing_after_its_request_finished_is_fully_described() -> None:
    eng, sink, _ = engine(polls=3)
    ctx = make_request("r", list(range(16)), GEO, lora_id=1, lora_name="lora-a")
    eng.on_new_request(ctx)
    keys = store_all(eng, ctx, 2)
    eng.on_request_finished(ctx)
    del ctx
    for _ in range(4):  # the tier finishes its puts several steps later
        eng.on_schedule_end()
        eng.lookup(keys[0], ReqContext("other"))
        eng.take_events()
    stored = [e for e in published(sink) if isinstance(e, BlockStored)]
    # each job's two chunks as one chain; the tier names no ownership
    assert [(e.medium, e.locality, e.ownership) for e in stored] == [
        ("CPU", None, None),
        ("STORAGE", "LOCAL", None),
    ]
    for e in stored:
        assert not e.is_placeholder
        assert (len(e.block_hashes), e.block_size, e.lora_name) == (4, 4, "lora-a")
        assert e.token_ids == list(range(16))
        assert e.parent_block_hash is None


def test_a_promotion_is_announced_with_the_promoting_requests_provenance() -> None:
    eng, sink, _ = engine(polls=1)
    writer = make_request("w", list(range(16)), GEO)
    keys = store_all(eng, writer, 2)
    eng.on_schedule_end()
    eng.lookup(keys[0], writer)  # poll: cascades done
    eng.reset()  # the host tier forgets; the tier keeps the chunks
    eng.take_events()
    sink.batches.clear()
    reader = make_request("reader", list(range(16)), GEO, session_id="s-9")
    assert eng.lookup(keys[1], reader) is LookupResult.RETRY
    eng.on_schedule_end()
    assert eng.lookup(keys[1], reader) is LookupResult.HIT_PENDING
    eng.on_schedule_end()
    assert eng.lookup(keys[1], reader) is LookupResult.HIT
    eng.take_events()
    (ev,) = [e for e in published(sink) if isinstance(e, BlockStored)]
    assert (ev.medium, ev.session_id, ev.token_ids) == ("CPU", "s-9", list(range(8, 16)))


def test_a_reset_announces_the_removal_of_every_host_chunk_with_its_hashes() -> None:
    eng, sink, _ = engine(polls=1)
    ctx = make_request("r", list(range(16)), GEO)
    store_all(eng, ctx, 2)
    eng.on_schedule_end()
    eng.lookup(chunk_key(ctx, 0, GROUP), ctx)
    eng.reset()
    eng.take_events()
    removed = [e for e in published(sink) if isinstance(e, BlockRemoved)]
    assert [(e.medium, len(e.block_hashes)) for e in removed] == [("CPU", 4)]


def test_no_request_context_stays_referenced_after_a_workload_drains() -> None:
    eng, _, _ = engine(slots=4, polls=2)
    refs = []
    for i in range(6):
        ctx = make_request(f"r{i % 2}", list(range(100 * i, 100 * i + 16)), GEO)
        refs.append(weakref.ref(ctx))
        eng.on_new_request(ctx)
        keys = [chunk_key(ctx, c, GROUP) for c in range(2)]
        for k in keys:
            eng.lookup(k, ctx)
        plan = eng.prepare_store(keys, ctx)
        if plan is not None:
            eng.complete_store(plan.keys, ctx, success=i != 3)
        eng.on_request_finished(ctx)
        eng.on_schedule_end()
        eng.take_events()
        del ctx
    while eng.has_pending_work():
        eng.lookup(b"\0" * 36, ReqContext("poller"))  # type: ignore[arg-type]
        eng.on_schedule_end()
        eng.take_events()
    eng.lookup(b"\0" * 36, ReqContext("poller"))  # type: ignore[arg-type]
    eng.take_events()
    gc.collect()
    assert [r() for r in refs] == [None] * 6
    eng.shutdown()
