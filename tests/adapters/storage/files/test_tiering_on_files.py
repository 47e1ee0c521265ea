"""The whole stack on a real file tier: device stores cascade into files, a reset empties the
host tier, a later request is served by promotion from the files with the same bytes, and
every STORAGE event is fully described; a second engine on the same root after a restart
serves the blocks too."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from kvhex.adapters.memory import MemoryEventSink, MemoryHostBuffer
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.domain import BlockStored, LookupResult, LruPolicy, PrimaryTier, ReqContext
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.translate import EventTranslator
from kvhex.service import EventPipeline, OffloadEngine, TieringManager
from tests.domain.requests import chunk_key, make_request

GROUP = KvGroup(0, tokens_per_block=4)
GEO = KvGeometry((GROUP,), tokens_per_hash=4)
SLOT = 8192


def engine(root: Path) -> tuple[OffloadEngine, MemoryHostBuffer, MemoryEventSink]:
    host = MemoryHostBuffer(8, SLOT)
    files = FsspecTierStore(
        host, str(root), capacity_bytes=1 << 22, name="disk", namespace={"model": "test"}
    )
    sink = MemoryEventSink()
    manager = TieringManager(PrimaryTier(8, LruPolicy(8)), [files], host=host)
    return OffloadEngine(manager, EventPipeline(EventTranslator(GEO), [sink])), host, sink


def chunk_bytes(key: bytes) -> bytes:
    return hashlib.shake_256(key).digest(SLOT)


def settle(eng: OffloadEngine, ctx: ReqContext, key: bytes) -> LookupResult:
    """Ask step after step, as a scheduler does, while the file tier works on its threads."""
    for _ in range(500):
        answer = eng.lookup(key, ctx)
        if answer not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
            return answer
        eng.on_schedule_end()
        eng.take_events()
        time.sleep(0.005)
    return eng.lookup(key, ctx)


def test_store_cascade_reset_promote_and_restart_on_real_files(tmp_path: Path) -> None:
    eng, host, sink = engine(tmp_path)
    writer = make_request("w", list(range(16)), GEO)
    keys = [chunk_key(writer, c, GROUP) for c in range(4)]
    plan = eng.prepare_store(keys, writer)
    assert plan is not None
    for k, slot in zip(plan.keys, plan.slots, strict=True):
        host.slot_view(slot)[:] = chunk_bytes(k)
    eng.complete_store(plan.keys, writer)
    eng.on_request_finished(writer)
    while eng.has_pending_work():
        eng.lookup(keys[0], writer)
        eng.on_schedule_end()
        eng.take_events()
        time.sleep(0.005)
    stored = [e for b in sink.batches for e in b.events if isinstance(e, BlockStored)]
    (disk,) = [e for e in stored if e.medium == "STORAGE"]  # the put's 4 chunks: one chain
    assert disk.block_hashes == [k[:-4] for k in keys]
    assert not disk.is_placeholder
    assert disk.ownership is None
    eng.reset()
    reader = make_request("r", list(range(16)), GEO)
    assert settle(eng, reader, keys[2]) is LookupResult.HIT
    (slot,) = eng.prepare_load([keys[2]], reader)
    assert bytes(host.slot_view(slot)) == chunk_bytes(keys[2])
    eng.complete_load([keys[2]], reader)
    eng.shutdown()

    again, host2, _ = engine(tmp_path)  # a new process on the same root
    later = make_request("l", list(range(16)), GEO)
    assert settle(again, later, keys[3]) is LookupResult.HIT
    (slot,) = again.prepare_load([keys[3]], later)
    assert bytes(host2.slot_view(slot)) == chunk_bytes(keys[3])
    again.complete_load([keys[3]], later)
    again.shutdown()
