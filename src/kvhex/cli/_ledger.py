"""Replaying a KV-event stream as a consumer does, and noting where it does not add up.

Used by ``kvhex events``. A consumer (a KV-aware router) keeps, per residency (medium,
locality, ownership, KV group), a reference count per block hash: every ``BlockStored``
hash adds one, every ``BlockRemoved`` hash takes one away, ``AllBlocksCleared`` forgets
everything (docs/events.md). Replaying the stream so, the ledger records:

* sequence gaps (batches never received) and sequences that went back (a restarted
  publisher, or duplicates), and batches that did not decode; a gap right before a batch
  that starts with ``AllBlocksCleared`` loses nothing (the clear forgets everything the
  missing batches said): it is what kvhex's replay sends for batches older than its buffer
  (a snapshot), and is counted apart, not failed;
* removals of hashes the residency does not hold (a consumer ignores them, but in a stream
  seen from its start they mean a store was never announced or a removal was sent twice);
* stores of hashes already held (counted, not an error: chunks that share blocks announce
  them with each chunk, which is why consumers count references);
* full stores whose parent no residency holds (a radix-tree index, Dynamo's or llm-d's,
  drops such a block: the stream must announce every parent first);
* ``AllBlocksCleared`` events, and the blocks each medium holds at the end.

A stream joined after its start (first sequence above 0, no replay) cannot tell a removal of
a block stored before it joined from a bad one: such removals are reported, not failed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs

from kvhex.adapters.events.wire import AllBlocksCleared, BlockRemoved, BlockStored

Residency = tuple[str | None, str | None, str | None, int | None]
"""(medium, locality, ownership, group_idx) of an event."""


def residency_label(medium: str | None, locality: str | None, ownership: str | None) -> str:
    """``CPU``, or ``STORAGE(LOCAL,files)`` when locality or ownership are set."""
    name = medium or "-"
    if locality is None and ownership is None:
        return name
    return f"{name}({locality or '-'},{ownership or '-'})"


@attrs.define
class StreamLedger:
    """The consumer-side state of one stream and its inconsistencies so far.

    ``expected_first`` is the sequence the stream must start at to be seen whole (the start
    of a replay), or ``None`` when it was joined live at whatever sequence came first.
    """

    expected_first: int | None = None
    first_seq: int | None = None
    last_seq: int | None = None
    batches: int = 0
    gaps: list[tuple[int, int]] = attrs.Factory(list)
    cleared_gaps: list[tuple[int, int]] = attrs.Factory(list)
    """Gaps right before a batch that starts with ``AllBlocksCleared``: nothing lost."""
    regressions: list[tuple[int, int]] = attrs.Factory(list)
    undecodable: int = 0
    events: Counter[str] = attrs.Factory(Counter)
    unknown_removals: Counter[str] = attrs.Factory(Counter)
    duplicate_stores: Counter[str] = attrs.Factory(Counter)
    orphan_stores: Counter[str] = attrs.Factory(Counter)
    clears: int = 0
    problems: list[str] = attrs.Factory(list)
    _held: dict[Residency, Counter[bytes | int]] = attrs.Factory(dict)
    _gap_before: bool = False  # the batch whose first event is next came after a gap

    # -- feeding -------------------------------------------------------------------------
    def batch(self, seq: int) -> None:
        """A batch with sequence ``seq`` arrived (call before its events)."""
        self.batches += 1
        gaps = len(self.gaps)
        if self.last_seq is None:
            self.first_seq = seq
            if self.expected_first is not None and seq > self.expected_first:
                self.gaps.append((self.expected_first, seq - 1))
        elif seq > self.last_seq + 1:
            self.gaps.append((self.last_seq + 1, seq - 1))
        elif seq <= self.last_seq:
            self.regressions.append((self.last_seq, seq))
        self.last_seq = seq
        self._gap_before = len(self.gaps) > gaps

    def bad_batch(self, seq: int) -> None:
        """A batch with sequence ``seq`` arrived but did not decode."""
        self.batch(seq)
        self.undecodable += 1

    def event(self, event: Any) -> None:
        """Apply one decoded event."""
        if self._gap_before:
            self._gap_before = False
            if isinstance(event, AllBlocksCleared):  # the missing batches no longer matter
                self.cleared_gaps.append(self.gaps.pop())
        kind = type(event).__name__
        self.events[kind] += 1
        if isinstance(event, BlockStored):
            label, held = self._residency(event)
            parent = event.parent_block_hash
            if event.block_size and parent is not None and not self._holds(parent):
                self.orphan_stores[label] += 1
            for h in event.block_hashes:
                if held[h]:
                    self.duplicate_stores[label] += 1
                held[h] += 1
        elif isinstance(event, BlockRemoved):
            label, held = self._residency(event)
            for h in event.block_hashes:
                count = held[h]
                if count == 0:
                    self.unknown_removals[label] += 1
                elif count == 1:
                    del held[h]
                else:
                    held[h] = count - 1
        elif isinstance(event, AllBlocksCleared):
            self.clears += 1
            self._held.clear()

    def _holds(self, block_hash: bytes | int) -> bool:
        return any(held[block_hash] for held in self._held.values())

    def _residency(self, event: BlockStored | BlockRemoved) -> tuple[str, Counter[bytes | int]]:
        key = (event.medium, event.locality, event.ownership, event.group_idx)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = Counter()
        return residency_label(event.medium, event.locality, event.ownership), held

    # -- verdict -------------------------------------------------------------------------
    @property
    def joined_late(self) -> bool:
        """The stream was not seen from its start: earlier stores are unknown."""
        return self.expected_first is None and (self.first_seq or 0) > 0

    def blocks(self) -> dict[str, int]:
        """Distinct hashes held at the end, per medium label seen (KV groups summed)."""
        out: Counter[str] = Counter()
        for (medium, locality, ownership, _), held in self._held.items():
            out[residency_label(medium, locality, ownership)] += len(held)
        return dict(sorted(out.items()))

    def failures(self) -> list[str]:
        """Why the stream is inconsistent; empty when it is consistent."""
        out = list(self.problems)
        if self.gaps:
            out.append(f"{sum(b - a + 1 for a, b in self.gaps)} batch(es) missing")
        if self.regressions:
            out.append(f"the sequence went back {len(self.regressions)} time(s)")
        if self.undecodable:
            out.append(f"{self.undecodable} batch(es) did not decode")
        if self.unknown_removals and not self.joined_late:
            out.append(f"{sum(self.unknown_removals.values())} removal(s) of hashes not stored")
        if self.orphan_stores and not self.joined_late:
            n = sum(self.orphan_stores.values())
            out.append(f"{n} store(s) announced before their parent")
        return out

    @property
    def consistent(self) -> bool:
        """No gap, regression, undecodable batch, unexplained removal or other problem."""
        return not self.failures()

    @property
    def verdict(self) -> str:
        """``consistent``, ``inconsistent``, or ``nothing received`` (no batch arrived, so
        nothing can be said of the stream: never reported as consistent)."""
        if not self.consistent:
            return "inconsistent"
        return "consistent" if self.batches else "nothing received"

    def summary(self) -> dict[str, Any]:
        """Everything above as JSON-ready builtins."""
        return {
            "batches": self.batches,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "joined_late": self.joined_late,
            "events": dict(sorted(self.events.items())),
            "gaps": [list(g) for g in self.gaps],
            "cleared_gaps": [list(g) for g in self.cleared_gaps],
            "sequence_regressions": [list(r) for r in self.regressions],
            "undecodable": self.undecodable,
            "unknown_removals": dict(sorted(self.unknown_removals.items())),
            "duplicate_stores": dict(sorted(self.duplicate_stores.items())),
            "orphan_stores": dict(sorted(self.orphan_stores.items())),
            "all_blocks_cleared": self.clears,
            "blocks": self.blocks(),
            "problems": self.failures(),
            "consistent": self.consistent,
            "verdict": self.verdict,
        }
