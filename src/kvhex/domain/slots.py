"""The host primary tier's slot pool.

Fresh slot ids are handed out in increasing order until the pool is exhausted; after that,
freed ids are reused last-in first-out. Within one allocation fresh ids come first. The order
is part of the contract (vLLM's tests depend on it: evicting the chunk in slot 0 of a 4-slot
pool, then storing three new keys, yields slots 2, 3, 0), and it keeps recently touched host
pages warm.
"""

from __future__ import annotations

from collections.abc import Iterable


class SlotPool:
    """Free-slot bookkeeping for ``num_slots`` fixed-size host slots."""

    __slots__ = ("_free", "_next_fresh", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        self._next_fresh = 0
        self._free: list[int] = []

    @property
    def free_count(self) -> int:
        """Slots that can be allocated without evicting."""
        return self.num_slots - self._next_fresh + len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` slot ids: fresh ones first (increasing), then freed ones (LIFO).

        The caller checks ``free_count`` first; asking for more raises ``ValueError``.
        """
        if n > self.free_count:
            raise ValueError(f"cannot allocate {n} slots, {self.free_count} free")
        fresh = min(n, self.num_slots - self._next_fresh)
        start = self._next_fresh
        slots = list(range(start, start + fresh))
        self._next_fresh = start + fresh
        if reused := n - fresh:  # the last freed first
            free = self._free
            slots += reversed(free[-reused:])
            del free[-reused:]
        return slots

    def release(self, slot: int) -> None:
        """Return one slot to the free list."""
        self._free.append(slot)

    def release_all(self, slots: Iterable[int]) -> None:
        """Return ``slots`` to the free list, in order (as ``release`` of each)."""
        self._free.extend(slots)

    def reset(self) -> None:
        """Every slot free again, fresh order restarting at 0."""
        self._next_fresh = 0
        self._free.clear()
