"""Least-recently-used eviction.

One ordered dict holds every resident key in recency order (oldest first) with its state, so
recency survives pins: a chunk loaded long ago is still old when its load completes, exactly as
in vLLM's CPU manager. ``evict`` scans from the oldest end and skips pending, pinned and
protected keys; pinned keys are few and short-lived, so the scan stays short.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext

_PENDING = 0
_EVICTABLE = 1
_PINNED = 2


class LruPolicy:
    """LRU over the resident keys. ``touch`` walks keys in reverse so the first key of a
    request (its oldest prefix chunk, the one most likely to be shared) ends most recent."""

    __slots__ = ("_capacity", "_order")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._order: OrderedDict[OffloadKey, int] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        """Add ``keys`` as most recent, writes pending."""
        order = self._order
        for key in keys:
            order[key] = _PENDING

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        """Forget ``keys`` (failed store)."""
        pop = self._order.pop
        for key in keys:
            pop(key, None)

    def mark_evictable(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` may be evicted; their recency is unchanged."""
        order = self._order
        for key in keys:
            order[key] = _EVICTABLE

    def mark_pinned(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` must not be evicted; their recency is unchanged."""
        order = self._order
        for key in keys:
            order[key] = _PINNED

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        """Make ``keys`` most recent, the first key last (so it ends most recent)."""
        move = self._order.move_to_end
        for key in reversed(keys):
            try:  # noqa: SIM105 (per key: suppress() would cost more than the test it saves)
                move(key)
            except (KeyError, TypeError):  # not resident (any more), or no key: nothing to touch
                pass

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        """The ``n`` oldest evictable, unprotected keys, or ``None`` (nothing changed)."""
        if n <= 0:
            return []
        victims: list[OffloadKey] = []
        for key, state in self._order.items():
            if state == _EVICTABLE and key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        order = self._order
        for key in victims:
            del order[key]
        return victims

    def clear(self) -> None:
        """Forget everything."""
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)
