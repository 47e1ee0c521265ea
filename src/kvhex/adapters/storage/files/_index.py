"""The index of a local file tier: a slot table at the head of every slab file.

A slab file holds its table, then its slots (one block each, in the format of
:mod:`kvhex.adapters.storage.format`)::

    head      4096 bytes: magic "KVHXTAB1" | slots (u64) | generation (u64)
    records   one 128-byte record per slot, padded to a multiple of 4096 bytes
    slots     slots x slot size, from the first 4096-byte boundary after the records

A record names the block its slot holds: key length (u16; 0: none) | 0 (u16) | CRC-32 of the
stored time and the key (u32) | stored (f64, Unix seconds) | the key (at most 112 bytes) |
zero padding. What the slab IO keeps true in every crash state that keeps the page cache (a
process killed at any point): a record is set only after its block is written, and cleared
before its slot is overwritten or unmarked, so a record always names a slot holding its block.
A record torn by a power loss fails its CRC and names nothing (its block is then an orphan).

Publishing a job's blocks costs a memory store per record where :class:`SlotTable` maps the
table (else a ``pwrite`` per run of adjacent slots), not a transaction per job: no lock is
shared between the IO threads or between processes. Only the instance holding a slab's
``flock`` writes its table, and it bumps the table's generation after every change, so other
instances (:class:`PeerTables`) re-read only the tables that changed, and of those only the
pages that changed.

Also here: the names a local namespace directory holds (:data:`SLAB_DIR`,
:data:`KNOWN_ENTRIES`, :func:`is_slab_id`), which the slab IO and ``kvhex fsck`` share.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import platform
import struct
import threading
import zlib
from collections.abc import Container, Iterable, Sequence

from kvhex.adapters.storage.block_io import write_fully
from kvhex.adapters.storage.format import CONFIG
from kvhex.domain.keys import OffloadKey

SLAB_DIR = "slabs"
KNOWN_ENTRIES = frozenset({CONFIG, SLAB_DIR})
"""What a local namespace directory holds; anything else in it is foreign."""
TABLE_MAGIC = b"KVHXTAB1"
_HEAD = struct.Struct(">8sQQ")  # magic, slots, generation
_GENERATION_AT = 16
_PAGE = 4096
RECORD_BYTES = 128
_RECORD = struct.Struct(">HHId")  # key length, 0, CRC-32 of stored time and key, stored time
MAX_KEY_BYTES = RECORD_BYTES - _RECORD.size
"""The longest key a slot record holds (vLLM's keys: 12 to 36 bytes)."""
_EMPTY = bytes(RECORD_BYTES)
_WHOLE_RECORD = struct.Struct(f">HHId{MAX_KEY_BYTES}s")  # the key zero-padded to the end
_STORED = struct.Struct(">d")

Record = tuple[int, OffloadKey, float]
"""One block a table names: slot, key, the time it was stored."""


class TableError(Exception):
    """A slab file whose head is not a slot table (damaged, or not a slab)."""


def is_slab_id(stem: str) -> bool:
    """True for a slab file's name stem: 32 lower-case hex digits."""
    return len(stem) == 32 and all(c in "0123456789abcdef" for c in stem)


def table_bytes(slots: int) -> int:
    """Bytes before the first slot of a slab of ``slots`` slots (a multiple of 4096)."""
    return _PAGE + -(-slots * RECORD_BYTES // _PAGE) * _PAGE


def pack_record(key: OffloadKey, stored: float) -> bytes:
    """The record of ``key``'s block, stored at ``stored``.

    Raises:
        ValueError: the key is longer than :data:`MAX_KEY_BYTES`.
    """
    length = len(key)
    if length > MAX_KEY_BYTES:
        raise ValueError(f"a {length}-byte key is longer than a slot record holds")
    crc = zlib.crc32(_STORED.pack(stored) + key, length)
    return _WHOLE_RECORD.pack(length, 0, crc, stored, key)


def _records(data: bytes, first: int) -> list[Record]:
    """The valid records in ``data`` (whole records of slots ``first``, ``first + 1``, ...)."""
    out: list[Record] = []
    unpack = _RECORD.unpack_from
    for at in range(0, len(data) - RECORD_BYTES + 1, RECORD_BYTES):
        if data[at] == 0 and data[at + 1] == 0:
            continue  # empty (key length 0)
        length, _, crc, stored = unpack(data, at)
        key = data[at + _RECORD.size : at + _RECORD.size + length]
        if (
            0 < length <= MAX_KEY_BYTES
            and zlib.crc32(data[at + 8 : at + _RECORD.size + length], length) == crc
        ):
            out.append((first + at // RECORD_BYTES, OffloadKey(key), stored))
    return out


def start_table(fd: int, slots: int) -> None:
    """Write the head of a new slab's table (its records are zero: every slot empty).

    Raises:
        OSError: the write failed.
    """
    head = _HEAD.pack(TABLE_MAGIC, slots, 0)
    if os.pwrite(fd, head, 0) != len(head):
        raise OSError(5, "short write of a slab's table head")


def _read_head(fd: int) -> tuple[int, int]:
    """(slots, generation) of the slab open as ``fd``.

    Raises:
        TableError: no table head there.
        OSError: the read failed.
    """
    data = os.pread(fd, _HEAD.size, 0)
    if len(data) < _HEAD.size:
        raise TableError("the file is shorter than a slot table's head")
    magic, slots, generation = _HEAD.unpack(data)
    if magic != TABLE_MAGIC or slots == 0:
        raise TableError("no slot table at the head of the file")
    if os.fstat(fd).st_size < table_bytes(slots):  # a damaged count, or a cut file
        raise TableError(f"the file is shorter than the table of the {slots} slots it names")
    return slots, generation


def read_table(fd: int) -> tuple[int, list[Record]]:
    """The slot count of the slab open as ``fd`` and the blocks its table names.

    Raises:
        TableError: no table head there.
        OSError: the read failed.
    """
    slots, _ = _read_head(fd)
    data = os.pread(fd, slots * RECORD_BYTES, _PAGE)
    return slots, _records(data, 0)


_MAPPABLE_FILESYSTEMS = frozenset({"ext4", "xfs", "tmpfs"})
"""Where a store into a mapped, preallocated table page never needs a new block: no
copy-on-write (btrfs, ZFS), no server to fail a page fault (NFS, FUSE)."""
_IN_ORDER_CPUS = frozenset({"x86_64", "amd64", "i386", "i686"})
"""Where every other CPU sees one thread's plain stores in program order (a peer that reads a
new generation finds the records stored before it)."""


def maps_tables(path: str) -> bool:
    """True where the slot tables of slabs under ``path`` may be written through a shared
    memory map (:class:`SlotTable`): an in-order CPU and a filesystem of
    :data:`_MAPPABLE_FILESYSTEMS`, found in ``/proc/self/mountinfo`` by ``path``'s device."""
    if platform.machine().lower() not in _IN_ORDER_CPUS:
        return False
    try:
        dev = os.stat(path).st_dev
        with open("/proc/self/mountinfo") as mounts:
            lines = mounts.read().splitlines()
    except OSError:
        return False
    device = f"{os.major(dev)}:{os.minor(dev)}"
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[2] == device and " - " in line:
            return line.split(" - ", 1)[1].split()[0] in _MAPPABLE_FILESYSTEMS
    return False


class SlotTable:
    """The table of one slab this instance owns (and holds locked): sets and clears its
    records, then bumps its generation. Safe from several IO threads at once (they write
    different slots' records).

    With ``mapped`` (see :func:`maps_tables`), the table is written through a shared memory
    map of the file's head: a store into the page cache takes no inode lock, where a
    ``pwrite`` of one record waits for (and, on Linux, spins a core on) another thread's
    block write into the same slab. What lands in the page cache, and when, is the same:
    every other reader (peers, ``fsck``, a restart) ``pread``s the same pages,
    ``fdatasync`` flushes them, and a killed process leaves them as written. The table is
    preallocated with its slab, so on the filesystems allowed no store needs a new block;
    an I/O error reading a table page back, or a slab truncated under its owner, would end
    the process with ``SIGBUS`` where ``pwrite`` returns an error. The map costs a second
    descriptor per slab (Python's ``mmap`` holds its own). Where the map cannot be made (no
    shared maps there, no descriptor left), the table is written with ``pwrite`` instead:
    one per run of adjacent slots, then the generation.
    """

    def __init__(self, fd: int, *, mapped: bool = False) -> None:
        slots, generation = _read_head(fd)
        self.fd = fd
        self._generation = itertools.count(generation + 1)
        self._map: mmap.mmap | None = None
        if mapped:
            with contextlib.suppress(OSError):  # ENODEV, EMFILE, ENOMEM: pwrite instead
                self._map = mmap.mmap(fd, table_bytes(slots))  # shared, read and write

    @property
    def mapped(self) -> bool:
        """Whether records are stored through the map (else written with ``pwrite``)."""
        return self._map is not None

    def write(self, entries: Iterable[tuple[int, bytes]]) -> None:
        """Set each (slot, record), ``b""`` clearing one, then the next generation.

        Raises:
            OSError: a write failed, or the table is closed; records before it may be set.
        """
        if self._map is None:
            self._write(entries)
            return
        table = self._map
        try:
            for slot, record in entries:
                at = _PAGE + slot * RECORD_BYTES
                table[at : at + RECORD_BYTES] = record or _EMPTY
            table[_GENERATION_AT : _GENERATION_AT + 8] = struct.pack(">Q", next(self._generation))
        except ValueError:
            if not table.closed:
                raise
            raise OSError(errno.EBADF, "the slab's table is closed") from None

    def _write(self, entries: Iterable[tuple[int, bytes]]) -> None:
        ordered = sorted(entries)
        if not ordered:
            return
        fd = self.fd
        first = prev = ordered[0][0]
        run = [ordered[0][1] or _EMPTY]
        for slot, record in ordered[1:]:
            if slot != prev + 1:
                write_fully(fd, (b"".join(run),), _PAGE + first * RECORD_BYTES)
                first, run = slot, []
            run.append(record or _EMPTY)
            prev = slot
        write_fully(fd, (b"".join(run),), _PAGE + first * RECORD_BYTES)
        write_fully(fd, (struct.pack(">Q", next(self._generation)),), _GENERATION_AT)

    def close(self) -> None:
        """Unmap the table, if mapped (the map holds its own descriptor of the file, and
        with it the slab's ``flock``). Idempotent."""
        if self._map is not None:
            self._map.close()


class _Peer:
    """Another instance's slab, as last read: its generation, table bytes and records."""

    __slots__ = ("base", "fd", "generation", "keys", "name", "path", "slots", "table")

    def __init__(self, name: str, path: str, fd: int, slots: int) -> None:
        self.name = name
        self.path = path
        self.fd = fd
        self.slots = slots
        self.base = table_bytes(slots)  # where slot 0 starts
        self.generation = -1
        self.table = b""
        self.keys: dict[int, OffloadKey] = {}  # slot -> key


class PeerTables:
    """The blocks of other instances on the same namespace directory (every slab file this
    one does not own, live or dead), read from their slot tables.

    Each lookup re-reads what changed first: the slab directory (new slabs), then each known
    slab's generation; a slab whose generation moved has its table read again and only its
    changed pages parsed. So a lookup sees every block another instance published before it
    began, and none it removed before. A place found is still checked by the read, which
    verifies the block's header (a slot reused meanwhile names another key: a miss).

    Args:
        slab_dir: the namespace's slab directory.
        own: the names of the slabs this instance owns (never read as a peer's).
    """

    def __init__(self, slab_dir: str, own: Container[str]) -> None:
        self._dir = slab_dir
        self._own = own
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._unreadable: set[str] = set()
        self._where: dict[OffloadKey, tuple[_Peer, int]] = {}

    def find(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, tuple[str, int, int, int]]:
        """Where other instances hold ``keys``: (slab path, open fd, slot, offset of slot 0)
        per key found."""
        with self._lock:
            self._refresh()
            where = self._where
            found = {}
            for key in keys:
                place = where.get(key)
                if place is not None:
                    peer, slot = place
                    found[key] = (peer.path, peer.fd, slot, peer.base)
            return found

    def keys(self) -> set[OffloadKey]:
        """Every key other instances' tables name, read afresh as :meth:`find` reads them
        (a key two slabs name is one entry)."""
        with self._lock:
            self._refresh()
            return set(self._where)

    def _refresh(self) -> None:
        try:
            names = os.listdir(self._dir)
        except OSError:
            names = []
        for entry in names:
            stem, _, ext = entry.partition(".")
            if ext != "slab" or stem in self._peers or stem in self._unreadable:
                continue
            if stem in self._own or not is_slab_id(stem):
                continue
            self._open(stem, os.path.join(self._dir, entry))
        for peer in list(self._peers.values()):
            if peer.name in self._own:  # listed while this instance was creating it
                self._forget(peer)
                continue
            try:
                generation = struct.unpack(">Q", os.pread(peer.fd, 8, _GENERATION_AT))[0]
                if generation != peer.generation:
                    table = os.pread(peer.fd, peer.slots * RECORD_BYTES, _PAGE)
                    peer.generation = generation
                    self._reread(peer, table)
            except (OSError, struct.error):
                continue  # a damaged peer slab: what was read of it stands (reads verify)

    def _forget(self, peer: _Peer) -> None:
        del self._peers[peer.name]
        for slot, key in peer.keys.items():
            if self._where.get(key) == (peer, slot):
                del self._where[key]
        with contextlib.suppress(OSError):
            os.close(peer.fd)

    def _open(self, name: str, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            slots, _ = _read_head(fd)
        except (OSError, TableError):
            os.close(fd)
            self._unreadable.add(name)
            return
        self._peers[name] = _Peer(name, path, fd, slots)

    def _reread(self, peer: _Peer, table: bytes) -> None:
        """Parse the pages of ``table`` that differ from the last read."""
        old = peer.table
        where = self._where
        for at in range(0, len(table), _PAGE):
            page = table[at : at + _PAGE]
            if old[at : at + _PAGE] == page:
                continue
            first = at // RECORD_BYTES
            for slot in range(first, first + len(page) // RECORD_BYTES):
                gone = peer.keys.pop(slot, None)
                if gone is not None and where.get(gone) == (peer, slot):
                    del where[gone]
            for slot, key, _ in _records(page, first):
                peer.keys[slot] = key
                where[key] = (peer, slot)
        peer.table = table

    def close(self) -> None:
        """Close the peers' files. Idempotent."""
        with self._lock:
            for peer in self._peers.values():
                with contextlib.suppress(OSError):
                    os.close(peer.fd)
            self._peers.clear()
            self._where.clear()
