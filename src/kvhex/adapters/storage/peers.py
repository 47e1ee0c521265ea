"""A storage tier's peer view: the blocks other instances hold on the storage it shares with
them, announced under the tier's ``peer_identity`` so that a router credits this instance
with every block it can load (:class:`~kvhex.ports.tier_store.PeerView`).

Every ``interval_s`` one scan runs, in two steps; never two scans at once:

1. **List** (:meth:`PeerListing.peer_keys`), on a thread of the view's own: the keys other
   instances hold now, diffed against the previous scan's. A listing that changed nothing
   ends the scan there, and the engine hears nothing of it: an idle engine is not stepped
   (woken) for a scan that found nothing (vLLM's worker spins for a second after each step).
   One that changed something waits for the tier's next poll (``next_poll_at`` says one is
   due), which applies it.
2. **Read** (:meth:`RecordReading.read_records`), on the tier's IO threads: the record of
   each new key, from its block's header. New keys are announced
   ``Stored(keys, peer_identity, None, records)``, parents first; a key without a record as a
   placeholder.

Between the two, on the scheduler thread, keys gone since the previous scan are announced
``Removed``, and on storage where no block belongs to one instance (object stores), keys
this instance holds itself are left out (its own events announce them). A key that a read of
this instance found missing or corrupt leaves the view at once (announced ``Removed``) and
comes back only once it was gone from a scan. After ``close`` nothing more is announced.

Threads: everything here runs on the scheduler thread but the two IO steps. The lister
diffs against the last applied listing under the view's lock, which the scheduler thread also
takes where it changes that listing; a read touches nothing of the view while it runs.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import structlog

from kvhex.adapters.storage._io_pool import IoPool, IoTask, TaskCancelled
from kvhex.adapters.storage.block_io import PeerListing, RecordReading, StoreLost, safe_error
from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import ChunkRecord, record_parent
from kvhex.domain.tiers import TierIdentity

log = structlog.get_logger(__name__)

MAX_SCAN_INTERVAL_S = 3600.0
"""Longest ``peer_scan_interval_s``: a view older than an hour credits blocks long gone."""

_Found = list[tuple[OffloadKey, ChunkRecord | None]]
_Listed = tuple[set[OffloadKey], list[OffloadKey], list[OffloadKey]]


def check_peer_options(announce_peers: Any, peer_scan_interval_s: Any) -> None:
    """Check a tier's peer options before anything is built.

    Raises:
        TypeError: ``announce_peers`` is not a ``bool``, or ``peer_scan_interval_s`` not a
            number.
        ValueError: ``peer_scan_interval_s`` is not in (0, 3600].
    """
    if not isinstance(announce_peers, bool):
        raise TypeError(
            f"announce_peers must be true or false, got {type(announce_peers).__name__} "
            f"{announce_peers!r}"
        )
    interval = peer_scan_interval_s
    if isinstance(interval, bool) or not isinstance(interval, int | float):
        raise TypeError(
            f"peer_scan_interval_s must be a number of seconds, got {type(interval).__name__} "
            f"{interval!r}"
        )
    if not (math.isfinite(interval) and 0 < interval <= MAX_SCAN_INTERVAL_S):
        raise ValueError(
            f"peer_scan_interval_s must be greater than 0 and at most "
            f"{MAX_SCAN_INTERVAL_S:g} seconds, got {interval!r}"
        )


class PeerIo(PeerListing, RecordReading, Protocol):
    """What the view needs of the storage."""


class PeerScan:
    """The peer view of one tier (see the module docstring).

    Args:
        io: the tier's data path (both :class:`PeerListing` and :class:`RecordReading`).
        identity: the tier's peer identity.
        interval_s: seconds from the start of one listing to the start of the next.
        pool: the tier's IO threads (the second step's reads run there).
        tier: the tier's name, for logs.
    """

    def __init__(
        self, io: PeerIo, identity: TierIdentity, interval_s: float, pool: IoPool, *, tier: str
    ) -> None:
        self.identity = identity
        self._io = io
        self._interval = interval_s
        self._pool = pool
        self._tier = tier
        self._lock = threading.Lock()  # _listed, _news and scans, shared with the lister
        self._news: _Listed | BaseException | None = None  # a listing that changed something
        self._reading: IoTask[_Found] | None = None  # step 2 in flight
        self._listed: set[OffloadKey] = set()  # what the last applied listing found
        self._view: set[OffloadKey] = set()  # announced under the identity
        self._bad: set[OffloadKey] = set()  # found missing or corrupt, still listed
        self._asked: list[OffloadKey] = []  # keys step 2 reads
        self._closed = False
        self._stop = threading.Event()
        self.scans = 0
        """Scans done (listings that changed nothing, and applied ones), failed included."""
        self._lister = threading.Thread(target=self._list_loop, name=f"{tier}_peers", daemon=True)
        self._lister.start()

    def __contains__(self, key: object) -> bool:
        return key in self._view

    def __len__(self) -> int:
        return len(self._view)

    # -- the lister's thread ---------------------------------------------------------------
    def _list_loop(self) -> None:
        """List every interval; park a listing that changed something (or failed) until the
        scheduler thread applied it, and count one that changed nothing right away."""
        stop, interval = self._stop, self._interval
        next_at = time.monotonic()
        while not stop.wait(max(0.0, next_at - time.monotonic())):
            next_at = max(next_at + interval, time.monotonic())
            with self._lock:
                busy = self._news is not None or self._reading is not None
            if busy:  # the last news is not applied yet: list again once it is
                next_at = time.monotonic() + min(interval, 0.05)
                continue
            try:
                listed: _Listed | BaseException = _diff(self._io.peer_keys(), self)
            except BaseException as exc:
                listed = exc
            with self._lock:
                if isinstance(listed, tuple) and not listed[1] and not listed[2]:
                    self.scans += 1  # nothing changed: no step of the engine needed
                else:
                    self._news = listed

    # -- the scheduler thread --------------------------------------------------------------
    def next_at(self) -> float | None:
        """``-inf`` while a listing waits to be applied or a read is in flight (a poll
        announces them), else ``None``: the lister lists on its own and says when it finds
        something (see :class:`~kvhex.ports.tier_store.ScheduledWork`). Plain reads."""
        if self._closed:
            return None
        if self._news is not None or self._reading is not None:
            return -math.inf
        return None

    def owns(self, task: object) -> bool:
        """Whether ``task`` is this view's read."""
        return task is self._reading

    def apply(self, own: Callable[[OffloadKey], bool] | None, events: list[TierEvent]) -> None:
        """Apply a listing the lister parked (announcing what it found gone, and starting
        the read of what it found new), appending the events to ``events``; ``own`` says
        which keys this instance holds itself, where the view leaves those out."""
        if self._news is None or self._closed:
            return
        with self._lock:  # (only this thread takes news: it is still there)
            news, self._news = self._news, None
        if isinstance(news, BaseException):
            self.scans += 1
            if isinstance(news, StoreLost):  # nothing is there any more
                self._drop_all(events)
            if not isinstance(news, Exception):
                raise news
            log.warning("tier_peer_scan_failed", tier=self._tier, error=safe_error(news))
            return
        self._listed_now(*news, own, events)

    def finished(
        self,
        task: object,
        own: Callable[[OffloadKey], bool] | None,
        events: list[TierEvent],
    ) -> None:
        """Apply the read ``task`` (:meth:`owns` it), appending what it announces to
        ``events``."""
        reading = self._reading
        if reading is None or task is not reading:
            return
        self._reading = None
        asked, self._asked = self._asked, []
        if self._closed:
            return
        exc = reading.error
        if isinstance(exc, TaskCancelled):
            return
        with self._lock:
            self.scans += 1
            if exc is not None:  # read them again at the next scan
                self._listed.difference_update(asked)
        if exc is not None:
            if isinstance(exc, StoreLost):
                self._drop_all(events)
            if not isinstance(exc, Exception):
                raise exc
            log.warning("tier_peer_scan_failed", tier=self._tier, error=safe_error(exc))
            return
        self._announce(asked, reading.value, events)

    def _listed_now(
        self,
        listed: set[OffloadKey],
        added: list[OffloadKey],
        gone: list[OffloadKey],
        own: Callable[[OffloadKey], bool] | None,
        events: list[TierEvent],
    ) -> None:
        """Step 1 done: announce what is gone, read the records of what is new."""
        with self._lock:
            self._listed = listed
        view, bad = self._view, self._bad
        bad.difference_update(gone)
        removed = [k for k in gone if k in view]
        if removed:
            view.difference_update(removed)
            events.append(Removed(tuple(removed), self.identity))
        new = [k for k in added if k not in view and k not in bad and not (own and own(k))]
        if not new:
            with self._lock:
                self.scans += 1
            return
        self._asked = new
        self._reading = self._pool.submit(_read, self._io, new)

    def lost(self, keys: Iterable[OffloadKey], events: list[TierEvent]) -> None:
        """A read of this instance found ``keys`` (others' blocks) missing or corrupt: they
        leave the view (announced) until a scan no longer lists them."""
        listed, view = self._listed, self._view
        bad = [k for k in keys if k in listed and k not in self._bad]
        self._bad.update(bad)
        gone = [k for k in bad if k in view]
        if gone and not self._closed:
            view.difference_update(gone)
            events.append(Removed(tuple(gone), self.identity))

    def close(self) -> None:
        """Announce nothing more; the lister stops (a listing under way is let finish and
        dropped)."""
        self._closed = True
        self._stop.set()

    def _announce(self, asked: list[OffloadKey], found: _Found, events: list[TierEvent]) -> None:
        view, bad = self._view, self._bad
        new = [(k, r) for k, r in found if k not in view and k not in bad]
        # a listed key whose block was not there: read again at the next scan if still listed
        there = {k for k, _ in found}
        with self._lock:
            self._listed.difference_update(k for k in asked if k not in there)
        if not new:
            return
        keys = tuple(k for k, _ in new)
        view.update(keys)
        records = tuple(r for _, r in new)
        described = records if any(r is not None for r in records) else None
        events.append(Stored(keys, self.identity, None, described))

    def _drop_all(self, events: list[TierEvent]) -> None:
        if self._view:
            events.append(Removed(tuple(self._view), self.identity))
        self._view.clear()
        with self._lock:
            self._listed = set()
        self._bad.clear()


