"""Announcing the blocks an object store adopted at start-up once their records are read
(:mod:`kvhex.adapters.storage.adoption`), on a real IO pool with a record source whose reads
wait for the test."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvhex.adapters.storage._io_pool import IoPool
from kvhex.adapters.storage.adoption import BATCH, Adoption
from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import ChunkRecord, record_of
from kvhex.domain.tiers import Medium, TierIdentity
from tests.adapters.storage.peer_kit import request

TIER = TierIdentity(Medium.STORAGE, None, "s3")


class GatedRecords:
    """Records of a request, read once the gate opens; ``fail_after`` batches succeed."""

    records_by_request = True

    def __init__(self, known: dict[OffloadKey, ChunkRecord | None], fail_after: int = -1) -> None:
        self.known = known
        self.gate = threading.Event()
        self.fail_after = fail_after
        self.batches = 0

    def read_records(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, ChunkRecord | None]:
        self.gate.wait(30)
        if self.batches == self.fail_after:
            raise OSError("the store went away")
        self.batches += 1
        return {k: self.known[k] for k in keys if k in self.known}


def test_removals_before_the_announcement_hide_their_blocks_for_good() -> None:
    ctx, keys = request("r", 4)
    records = {k: record_of(ctx, k) for k in keys}
    io = GatedRecords(records)
    pool = IoPool(1, "test")
    try:
        adoption = Adoption(Stored(tuple(keys), TIER), io, pool, tier="s3")
        other = OffloadKey(b"o" * 36)
        assert adoption.hide([Removed((keys[0], other), TIER)]) == [Removed((other,), TIER)]
        # a new copy's life after the hidden one's: announced
        again: list[TierEvent] = [Stored((keys[0],), TIER), Removed((keys[0],), TIER)]
        assert adoption.hide(again) == again
        io.gate.set()
        pool.wait([adoption.task])
        # evicted, then stored again, before the records were read
        later: list[TierEvent] = [Removed((keys[1],), TIER), Stored((keys[1],), TIER)]
        out = adoption.announce(later)
        assert out[0] == Stored((keys[1],), TIER)  # the new copy, as the tier announced it
        assert out[1] == Stored(
            (keys[2], keys[3]), TIER, None, (records[keys[2]], records[keys[3]])
        )
        assert adoption.hide([Removed((keys[2],), TIER)]) == [Removed((keys[2],), TIER)]
    finally:
        pool.close()


def test_a_failed_read_announces_placeholders_for_what_it_left() -> None:
    ctx, keys = request("r", 2)
    many = [OffloadKey(i.to_bytes(32, "big") + bytes(4)) for i in range(BATCH)] + keys
    io = GatedRecords({k: record_of(ctx, k) for k in keys}, fail_after=1)
    io.gate.set()
    pool = IoPool(1, "test")
    try:
        adoption = Adoption(Stored(tuple(many), TIER), io, pool, tier="s3")
        pool.wait([adoption.task])
        (stored,) = adoption.announce([])
        assert isinstance(stored, Stored)
        assert stored.keys == tuple(many)
        assert stored.records is None  # the first batch had no records, the second failed
    finally:
        pool.close()
