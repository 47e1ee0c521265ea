"""``ReplayLog``: what a replay socket answers, however long ago the subscriber's gap began.

A publisher keeps its last ``keep`` batches for replay, as vLLM's does; a subscriber that asks
from an older sequence (an indexer that joins after hours, or restarts) would otherwise get
only the tail, and a router would hold a block whose removal it never saw, or miss one stored
long ago. The batches that leave the window are folded into a snapshot instead: every
``BlockStored`` block not removed since, per residency (medium, locality, ownership, KV group)
and block hash. A replay from a sequence the window no longer holds starts with one batch,
numbered with the last folded sequence, holding ``AllBlocksCleared`` (forget what this
publisher said before) and then the snapshot's stores, parent first; the window's batches
follow. Replaying that gives exactly the blocks the whole stream holds.

Memory: the snapshot keeps the store events of live blocks (their tokens included), what a
router's index itself holds for this publisher (``kvhex.domain.holdings.StreamHoldings``).

Thread: the sink's sender thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from kvhex.domain.events import AllBlocksCleared, EventBatch, PublicEvent
from kvhex.domain.holdings import StreamHoldings


class ReplayLog:
    """The last ``keep`` batches, and a snapshot of what the older ones still announce.

    Args:
        keep: batches kept whole (at least 1).
        encode: a batch's wire bytes (the snapshot batch is encoded when asked for).
    """

    def __init__(self, keep: int, encode: Callable[[EventBatch], bytes]) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self._keep = keep
        self._encode = encode
        self._window: deque[tuple[int, EventBatch, bytes]] = deque()
        self._held = StreamHoldings()  # what the folded batches still announce
        self._folded: int | None = None  # the last sequence folded into the snapshot
        self._rank: int | None = None

    @property
    def folded_up_to(self) -> int | None:
        """The last sequence folded into the snapshot (``None``: nothing folded yet)."""
        return self._folded

    @property
    def snapshot_blocks(self) -> int:
        """Blocks the snapshot holds."""
        return len(self._held)

    def append(self, seq: int, batch: EventBatch, payload: bytes) -> None:
        """Batch ``seq`` was published as ``payload``."""
        self._window.append((seq, batch, payload))
        self._rank = batch.data_parallel_rank
        while len(self._window) > self._keep:
            old_seq, old, _ = self._window.popleft()
            self._held.fold(old.events)
            self._folded = old_seq

    def since(self, first: int) -> Iterator[tuple[int, bytes]]:
        """``(sequence, payload)`` of everything from ``first`` on: the snapshot batch when
        ``first`` is older than the window, then the window's batches from ``first``."""
        if self._folded is not None and first <= self._folded:
            ts = self._window[0][1].ts if self._window else 0.0
            events: list[PublicEvent] = [AllBlocksCleared(), *self._held.snapshot()]
            yield self._folded, self._encode(EventBatch(ts, events, self._rank))
        for seq, _, payload in list(self._window):
            if seq >= first:
                yield seq, payload
