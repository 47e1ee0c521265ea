"""A storage tier's residency: the pure, bounded index of the blocks a tier owns.

Every secondary tier that stores blocks (memory, local files, object stores, NIXL, a third
party's) has to answer the same questions, whatever moves its bytes: which keys are readable,
which are being written and by which job, which blocks to evict to make room (announced
before the blocks that take their room), what a job that failed, was aborted or raced
another job on the same key leaves behind, and which keys a read, a probe or a verification
found lost. This module answers them once, with no IO, no threads and no clock, so a tier only
moves bytes and reports what it saw.

A key's life, as the index sees it::

    absent --reserve--> pending (owned by one job) --commit, written--> readable
                              \\--commit, not written (failed, aborted)--> absent
    readable --evicted for room / delete / found lost / drop_all--> absent

Readable keys may be pinned by reads in flight (``snapshot(..., pin=True)``): never evicted
meanwhile. Every time a key becomes readable it gets a new serial number, and observations
made by an asynchronous job (a read that found the block missing, a listing that lacks it)
carry the serial the key had when the job started: an observation about an earlier residency
never drops a later one (a get that found ``k`` missing, completing after a put of ``k``,
leaves the new ``k`` alone).

Events (``take_events``): ``Stored(keys, identity, ctx)`` when keys become readable,
``Removed(keys, identity)`` when readable keys stop being readable, appended at the moment the
index changes: a job's evictions are announced when the job reserves its room, before its
``Stored``. Replaying the events (Stored adds, Removed removes) gives exactly the readable keys.

Capacity is counted in blocks of ``block_bytes`` (``capacity_bytes // block_bytes`` of them):
readable and pending keys together never exceed it. Eviction order is an
:class:`~kvhex.domain.policies.base.EvictionPolicy` (LRU by default, any ``kvhex.policies``
one), driven as the host tier drives it.

One thread at a time: a tier calls it from its scheduler thread, or under its own lock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence

from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.keys import OffloadKey
from kvhex.domain.policies.base import EvictionPolicy, PolicyFactory
from kvhex.domain.policies.lru import LruPolicy
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import TierIdentity


class Snapshot:
    """Serials of the readable keys among those a job looks at, taken when it started.

    ``serials`` maps each key readable at that moment to its serial; keys absent then are not
    in it. ``pinned`` says whether the snapshot pins them (a read in flight).
    """

    __slots__ = ("pinned", "serials")

    def __init__(self, serials: dict[OffloadKey, int], pinned: bool) -> None:
        self.serials = serials
        self.pinned = pinned


class Reservation:
    """What :meth:`Residency.reserve` decided for one put job.

    Attributes:
        owned: keys this job writes; pending, owned by this job until :meth:`Residency.commit`.
        present: keys readable when the job was reserved (skipped, or verified; see
            ``verify``).
        busy: keys another job was writing (skipped: that job announces them).
        victims: keys evicted to make room, already announced as removed; the job deletes
            their blocks before it writes (their room is its room).
        verify: for tiers that do not trust their index (object stores): the snapshot of
            ``present`` (pinned), so the job can check them in storage and rewrite the lost.
    """

    __slots__ = ("busy", "ctx", "owned", "present", "verify", "victims")

    def __init__(
        self,
        *,
        owned: tuple[OffloadKey, ...],
        present: tuple[OffloadKey, ...],
        busy: tuple[OffloadKey, ...],
        victims: tuple[OffloadKey, ...],
        verify: Snapshot | None,
        ctx: ReqContext | None,
    ) -> None:
        self.owned = owned
        self.present = present
        self.busy = busy
        self.victims = victims
        self.verify = verify
        self.ctx = ctx

    def __repr__(self) -> str:
        return (
            f"Reservation(owned={len(self.owned)}, present={len(self.present)}, "
            f"busy={len(self.busy)}, victims={len(self.victims)})"
        )


class Residency:
    """A tier's bounded index. See the module docstring.

    Args:
        identity: the tier's identity, announced in every event.
        capacity_bytes: bytes the tier may hold (readable and pending blocks).
        block_bytes: bytes one block costs here (what a write of it takes).
        policy: builds the eviction policy for ``capacity_bytes // block_bytes`` blocks.

    Raises:
        ValueError: ``block_bytes`` is not positive, or the capacity holds no block (naming
            both numbers).
    """

    __slots__ = (
        "_events",
        "_next_serial",
        "_pending",
        "_pins",
        "_policy",
        "_readable",
        "block_bytes",
        "capacity_blocks",
        "identity",
    )

    def __init__(
        self,
        identity: TierIdentity,
        capacity_bytes: int,
        block_bytes: int,
        policy: PolicyFactory = LruPolicy,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        if capacity_bytes < block_bytes:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} holds no block of {block_bytes} bytes"
            )
        self.identity = identity
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_bytes // block_bytes
        self._policy: EvictionPolicy = policy(self.capacity_blocks)
        self._readable: dict[OffloadKey, int] = {}  # key -> serial, in order of arrival
        self._pending: dict[OffloadKey, Reservation] = {}  # key -> the job writing it
        self._pins: dict[OffloadKey, int] = {}  # readable key -> reads in flight
        self._next_serial = 0
        self._events: list[TierEvent] = []

    # -- views ---------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        """True when ``key`` is readable."""
        return key in self._readable

    def __len__(self) -> int:
        """Readable keys."""
        return len(self._readable)

    def __iter__(self) -> Iterator[OffloadKey]:
        """Readable keys, in the order they became readable."""
        return iter(self._readable)

    def keys(self) -> list[OffloadKey]:
        """Readable keys, in the order they became readable."""
        return list(self._readable)

    def readable(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The readable ones among ``keys``, in their order."""
        readable = self._readable
        return [k for k in keys if k in readable]

    def is_pending(self, key: OffloadKey) -> bool:
        """True while a job is writing ``key``."""
        return key in self._pending

    @property
    def pending_count(self) -> int:
        """Keys being written."""
        return len(self._pending)

    @property
    def used_bytes(self) -> int:
        """Bytes held by readable blocks and reserved by pending ones."""
        return (len(self._readable) + len(self._pending)) * self.block_bytes

    def take_events(self) -> list[TierEvent]:
        """Events since the last call, in the order the index changed."""
        events, self._events = self._events, []
        return events

    # -- start-up ------------------------------------------------------------------------
    def adopt(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Blocks found in storage at start-up, oldest first: the newest that fit become
        readable and are announced once as ``Stored`` without a request. A key listed twice
        counts once (at its newest place). Returns the older blocks that do not fit, never
        announced: the tier deletes them. Keys already known are ignored."""
        unique = list(dict.fromkeys(reversed(list(keys))))  # newest first, each once
        fresh = [k for k in unique if k not in self._readable and k not in self._pending]
        room = self.capacity_blocks - len(self._readable) - len(self._pending)
        kept = list(reversed(fresh[: max(0, room)]))  # oldest first again
        for key in kept:
            self._readable[key] = self._serial()
        if kept:
            self._policy.insert(kept)
            self._policy.mark_evictable(kept)
            self._events.append(Stored(tuple(kept), self.identity, None))
        return list(reversed(fresh[max(0, room) :]))

    # -- puts ----------------------------------------------------------------------------
    def reserve(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None, *, verify: bool = False
    ) -> Reservation | None:
        """Room for a put of ``keys``: keys neither readable nor being written become pending,
        owned by the returned reservation; readable ones are touched (most recent); keys
        another job is writing are left to it. Evicts what the room needs (oldest first by
        the policy, never a key of this job, a pinned or a pending one) and announces the
        evictions now. ``verify`` pins the present keys so the job can check them in
        storage (:meth:`commit` with ``lost``).

        Returns ``None``, changing nothing, when the room cannot be found.
        """
        readable, pending = self._readable, self._pending
        owned: list[OffloadKey] = []
        present: list[OffloadKey] = []
        busy: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            if key in readable:
                present.append(key)
            elif key in pending:
                busy.append(key)
            else:
                owned.append(key)
        short = len(owned) - (self.capacity_blocks - len(readable) - len(pending))
        victims: list[OffloadKey] = []
        if short > 0:
            chosen = self._policy.evict(short, frozenset(keys))
            if chosen is None:
                return None
            victims = chosen
            for key in victims:
                del readable[key]
            self._events.append(Removed(tuple(victims), self.identity))
        if present:
            self._policy.touch(present, ctx)
        snapshot = self.snapshot(present, pin=True) if verify and present else None
        reservation = Reservation(
            owned=tuple(owned),
            present=tuple(present),
            busy=tuple(busy),
            victims=tuple(victims),
            verify=snapshot,
            ctx=ctx,
        )
        for key in owned:
            pending[key] = reservation
        if owned:
            self._policy.insert(owned)
        return reservation

    def commit(
        self,
        reservation: Reservation,
        written: Collection[OffloadKey],
        lost: Collection[OffloadKey] = (),
    ) -> list[OffloadKey]:
        """The job of ``reservation`` ended: its owned keys in ``written`` become readable
        and are announced with the job's context; the rest are released (failed or aborted:
        nothing announced). With ``verify``: present keys the job found ``lost`` in storage
        are removed and announced (if still the residency the job saw), and become readable
        again (announced) if the job rewrote them (``written``).

        Returns the keys the job rewrote that nobody holds any more (deleted meanwhile): the
        tier deletes their blocks.
        """
        readable, pending = self._readable, self._pending
        have = written if isinstance(written, (set, frozenset)) else set(written)
        removed: list[OffloadKey] = []
        strays: list[OffloadKey] = []
        rewritten: list[OffloadKey] = []
        snapshot = reservation.verify
        if snapshot is not None:
            same = self._unpin(snapshot)
            for key in lost:
                if key not in snapshot.serials:
                    continue
                if key in same:
                    self._forget(key)
                    removed.append(key)
                    if key in have:
                        rewritten.append(key)
                elif key in have and key not in readable and key not in pending:
                    strays.append(key)
        # the job's own keys (all of them, unless a bug or a racing abort took some)
        mine = [k for k in reservation.owned if pending.get(k) is reservation]
        for key in mine:
            del pending[key]
        if len(have) >= len(mine) and have.issuperset(mine):
            stored = mine  # the common case: everything written
        else:
            stored = [k for k in mine if k in have]
            self._policy.remove([k for k in mine if k not in have])
        if removed:
            self._events.append(Removed(tuple(removed), self.identity))
        if rewritten:
            self._policy.insert(rewritten)
            stored = stored + rewritten
        if stored:
            serial = self._next_serial
            for key in stored:
                serial += 1
                readable[key] = serial
            self._next_serial = serial
            self._policy.mark_evictable(stored)
            self._events.append(Stored(tuple(stored), self.identity, reservation.ctx))
        return strays

    # -- reads, probes and losses -----------------------------------------------------------
    def snapshot(self, keys: Iterable[OffloadKey], *, pin: bool = False) -> Snapshot:
        """The serials of the readable ones among ``keys``; with ``pin``, they are not evicted
        until :meth:`release` (a read in flight)."""
        readable = self._readable
        serials = {k: readable[k] for k in keys if k in readable}
        if pin and serials:
            pins = self._pins
            first = []
            for key in serials:
                count = pins.get(key, 0)
                if not count:
                    first.append(key)
                pins[key] = count + 1
            if first:
                self._policy.mark_pinned(first)
        return Snapshot(serials, pin)

    def release(
        self,
        snapshot: Snapshot,
        ok: Collection[OffloadKey] = (),
        lost: Collection[OffloadKey] = (),
        ctx: ReqContext | None = None,
    ) -> list[OffloadKey]:
        """A job that took ``snapshot`` ended: unpins, touches the keys it read (``ok``), and
        removes (announcing them) the ``lost`` keys it found missing or corrupt in storage,
        but only those still the residency the snapshot saw. Returns the removed keys; the
        tier deletes their blocks (a corrupt block must not stay)."""
        same = self._unpin(snapshot) if snapshot.pinned else self._same(snapshot)
        if ok:
            hits = [k for k in ok if k in same]
            if hits:
                self._policy.touch(hits, ctx)
        removed = [k for k in dict.fromkeys(lost) if k in same]
        for key in removed:
            self._forget(key)
        if removed:
            self._events.append(Removed(tuple(removed), self.identity))
        return removed

    def delete(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Remove the readable ones among ``keys`` (each once), pinned or not, and announce
        them. Keys being written are not readable yet and are left to their job. Returns the
        removed keys: the tier deletes their blocks."""
        readable = self._readable
        removed = [k for k in dict.fromkeys(keys) if k in readable]
        for key in removed:
            self._forget(key)
        if removed:
            self._events.append(Removed(tuple(removed), self.identity))
        return removed

    def drop_all(self) -> list[OffloadKey]:
        """Every readable key is gone at once (the storage itself was lost): removed and
        announced. Pending keys stay with their jobs. Returns the removed keys."""
        removed = list(self._readable)
        if removed:
            self._policy.remove(removed)
            self._readable.clear()
            self._pins.clear()
            self._events.append(Removed(tuple(removed), self.identity))
        return removed

    # -- internals -----------------------------------------------------------------------
    def _serial(self) -> int:
        self._next_serial += 1
        return self._next_serial

    def _forget(self, key: OffloadKey) -> None:
        del self._readable[key]
        self._pins.pop(key, None)
        self._policy.remove((key,))

    def _same(self, snapshot: Snapshot) -> set[OffloadKey]:
        readable = self._readable
        return {k for k, s in snapshot.serials.items() if readable.get(k) == s}

    def _unpin(self, snapshot: Snapshot) -> set[OffloadKey]:
        """Drop the snapshot's pins on keys still the residency it saw; those keys."""
        same = self._same(snapshot)
        pins = self._pins
        freed = []
        for key in same:
            count = pins.get(key, 0) - 1
            if count > 0:
                pins[key] = count
            else:
                pins.pop(key, None)
                freed.append(key)
        if freed:
            self._policy.mark_evictable(freed)
        return same
