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
router's index itself holds for this publisher; a store event whose blocks were all removed
is dropped.

Thread: the sink's sender thread only.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from kvhex.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalHash,
    PublicEvent,
)

_Block = tuple[Any, ...]
"""(medium, locality, ownership, group_idx, block hash)."""


class _Kept:
    """A folded ``BlockStored`` and which of its blocks are still live."""

    __slots__ = ("event", "live")

    def __init__(self, event: BlockStored) -> None:
        self.event = event
        self.live = [True] * len(event.block_hashes)


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
        self._ids = itertools.count()
        self._kept: dict[int, _Kept] = {}  # in fold order
        self._where: dict[_Block, tuple[int, int]] = {}  # block -> (kept id, index)
        self._folded: int | None = None  # the last sequence folded into the snapshot
        self._rank: int | None = None

    @property
    def folded_up_to(self) -> int | None:
        """The last sequence folded into the snapshot (``None``: nothing folded yet)."""
        return self._folded

    @property
    def snapshot_blocks(self) -> int:
        """Blocks the snapshot holds."""
        return len(self._where)

    def append(self, seq: int, batch: EventBatch, payload: bytes) -> None:
        """Batch ``seq`` was published as ``payload``."""
        self._window.append((seq, batch, payload))
        self._rank = batch.data_parallel_rank
        while len(self._window) > self._keep:
            old_seq, old, _ = self._window.popleft()
            self._fold(old.events)
            self._folded = old_seq

    def since(self, first: int) -> Iterator[tuple[int, bytes]]:
        """``(sequence, payload)`` of everything from ``first`` on: the snapshot batch when
        ``first`` is older than the window, then the window's batches from ``first``."""
        if self._folded is not None and first <= self._folded:
            ts = self._window[0][1].ts if self._window else 0.0
            events: list[PublicEvent] = [AllBlocksCleared(), *self._snapshot()]
            yield self._folded, self._encode(EventBatch(ts, events, self._rank))
        for seq, _, payload in list(self._window):
            if seq >= first:
                yield seq, payload

    # -- the snapshot --------------------------------------------------------------------
    def _fold(self, events: list[PublicEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                where = (event.medium, event.locality, event.ownership, event.group_idx)
                kid = next(self._ids)
                self._kept[kid] = _Kept(event)
                for i, h in enumerate(event.block_hashes):
                    old = self._where.get((*where, h))
                    if old is not None:
                        self._drop(*old)  # announced again: the newer store describes it
                    self._where[(*where, h)] = (kid, i)
            elif isinstance(event, BlockRemoved):
                where = (event.medium, event.locality, event.ownership, event.group_idx)
                for h in event.block_hashes:
                    place = self._where.pop((*where, h), None)
                    if place is not None:
                        self._drop(*place)
            elif isinstance(event, AllBlocksCleared):
                self._kept.clear()
                self._where.clear()

    def _drop(self, kid: int, index: int) -> None:
        kept = self._kept.get(kid)
        if kept is None:
            return
        kept.live[index] = False
        if not any(kept.live):
            del self._kept[kid]

    def _snapshot(self) -> list[BlockStored]:
        """The live blocks as store events: each kept event's live runs, in fold order, but
        a run whose parent is live and not out yet waits for it (a parent stored again after
        its child)."""
        runs: list[tuple[BlockStored, ExternalHash | None]] = []
        for kept in self._kept.values():
            runs += _live_runs(kept)
        live_hashes = {block[4] for block in self._where}
        out: list[BlockStored] = []
        emitted: set[ExternalHash] = set()
        waiting: dict[ExternalHash, list[tuple[BlockStored, ExternalHash | None]]] = {}
        work: deque[tuple[BlockStored, ExternalHash | None]] = deque(runs)
        while work:
            event, parent = work.popleft()
            if parent is not None and parent in live_hashes and parent not in emitted:
                waiting.setdefault(parent, []).append((event, parent))
                continue
            out.append(event)
            for h in event.block_hashes:
                emitted.add(h)
                work.extendleft(reversed(waiting.pop(h, [])))
        for stuck in waiting.values():  # a cycle of hashes cannot happen; never lose one
            out += [event for event, _ in stuck]
        return out


def _live_runs(kept: _Kept) -> list[tuple[BlockStored, ExternalHash | None]]:
    """The contiguous live blocks of a kept store, each run as a store of its own with the
    hash before it as parent."""
    event = kept.event
    if all(kept.live):
        return [(event, event.parent_block_hash)]
    size = event.block_size
    out = []
    i, n = 0, len(event.block_hashes)
    while i < n:
        if not kept.live[i]:
            i += 1
            continue
        j = i
        while j < n and kept.live[j]:
            j += 1
        parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
        extra = event.extra_keys[i:j] if event.extra_keys is not None else None
        tokens = event.token_ids[i * size : j * size] if size else event.token_ids
        run = event._replace(
            block_hashes=event.block_hashes[i:j],
            parent_block_hash=parent,
            token_ids=tokens,
            extra_keys=extra,
        )
        out.append((run, parent))
        i = j
    return out
