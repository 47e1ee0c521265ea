"""Local file tiers: positional IO into preallocated slab files, published through a shared
SQLite index (what :class:`~kvhex.adapters.storage.fsspec.FsspecTierStore` and the NIXL POSIX tier
use on a local root).

Layout under the namespace directory (see :mod:`kvhex.adapters.storage.format` for the block
format)::

    config.json         what makes blocks compatible, recorded
    index.sqlite        shared index: key -> (slab, slot), SQLite WAL
    slabs/<id>.slab     preallocated slab files of fixed-size slots, one block each

Names are built only from hex (random 128-bit slab ids); files are created ``0600`` and
directories ``0700``.

A put takes free slots of slab files this instance owns (each live instance holds an
exclusive ``flock`` on its slabs), writes each block (header and payload in one ``pwritev``),
then one index transaction per job publishes the job's blocks, with the rows of the blocks it
evicted. A crash before the commit leaves no index row, so nothing torn is ever found; the
checksum catches anything else. Concurrent jobs write to different slabs where they can:
writes into one file serialize on its inode lock, so the capacity is spread over at least
``stripes`` slab files.

At start-up an instance adopts the slabs of instances that died (their lock is free) with
their blocks. Other live instances' blocks are found through the index and read from their
slabs, never announced or evicted here.

Threads: every method may run on any IO thread; ``_lock`` guards slabs, free lists and the
block map, ``_db_lock`` the SQLite connection. No syscall runs under ``_lock`` but creating
a slab and opening another instance's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import structlog

from kvhex.adapters.storage.format import (
    CONFIG,
    HEADER,
    HEADER_AREA,
    MAGIC,
    Located,
    oserror,
    pack_header,
    write_fully,
)
from kvhex.domain.keys import OffloadKey

__all__ = ["INDEX", "KNOWN_ENTRIES", "SLAB_BYTES", "SLAB_DIR", "SlabIo", "is_slab_id"]

log = structlog.get_logger(__name__)

SLAB_BYTES = 1 << 30
"""Largest slab file; a tier smaller than ``stripes`` of these gets ``stripes`` smaller ones."""
INDEX = "index.sqlite"
SLAB_DIR = "slabs"
KNOWN_ENTRIES = frozenset({CONFIG, INDEX, INDEX + "-wal", INDEX + "-shm", SLAB_DIR})
"""What a local namespace directory holds; anything else in it is foreign."""
_SQL_VARS = 500  # keys per ``IN (...)`` query, under SQLite's variable limit
_UNMARKED = bytes(len(MAGIC))
_RUN_BLOCKS = 512
"""Blocks per vectored syscall: two buffers each, within Linux's ``IOV_MAX`` of 1024."""


def _runs(places: Sequence[tuple[int, int] | None], stride: int) -> Iterator[list[int]]:
    """Indices of ``places`` (fd, offset) in runs of adjacent slots of one file, each at most
    ``_RUN_BLOCKS`` long; ``None`` places belong to no run."""
    run: list[int] = []
    for i, place in enumerate(places):
        if place is None:
            continue
        if run and (len(run) == _RUN_BLOCKS or places[run[-1]] != (place[0], place[1] - stride)):
            yield run
            run = []
        run.append(i)
    if run:
        yield run


def is_slab_id(stem: str) -> bool:
    """True for a slab file's name stem: 32 lower-case hex digits."""
    return len(stem) == 32 and all(c in "0123456789abcdef" for c in stem)


class _Slab:
    """One slab file this instance owns (its ``flock`` held while open)."""

    __slots__ = ("fd", "free", "name", "path", "slots", "writers")

    def __init__(self, name: str, path: str, fd: int, slots: int, used: Iterable[int]) -> None:
        self.name = name
        self.path = path
        self.fd = fd
        self.slots = slots
        self.writers = 0  # jobs writing into it now
        taken = set(used)
        # popped from the end: ascending slot order while the slab fills
        self.free = [s for s in range(slots - 1, -1, -1) if s not in taken]


