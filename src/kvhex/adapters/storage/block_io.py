"""The data path under a storage tier: the seam a new backend plugs into.

:class:`~kvhex.adapters.storage.tier.BlockTierStore` keeps the bookkeeping (the domain's
residency index, jobs, events, IO threads); a :class:`BlockIo` moves and finds blocks in one
namespace of one storage. Two are built in: slab files with a shared index
(:mod:`kvhex.adapters.storage.files.slabs`) and one object per block
(:mod:`kvhex.adapters.storage.objects.io`). Each takes a mover that only copies bytes
(:class:`SlotMover` for slab slots, :class:`ObjectMover` for objects), so NIXL plugs in by
handing its own movers over, not by subclassing (:mod:`kvhex.adapters.storage.nixl`).

Threads: every method of these Protocols runs on the tier's IO threads, several at once, and
may block on IO; none is called on the scheduler thread after start-up. Buffers: the views
passed in are host slots the tier keeps pinned (put) or reserved (get) for the call's length;
implementations never keep them.

Records: a put whose job has a request hands ``write_many`` (and the movers) each block's
record, encoded (:mod:`kvhex.adapters.storage.records`), to keep in its header area. Two
optional capabilities read them back: :class:`RecordReading` (what a restart announces) and
:class:`PeerListing` (what other instances hold, for a tier's peer view,
:mod:`kvhex.adapters.storage.peers`). A third, :class:`Relisting`, survives a namespace
record that vanished while its blocks did not.

Also here: the few IO helpers every backend shares (:func:`write_fully`, :func:`oserror`,
:func:`safe_error`).
"""

from __future__ import annotations

import errno
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import structlog

from kvhex.adapters.storage.format import CONFIG, Verdict
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import ChunkRecord

Located = tuple[str, int]
"""Where a block lives: a file or object, and the byte offset of its header."""

Records = Mapping[OffloadKey, bytes]
"""Encoded records of some of a job's keys, to keep in their blocks' header areas."""

log = structlog.get_logger(__name__)


class Inventory(NamedTuple):
    """What a namespace held when this instance started.

    ``blocks``: the keys of blocks this instance now owns, oldest first, each once.
    ``foreign``: entries in the namespace that are not the tier's (counted, ignored).
    """

    blocks: list[OffloadKey]
    foreign: int


class StoreLost(Exception):
    """The storage itself is gone (a deleted bucket, an emptied namespace): no block this
    instance announced can still be there. Raised by any :class:`BlockIo` method."""


class NamespaceConflict(Exception):
    """The namespace directory or prefix records another configuration than this one."""

    def __init__(self, recorded: bytes) -> None:
        self.recorded = recorded
        super().__init__("the namespace records another configuration")


@runtime_checkable
class BlockIo(Protocol):
    """Blocks of one namespace in one storage, in the block format of
    :mod:`kvhex.adapters.storage.format`. Built (and its namespace prepared and checked) by
    the tier's constructor; every method below runs on IO threads."""

    @property
    def exclusive(self) -> bool:
        """True when only this instance ever removes the blocks it owns (local slabs it holds
        locked): its index is the truth. False for object stores, where anyone with access may
        delete objects: the tier then checks what its index lists against the storage."""
        ...

    def inventory(self) -> Inventory:
        """The blocks this instance owns from start-up on (adopted from instances that died,
        or listed) and the foreign entries seen. Called once, before any job."""
        ...

    def write_many(
        self,
        items: Sequence[tuple[OffloadKey, memoryview]],
        evict: Sequence[OffloadKey] = (),
        records: Records | None = None,
    ) -> list[str | None]:
        """Remove the blocks of ``evict`` (the job's victims: their room may be reused for
        ``items``), then write ``items`` (key, payload) and make them findable, each block
        keeping its key's entry of ``records`` (encoded) in its header area. Per item
        ``None``, or why it was not stored (nothing of a failed item may be found later).

        Raises:
            StoreLost: the storage is gone.
            Exception: a failure outside per-item handling; then nothing was stored.
        """
        ...

    def read_many(
        self, items: Sequence[tuple[OffloadKey, memoryview]], *, up_to: bool = False
    ) -> list[Verdict]:
        """Read each key's block, its payload into the view, and verify it. A view whose
        verdict is not ``OK`` holds undefined bytes. ``up_to`` (a coded tier's reads,
        :mod:`kvhex.adapters.codecs`): a view may be longer than its block's payload, which
        then fills its start (``format.verify(..., up_to=True)``); without it a payload of
        another length than its view's is corrupt. A data path that cannot read blocks of
        varying length belongs to a tier that takes no codec.

        Raises:
            StoreLost: the storage is gone.
        """
        ...

    def exists_many(self, keys: Sequence[OffloadKey]) -> set[OffloadKey]:
        """The keys whose blocks exist (this instance's or another's on the same storage).

        Raises:
            StoreLost: the storage is gone.
        """
        ...

    def remove_many(self, keys: Sequence[OffloadKey]) -> None:
        """Remove the blocks this instance owns among ``keys`` (absent ones are ignored), so
        that no restart or other instance finds them again."""
        ...

    def close(self) -> None:
        """Release files, locks, connections and movers. Called once, after the last job."""
        ...


