"""A small serving workload through the real engine, publishing its KV events to sinks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain import LruPolicy, PrimaryTier
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.translate import EventTranslator
from kvhex.ports.event_sink import EventSink
from kvhex.service import EventPipeline, OffloadEngine, TieringManager
from tests.domain.requests import chunk_key, make_request

GROUP = KvGroup(0, tokens_per_block=4, blocks_per_chunk=2)
GEO = KvGeometry((GROUP,), tokens_per_hash=4)
SLOTS = 4
REQUESTS = 5
CHUNKS = 2
"""Chunks per request: 10 chunks into a host tier of 4 slots, so the host tier evicts."""


def serve(sinks: Sequence[EventSink], *, int_hashes: bool = False) -> Iterator[MemoryTierStore]:
    """Store every request's chunks (host tier, then a cascade to an in-memory tier named
    ``mem``), one step each, then reset the host tier; yields after each step so a test can
    pace the publishing, and finally the secondary tier (which keeps every chunk).
    ``int_hashes``: publish hashes as ints (vLLM's default form), else as bytes."""
    host = MemoryHostBuffer(SLOTS, 32)
    tier = MemoryTierStore(host, capacity_bytes=64 * 32, name="mem", complete_after_polls=1)
    manager = TieringManager(PrimaryTier(SLOTS, LruPolicy(SLOTS)), [tier], host=host)
    translator = EventTranslator(GEO, int_hashes=int_hashes)
    engine = OffloadEngine(manager, EventPipeline(translator, list(sinks)))
    for r in range(REQUESTS):
        ctx = make_request(f"r{r}", list(range(100 * r, 100 * r + 4 * 2 * CHUNKS)), GEO)
        engine.on_new_request(ctx)
        keys = [chunk_key(ctx, c, GROUP) for c in range(CHUNKS)]
        plan = engine.prepare_store(keys, ctx)
        assert plan is not None
        engine.complete_store(plan.keys, ctx)
        engine.on_schedule_end()
        engine.take_events()
        engine.on_request_finished(ctx)
        yield tier
    for _ in range(3):  # the last cascades complete on later polls
        engine.on_schedule_end()
        engine.take_events()
    engine.reset()
    engine.take_events()
    yield tier  # no shutdown: it would close the sinks, which the test still replays from