def _diff(now: set[OffloadKey], scan: PeerScan) -> _Listed:
    """(The lister's thread.) The keys listed now, those new since the listing the scheduler
    thread applied last, and those gone since (under the view's lock)."""
    with scan._lock:
        before = scan._listed
        return now, [k for k in now if k not in before], [k for k in before if k not in now]


def _read(io: RecordReading, keys: list[OffloadKey]) -> _Found:
    """Step 2 (an IO thread): the records of ``keys`` whose blocks are there, parents
    first."""
    found = io.read_records(keys)
    return parent_first([(k, found[k]) for k in keys if k in found])


def parent_first(found: _Found) -> _Found:
    """``found`` reordered so that each key comes after its parent when both are in it
    (records name a key's parent), each chain in order; otherwise in the order given."""
    keys = {k for k, _ in found}
    children: dict[OffloadKey, list[tuple[OffloadKey, ChunkRecord | None]]] = {}
    roots: _Found = []
    for key, record in found:
        parent = record_parent(record) if record is not None else None
        if parent is not None and parent in keys and parent != key:
            children.setdefault(parent, []).append((key, record))
        else:
            roots.append((key, record))
    out: _Found = []
    stack = list(reversed(roots))
    while stack:
        entry = stack.pop()
        out.append(entry)
        stack.extend(reversed(children.pop(entry[0], ())))
    for left in children.values():  # a cycle (no real chain has one): as given
        out.extend(left)
    return out
