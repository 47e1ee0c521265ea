"""Adaptive Replacement Cache (Megiddo & Modha) over the resident keys.

T1 holds keys seen once, T2 keys seen at least twice; B1 and B2 are ghost lists of keys
recently evicted from T1 and T2 (keys only). ``target_t1_size`` adapts: a touch that hits a
B1 ghost means T1 was too small, a B2 ghost hit means T2 was. Eviction takes from T1 while
its (virtual) size is at least the target, else from T2, skipping pending, pinned and
protected keys, and commits only when all ``n`` victims were found.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence

from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext

_PENDING = 0
_EVICTABLE = 1
_PINNED = 2


class ArcPolicy:
    """ARC with ref-count-aware eviction, matching vLLM's CPU ``arc`` policy."""

    __slots__ = ("_b1", "_b2", "_capacity", "_t1", "_t2", "target_t1_size")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._t1: OrderedDict[OffloadKey, int] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, int] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target_t1_size = 0.0

    # -- views for tests and stats -------------------------------------------------------
    @property
    def t1(self) -> tuple[OffloadKey, ...]:
        """Keys seen once, oldest first."""
        return tuple(self._t1)

    @property
    def t2(self) -> tuple[OffloadKey, ...]:
        """Keys seen at least twice, oldest first."""
        return tuple(self._t2)

    @property
    def b1(self) -> tuple[OffloadKey, ...]:
        """Ghosts evicted from T1, oldest first."""
        return tuple(self._b1)

    @property
    def b2(self) -> tuple[OffloadKey, ...]:
        """Ghosts evicted from T2, oldest first."""
        return tuple(self._b2)

    # -- EvictionPolicy ------------------------------------------------------------------
    def insert(self, keys: Sequence[OffloadKey]) -> None:
        """New keys: most recent in T1, writes pending; no longer ghosts."""
        t1, b1, b2 = self._t1, self._b1, self._b2
        for key in keys:
            if b1:
                b1.pop(key, None)
            if b2:
                b2.pop(key, None)
            t1[key] = _PENDING

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        """Forget ``keys`` (failed store); ghosts are untouched."""
        for key in keys:
            if self._t1.pop(key, None) is None:
                self._t2.pop(key, None)

    def mark_evictable(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` may be evicted; their positions are unchanged."""
        self._set_state(keys, _EVICTABLE)

    def mark_pinned(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` must not be evicted; their positions are unchanged."""
        self._set_state(keys, _PINNED)

    def _set_state(self, keys: Sequence[OffloadKey], state: int) -> None:
        # assigning to an existing key keeps its position
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t1:
                t1[key] = state
            elif key in t2:
                t2[key] = state

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        """Promote T1 hits to T2 (pending keys stay in T1 as most recent), refresh T2 hits,
        and adapt the target on ghost hits. Keys are walked in reverse order."""
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        refresh = t2.move_to_end
        for key in reversed(keys):
            if key in t2:  # the common case first: a frequently used chunk
                refresh(key)
            elif key in t1:
                if t1[key] == _PENDING:
                    t1.move_to_end(key)
                else:
                    t2[key] = t1.pop(key)
            elif key in b1:
                step = max(1.0, len(b2) / len(b1))
                self.target_t1_size = min(self.target_t1_size + step, float(self._capacity))
            elif key in b2:
                step = max(1.0, len(b1) / len(b2))
                self.target_t1_size = max(self.target_t1_size - step, 0.0)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        """``n`` victims in ARC order, or ``None`` with nothing changed."""
        if n <= 0:
            return []
        victims: list[OffloadKey] = []
        from_t1: list[OffloadKey] = []
        from_t2: list[OffloadKey] = []
        scan1 = _eligible(self._t1, protected)
        scan2 = _eligible(self._t2, protected)
        virtual_t1 = len(self._t1)
        target = int(self.target_t1_size)
        while len(victims) < n:
            prefer_t1 = virtual_t1 >= target
            first, second = (scan1, scan2) if prefer_t1 else (scan2, scan1)
            key = next(first, None)
            took_t1 = prefer_t1
            if key is None:
                key = next(second, None)
                took_t1 = not prefer_t1
                if key is None:
                    return None
            victims.append(key)
            if took_t1:
                from_t1.append(key)
                virtual_t1 -= 1
            else:
                from_t2.append(key)
        self._commit(from_t1, self._t1, self._b1)
        self._commit(from_t2, self._t2, self._b2)
        return victims

    def _commit(
        self,
        victims: list[OffloadKey],
        live: OrderedDict[OffloadKey, int],
        ghosts: OrderedDict[OffloadKey, None],
    ) -> None:
        for key in victims:
            del live[key]
            ghosts[key] = None
        while len(ghosts) > self._capacity:
            ghosts.popitem(last=False)

    def clear(self) -> None:
        """Forget everything, ghosts and target included."""
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self.target_t1_size = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


def _eligible(
    entries: OrderedDict[OffloadKey, int], protected: Container[OffloadKey]
) -> Iterator[OffloadKey]:
    """Evictable, unprotected keys of ``entries``, oldest first (one monotonic scan)."""
    for key, state in entries.items():
        if state == _EVICTABLE and key not in protected:
            yield key
