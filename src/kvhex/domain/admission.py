"""Store admission by repeated offers (vLLM's ``store_threshold``).

A chunk is admitted to the primary tier only once it has been offered ``threshold`` times;
a repeated prefix is therefore admitted at once on its second offer. Offer counts live in a
bounded LRU tracker: when full, its least recently offered entry is dropped (never a key of
the offer being counted), so a key that aged out starts again at one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvhex.domain.keys import OffloadKey


class OfferTracker:
    """Counts offers per key, bounded to ``max_size`` keys."""

    __slots__ = ("_counts", "max_size", "threshold")

    def __init__(self, threshold: int, max_size: int) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"store_threshold must be an int >= 1, got {threshold!r}")
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_tracker_size must be an int >= 1, got {max_size!r}")
        self.threshold = threshold
        self.max_size = max_size
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    def offer(self, keys: Sequence[OffloadKey]) -> None:
        """Count one offer of each distinct key in ``keys``, in vLLM's order: keys already
        tracked are counted and become most recent first, then new keys enter at one, each
        dropping the least recently offered entry not offered now when the tracker is full
        (a new key that finds only such entries is not tracked)."""
        counts = self._counts
        offered = dict.fromkeys(keys)
        protected = 0
        for key in offered:
            if key in counts:
                counts[key] += 1
                counts.move_to_end(key)
                protected += 1
        droppable = len(counts) - protected  # the oldest entries, before every offered one
        for key in offered:
            if key in counts:
                continue
            if len(counts) >= self.max_size:
                if droppable == 0:
                    continue
                counts.popitem(last=False)
                droppable -= 1
            counts[key] = 1

    def admitted(self, key: OffloadKey) -> bool:
        """True once ``key`` was offered at least ``threshold`` times (and not aged out)."""
        return self._counts.get(key, 0) >= self.threshold

    def count(self, key: OffloadKey) -> int:
        """Offers counted for ``key`` (0 if unknown or aged out)."""
        return self._counts.get(key, 0)

    def clear(self) -> None:
        """Forget every count."""
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._counts)