@runtime_checkable
class Locating(Protocol):
    """Optional: a :class:`BlockIo` that can say where a block lives (debugging, fsck)."""

    def location(self, key: OffloadKey) -> Located:
        """The file or object holding ``key``'s block and the offset of its header.

        Raises:
            KeyError: no instance on this storage holds ``key``.
        """
        ...


@runtime_checkable
class RecordReading(Protocol):
    """Optional: a :class:`BlockIo` that reads back the records blocks keep in their
    headers (a restart announces adopted blocks in full with them)."""

    @property
    def records_by_request(self) -> bool:
        """True where reading a block's record costs a request (object stores): a restart
        reads them on an IO thread after start-up, not during it
        (:mod:`kvhex.adapters.storage.adoption`)."""
        ...

    def read_records(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, ChunkRecord | None]:
        """The record of each key whose block is there (this instance's or another's): its
        header read and checked to name the key, its record decoded (``None``: none kept, or
        damaged). Keys whose block is not there are left out.

        Raises:
            StoreLost: the storage is gone.
            Exception: the storage failed (nothing is known of the keys then).
        """
        ...


@runtime_checkable
class PeerPresence(Protocol):
    """Optional for an ``exclusive`` :class:`BlockIo` whose storage other instances may
    share (local slabs on one root): whether any other instance's blocks may be there, so
    the tier knows when its own index alone answers lookups."""

    def others_present(self) -> bool:
        """True when the storage holds another instance's blocks (as far as a directory
        listing tells, without reading them). Runs on an IO thread."""
        ...


@runtime_checkable
class PeerListing(Protocol):
    """Optional: a :class:`BlockIo` on storage other instances share that can say which
    blocks they hold (a tier's peer view)."""

    def peer_keys(self) -> set[OffloadKey]:
        """The keys of the blocks other instances hold now, as the storage tells: every key
        another instance's slot table names (local slabs), or every key listed (object
        stores, where no block belongs to one instance: the tier leaves its own out).

        Raises:
            StoreLost: the storage is gone.
            Exception: the storage failed.
        """
        ...


@runtime_checkable
class Relisting(Protocol):
    """Optional: a :class:`BlockIo` on shared storage whose namespace record
    (``config.json``) can vanish while blocks remain (a server evicting it as any key, a
    lifecycle rule expiring it): it records it again and lists the namespace
    (:class:`NamespaceRecord`), and the tier drops what each listing lacks."""

    def take_listings(self) -> list[frozenset[OffloadKey]]:
        """(Scheduler thread.) The listings taken since the last call."""
        ...


