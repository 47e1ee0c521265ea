"""``StreamHoldings``: what a KV-event stream still announces, folded, and said again.

A consumer of a KV-event stream (a router's index) ends up holding, per residency (medium,
locality, ownership, KV group), every block a ``BlockStored`` announced and no
``BlockRemoved`` took back since the last ``AllBlocksCleared``. This fold keeps exactly that,
with each block's store event (its tokens, parent, extra keys), and says it again as store
events, parent first, when a consumer must learn it anew:

* a replay socket asked for batches older than it keeps (``adapters.events.replay``): the
  snapshot stands for every batch it folded;
* a publisher whose consumers were told to forget everything it said (vLLM's device pool
  publishes ``AllBlocksCleared``, with no medium, when its prefix cache is reset, and routers
  forget every medium of that publisher): the blocks kvhex's tiers still hold are announced
  again (``kvhex.vllm``).

Memory: the store events of live blocks (their tokens included), what a router's index itself
holds for the stream; a store event whose blocks were all removed is dropped.

Pure: no IO, no clock; one thread at a time.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any

from kvhex.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalHash,
    PublicEvent,
)

_Block = tuple[Any, ...]
"""(medium, locality, ownership, group_idx, block hash)."""


class _Kept:
    """A folded ``BlockStored`` and which of its blocks are still live."""

    __slots__ = ("event", "left", "live")

    def __init__(self, event: BlockStored) -> None:
        self.event = event
        self.live = [True] * len(event.block_hashes)
        self.left = len(self.live)  # blocks still live


class StreamHoldings:
    """The blocks a stream's events still announce (see the module docstring)."""

    __slots__ = ("_ids", "_kept", "_where", "withheld")

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._kept: dict[int, _Kept] = {}  # in fold order
        self._where: dict[_Block, tuple[int, int]] = {}  # block -> (kept id, index)
        self.withheld: set[_Block] = set()
        """Blocks a snapshot without orphans left out: consumers do not know them (see
        :meth:`unsaid`)."""

    def __len__(self) -> int:
        """Blocks held, counted once per residency."""
        return len(self._where)

    def fold(self, events: Iterable[PublicEvent]) -> None:
        """Apply ``events`` in order: stores add their blocks (a block announced again is
        described by its newer store), removals take them back, a clear forgets all."""
        where_of = self._where
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                stored: BlockStored = event  # type: ignore[assignment]
                where = (stored.medium, stored.locality, stored.ownership, stored.group_idx)
                kid = next(self._ids)
                self._kept[kid] = _Kept(stored)
                for i, h in enumerate(stored.block_hashes):
                    block = (*where, h)
                    old = where_of.get(block)
                    if old is not None:
                        self._drop(*old)  # announced again: the newer store describes it
                    where_of[block] = (kid, i)
            elif kind is BlockRemoved:
                removed: BlockRemoved = event  # type: ignore[assignment]
                where = (removed.medium, removed.locality, removed.ownership, removed.group_idx)
                for h in removed.block_hashes:
                    place = where_of.pop((*where, h), None)
                    if place is not None:
                        self._drop(*place)
            elif kind is AllBlocksCleared:
                self.clear()

    def unsaid(self, events: list[PublicEvent]) -> list[PublicEvent]:
        """``events`` less the removals of :attr:`withheld` blocks, which consumers never
        heard of again (a store of one says it again). Called before :meth:`fold`."""
        withheld = self.withheld
        out: list[PublicEvent] = []
        for event in events:
            if type(event) is BlockRemoved:
                removed: BlockRemoved = event
                where = (removed.medium, removed.locality, removed.ownership, removed.group_idx)
                gone = {(*where, h) for h in removed.block_hashes} & withheld
                if gone:
                    withheld -= gone
                    kept = [h for h in removed.block_hashes if (*where, h) not in gone]
                    if kept:
                        out.append(removed._replace(block_hashes=kept))
                    continue
            elif type(event) is BlockStored:
                stored: BlockStored = event
                where = (stored.medium, stored.locality, stored.ownership, stored.group_idx)
                withheld.difference_update((*where, h) for h in stored.block_hashes)
            elif type(event) is AllBlocksCleared:
                withheld.clear()
            out.append(event)
        return out

    def clear(self) -> None:
        """Forget everything (as a consumer does at ``AllBlocksCleared``)."""
        self._kept.clear()
        self._where.clear()
        self.withheld.clear()

    def snapshot(self, *, orphans: bool = True) -> list[BlockStored]:
        """The live blocks as store events: each kept event's live runs, in fold order, but
        a run whose parent is live and not out yet waits for it (a parent stored again after
        its child). A run whose parent nothing here holds (a block of another publisher, or
        of the engine's device) goes out in fold order, unless ``orphans`` is false: then it
        is left out, with the runs under it (a radix-tree index would drop them: after a
        device clear, a block whose parent only the device held has no parent left), and
        its blocks are :attr:`withheld` from then on (their removals unsaid)."""
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
            if parent is not None and parent not in emitted:
                if parent in live_hashes:  # its parent is not out yet
                    waiting.setdefault(parent, []).append((event, parent))
                    continue
                if not orphans:  # no parent here: left out, and what waits for it
                    continue
            out.append(event)
            for h in event.block_hashes:
                emitted.add(h)
                work.extendleft(reversed(waiting.pop(h, [])))
        if orphans:
            for stuck in waiting.values():  # a cycle of hashes cannot happen; never lose one
                out += [event for event, _ in stuck]
        else:
            said = {
                (e.medium, e.locality, e.ownership, e.group_idx, h)
                for e in out
                for h in e.block_hashes
            }
            self.withheld = set(self._where).difference(said)
        return out

    def _drop(self, kid: int, index: int) -> None:
        kept = self._kept.get(kid)
        if kept is None:
            return
        if kept.live[index]:
            kept.live[index] = False
            kept.left -= 1
            if not kept.left:
                del self._kept[kid]


def _live_runs(kept: _Kept) -> list[tuple[BlockStored, ExternalHash | None]]:
    """The contiguous live blocks of a kept store, each run as a store of its own with the
    hash before it as parent."""
    event = kept.event
    if kept.left == len(kept.live):
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
