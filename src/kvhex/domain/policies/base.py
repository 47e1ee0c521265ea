"""The ``EvictionPolicy`` protocol the primary tier drives.

Key lifecycle as the policy sees it::

    insert (write pending) --mark_evictable--> evictable <--mark_pinned / mark_evictable--> pinned
         |  \\--mark_pinned (completed straight into a pin) ---------------------------^
         \\--remove (failed store)                 \\--evict--> gone

All calls come from the primary tier, on the scheduler's thread, synchronously, and must not
block or do IO. Only evictable keys may be returned by ``evict``. State changes arrive in
batches (one call per tier operation, not per key): the per-key cost of a Python call is what
a hot path cannot afford.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Protocol, runtime_checkable

from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders resident keys for eviction. Built by a :class:`PolicyFactory` with the tier's
    capacity in slots."""

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` were just allocated slots; their writes are pending (not evictable)."""

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` left without being evicted (their store failed). They were not evictable."""

    def mark_evictable(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` are readable and unpinned (store completed, or their last load finished)."""

    def mark_pinned(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` are pinned by readers (or completed straight into a pin) and must not be
        evicted until marked evictable."""

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        """``keys`` were used, in request order (first key = oldest prefix chunk). Keys the
        policy does not hold are ignored (or used as ghost hits). ``ctx`` is the exact request
        context the engine passed."""

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        """Choose exactly ``n`` evictable keys not in ``protected`` and forget them.

        All-or-nothing: returns ``None`` and changes nothing when ``n`` keys cannot be found.
        """

    def clear(self) -> None:
        """Forget every key (the tier was reset)."""


class PolicyFactory(Protocol):
    """What a ``kvhex.policies`` entry point names: usually the policy class itself."""

    def __call__(self, capacity: int) -> EvictionPolicy:
        """Build a policy for a tier of ``capacity`` slots."""
        ...