class NamespaceRecord:
    """The check a :class:`Relisting` storage runs after a block was found missing or a
    write failed: is the namespace still there? Its record gone while blocks are still
    listed: it is written again (by ``intact``) and the listing queued for
    :meth:`take_listings`. Gone with nothing listed: the store is lost (an emptied
    namespace, a deleted bucket, a server replaced empty).

    Args:
        intact: whether the record is there, writing it again if not.
        listing: the namespace's block keys now.
        where: the namespace, named in the log and in :class:`StoreLost`.
    """

    def __init__(
        self, intact: Callable[[], bool], listing: Callable[[], Iterable[OffloadKey]], where: str
    ) -> None:
        self._intact = intact
        self._listing = listing
        self._where = where
        self._listings: deque[frozenset[OffloadKey]] = deque()

    def check(self) -> None:
        """(IO threads.)

        Raises:
            StoreLost: the namespace is gone.
            Exception: what ``intact`` or ``listing`` raised (the storage failed).
        """
        if self._intact():
            return
        listed = frozenset(self._listing())
        if not listed:
            raise StoreLost(f"{self._where} is gone: its {CONFIG} vanished")
        self._listings.append(listed)
        log.warning("tier_namespace_record_restored", where=self._where, blocks=len(listed))

    def take_listings(self) -> list[frozenset[OffloadKey]]:
        """(Scheduler thread.) See :meth:`Relisting.take_listings`."""
        taken = []
        while self._listings:
            taken.append(self._listings.popleft())
        return taken


class SlotMover(Protocol):
    """Copies blocks between host memory and slots of open slab files (what the slab IO
    leaves to its mover: POSIX ``pwritev``/``preadv``, or NIXL's POSIX backend)."""

    def write_slots(
        self,
        blocks: Sequence[tuple[int, int, OffloadKey, memoryview]],
        records: Records | None = None,
    ) -> list[str | None]:
        """Write each (fd, offset, key, payload) as a whole block (header area, with the
        key's entry of ``records``, then payload) at ``offset``; per block ``None`` or why it
        failed (a block cut short may be left: its checksum fails and nothing names it)."""
        ...

    def read_slots(
        self, blocks: Sequence[tuple[int, int, memoryview]]
    ) -> list[tuple[bytes, int | None]]:
        """Read each (fd, offset, view): the payload into the view, and return the header
        area (``b""`` when the block is cut short) with the payload's checksum where the
        mover took it while the bytes were at hand (``None``: the caller takes it)."""
        ...

    def close(self) -> None:
        """Release what the mover holds (before the slab files close)."""
        ...


class ObjectMover(Protocol):
    """Copies whole blocks between host memory and objects (what the object IO leaves to
    its mover: s3fs batches, or NIXL's OBJ backend)."""

    def put_objects(
        self,
        objects: Sequence[tuple[str, OffloadKey, memoryview]],
        records: Records | None = None,
    ) -> list[str | None]:
        """Write each (path, key, payload) as one object holding the whole block (its header
        with the key's entry of ``records``); per object ``None`` or why it failed (a failed
        object is never left half-written)."""
        ...

    def get_objects(
        self, objects: Sequence[tuple[str, memoryview]], *, up_to: bool = False
    ) -> list[bytes | None]:
        """Read each (path, view): the payload into the view; return the header area,
        ``None`` when the object does not exist, ``b""`` when it is not a whole block.
        ``up_to``: a block shorter than its view is whole too, and fills the view's start
        (a coded tier's reads; a mover that cannot raises ``ValueError``)."""
        ...

    def close(self) -> None:
        """Release what the mover holds."""
        ...


def write_fully(
    fd: int, parts: Sequence[bytes | memoryview], offset: int, nbytes: int = -1
) -> None:
    """Write ``parts`` back to back at ``offset``: one ``pwritev``, finished piece by piece
    after a short write. ``nbytes``, the parts' total when the caller knows it, spares a
    whole write the look at each part.

    Raises:
        OSError: the write failed (a full disk, an IO error, a write that made no progress).
    """
    done = os.pwritev(fd, parts, offset)
    if done == nbytes:
        return
    for part in parts:
        view = memoryview(part).cast("B")
        if done >= len(view):
            done -= len(view)
            offset += len(view)
            continue
        view, offset, done = view[done:], offset + done, 0
        while view:
            written = os.pwrite(fd, view, offset)
            if written == 0:  # no progress (never spin): as the native data path reports it
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            offset += written
            view = view[written:]


def oserror(exc: OSError) -> str:
    """The text of a failed job for ``exc``: its type and reason, no path."""
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def safe_error(exc: BaseException) -> str:
    """An error text without credentials (fsspec/botocore messages can echo options)."""
    text = str(exc)
    for marker in ("key=", "secret=", "token=", "aws_secret_access_key", "aws_access_key_id"):
        if marker in text:
            return type(exc).__name__
    return text[:300]
