"""The host-memory primary tier: which chunk lives in which host slot, and in what state.

Pure bookkeeping (no bytes, no IO, no clock): the engine asks it where to put or find chunks,
a transfer adapter moves the bytes, and the engine reports completion. Semantics follow
vLLM's ``CPUOffloadingManager`` (reference §B.2):

* Slot state is a ref count: ``-1`` write pending (not readable, not evictable), ``0`` ready
  and evictable, ``> 0`` ready and pinned by that many readers (device loads, cascades).
* ``prepare_store`` never evicts a key of the same offer and is atomic: when capacity is
  short it returns ``None`` and changes nothing.
* Evictions are announced (one ``Removed`` per call) before the ``Stored`` of the keys that
  reuse the capacity; ``Stored`` is appended only by a successful ``complete_store``, which
  touches only keys whose write is still pending. A failed store frees its slots and
  announces nothing.

Key checks: keys entering the tier (``prepare_store``) must be ``bytes`` of the tier's key
length (fixed by the first stored key unless configured). ``lookup`` does no checks on its
hot path: a key that could never have been stored is a ``MISS``; an unhashable one raises
``InvalidKeyError``.

Two paths, one behaviour: under the built-in :class:`LruPolicy` the per-key work of pins,
touches, stores and evictions runs in the native module ``_hostslots`` (``_hostslots.c``,
compiled at install where a C compiler is found), which keeps the recency order, the free
slots and each slot's key itself; otherwise, or where it was not built, in Python, over a
``SlotPool`` and the policy object. Both give the same answers, slots, victims and events
(tests/domain/test_primary_native.py compares them operation by operation).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import attrs

from kvhex.domain.admission import OfferTracker
from kvhex.domain.events import Cleared, Removed, Stored, TierEvent
from kvhex.domain.keys import OffloadKey, check_key
from kvhex.domain.policies.base import EvictionPolicy
from kvhex.domain.policies.lru import LruPolicy
from kvhex.domain.request import ReqContext
from kvhex.domain.slots import SlotPool
from kvhex.domain.tiers import LookupResult, Medium, TierIdentity
from kvhex.errors import InvalidKeyError, StateError

if TYPE_CHECKING:
    from kvhex.domain._hostslots import LruSlots

_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING

PRIMARY_IDENTITY = TierIdentity(Medium.CPU)
_NATIVE_API = 2
"""The ``_hostslots`` API this code speaks (a build of another version is not used)."""


@functools.cache
def native_module() -> tuple[ModuleType | None, str]:
    """The native module ``_hostslots`` (``_hostslots.c``), or ``None`` and why it cannot
    run here."""
    try:
        from kvhex.domain import _hostslots
    except ImportError as exc:
        return None, (
            f"not built ({exc}); reinstall kvhex where a C compiler and Python's headers are "
            "found (KVHEX_NATIVE=required makes a failed build an error)"
        )
    if _hostslots.API_VERSION != _NATIVE_API:
        return None, (
            f"the built module is version {_hostslots.API_VERSION}, this code expects "
            f"{_NATIVE_API}: reinstall kvhex to rebuild it"
        )
    return _hostslots, ""


class StorePlan(NamedTuple):
    """What ``prepare_store`` decided. ``slots[i]`` is the host slot for ``keys[i]``.

    ``keys`` may be empty (everything offered is already stored, pending or not admitted):
    that is success, not failure. ``evicted`` lists the keys evicted to make room.
    """

    keys: list[OffloadKey]
    slots: list[int]
    evicted: list[OffloadKey]


@attrs.frozen(slots=True)
class PrimaryStats:
    """Gauges (now) and cumulative counters (since construction) of a primary tier.

    ``usage`` counts slots that cannot be reused right now (write pending or pinned), as a
    fraction of all slots; ``write_usage`` and ``read_usage`` split it.
    """

    num_slots: int
    resident: int
    pending: int
    evictable: int
    pinned: int
    usage: float
    write_usage: float
    read_usage: float
    stores_prepared: int
    stores_completed: int
    stores_failed: int
    stores_skipped: int
    store_allocation_failures: int
    evictions: int
    loads: int
    allocation_sizes: dict[int, int]


class PrimaryTier:
    """Slot index, ref counts and eviction for the host primary tier.

    Called from the scheduler's thread only; every method is synchronous and O(keys).
    """

    __slots__ = (
        "_allocation_sizes",
        "_events",
        "_evictable",
        "_evictions",
        "_failed",
        "_index",
        "_key_length",
        "_loads",
        "_native",
        "_num_slots",
        "_offered",
        "_pending",
        "_policy",
        "_pool",
        "_prepared",
        "_record_events",
        "_refs",
        "_skipped",
        "_stored",
        "_tracker",
        "_unallocated",
        "identity",
    )

    def __init__(
        self,
        num_slots: int,
        policy: EvictionPolicy,
        *,
        identity: TierIdentity = PRIMARY_IDENTITY,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        key_length: int | None = None,
        record_events: bool = True,
        native: bool | None = None,
    ) -> None:
        """Args:
        num_slots: capacity in host slots.
        policy: the eviction policy (a fresh one, holding no key).
        identity: the tier's identity in its events.
        store_threshold: offers a chunk needs before it is stored.
        max_tracker_size: chunks the offer tracker remembers (with a threshold).
        key_length: the keys' length in bytes (default: the first stored key's).
        record_events: append events (off: the tier announces nothing).
        native: run the per-key work in the native module (``None``: where it was built and
            ``policy`` is exactly :class:`LruPolicy`, which it then replaces; ``False``:
            never).

        Raises:
            ValueError: ``native=True`` where the module was not built or the policy is not
                :class:`LruPolicy`.
        """
        self._pool = SlotPool(num_slots)
        self._num_slots = num_slots
        self._policy = policy
        self.identity = identity
        self._tracker = (
            OfferTracker(store_threshold, max_tracker_size) if store_threshold != 1 else None
        )
        if key_length is not None:
            check_key(b"\0" * key_length, None)
        self._key_length = key_length
        self._record_events = record_events
        self._index: dict[OffloadKey, int] = {}
        self._refs: list[int] = [0] * num_slots
        self._events: list[TierEvent] = []
        self._pending = 0
        self._evictable = 0
        self._prepared = 0
        self._stored = 0
        self._failed = 0
        self._skipped = 0
        self._unallocated = 0
        self._evictions = 0
        self._loads = 0
        self._allocation_sizes: dict[int, int] = {}
        self._native: LruSlots | None = None
        if native is not False:
            module, why = native_module()
            if type(policy) is not LruPolicy:
                why = f"the policy is {type(policy).__name__}, the native path runs LruPolicy"
            if native and why:
                raise ValueError(f"native=True, but {why}")
            if module is not None and not why:
                self._native = module.LruSlots(num_slots, self._index, self._refs)
        # per slot: when its pending write was prepared, so a completion the engine reports
        # in another order (vLLM passes a set) announces the keys in the order offered (the
        # native path keeps its own)
        self._offered: list[int] = [] if self._native is not None else [0] * num_slots

    # -- queries -------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """Capacity in slots."""
        return self._num_slots

    @property
    def native(self) -> bool:
        """Whether the per-key work runs in the native module (see the module docstring)."""
        return self._native is not None

    @property
    def store_threshold(self) -> int:
        """Offers a chunk needs before it is stored (1: stored on first offer)."""
        return 1 if self._tracker is None else self._tracker.threshold

    def __len__(self) -> int:
        """Resident keys (pending, ready and pinned)."""
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def lookup(self, key: OffloadKey) -> LookupResult:
        """``HIT`` if readable, ``HIT_PENDING`` if its write is in flight, else ``MISS``."""
        try:
            slot = self._index.get(key)
        except TypeError:
            raise InvalidKeyError(key, "unhashable") from None
        if slot is None:
            return _MISS
        return _HIT if self._refs[slot] >= 0 else _HIT_PENDING

    def slot_of(self, key: OffloadKey) -> int | None:
        """The host slot holding ``key`` (any state), or ``None``."""
        return self._index.get(key)

    def read_view(self) -> tuple[Mapping[OffloadKey, int], Sequence[int]]:
        """``(index, ref_counts)``: live, read-only references for a composing manager's hot
        path (key -> slot, and slot -> ref count: -1 pending, 0 evictable, > 0 pinned).
        They stay valid across :meth:`reset`. Never mutate them."""
        return self._index, self._refs

    def slots_of(self, keys: Sequence[OffloadKey]) -> list[int]:
        """The host slots of resident ``keys``, co-indexed.

        Raises:
            StateError: a key is not resident.
        """
        index = self._index
        try:
            return [index[key] for key in keys]
        except KeyError as exc:
            raise StateError("slots_of", exc.args[0], "not stored") from None

    def ref_count(self, key: OffloadKey) -> int | None:
        """``-1`` pending, ``0`` evictable, ``> 0`` pinned; ``None`` if absent."""
        slot = self._index.get(key)
        return None if slot is None else self._refs[slot]

    # -- loads (host -> device) ----------------------------------------------------------
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> list[int]:
        """Pin ``keys`` for a device load until ``complete_load``; their slots, co-indexed.

        Raises:
            StateError: a key is absent or its write is still pending (nothing is pinned).
        """
        slots = self._pin(keys, "prepare_load")
        self._loads += len(slots)
        return slots

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Unpin ``keys`` after a device load (once per listing); a key at zero pins becomes
        evictable.

        Raises:
            StateError: a key is absent or not pinned (nothing is unpinned).
        """
        self._unpin(keys, "complete_load")

    def pin(self, keys: Sequence[OffloadKey], times: int = 1) -> list[int]:
        """Pin ``keys`` ``times`` times, once per secondary tier about to read them (a cascade
        put); their slots. Like ``prepare_load`` but not counted as a device load. Each pin is
        released by one :meth:`unpin`.

        Raises:
            StateError: a key is absent or its write is still pending (nothing is pinned).
            ValueError: ``times`` is below 1.
        """
        if times < 1:
            raise ValueError(f"times must be at least 1, got {times}")
        return self._pin(keys, "pin", times)

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        """Release pins taken by :meth:`pin`.

        Raises:
            StateError: a key is absent or not pinned (nothing is unpinned).
        """
        self._unpin(keys, "unpin")

    def _pin(self, keys: Sequence[OffloadKey], operation: str, times: int = 1) -> list[int]:
        # one pass, pinning as it goes; a key that cannot be pinned undoes the pass
        if self._native is not None:
            pinned = self._native.repin(keys, times)
            if isinstance(pinned, int):
                raise self._pin_error(keys[pinned], operation)
            slots, newly = pinned
            self._evictable -= newly
            return slots
        index, refs = self._index, self._refs
        slots = []
        newly_pinned = []
        for key in keys:
            try:
                slot = index.get(key)
            except TypeError:
                self._undo(slots, -times)
                raise InvalidKeyError(key, "unhashable") from None
            if slot is None or refs[slot] < 0:
                self._undo(slots, -times)
                raise self._pin_error(key, operation)
            count = refs[slot]
            if not count:
                newly_pinned.append(key)
            refs[slot] = count + times
            slots.append(slot)
        if newly_pinned:
            self._evictable -= len(newly_pinned)
            self._policy.mark_pinned(newly_pinned)
        return slots

    def _pin_error(self, key: object, operation: str) -> Exception:
        """Why ``key`` cannot be pinned (absent, pending, not a key)."""
        try:
            slot = self._index.get(key)  # type: ignore[call-overload]
        except TypeError:
            return InvalidKeyError(key, "unhashable")
        if slot is None:
            check_key(key, self._key_length)
            return StateError(operation, key, "not stored")  # type: ignore[arg-type]
        return StateError(operation, key, "write pending")  # type: ignore[arg-type]

    def _unpin(self, keys: Sequence[OffloadKey], operation: str) -> None:
        # one pass, unpinning as it goes; a key that is not pinned undoes the pass
        if self._native is not None:
            unpinned = self._native.repin(keys, -1)
            if isinstance(unpinned, int):
                key = keys[unpinned]  # (an unhashable one raises TypeError here, as below)
                state = "not stored" if key not in self._index else "not pinned"
                raise StateError(operation, key, state)
            self._evictable += unpinned[1]
            return
        index, refs = self._index, self._refs
        slots: list[int] = []
        freed = []
        for key in keys:
            try:
                slot = index.get(key)
            except TypeError:
                self._undo(slots, 1)
                raise
            if slot is None or refs[slot] <= 0:
                self._undo(slots, 1)
                raise StateError(operation, key, "not stored" if slot is None else "not pinned")
            count = refs[slot] - 1
            refs[slot] = count
            if not count:  # a key listed twice is freed at its last listing
                freed.append(key)
            slots.append(slot)
        if freed:
            self._evictable += len(freed)
            self._policy.mark_evictable(freed)

    def _undo(self, slots: list[int], delta: int) -> None:
        refs = self._refs
        for slot in slots:
            refs[slot] += delta

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used (forwarded to the policy with the exact ``ctx``)."""
        if self._native is not None:
            self._native.touch(keys)
        else:
            self._policy.touch(keys, ctx)

    # -- stores (device -> host) ---------------------------------------------------------
    def prepare_store(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext | None = None,
        protect: Collection[OffloadKey] = (),
    ) -> StorePlan | None:
        """Reserve slots for the offered keys that are not resident yet.

        Resident keys (ready or pending) are skipped; with a store threshold, keys not offered
        often enough are skipped and counted. Evicts the least valuable evictable keys when
        free slots are short, never one of ``keys`` nor of ``protect`` (chunks the caller
        already answered as hits this step). Returns ``None``, with no state change, when even
        eviction cannot make room.

        Raises:
            InvalidKeyError: a new key is not bytes of the tier's key length.
        """
        index = self._index
        native = self._native
        candidates: list[OffloadKey]
        if native is not None and self._tracker is None:  # one native pass
            return self._store_natively(native, keys, protect)
        if native is not None:
            while isinstance(found := native.candidates(keys, self._key_length or -1), int):
                self._learn_key_length(keys[found])  # raises unless it learns the length
            candidates = found
        else:
            length = self._key_length
            candidates = []
            for key in keys:
                if type(key) is not bytes or len(key) != length:
                    length = self._learn_key_length(key)
                if key not in index:
                    candidates.append(key)
            if len(candidates) > 1 and len(set(candidates)) != len(candidates):
                candidates = list(dict.fromkeys(candidates))
        tracker = self._tracker
        if tracker is not None:
            tracker.offer(keys)
            admitted = [k for k in candidates if tracker.admitted(k)]
            self._skipped += len(candidates) - len(admitted)
            candidates = admitted
        n = len(candidates)
        if n == 0:
            return StorePlan([], [], [])
        sizes = self._allocation_sizes
        sizes[n] = sizes.get(n, 0) + 1
        pool = self._pool
        need = n - (pool.free_count if native is None else native.free_count)
        evicted: list[OffloadKey] = []
        if need > 0:
            if need > self._evictable:
                self._unallocated += 1
                return None
            protected = set(keys)
            protected.update(protect)
            if native is not None:
                victims = native.evict(need, protected)
            else:
                victims = self._policy.evict(need, protected)
                if victims is not None:
                    pool.release_all([index.pop(victim) for victim in victims])
            if victims is None:
                self._unallocated += 1
                return None
            evicted = victims
            self._evict_counted(victims)
        if native is not None:
            slots = native.insert(candidates, self._prepared)
            self._pending += n
            self._prepared += n
            return StorePlan(candidates, slots, evicted)
        slots = pool.allocate(n)
        refs, offered = self._refs, self._offered
        seq = self._prepared
        for key, slot in zip(candidates, slots, strict=True):
            index[key] = slot
            refs[slot] = -1
            offered[slot] = seq
            seq += 1
        self._policy.insert(candidates)
        self._pending += n
        self._prepared += n
        return StorePlan(candidates, slots, evicted)

    def _store_natively(
        self, native: LruSlots, keys: Sequence[OffloadKey], protect: Collection[OffloadKey]
    ) -> StorePlan | None:
        """``prepare_store`` with no store threshold, the per-key work in one native call."""
        while isinstance(
            placed := native.store(
                keys, self._key_length or -1, self._evictable, protect, self._prepared
            ),
            int,
        ):
            self._learn_key_length(keys[placed])  # raises unless it learns the length
        candidates, slots, victims = placed
        if not (n := len(candidates)):
            return StorePlan(candidates, [], [])
        sizes = self._allocation_sizes
        sizes[n] = sizes.get(n, 0) + 1
        if slots is None or victims is None:  # no room, even evicting: nothing changed
            self._unallocated += 1
            return None
        if victims:
            self._evict_counted(victims)
        self._pending += n
        self._prepared += n
        return StorePlan(candidates, slots, victims)

    def _evict_counted(self, victims: list[OffloadKey]) -> None:
        """Count and announce ``victims``, evicted."""
        need = len(victims)
        self._evictable -= need
        self._evictions += need
        if self._record_events:
            self._events.append(Removed(tuple(victims), self.identity))

    def _learn_key_length(self, key: object) -> int:
        checked = check_key(key, self._key_length)
        if self._key_length is None:
            self._key_length = len(checked)
        return self._key_length

    def complete_store(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext | None = None,
        success: bool = True,
        pin: int = 0,
    ) -> list[OffloadKey]:
        """Finish the writes of ``keys``. Only keys whose write is pending are affected, so a
        second completion, or an over-broad key list, is a no-op for the others.

        On success the keys become readable and evictable and one ``Stored`` (carrying
        ``ctx``) is appended, its keys in the order :meth:`prepare_store` was offered them
        (whatever order ``keys`` has: an engine may report a job's keys as a set). On
        failure their slots are freed and nothing is announced. Returns the keys this call
        completed (made readable, or freed on failure).

        ``pin`` > 0 completes and pins the stored keys that many times in one step (one pin
        per secondary tier about to read them), each released by one :meth:`unpin`.
        """
        index, refs = self._index, self._refs
        done: list[OffloadKey] = []
        native = self._native
        if native is not None:
            done = native.complete(keys, pin) if success else native.fail(keys)
            n = len(done)
            if not success:
                self._failed += n
            elif n:
                if not pin:
                    self._evictable += n
                self._stored += n
                if self._record_events:
                    self._events.append(Stored(tuple(done), self.identity, ctx))
            self._pending -= n
            return done
        if success:
            for key in keys:
                slot = index.get(key)
                if slot is not None and refs[slot] == -1:
                    refs[slot] = pin
                    done.append(key)
            if not done:
                return done
            n = len(done)
            if n > 1:  # in the order the keys were offered: a request's chunks parent first
                offered = self._offered
                done.sort(key=lambda k: offered[index[k]])
            if pin:
                self._policy.mark_pinned(done)
            else:
                self._evictable += n
                self._policy.mark_evictable(done)
            self._stored += n
            if self._record_events:
                self._events.append(Stored(tuple(done), self.identity, ctx))
        else:
            release = self._pool.release
            for key in keys:
                slot = index.get(key)
                if slot is not None and refs[slot] == -1:
                    del index[key]
                    refs[slot] = 0
                    release(slot)
                    done.append(key)
            n = len(done)
            if done:
                self._policy.remove(done)
            self._failed += n
        self._pending -= n
        return done

    # -- events, reset, stats ------------------------------------------------------------
    def take_events(self) -> list[TierEvent]:
        """Events appended since the last call, in order; the buffer is emptied."""
        events = self._events
        self._events = []
        return events

    def reset(self) -> None:
        """Forget every chunk and announce ``Cleared``. Events not yet taken are kept (they
        precede the ``Cleared``). The learned key length and cumulative counters are kept."""
        self._index.clear()
        self._refs[:] = [0] * self._num_slots  # in place: readers hold this list
        self._pool.reset()
        if self._native is not None:
            self._native.reset()
        else:
            self._policy.clear()
        if self._tracker is not None:
            self._tracker.clear()
        self._pending = 0
        self._evictable = 0
        if self._record_events:
            self._events.append(Cleared(self.identity))

    def stats(self) -> PrimaryStats:
        """A snapshot of gauges and cumulative counters."""
        n = self._num_slots
        resident = len(self._index)
        pinned = resident - self._pending - self._evictable
        frac = (lambda x: x / n) if n else (lambda x: 0.0)
        return PrimaryStats(
            num_slots=n,
            resident=resident,
            pending=self._pending,
            evictable=self._evictable,
            pinned=pinned,
            usage=frac(self._pending + pinned),
            write_usage=frac(self._pending),
            read_usage=frac(pinned),
            stores_prepared=self._prepared,
            stores_completed=self._stored,
            stores_failed=self._failed,
            stores_skipped=self._skipped,
            store_allocation_failures=self._unallocated,
            evictions=self._evictions,
            loads=self._loads,
            allocation_sizes=dict(self._allocation_sizes),
        )
