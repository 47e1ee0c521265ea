"""Local file tiers: blocks in slots of preallocated slab files, each slab publishing its
blocks in the slot table at its head (:mod:`kvhex.adapters.storage.files._index`). The
:class:`BlockIo` of the fsspec tier on a local root and of NIXL's POSIX tier.

Layout under the namespace directory (see :mod:`kvhex.adapters.storage.format` for the block
format)::

    config.json         what makes blocks compatible, recorded
    slabs/<id>.slab     preallocated slab files: a slot table, then fixed-size slots

Names are built only from hex (random 128-bit slab ids); files are created ``0600`` and
directories ``0700``.

Each live instance holds an exclusive ``flock`` on the slabs it owns, and only it writes or
frees their slots and records. A put first clears its victims' records, then writes its
blocks (header and payload together, by the mover: ``pwritev`` runs of adjacent slots, or
NIXL) into the victims' slots and free ones, then sets the new records. A removal clears the
records, then unmarks the slots' headers, then frees them. So in every crash state a record
names a slot holding its block: a restart announces only blocks it can serve, and what a crash
leaves is at worst an orphan (a whole-looking block no record names; its slot is free).
Concurrent jobs write to different slabs where they can: writes into one file serialize on
its inode lock, so the capacity is spread over at least ``stripes`` slab files.

At start-up an instance adopts the slabs of instances that died (their lock is free) with
their blocks; a key found in several adopted slabs is kept once, the newest. Other instances'
blocks are found through their slabs' tables
(:class:`~kvhex.adapters.storage.files._index.PeerTables`) and read from their slabs, never
removed here. Each block's header keeps its chunk record where its put had one
(:mod:`kvhex.adapters.storage.records`), read back by :meth:`SlabIo.read_records` (a restart,
a peer view) with a ``pread`` of the header area.

Threads: every method may run on any IO thread; ``_lock`` guards slabs, free lists and the
block map. No syscall runs under ``_lock`` but creating a slab.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence

import structlog

from kvhex.adapters.storage.block_io import (
    Inventory,
    Located,
    NamespaceConflict,
    Records,
    SlotMover,
    oserror,
    write_fully,
)
from kvhex.adapters.storage.files._index import (
    KNOWN_ENTRIES,
    MAX_KEY_BYTES,
    SLAB_DIR,
    PeerTables,
    Record,
    SlotTable,
    TableError,
    is_slab_id,
    maps_tables,
    pack_record,
    read_table,
    start_table,
    table_bytes,
)
from kvhex.adapters.storage.files.posix import PosixSlotMover
from kvhex.adapters.storage.format import (
    CONFIG,
    HEADER_AREA,
    MAGIC,
    Verdict,
    holds_key,
    verify,
)
from kvhex.adapters.storage.records import RecordOpener, header_record
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import ChunkRecord

log = structlog.get_logger(__name__)


SLAB_BYTES = 1 << 30
"""Largest slab file; a tier smaller than ``stripes`` of these gets ``stripes`` smaller ones."""
_UNMARKED = bytes(len(MAGIC))


class _Slab:
    """One slab file this instance owns (its ``flock`` held while open)."""

    __slots__ = ("base", "fd", "free", "name", "path", "slots", "table", "writers")

    def __init__(
        self, name: str, path: str, fd: int, slots: int, used: Iterable[int], *, mapped: bool
    ) -> None:
        self.name = name
        self.path = path
        self.fd = fd
        self.slots = slots
        self.base = table_bytes(slots)  # where slot 0 starts
        self.table = SlotTable(fd, mapped=mapped)
        self.writers = 0  # jobs writing into it now
        taken = set(used)
        # popped from the end: ascending slot order while the slab fills
        self.free = [s for s in range(slots - 1, -1, -1) if s not in taken]


_Place = tuple[_Slab, int]


class SlabIo:
    """Slab files and their shared index under one namespace directory ``root``, created and
    checked at construction. See the module docstring.

    Args:
        root: the namespace directory.
        slot_size: bytes per slot (one whole block: header area and payload).
        max_slots: slots this instance may create in all (its capacity).
        config: what ``config.json`` must record (written if absent).
        fsync: flush each job's blocks to the device before publishing them.
        stripes: spread the capacity over at least this many slab files.
        mover: copies blocks into and out of slots (default: POSIX ``pwritev``/``preadv``).
        records_opener: opens the sealed records of a tier whose codec chain seals them.

    Raises:
        NamespaceConflict: ``config.json`` records another configuration.
        OSError: the directory or a slab cannot be used.
    """

    exclusive = True
    """Only this instance frees the slots of the slabs it holds locked."""
    records_by_request = False
    """A block's chunk record is one ``pread`` away."""

    def __init__(
        self,
        root: str,
        slot_size: int,
        max_slots: int,
        *,
        config: bytes,
        fsync: bool = False,
        stripes: int = 1,
        mover: SlotMover | None = None,
        records_opener: RecordOpener | None = None,
    ) -> None:
        self.root = root
        self._open_record = records_opener
        self.slab_dir = os.path.join(root, SLAB_DIR)
        self.slot_size = slot_size
        self.max_slots = max_slots
        self.per_slab = max(1, min(-(-max_slots // max(1, stripes)), SLAB_BYTES // slot_size))
        self.fsync = fsync
        self.mover: SlotMover = mover or PosixSlotMover()
        self._lock = threading.Lock()
        self._slabs: dict[str, _Slab] = {}
        self._where: dict[OffloadKey, _Place] = {}
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.makedirs(self.slab_dir, mode=0o700, exist_ok=True)
        self.maps_tables = maps_tables(self.slab_dir)
        """Whether slot tables are written through memory maps (:func:`maps_tables`)."""
        recorded = _write_config(os.path.join(root, CONFIG), config)
        if recorded is not None and recorded != config:
            raise NamespaceConflict(recorded)
        self.peers = PeerTables(self.slab_dir, self._slabs)
        try:
            self._inventory = self._adopt_all()
        except BaseException:
            self.close()
            raise

    # -- start-up ------------------------------------------------------------------------
    def _adopt_all(self) -> Inventory:
        """Take over the slabs of dead instances (their lock is free) with the blocks their
        tables name, each key once (the newest copy; older copies are removed)."""
        foreign = sum(1 for name in os.listdir(self.root) if name not in KNOWN_ENTRIES)
        held: list[tuple[float, OffloadKey, _Place]] = []
        for name in sorted(os.listdir(self.slab_dir)):
            stem, _, ext = name.partition(".")
            if not is_slab_id(stem) or ext not in ("slab", "new"):
                foreign += 1
                continue
            adopted = self._adopt(stem, os.path.join(self.slab_dir, name), ext == "new")
            if adopted is None:
                continue
            slab, records = adopted
            held.extend((stored, key, (slab, slot)) for slot, key, stored in records)
        held.sort(key=lambda h: h[0])  # oldest first: a later copy of a key replaces it
        older: list[tuple[OffloadKey, _Place]] = []
        for _, key, place in held:
            if key in self._where:
                older.append((key, self._where[key]))
            self._where[key] = place
        for slab in self._slabs.values():
            taken = {slot for s, slot in self._where.values() if s is slab}
            slab.free = [s for s in range(slab.slots - 1, -1, -1) if s not in taken]
        if older:  # a key in two adopted slabs: the older copy's record goes, then its header
            self._unpublish(older)
            for _, (slab, slot) in older:
                os.pwrite(slab.fd, _UNMARKED, slab.base + slot * self.slot_size)
        order = [key for _, key, place in held if self._where[key] == place]
        return Inventory(order, foreign)

    def _adopt(self, name: str, path: str, unfinished: bool) -> tuple[_Slab, list[Record]] | None:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live instance's
            return None
        try:
            if unfinished:  # a crash while creating it: it never held a block
                os.unlink(path)
                os.close(fd)
                return None
            slots, records = read_table(fd)
            if os.fstat(fd).st_size < table_bytes(slots) + slots * self.slot_size:
                raise TableError("shorter than its slots")
            slab = _Slab(name, path, fd, slots, (), mapped=self.maps_tables)
        except TableError as exc:  # left as it is, for fsck to report
            log.warning("tier_slab_unreadable", slab=name, error=str(exc))
            os.close(fd)
            return None
        except BaseException:  # a read failed: the error goes on, the slab's lock is let go
            os.close(fd)
            raise
        self._slabs[name] = slab
        return slab, records

    def inventory(self) -> Inventory:
        """Blocks adopted at start-up, oldest first, and foreign entries seen."""
        return self._inventory

    # -- slots ---------------------------------------------------------------------------
    def _allocate(
        self, count: int, room: Sequence[_Place]
    ) -> tuple[list[_Place], list[_Place], str | None]:
        """Slots for a job of ``count`` blocks: the job's own ``room`` first (its victims'
        slots), then free ones from the slabs the fewest jobs are writing (a new slab while
        every one with room is being written and the capacity allows it). Returns the
        slots, the room left over, and why there are fewer than ``count``. Each slab a job
        writes counts it as a writer until :meth:`_written`."""
        ordered = sorted(room, key=_file_order)
        got, spare = ordered[:count], ordered[count:]
        with self._lock:
            counted = {mine for mine, _ in got}
            for mine in counted:
                mine.writers += 1
            while len(got) < count:
                slab = min((s for s in self._slabs.values() if s.free), key=_writers, default=None)
                if slab is None or slab.writers:
                    total = sum(s.slots for s in self._slabs.values())
                    try:
                        if total < self.max_slots:
                            slab = self._new_slab(min(self.per_slab, self.max_slots - total))
                        elif slab is None:
                            raise OSError(28, "every slot of this tier is taken")
                    except OSError as exc:
                        if slab is None:
                            return got, spare, oserror(exc)
                if slab not in counted:
                    counted.add(slab)
                    slab.writers += 1
                # the most recently freed slots, in file order: adjacent ones make one run
                take = min(count - len(got), len(slab.free))
                got.extend((slab, slot) for slot in sorted(slab.free[-take:]))
                del slab.free[-take:]
        return got, spare, None

    def _written(self, slots: list[_Place]) -> None:
        """A job's writes ended: each slab it wrote loses a writer."""
        with self._lock:
            for slab in {slab for slab, _ in slots}:
                slab.writers -= 1

    def _free(self, slots: Sequence[_Place]) -> None:
        """Unmark the headers of ``slots`` (fsck's scan finds no removed or torn block
        there), then make them free. Their records must be cleared already."""
        for slab, slot in slots:
            with contextlib.suppress(OSError):
                os.pwrite(slab.fd, _UNMARKED, slab.base + slot * self.slot_size)
        with self._lock:
            for slab, slot in slots:
                slab.free.append(slot)

    def _new_slab(self, slots: int) -> _Slab:
        name = uuid.uuid4().hex
        path = os.path.join(self.slab_dir, name + ".slab")
        building = os.path.join(self.slab_dir, name + ".new")
        fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        slab: _Slab | None = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(fd, 0, table_bytes(slots) + slots * self.slot_size)
            start_table(fd, slots)
            slab = _Slab(name, path, fd, slots, (), mapped=self.maps_tables)
            os.rename(building, path)  # the lock stays with the open file
        except BaseException:
            if slab is not None:
                slab.table.close()
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(building)
            raise
        self._slabs[name] = slab
        return slab

    def _take(self, keys: Iterable[OffloadKey]) -> list[tuple[OffloadKey, _Place]]:
        """Take the places of the owned ones among ``keys`` out of the block map."""
        with self._lock:
            return [(k, where) for k in keys if (where := self._where.pop(k, None))]

    def _unpublish(self, places: list[tuple[OffloadKey, _Place]]) -> None:
        """Clear the records of ``places`` (taken out of the block map), before their slots
        are reused or unmarked (and, with ``fsync``, on the device before that).

        Raises:
            OSError: the records may remain; the places are owned again.
        """
        try:
            _publish([(slab, slot, b"") for _, (slab, slot) in places])
            if self.fsync:
                for fd in {slab.fd for _, (slab, _) in places}:
                    os.fdatasync(fd)
        except BaseException:
            with self._lock:
                for key, place in places:
                    self._where.setdefault(key, place)
            raise

    # -- BlockIo -------------------------------------------------------------------------
    def write_many(
        self,
        items: Sequence[tuple[OffloadKey, memoryview]],
        evict: Sequence[OffloadKey] = (),
        records: Records | None = None,
    ) -> list[str | None]:
        """Remove the victims ``evict`` (their slot records first), write ``items`` into
        their slots and free ones (each block's header keeping its chunk record from
        ``records``), publish the written blocks; per item ``None`` or why it was not
        stored."""
        victims = self._take(evict)
        if victims:
            self._unpublish(victims)
        errors: list[str | None] = [None] * len(items)
        fit = [i for i, (key, _) in enumerate(items) if len(key) <= MAX_KEY_BYTES]
        for i in sorted(set(range(len(items))) - set(fit)):
            errors[i] = f"a {len(items[i][0])}-byte key is longer than a slot record holds"
        room = [place for _, place in victims]
        slots, spare, short = self._allocate(len(fit), room)
        for i in fit[len(slots) :]:
            errors[i] = short
        size = self.slot_size
        try:
            written = self.mover.write_slots(
                [
                    (slab.fd, slab.base + slot * size, *items[i])
                    for i, (slab, slot) in zip(fit, slots, strict=False)
                ],
                records,
            )
        except BaseException:  # a bug or a backend failure outside per-block handling
            self._free(slots + spare)
            self._written(slots)
            raise
        done: list[tuple[OffloadKey, _Slab, int]] = []
        unused = list(spare)
        for i, place, error in zip(fit, slots, written, strict=False):
            if error is None:
                done.append((items[i][0], *place))
            else:
                errors[i] = error
                unused.append(place)
        self._free(unused)
        replaced = self._take(key for key, _, _ in done)  # an older copy of a key rewritten
        now = time.time()
        try:
            if self.fsync:
                for fd in {slab.fd for _, slab, _ in done}:
                    os.fdatasync(fd)
            # the new records, then the older copies' (a crash in between leaves two copies
            # of a key: a restart keeps the newer)
            _publish([(slab, slot, pack_record(key, now)) for key, slab, slot in done])
            _publish([(slab, slot, b"") for _, (slab, slot) in replaced])
        except OSError as exc:
            for i in fit[: len(slots)]:
                errors[i] = errors[i] or oserror(exc)
            with contextlib.suppress(OSError):  # no record may name a slot freed here
                _publish([(slab, slot, b"") for _, slab, slot in done])
            with self._lock:
                for key, place in replaced:
                    self._where.setdefault(key, place)
            self._free([(slab, slot) for _, slab, slot in done])
            self._written(slots)
            return errors
        with self._lock:
            for key, slab, slot in done:
                self._where[key] = (slab, slot)
        self._free([place for _, place in replaced])
        self._written(slots)
        return errors

    def _locate(self, keys: Sequence[OffloadKey]) -> list[tuple[int, int] | None]:
        """(fd, offset) of each key: owned blocks first, then other instances' slabs."""
        out: list[tuple[int, int] | None] = []
        missing: list[OffloadKey] = []
        size = self.slot_size
        with self._lock:
            for key in keys:
                where = self._where.get(key)
                if where is None:
                    missing.append(key)
                    out.append(None)
                else:
                    slab, slot = where
                    out.append((slab.fd, slab.base + slot * size))
        if missing:
            elsewhere = self.peers.find(missing)
            for i, key in enumerate(keys):
                if out[i] is None and key in elsewhere:
                    _, fd, slot, base = elsewhere[key]
                    out[i] = (fd, base + slot * size)
        return out

    def read_many(
        self, items: Sequence[tuple[OffloadKey, memoryview]], *, up_to: bool = False
    ) -> list[Verdict]:
        """Read and verify each key's block (this instance's or another's). A slot holds
        the longest block, so ``up_to`` reads each whole slot and the header says how much
        of it is the block's."""
        places = self._locate([key for key, _ in items])
        located = [(i, place) for i, place in enumerate(places) if place is not None]
        read = self.mover.read_slots([(fd, off, items[i][1]) for i, (fd, off) in located])
        verdicts = [Verdict.MISSING] * len(items)
        for (i, _), (header, digest) in zip(located, read, strict=True):
            key, view = items[i]
            verdicts[i] = verify(header, key, view, digest, up_to=up_to)
        return verdicts

    def read_records(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, ChunkRecord | None]:
        """The chunk record kept in the header of each key's block (this instance's copy,
        else another's): one ``pread`` of the header area per block. Keys whose block is not
        there (no slot record names one, or its slot holds another block now) are left
        out."""
        out: dict[OffloadKey, ChunkRecord | None] = {}
        for key, place in zip(keys, self._locate(keys), strict=True):
            if place is None:
                continue
            try:
                header = os.pread(place[0], HEADER_AREA, place[1])
            except OSError:  # a peer's slab closed meanwhile: nothing known of it
                continue
            if holds_key(header, key):
                out[key] = header_record(header, key, self._open_record)
        return out

    def peer_keys(self) -> set[OffloadKey]:
        """Every key the slot tables of other instances' slabs name now."""
        return self.peers.keys()

    def remove_many(self, keys: Sequence[OffloadKey]) -> None:
        """Remove the blocks of ``keys`` this instance owns: rows first, then the slots."""
        places = self._take(keys)
        if places:
            self._unpublish(places)
            self._free([place for _, place in places])

    def others_present(self) -> bool:
        """Whether the slab directory holds a slab this instance does not own (another
        instance's, live or died since this one started: its blocks are found by probes)."""
        try:
            names = os.listdir(self.slab_dir)
        except OSError:
            return True  # cannot tell: lookups keep probing
        own = self._slabs
        for entry in names:
            stem, _, ext = entry.partition(".")
            if ext == "slab" and is_slab_id(stem) and stem not in own:
                return True
        return False

    def exists_many(self, keys: Sequence[OffloadKey]) -> set[OffloadKey]:
        """Keys held here or by another instance on this root."""
        with self._lock:
            found = {k for k in keys if k in self._where}
        rest = [k for k in keys if k not in found]
        return found | set(self.peers.find(rest)) if rest else found

    def location(self, key: OffloadKey) -> Located:
        """The slab file holding ``key``'s block and the offset of its header.

        Raises:
            KeyError: no instance on this root holds ``key``.
        """
        with self._lock:
            where = self._where.get(key)
        if where is not None:
            slab, slot = where
            return slab.path, slab.base + slot * self.slot_size
        found = self.peers.find([key])
        if key not in found:
            raise KeyError(key.hex())
        path, _, slot, base = found[key]
        return path, base + slot * self.slot_size

    def slot_tables(self) -> list[SlotTable]:
        """The slot table of each slab this instance holds open (``mapped``: written through
        a memory map, else with ``pwrite``), for inspection: its records are what other
        readers (fsck, peers) see."""
        return [slab.table for slab in self._slabs.values()]

    def close(self) -> None:
        """Release the mover, then the slabs (their locks: a later instance may adopt
        them) and the peers' files. Idempotent."""
        self.mover.close()
        with self._lock:
            for slab in self._slabs.values():
                slab.table.close()
                os.close(slab.fd)
            self._slabs.clear()
            self._where.clear()
        self.peers.close()


def _publish(entries: Iterable[tuple[_Slab, int, bytes]]) -> None:
    """Write each (slab, slot, record) (``b""`` clears it), grouped by slab."""
    by_slab: dict[_Slab, list[tuple[int, bytes]]] = {}
    for slab, slot, record in entries:
        by_slab.setdefault(slab, []).append((slot, record))
    for slab, records in by_slab.items():
        slab.table.write(records)


def _write_config(path: str, data: bytes) -> bytes | None:
    """Create ``path`` holding ``data`` unless it exists (atomically); what it held if it
    did."""
    tmp = f"{path}.{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_fully(fd, (data,), 0)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic create-if-absent
    except FileExistsError:
        with open(path, "rb") as existing:
            return existing.read()
    finally:
        os.unlink(tmp)
    return None


def _writers(slab: _Slab) -> int:
    return slab.writers


def _file_order(place: _Place) -> tuple[str, int]:
    return place[0].name, place[1]
