"""The announcement of the blocks a storage tier adopts at start-up, each in full from the
chunk record its header keeps (:mod:`kvhex.adapters.storage.records`), or as a placeholder
where it keeps none.

Where reading a record is a local read (slabs: a ``pread`` of the header area per block,
about 13 us with its decoding), the records are read at start-up and the adopted blocks
announced with the tier's first events (:func:`described`). Where it is a request per block
(object stores: a ranged GET of each object's header area, about 2 ms of the client's CPU
each through s3fs), reading them could hold a large bucket's start-up for minutes, so they
are read by an IO job after it (:class:`Adoption`, a batch of :data:`BATCH` objects at a
time, concurrently), and the adopted blocks are announced when it is done. Meanwhile the
tier serves them and announces everything else: what happens to an adopted block before it
is announced (an eviction, a loss) is never announced, so its stream stays one that replays
to what the tier holds.

Threads: the scheduler thread, but the record reads (one IO job).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from kvhex.adapters.storage._io_pool import IoPool
from kvhex.adapters.storage.block_io import RecordReading, safe_error
from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import ChunkRecord

log = structlog.get_logger(__name__)

BATCH = 1024
"""Objects whose records one request batch reads (the tier's other requests go between)."""


def described(event: Stored, io: RecordReading, *, tier: str) -> Stored:
    """``event`` (the blocks adopted at start-up) with the records their headers keep, read
    now; as it is where they cannot be read (announced as placeholders, as before)."""
    try:
        found = io.read_records(event.keys)
    except Exception as exc:
        log.warning("tier_records_unread", tier=tier, error=safe_error(exc))
        return event
    return _with(event, found)


class Adoption:
    """The adopted blocks of ``event``, announced once their records are read by an IO job.

    Args:
        event: the adoption's ``Stored`` (no records), not announced yet.
        io: reads the records.
        pool: the tier's IO threads.
        tier: the tier's name, for logs.
    """

    __slots__ = ("_event", "_hidden", "task")

    def __init__(self, event: Stored, io: RecordReading, pool: IoPool, *, tier: str) -> None:
        self._event = event
        self._hidden = set(event.keys)  # adopted, not announced, not removed since
        self.task = pool.submit(_read_all, io, event.keys, tier)

    def hide(self, events: list[TierEvent]) -> list[TierEvent]:
        """``events`` less the removals of adopted blocks not announced yet (each of those
        blocks is then never announced)."""
        hidden = self._hidden
        out: list[TierEvent] = []
        for event in events:
            if type(event) is not Removed or hidden.isdisjoint(event.keys):
                out.append(event)
                continue
            keys = tuple(k for k in event.keys if k not in hidden)
            hidden.difference_update(event.keys)
            if keys:
                out.append(Removed(keys, event.tier))
        return out

    def announce(self, earlier: list[TierEvent]) -> list[TierEvent]:
        """The events to announce now that :attr:`task` finished: ``earlier`` (the tier's
        events so far, hidden as :meth:`hide`), then the adopted blocks still held, with
        their records (none where the job failed: placeholders)."""
        out = self.hide(earlier)
        found: dict[OffloadKey, ChunkRecord | None] = {}
        if self.task.error is None:
            found = self.task.value
        hidden = self._hidden
        keys = tuple(k for k in self._event.keys if k in hidden)
        hidden.clear()
        if keys:
            out.append(_with(Stored(keys, self._event.tier, None), found))
        return out


def _with(event: Stored, found: dict[OffloadKey, ChunkRecord | None]) -> Stored:
    records = tuple(found.get(key) for key in event.keys)
    if all(record is None for record in records):
        return event
    return Stored(event.keys, event.tier, event.ctx, records)


def _read_all(
    io: RecordReading, keys: Sequence[OffloadKey], tier: str
) -> dict[OffloadKey, ChunkRecord | None]:
    """The records of ``keys``, :data:`BATCH` at a time; after a failed batch, what was
    read (the rest are announced as placeholders)."""
    found: dict[OffloadKey, ChunkRecord | None] = {}
    for start in range(0, len(keys), BATCH):
        try:
            found.update(io.read_records(keys[start : start + BATCH]))
        except Exception as exc:
            log.warning(
                "tier_records_unread", tier=tier, blocks=len(keys) - start, error=safe_error(exc)
            )
            break
    return found