class SlabIo:
    """Slab files and their shared index under one namespace directory ``root``. See the
    module docstring for ownership, crash safety and sharing.

    ``slot_size`` is a whole block (header area and payload); at most ``max_slots`` slots
    exist in all. New slabs are created while jobs find no free slot in a slab that no other
    job is writing, up to ``max_slots``.
    """

    def __init__(
        self, root: str, slot_size: int, max_slots: int, *, fsync: bool, stripes: int = 1
    ) -> None:
        self.root = root
        self.slab_dir = os.path.join(root, SLAB_DIR)
        self.slot_size = slot_size
        self.max_slots = max_slots
        spread = -(-max_slots // max(1, stripes))
        self.per_slab = max(1, min(spread, SLAB_BYTES // slot_size))
        self.fsync = fsync
        self._lock = threading.Lock()  # slabs, free lists, _where, foreign fds
        self._db_lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._slabs: dict[str, _Slab] = {}
        self._where: dict[OffloadKey, tuple[_Slab, int]] = {}
        self._foreign_fds: dict[str, int] = {}
        self._adopted: list[tuple[OffloadKey, float]] = []
        self._foreign = 0
        self._unpublished: list[tuple[OffloadKey, str]] = []  # rows of freed slots
        self._rebuilt = False  # the index was unreadable: adopted slabs are scanned

    # -- start-up ------------------------------------------------------------------------
    def prepare(self) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)  # the namespace directory
        os.makedirs(self.slab_dir, mode=0o700, exist_ok=True)
        try:
            self._db = self._open_index()
            self._query("SELECT count(*) FROM blocks", ())  # reads every page header
        except sqlite3.DatabaseError as exc:
            # unreadable (a power loss without fsync, a damaged disk): start a new index and
            # recover this instance's blocks from the headers of the slabs it adopts
            log.warning("tier_index_rebuilt", root=self.root, error=str(exc)[:200])
            if self._db is not None:
                self._db.close()
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.root, INDEX + suffix))
            self._db = self._open_index()
            self._rebuilt = True
        self._foreign = sum(1 for name in os.listdir(self.root) if name not in KNOWN_ENTRIES)
        for name in sorted(os.listdir(self.slab_dir)):
            stem, _, ext = name.partition(".")
            if not is_slab_id(stem) or ext not in ("slab", "new"):
                self._foreign += 1
                continue
            self._adopt(stem, os.path.join(self.slab_dir, name), ext == "new")

    def _open_index(self) -> sqlite3.Connection:
        path = os.path.join(self.root, INDEX)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))  # SQLite's files inherit 0600
        db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        # without fsync, SQLite need not sync either: a process crash keeps every committed
        # transaction (the WAL is in the page cache); a power loss may cost the index, which
        # is then rebuilt from the slab headers
        db.execute(f"PRAGMA synchronous={'NORMAL' if self.fsync else 'OFF'}")
        db.execute(
            "CREATE TABLE IF NOT EXISTS blocks (key BLOB NOT NULL, slab TEXT NOT NULL, "
            "slot INTEGER NOT NULL, stored REAL NOT NULL, PRIMARY KEY (key, slab)) WITHOUT ROWID"
        )
        db.execute("CREATE INDEX IF NOT EXISTS blocks_by_slab ON blocks (slab, slot)")
        return db

    def _scan(self, name: str, fd: int, slots: int) -> list[tuple[OffloadKey, int, float]]:
        """Blocks whose header looks whole in each slot of a slab (payloads are verified when
        read), written back to the index."""
        stored = os.fstat(fd).st_mtime
        payload = self.slot_size - HEADER_AREA
        found: list[tuple[OffloadKey, int, float]] = []
        for slot in range(slots):
            header = os.pread(fd, HEADER.size + 255, slot * self.slot_size)
            if len(header) < HEADER.size:
                break
            magic, length, _, key_len = HEADER.unpack_from(header)
            key = header[HEADER.size : HEADER.size + key_len]
            if magic == MAGIC and length == payload and 4 < key_len == len(key):
                found.append((OffloadKey(key), slot, stored))
        self._commit([(key, name, slot, t) for key, slot, t in found])
        return found

    def _adopt(self, name: str, path: str, unfinished: bool) -> None:
        """Take over a dead instance's slab (its lock is free) with the blocks it holds."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live instance's
            return
        slots = os.fstat(fd).st_size // self.slot_size
        if unfinished or slots == 0:  # a crash while creating it: it never held a block
            os.unlink(path)
            os.close(fd)
            return
        if self._rebuilt:
            held = self._scan(name, fd, slots)
        else:
            rows = self._query("SELECT key, slot, stored FROM blocks WHERE slab = ?", (name,))
            held = [(OffloadKey(bytes(k)), s, t) for k, s, t in rows if 0 <= s < slots]
        slab = _Slab(name, path, fd, slots, (s for _, s, _ in held))
        self._slabs[name] = slab
        for key, slot, stored in held:
            self._where[key] = (slab, slot)
            self._adopted.append((key, stored))

    def inventory(self) -> tuple[list[tuple[OffloadKey, float]], int]:
        """Blocks adopted at start-up with their store time, and foreign entries seen."""
        return self._adopted, self._foreign

    def write_config(self, name: str, data: bytes) -> bytes | None:
        path = os.path.join(self.root, name)
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

    # -- slots ---------------------------------------------------------------------------
    def _allocate(
        self, count: int, room: Sequence[tuple[_Slab, int]]
    ) -> tuple[list[tuple[_Slab, int]], list[tuple[_Slab, int]], str | None]:
        """Slots for a job of ``count`` blocks: the job's own ``room`` first (the slots its
        evictions freed), then free ones from the slabs the fewest jobs are writing (a new
        slab while every one with room is being written and the capacity allows it). Returns
        the slots, the room left over, and why there are fewer than ``count``. Each slab a
        job writes counts it as a writer until :meth:`_written`."""
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

    def _written(self, slots: list[tuple[_Slab, int]]) -> None:
        """A job's writes ended: each slab it wrote loses a writer."""
        with self._lock:
            for slab in {slab for slab, _ in slots}:
                slab.writers -= 1

    def _free(self, slots: Sequence[tuple[_Slab, int]]) -> None:
        """Unmark the headers of ``slots`` (a rebuilt index never brings a removed or torn
        block back), then make them free."""
        for slab, slot in slots:
            with contextlib.suppress(OSError):
                os.pwrite(slab.fd, _UNMARKED, slot * self.slot_size)
        with self._lock:
            for slab, slot in slots:
                slab.free.append(slot)

    def _new_slab(self, slots: int) -> _Slab:
        name = uuid.uuid4().hex
        path = os.path.join(self.slab_dir, name + ".slab")
        building = os.path.join(self.slab_dir, name + ".new")
        fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(fd, 0, slots * self.slot_size)
            os.rename(building, path)  # the lock stays with the open file
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(building)
            raise
        slab = _Slab(name, path, fd, slots, ())
        self._slabs[name] = slab
        return slab

    # -- index ---------------------------------------------------------------------------
    def _query(self, sql: str, args: Sequence[Any]) -> list[Any]:
        assert self._db is not None
        with self._db_lock:
            return self._db.execute(sql, args).fetchall()

    def _commit(self, inserts: list[tuple[Any, ...]]) -> None:
        """Publish ``inserts`` and the removals queued so far in one transaction.

        Raises:
            sqlite3.Error, OSError: the transaction failed; none of its rows are published
                (the removals are queued again for the next one).
        """
        with self._lock:
            deletes, self._unpublished = self._unpublished, []
        try:
            with self._db_lock:
                self._transaction(deletes, inserts)
        except BaseException:
            with self._lock:  # retried with the next transaction
                self._unpublished[:0] = deletes
            raise

    def _transaction(self, deletes: list[tuple[Any, ...]], inserts: list[tuple[Any, ...]]) -> None:
        db = self._db
        assert db is not None
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany("DELETE FROM blocks WHERE key = ? AND slab = ?", deletes)
            db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?)", inserts)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _lookup(self, keys: list[OffloadKey]) -> dict[OffloadKey, tuple[str, int]]:
        """Where other instances hold ``keys``, from the shared index."""
        found: dict[OffloadKey, tuple[str, int]] = {}
        for start in range(0, len(keys), _SQL_VARS):
            batch = keys[start : start + _SQL_VARS]
            marks = ",".join("?" * len(batch))
            sql = f"SELECT key, slab, slot FROM blocks WHERE key IN ({marks})"
            for key, slab, slot in self._query(sql, batch):
                found.setdefault(OffloadKey(bytes(key)), (slab, slot))
        return found

    # -- IO ------------------------------------------------------------------------------
    def write_many(
        self,
        items: list[tuple[OffloadKey, memoryview]],
        room: Sequence[tuple[_Slab, int]] = (),
    ) -> list[str | None]:
        """Write and publish ``items``; per item ``None`` or why it was not stored. ``room``
        is what :meth:`remove_many` freed for this job (``defer``): written into first, and
        whatever is left of it is unmarked and freed before the job's index commit."""
        slots, spare, short = self._allocate(len(items), room)
        errors: list[str | None] = [None] * len(items)
        errors[len(slots) :] = [short] * (len(items) - len(slots))
        size = self.slot_size
        try:
            written = self._write_blocks(
                [
                    (slab.fd, slot * size, key, view)
                    for (key, view), (slab, slot) in zip(items, slots, strict=False)
                ]
            )
        except BaseException:  # a bug or a backend failure outside per-block handling
            self._free(slots + spare)
            self._written(slots)
            raise
        done: list[tuple[OffloadKey, _Slab, int]] = []
        unused = list(spare)
        for i, ((key, _), place, error) in enumerate(zip(items, slots, written, strict=False)):
            if error is None:
                done.append((key, *place))
            else:
                errors[i] = error
                unused.append(place)
        self._free(unused)
        try:
            if done:
                if self.fsync:
                    for fd in {slab.fd for _, slab, _ in done}:
                        os.fdatasync(fd)
                now = time.time()
                self._commit([(key, slab.name, slot, now) for key, slab, slot in done])
        except (OSError, sqlite3.Error) as exc:
            text = oserror(exc) if isinstance(exc, OSError) else f"index: {exc}"
            errors[: len(slots)] = [text if e is None else e for e in errors[: len(slots)]]
            self._free([(slab, slot) for _, slab, slot in done])
            self._written(slots)
            return errors
        with self._lock:
            for key, slab, slot in done:
                self._where[key] = (slab, slot)
        self._written(slots)
        return errors

    def _write_blocks(
        self, blocks: list[tuple[int, int, OffloadKey, memoryview]]
    ) -> list[str | None]:
        """Write each (fd, offset, key, payload), header and payload back to back: one
        ``pwritev`` for each run of adjacent slots. Checksums are computed first (the pass
        leaves each payload in the CPU cache for the copy); a write cut short leaves headers
        whose checksums fail, and the index never names them."""
        errors: list[str | None] = [None] * len(blocks)
        for run in _runs([(fd, offset) for fd, offset, _, _ in blocks], self.slot_size):
            parts: list[bytes | memoryview] = []
            for i in run:
                _, _, key, payload = blocks[i]
                parts += (pack_header(key, payload), payload)
            fd, offset, _, _ = blocks[run[0]]
            try:
                write_fully(fd, parts, offset)
            except OSError as exc:
                for i in run:
                    errors[i] = oserror(exc)
        return errors

    def _locate(self, keys: list[OffloadKey]) -> list[tuple[int, int] | None]:
        """(fd, offset) of each key: owned blocks first, then other instances' slabs."""
        out: list[tuple[int, int] | None] = []
        missing: list[OffloadKey] = []
        with self._lock:
            for key in keys:
                where = self._where.get(key)
                if where is None:
                    missing.append(key)
                    out.append(None)
                else:
                    out.append((where[0].fd, where[1] * self.slot_size))
        if missing:
            elsewhere = self._lookup(missing)
            for i, key in enumerate(keys):
                if out[i] is None and key in elsewhere:
                    slab, slot = elsewhere[key]
                    fd = self._foreign_fd(slab)
                    if fd is not None:
                        out[i] = (fd, slot * self.slot_size)
        return out

    def _foreign_fd(self, slab: str) -> int | None:
        with self._lock:
            fd = self._foreign_fds.get(slab)
            if fd is None and slab in self._slabs:
                return self._slabs[slab].fd
            if fd is None and is_slab_id(slab):
                try:
                    fd = os.open(os.path.join(self.slab_dir, slab + ".slab"), os.O_RDONLY)
                except FileNotFoundError:
                    return None
                self._foreign_fds[slab] = fd
            return fd

    def read_many(self, items: list[tuple[OffloadKey, memoryview]]) -> list[bytes | None]:
        places = self._locate([key for key, _ in items])
        return self._read_blocks(
            [(place, view) for place, (_, view) in zip(places, items, strict=True)]
        )

    def _read_blocks(
        self, blocks: list[tuple[tuple[int, int] | None, memoryview]]
    ) -> list[bytes | None]:
        """The header area of each block, its payload read into the view (one ``preadv``
        for each run of adjacent slots); ``None`` if it is not in the index, ``b""`` for a
        short read."""
        out: list[bytes | None] = [None] * len(blocks)
        places = [place for place, _ in blocks]
        for run in _runs(places, self.slot_size):
            headers = [bytearray(HEADER_AREA) for _ in run]
            parts = [part for i, h in zip(run, headers, strict=True) for part in (h, blocks[i][1])]
            first = places[run[0]]
            assert first is not None  # runs hold located blocks only
            got = os.preadv(first[0], parts, first[1])
            for i, header in zip(run, headers, strict=True):
                size = HEADER_AREA + len(blocks[i][1])
                out[i] = bytes(header) if got >= size else b""
                got -= size
        return out

    def invalid(self, key: OffloadKey) -> bool:
        """``key`` failed verification: drop it if this instance owns it (True); a block
        another instance owns, or one already gone, is left alone (False)."""
        with self._lock:
            if key not in self._where:
                return False
        self.remove_many([key])
        return True

    def remove_many(
        self, keys: Sequence[OffloadKey], *, defer: bool = False
    ) -> list[tuple[_Slab, int]]:
        """Drop the blocks of ``keys`` this instance owns.

        With ``defer`` (a put's evictions) their index rows go with the next transaction and
        their slots are returned, old headers intact, as room for that put
        (:meth:`write_many`); nobody else can take them meanwhile. Otherwise the headers are
        unmarked, the slots freed and the rows deleted now. A reader sent to a reused slot by
        a stale row finds another key's header there: a miss, never wrong bytes.
        """
        with self._lock:
            freed = [(key, where) for key in keys if (where := self._where.pop(key, None))]
            if defer:
                self._unpublished.extend((key, slab.name) for key, (slab, _) in freed)
                return [where for _, where in freed]
        self._free([where for _, where in freed])
        with self._lock:
            self._unpublished.extend((key, slab.name) for key, (slab, _) in freed)
            if not self._unpublished:
                return []
        self._commit([])
        return []

    def exists_many(self, keys: list[OffloadKey]) -> set[OffloadKey]:
        with self._lock:
            found = {k for k in keys if k in self._where}
        rest = [k for k in keys if k not in found]
        return found | set(self._lookup(rest)) if rest else found

    def location(self, key: OffloadKey) -> Located:
        with self._lock:
            where = self._where.get(key)
        if where is not None:
            return where[0].path, where[1] * self.slot_size
        found = self._lookup([key])
        if key not in found:
            raise KeyError(key.hex())
        slab, slot = found[key]
        return os.path.join(self.slab_dir, slab + ".slab"), slot * self.slot_size

    def close(self) -> None:
        if self._db is not None and self._unpublished:
            with contextlib.suppress(sqlite3.Error):
                self._commit([])
        with self._lock:
            for fd in self._foreign_fds.values():
                os.close(fd)
            for slab in self._slabs.values():
                os.close(slab.fd)  # releases the lock: a later instance may adopt it
            self._foreign_fds.clear()
            self._slabs.clear()
            self._where.clear()
        if self._db is not None:
            with self._db_lock:
                self._db.close()
            self._db = None


def _writers(slab: _Slab) -> int:
    return slab.writers


def _file_order(place: tuple[_Slab, int]) -> tuple[str, int]:
    return place[0].name, place[1]
