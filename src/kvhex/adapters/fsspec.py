"""A secondary tier on any fsspec filesystem: local files (slab files with a shared index) or
object stores (one object per block).

Local layout under the configured root::

    ROOT/<namespace digest>/config.json       what makes blocks compatible (model, chunk
                                              geometry, dtype, layout version), recorded
    ROOT/<namespace digest>/index.sqlite      shared index: key -> (slab, slot), SQLite WAL
    ROOT/<namespace digest>/slabs/<id>.slab   preallocated slab files of fixed-size slots

Object-store layout::

    ROOT/<namespace digest>/config.json
    ROOT/<namespace digest>/<k0k1>/<key hex>.blk

Names are built only from hex (offload keys, random slab ids) under the configured root, so no
input can name a path outside it. Local files are created ``0600`` and directories ``0700``.

A block is a 4 KiB header area (magic, payload length, XXH3-64 of the payload, the key, zero
padding) and the host slot's bytes; in a slab it fills one slot. Every read verifies all of
it: a mismatch or a short read is a failed load, and a block this instance owns is dropped
and its removal announced.

Local writes are positional: the payload goes into a free slot of a slab file this instance
owns (each live instance holds an exclusive ``flock`` on its slabs), then the header, then
one index transaction per job publishes the job's blocks. A crash before the commit leaves
no index row, so nothing torn is ever found; the checksum catches anything else. At start-up
an instance adopts the slabs of instances that died (their lock is free) with their blocks,
and announces those blocks once, as stored without provenance. Other live instances' blocks
are found through the index and read from their slabs, never announced or evicted here.
Object-store writes are single ``PUT``s, atomic by nature; every instance lists the
namespace at start-up.

The tier keeps an LRU index of the blocks it owns and a byte capacity: blocks are evicted
least recently used first, and announced.

Threads: all IO runs on a pool of ``io_threads``; submissions, ``poll``, ``delete`` and the
index and event bookkeeping run on the scheduler thread only.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import hashlib
import json
import os
import sqlite3
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import structlog
import xxhash

from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.jobs import JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer

__all__ = [
    "CONFIG",
    "HEADER",
    "HEADER_AREA",
    "INDEX",
    "KNOWN_ENTRIES",
    "LAYOUT_VERSION",
    "MAGIC",
    "SLAB_DIR",
    "FsspecTierStore",
    "header_matches",
    "is_slab_id",
    "namespace_digest",
    "pack_header",
]

log = structlog.get_logger(__name__)

LAYOUT_VERSION = 2
MAGIC = b"KVHXBLK1"
HEADER = struct.Struct(">8sQQH")  # magic, payload length, xxh3-64 of the payload, key length
HEADER_AREA = 4096
"""Bytes before the payload (header, key, zero padding): a page-aligned payload is written
4x faster through the page cache than one at an odd offset (docs/tiers.md), and suits
NIXL and direct IO."""
SUFFIX = ".blk"
SLAB_BYTES = 1 << 30
"""Target size of one slab file; a tier smaller than this gets one slab of its size."""
INDEX = "index.sqlite"
CONFIG = "config.json"
SLAB_DIR = "slabs"
KNOWN_ENTRIES = frozenset({CONFIG, INDEX, INDEX + "-wal", INDEX + "-shm", SLAB_DIR})
"""What a local namespace directory holds; anything else in it is foreign."""
_SQL_VARS = 500  # keys per ``IN (...)`` query, under SQLite's variable limit

Located = tuple[str, int]
"""Where a block lives: a file or object, and the byte offset of its header."""


def namespace_digest(namespace: Mapping[str, Any]) -> str:
    """16 hex digits naming a namespace: blocks are shared only between identical ones."""
    canonical = json.dumps({**namespace, "layout_version": LAYOUT_VERSION}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def pack_header(key: OffloadKey, payload: memoryview) -> bytes:
    """The header area of a block holding ``payload`` under ``key``."""
    header = HEADER.pack(MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload), len(key))
    return (header + key).ljust(HEADER_AREA, b"\0")


def header_matches(header: bytes, key: OffloadKey, payload: memoryview) -> bool:
    """True when ``header`` describes ``payload`` stored under ``key``, checksum included."""
    if len(header) != HEADER_AREA:
        return False
    magic, length, digest, key_len = HEADER.unpack_from(header)
    return (
        magic == MAGIC
        and length == len(payload)
        and key_len == len(key)
        and header[HEADER.size : HEADER.size + key_len] == key
        and xxhash.xxh3_64_intdigest(payload) == digest
    )


def _key_from_hex(stem: str) -> OffloadKey | None:
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return OffloadKey(key) if len(key) > 4 and key.hex() == stem else None


def is_slab_id(stem: str) -> bool:
    """True for a slab file's name stem: 32 lower-case hex digits."""
    return len(stem) == 32 and all(c in "0123456789abcdef" for c in stem)


def _write_fully(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        offset += written
        view = view[written:]


def _oserror(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}"


class _Slab:
    """One slab file this instance owns (its ``flock`` held while open)."""

    __slots__ = ("fd", "free", "name", "path", "slots")

    def __init__(self, name: str, path: str, fd: int, slots: int, used: Iterable[int]) -> None:
        self.name = name
        self.path = path
        self.fd = fd
        self.slots = slots
        taken = set(used)
        # popped from the end: ascending slot order while the slab fills
        self.free = [s for s in range(slots - 1, -1, -1) if s not in taken]


class _SlabIo:
    """Local files: positional IO into preallocated slab files, published through a shared
    SQLite index (WAL mode). See the module docstring for ownership, crash safety and
    sharing.

    ``slot_size`` is a whole block (header area and payload). New slabs are created only when
    every owned slot is taken and fewer than ``max_slots`` exist.
    """

    def __init__(self, root: str, slot_size: int, max_slots: int, *, fsync: bool) -> None:
        self.root = root
        self.slab_dir = os.path.join(root, SLAB_DIR)
        self.slot_size = slot_size
        self.max_slots = max_slots
        self.per_slab = max(1, min(max_slots, SLAB_BYTES // slot_size))
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
            _write_fully(fd, data, 0)
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
    def _allocate(self) -> tuple[_Slab, int]:
        with self._lock:
            for slab in self._slabs.values():
                if slab.free:
                    return slab, slab.free.pop()
            total = sum(s.slots for s in self._slabs.values())
            if total >= self.max_slots:
                raise OSError(28, "every slot of this tier is taken")
            return self._new_slab(min(self.per_slab, self.max_slots - total))

    def _new_slab(self, slots: int) -> tuple[_Slab, int]:
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
        return slab, slab.free.pop()

    def _release(self, slab: _Slab, slot: int) -> None:
        with self._lock:
            slab.free.append(slot)

    # -- index ---------------------------------------------------------------------------
    def _query(self, sql: str, args: Sequence[Any]) -> list[Any]:
        assert self._db is not None
        with self._db_lock:
            return self._db.execute(sql, args).fetchall()

    def _commit(self, inserts: list[tuple[Any, ...]]) -> None:
        """One transaction: the removals queued so far, then ``inserts``."""
        assert self._db is not None
        with self._lock:
            deletes, self._unpublished = self._unpublished, []
        try:
            with self._db_lock:
                db = self._db
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.executemany("DELETE FROM blocks WHERE key = ? AND slab = ?", deletes)
                    db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?)", inserts)
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
        except BaseException:
            with self._lock:  # retried with the next transaction
                self._unpublished[:0] = deletes
            raise

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
    def write_many(self, items: list[tuple[OffloadKey, memoryview]]) -> list[str | None]:
        errors: list[str | None] = [None] * len(items)
        placed: list[tuple[int, OffloadKey, _Slab, int]] = []
        for i, (key, _) in enumerate(items):
            try:
                slab, slot = self._allocate()
            except OSError as exc:
                errors[i] = _oserror(exc)
                continue
            placed.append((i, key, slab, slot))
        size = self.slot_size
        written = self._write_blocks(
            [(slab.fd, slot * size, key, items[i][1]) for i, key, slab, slot in placed]
        )
        done: list[tuple[int, OffloadKey, _Slab, int]] = []
        for entry, error in zip(placed, written, strict=True):
            if error is None:
                done.append(entry)
            else:
                errors[entry[0]] = error
                self._release(entry[2], entry[3])
        if done:
            try:
                if self.fsync:
                    for fd in {slab.fd for _, _, slab, _ in done}:
                        os.fdatasync(fd)
                now = time.time()
                self._commit([(key, slab.name, slot, now) for _, key, slab, slot in done])
            except (OSError, sqlite3.Error) as exc:
                text = _oserror(exc) if isinstance(exc, OSError) else f"index: {exc}"
                for i, _, slab, slot in done:
                    errors[i] = text
                    self._release(slab, slot)
                return errors
            with self._lock:
                for _, key, slab, slot in done:
                    self._where[key] = (slab, slot)
        return errors

    def _write_blocks(
        self, blocks: list[tuple[int, int, OffloadKey, memoryview]]
    ) -> list[str | None]:
        """Write each (fd, offset, key, payload): payload first, header last. Each payload is
        checksummed right before it is written, while its bytes are still in the CPU cache
        (measured faster than checksumming a whole job first: docs/tiers.md)."""
        errors: list[str | None] = []
        for fd, offset, key, payload in blocks:
            try:
                header = pack_header(key, payload)
                _write_fully(fd, payload, offset + HEADER_AREA)
                _write_fully(fd, header, offset)
                errors.append(None)
            except OSError as exc:
                errors.append(_oserror(exc))
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
        """The header area of each block, its payload read into the view; ``None`` if it is
        not in the index, ``b""`` for a short read."""
        out: list[bytes | None] = []
        for place, view in blocks:
            if place is None:
                out.append(None)
                continue
            fd, offset = place
            header = os.pread(fd, HEADER_AREA, offset)
            if len(header) != HEADER_AREA or os.preadv(fd, [view], offset + HEADER_AREA) != len(
                view
            ):
                out.append(b"")
            else:
                out.append(header)
        return out

    def invalid(self, key: OffloadKey) -> bool:
        """``key`` failed verification: drop it if this instance owns it (True); a block
        another instance owns, or one already gone, is left alone (False)."""
        with self._lock:
            if key not in self._where:
                return False
        self.remove_many([key])
        return True

    def remove_many(self, keys: Sequence[OffloadKey], *, defer: bool = False) -> None:
        """Free the slots of ``keys`` this instance owns. Their index rows go with the next
        transaction when ``defer`` (a put that reuses the slots publishes right after),
        otherwise now. A reader sent to a reused slot by a stale row finds another key's
        header there: a miss, never wrong bytes."""
        with self._lock:
            for key in keys:
                where = self._where.pop(key, None)
                if where is not None:
                    slab, slot = where
                    # unmark the header before the slot can be reused: a rebuilt index
                    # never brings a removed block back
                    with contextlib.suppress(OSError):
                        os.pwrite(slab.fd, bytes(len(MAGIC)), slot * self.slot_size)
                    slab.free.append(slot)
                    self._unpublished.append((key, slab.name))
            if defer or not self._unpublished:
                return
        self._commit([])

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


class _ObjectIo:
    """One object per block through any fsspec filesystem. Object stores get one concurrent
    batch of requests per job (``pipe``/``cat`` of many paths) and existence probes by
    listing where a listing is cheaper than one request per key."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root

    def path(self, key: OffloadKey) -> str:
        h = key.hex()
        return f"{self.root}/{h[:2]}/{h}{SUFFIX}"

    def prepare(self) -> None:
        bucket = self.root.split("/", 1)[0]
        if not self.fs.exists(bucket):
            raise FileNotFoundError(f"bucket or root {bucket!r} does not exist")

    def write_config(self, name: str, data: bytes) -> bytes | None:
        path = f"{self.root}/{name}"
        if self.fs.exists(path):
            return bytes(self.fs.cat_file(path))
        self.fs.pipe_file(path, data)
        return None

    def inventory(self) -> tuple[list[tuple[OffloadKey, float]], int]:
        found: list[tuple[OffloadKey, float]] = []
        foreign = 0
        for path, mtime in self._walk():
            name = path.rsplit("/", 1)[-1]
            if name == CONFIG:
                continue
            key = _key_from_hex(name[: -len(SUFFIX)]) if name.endswith(SUFFIX) else None
            if key is None or path != self.path(key):
                foreign += 1
                continue
            found.append((key, mtime))
        return found, foreign

    def _walk(self) -> Iterable[tuple[str, float]]:
        try:
            listing = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return
        for path, info in listing.items():
            mtime = info.get("mtime") or info.get("LastModified") or 0.0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            yield path, float(mtime)

    def write_many(self, items: list[tuple[OffloadKey, memoryview]]) -> list[str | None]:
        if not items:
            return []
        payload = {self.path(key): pack_header(key, view) + bytes(view) for key, view in items}
        try:
            self.fs.pipe(payload)
        except Exception as exc:
            # the batch is all or nothing from here: find out what actually landed
            error = f"{type(exc).__name__}: {_safe(exc)}"
            try:
                landed = self.exists_many([key for key, _ in items])
            except Exception:
                landed = set()
            return [None if key in landed else error for key, _ in items]
        return [None] * len(items)

    def read_many(self, items: list[tuple[OffloadKey, memoryview]]) -> list[bytes | None]:
        if not items:
            return []
        paths = [self.path(key) for key, _ in items]
        got = self.fs.cat(paths, on_error="return")
        out: list[bytes | None] = []
        for path, (_, view) in zip(paths, items, strict=True):
            data = got.get(path)
            if data is None or isinstance(data, FileNotFoundError):
                out.append(None)
            elif isinstance(data, BaseException):
                raise data
            elif len(data) != HEADER_AREA + len(view):
                out.append(b"")
            else:
                view[:] = data[HEADER_AREA:]
                out.append(bytes(data[:HEADER_AREA]))
        return out

    def invalid(self, key: OffloadKey) -> bool:
        """A block failed verification: delete it (True)."""
        self.remove_many([key])
        return True

    def exists_many(self, keys: list[OffloadKey]) -> set[OffloadKey]:
        by_path = {self.path(k): k for k in keys}
        return {by_path[p] for p in self._exists_paths(list(by_path))}

    def _exists_paths(self, paths: list[str]) -> set[str]:
        by_prefix: dict[str, list[str]] = {}
        for path in paths:
            by_prefix.setdefault(path.rsplit("/", 1)[0], []).append(path)
        found: set[str] = set()
        for prefix, wanted in by_prefix.items():
            if len(wanted) > 1:  # one LIST answers every key under this shard
                try:
                    listed = set(self.fs.find(prefix))
                except FileNotFoundError:
                    listed = set()
                found.update(p for p in wanted if p in listed)
            else:
                found.update(p for p in wanted if self.fs.exists(p))
        return found

    def remove_many(self, keys: Sequence[OffloadKey], *, defer: bool = False) -> None:
        """Delete the blocks of ``keys`` in one batch (one bulk request on S3). ``defer`` is
        accepted for the slab IO's sake: an object is gone once deleted, nothing to publish."""
        self._remove_paths([self.path(key) for key in keys])

    def _remove_paths(self, paths: list[str]) -> None:
        if not paths:
            return
        try:
            self.fs.rm(paths)
        except FileNotFoundError:  # some were gone already: delete the rest one by one
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)

    def location(self, key: OffloadKey) -> Located:
        return self.path(key), 0

    def close(self) -> None:
        """Nothing held."""


class FsspecTierStore:
    """A file or object-store tier. See the module docstring for layout and guarantees.

    Args:
        host: the host buffer whose slots jobs name.
        url: root, e.g. ``/var/cache/kvhex`` or ``s3://bucket/prefix``.
        capacity_bytes: bytes the tier may hold (headers included); LRU eviction beyond.
        name: ownership name announced in events and used in errors.
        namespace: what makes blocks compatible (model, geometry, dtype, ...).
        medium, locality: announced in events.
        io_threads: concurrent IO operations.
        fsync: flush each job's blocks to the device before publishing them (local files
            only; without it a power loss can lose recent blocks, never tear one).
        storage_options: passed to fsspec (credentials never reach logs or events).

    Raises:
        TierUnavailable: the root cannot be created or written, or holds a namespace whose
            recorded configuration differs.
    """

    def __init__(
        self,
        host: HostBuffer,
        url: str,
        *,
        capacity_bytes: int,
        name: str = "files",
        namespace: Mapping[str, Any] | None = None,
        medium: Medium = Medium.STORAGE,
        locality: Locality | None = Locality.LOCAL,
        io_threads: int = 8,
        fsync: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        import fsspec

        self._name = name
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self._host = host
        self._identity = TierIdentity(medium, locality, name)
        self.capacity_bytes = capacity_bytes
        self._fsync = fsync
        ns = dict(namespace or {})
        ns.setdefault("slot_bytes", host.slot_bytes)
        self.namespace = ns
        digest = namespace_digest(ns)
        try:
            fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
            base = root.rstrip("/") + "/" + digest
            self._io: Any = self._make_io(fs, base)
            self._io.prepare()
            config = json.dumps({**ns, "layout_version": LAYOUT_VERSION}, sort_keys=True)
            recorded = self._io.write_config(CONFIG, config.encode())
        except Exception as exc:
            raise TierUnavailable(
                f"cannot use root {url!r}: {type(exc).__name__}: {_safe(exc)}", tier=name
            ) from exc
        if recorded is not None and json.loads(recorded) != json.loads(config):
            raise TierUnavailable(
                f"namespace {digest} under {url!r} records another config", tier=name
            )
        self.root = base
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()
        self._used = 0
        self._writing: set[OffloadKey] = set()
        # keys whose file deletion is still running: never found, read or rewritten meanwhile
        self._deleting: dict[OffloadKey, cf.Future[Any]] = {}
        self._deletions: dict[cf.Future[Any], list[OffloadKey]] = {}
        self._events: list[TierEvent] = []
        self._pending: list[tuple[TierJob, float, cf.Future[Any]]] = []
        self._pool = cf.ThreadPoolExecutor(io_threads, thread_name_prefix=f"kvhex-{name}")
        self._closed = False
        self.corrupt_blocks = 0
        self.foreign_files = 0
        self.io_errors = 0
        self._recover()

    def _make_io(self, fs: Any, base: str) -> Any:
        """The IO strategy for this filesystem (subclasses move the data path elsewhere)."""
        if "file" in _protocols(fs):
            return _SlabIo(base, *self._slab_geometry(), fsync=self._fsync)
        return _ObjectIo(fs, base)

    def _slab_geometry(self) -> tuple[int, int]:
        """Bytes per slab slot (one block) and how many slots the capacity allows."""
        size = HEADER_AREA + self._host.slot_bytes
        return size, max(1, self.capacity_bytes // size)

    # -- start-up ------------------------------------------------------------------------
    def _recover(self) -> None:
        found, self.foreign_files = self._io.inventory()
        for key, _ in sorted(found, key=lambda f: f[1]):
            size = self._size(key)  # what a write of it costs here, whatever was recorded
            self._index[key] = size
            self._used += size
        evicted = self._evict_to(self.capacity_bytes, protected=set())
        self._io.remove_many(evicted)
        if self._index:
            self._events.append(Stored(tuple(self._index), self._identity, None))
        if found or self.foreign_files:
            log.info(
                "tier_recovered",
                tier=self._identity.ownership,
                blocks=len(self._index),
                evicted=len(evicted),
                foreign_files=self.foreign_files,
            )

    def _evict_to(self, limit: int, protected: set[OffloadKey]) -> list[OffloadKey]:
        victims: list[OffloadKey] = []
        if self._used <= limit:
            return victims
        used = self._used
        for key, size in self._index.items():  # oldest first; stops as soon as enough
            if key in protected:
                continue
            victims.append(key)
            used -= size
            if used <= limit:
                break
        for key in victims:
            self._used -= self._index.pop(key)
        return victims

    # -- TierStore -----------------------------------------------------------------------
    @property
    def identity(self) -> TierIdentity:
        """Medium, locality and ownership announced in events."""
        return self._identity

    def submit_put(self, job: TierJob) -> None:
        """Write the new keys of ``job`` (evicting LRU blocks first if the tier is full)."""
        self._check_open(job, JobKind.PUT)
        new = [
            (k, s)
            for k, s in zip(job.keys, job.slots, strict=True)
            if k not in self._index and k not in self._writing
        ]
        for key in job.keys:
            if key in self._index:
                self._index.move_to_end(key)
        need = sum(self._size(k) for k, _ in new)
        victims: list[OffloadKey] = []
        if need > self.capacity_bytes:
            future: cf.Future[Any] = cf.Future()
            future.set_result(([], "job larger than tier capacity"))
            self._pending.append((job, time.perf_counter(), future))
            return
        victims = self._evict_to(self.capacity_bytes - need, protected=set(job.keys))
        if victims:
            self._events.append(Removed(tuple(victims), self._identity))
        self._used += need
        self._writing.update(k for k, _ in new)
        before = [self._deleting[k] for k, _ in new if k in self._deleting]
        future = self._pool.submit(self._do_put, new, victims, before)
        for victim in victims:
            self._deleting[victim] = future
        if victims:
            self._deletions[future] = victims
        self._pending.append((job, time.perf_counter(), future))

    def submit_get(self, job: TierJob) -> None:
        """Read and verify ``job.keys`` into ``job.slots``."""
        self._check_open(job, JobKind.GET)
        items = [
            (k, slot)
            for k, slot in zip(job.keys, job.slots, strict=True)
            if k not in self._deleting
        ]
        self._pending.append((job, time.perf_counter(), self._pool.submit(self._do_get, items)))

    def submit_probe(self, job: TierJob) -> None:
        """Which keys exist: the index answers for known blocks, the root for the rest."""
        self._check_open(job, JobKind.PROBE)
        unknown = [k for k in job.keys if k not in self._index and k not in self._deleting]
        known = frozenset(k for k in job.keys if k in self._index)
        self._pending.append(
            (job, time.perf_counter(), self._pool.submit(self._do_probe, known, unknown))
        )

    def poll(self) -> list[JobResult]:
        """Results of finished jobs, each once; applies them to the index and events."""
        if self._deletions:  # per job, not per key: poll runs every scheduler step
            for future in [f for f in self._deletions if f.done()]:
                for key in self._deletions.pop(future):
                    if self._deleting.get(key) is future:
                        del self._deleting[key]
        results = []
        still = []
        for job, started, future in self._pending:
            if not future.done():
                still.append((job, started, future))
                continue
            results.append(self._apply(job, future, time.perf_counter() - started))
        self._pending = still
        return results

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        """Remove ``keys`` this tier holds and announce them (files deleted on the pool)."""
        gone = [k for k in keys if k in self._index]
        for key in gone:
            self._used -= self._index.pop(key)
        if gone:
            self._events.append(Removed(tuple(gone), self._identity))
            if not self._closed:
                future = self._pool.submit(self._remove_all, gone)
                for key in gone:
                    self._deleting[key] = future
                self._deletions[future] = gone

    def drain(self) -> None:
        """Block until every submitted job finished."""
        cf.wait([f for _, _, f in self._pending])

    def close(self) -> None:
        """Finish running IO, cancel queued jobs (reported failed by the next poll). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        close_io = getattr(self._io, "close", None)
        if close_io is not None:
            close_io()

    def take_events(self) -> list[TierEvent]:
        """Events since the last call."""
        events, self._events = self._events, []
        return events

    # -- introspection -------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._index

    def keys(self) -> list[OffloadKey]:
        """Blocks this tier knows, least recently used first."""
        return list(self._index)

    def location(self, key: OffloadKey) -> tuple[str, int]:
        """Where ``key``'s block lives: a file or object path and the offset of its header.

        Raises:
            KeyError: no instance on this root holds ``key``.
        """
        return self._io.location(key)  # type: ignore[no-any-return]

    @property
    def used_bytes(self) -> int:
        """Bytes held or reserved by in-flight writes."""
        return self._used

    # -- internals -----------------------------------------------------------------------
    def _size(self, key: OffloadKey) -> int:
        return HEADER_AREA + self._host.slot_bytes

    def _check_open(self, job: TierJob, kind: JobKind) -> None:
        if self._closed:
            raise TierUnavailable("closed", tier=self._identity.ownership or "files")
        if job.kind is not kind:
            raise ValueError(f"job {job.job_id} is a {job.kind.value}, not a {kind.value}")

    def _apply(self, job: TierJob, future: cf.Future[Any], seconds: float) -> JobResult:
        if future.cancelled():
            if job.kind is JobKind.PUT:
                for key in job.keys:
                    if key in self._writing:
                        self._writing.discard(key)
                        self._used -= self._size(key)
            return JobResult(job.job_id, False, seconds=seconds, error="tier closed")
        try:
            outcome = future.result()
        except Exception as exc:  # a bug or an IO error outside per-key handling
            self.io_errors += 1
            outcome = exc
        if job.kind is JobKind.PUT:
            return self._apply_put(job, outcome, seconds)
        if job.kind is JobKind.GET:
            return self._apply_get(job, outcome, seconds)
        if isinstance(outcome, Exception):
            return JobResult(job.job_id, False, seconds=seconds, error=_safe(outcome))
        return JobResult(job.job_id, True, found=outcome, seconds=seconds)

    def _apply_put(self, job: TierJob, outcome: Any, seconds: float) -> JobResult:
        written: list[OffloadKey]
        error: str | None
        if isinstance(outcome, Exception):
            written, error = [], _safe(outcome)
        else:
            written, error = outcome
        written_set = set(written)
        for key in job.keys:
            if key in self._writing:
                self._writing.discard(key)
                if key in written_set:
                    self._index[key] = self._size(key)
                else:
                    self._used -= self._size(key)
        if written:
            self._events.append(Stored(tuple(written), self._identity, job.ctx))
        nbytes = len(written) * self._host.slot_bytes
        if error is not None:
            self.io_errors += 1
            log.warning(
                "tier_write_failed", tier=self._identity.ownership, job_id=job.job_id, error=error
            )
            return JobResult(job.job_id, False, nbytes=nbytes, seconds=seconds, error=error)
        return JobResult(job.job_id, True, nbytes=nbytes, seconds=seconds)

    def _apply_get(self, job: TierJob, outcome: Any, seconds: float) -> JobResult:
        if isinstance(outcome, Exception):
            return JobResult(job.job_id, False, seconds=seconds, error=_safe(outcome))
        ok, corrupt, vanished = outcome
        for key in ok:
            if key in self._index:
                self._index.move_to_end(key)
        # corrupt blocks were deleted; vanished ones another instance sharing the root removed
        # (a key still being written here is not gone)
        lost = corrupt + [k for k in vanished if k not in self._writing]
        gone = [k for k in lost if k in self._index]
        for key in gone:
            self._used -= self._index.pop(key)
        if gone:
            self._events.append(Removed(tuple(gone), self._identity))
        if corrupt:
            self.corrupt_blocks += len(corrupt)
            log.warning(
                "tier_block_corrupt",
                tier=self._identity.ownership,
                job_id=job.job_id,
                blocks=len(corrupt),
            )
        nbytes = len(ok) * self._host.slot_bytes
        if len(ok) == len(job.keys):
            return JobResult(job.job_id, True, nbytes=nbytes, seconds=seconds)
        missing = len(job.keys) - len(ok)
        return JobResult(
            job.job_id,
            False,
            ok_keys=frozenset(ok),
            nbytes=nbytes,
            seconds=seconds,
            error=f"{missing} blocks missing or corrupt",
        )

    # -- IO on the pool (no shared state touched) ----------------------------------------
    def _do_put(
        self,
        items: list[tuple[OffloadKey, int]],
        victims: list[OffloadKey],
        before: list[cf.Future[Any]],
    ) -> tuple[list[OffloadKey], str | None]:
        # deletions of these keys were submitted earlier, so they already hold a thread
        cf.wait(before)
        self._remove_all(victims, defer=True)  # published with this job's blocks
        errors = self._io.write_many([(key, self._host.slot_view(slot)) for key, slot in items])
        written = [key for (key, _), err in zip(items, errors, strict=True) if err is None]
        error = next((err for err in errors if err is not None), None)
        return written, error

    def _do_get(
        self, items: list[tuple[OffloadKey, int]]
    ) -> tuple[list[OffloadKey], list[OffloadKey], list[OffloadKey]]:
        reads = [(key, self._host.slot_view(slot)) for key, slot in items]
        headers = self._io.read_many(reads)
        ok: list[OffloadKey] = []
        corrupt: list[OffloadKey] = []
        vanished: list[OffloadKey] = []
        for (key, view), header in zip(reads, headers, strict=True):
            if header is None:
                vanished.append(key)
            elif header_matches(header, key, view):
                ok.append(key)
            elif self._io.invalid(key):
                corrupt.append(key)
            else:  # rewritten under the read, or another instance's: not ours to drop
                vanished.append(key)
        return ok, corrupt, vanished

    def _do_probe(
        self, known: frozenset[OffloadKey], unknown: list[OffloadKey]
    ) -> frozenset[OffloadKey]:
        return known | frozenset(self._io.exists_many(unknown))

    def _remove_all(self, keys: list[OffloadKey], *, defer: bool = False) -> None:
        if not keys:
            return
        try:
            self._io.remove_many(keys, defer=defer)
        except Exception as exc:
            log.warning("tier_remove_failed", tier=self._identity.ownership, error=_safe(exc))


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _safe(exc: BaseException) -> str:
    """An error text without credentials (fsspec/botocore messages can echo options)."""
    text = str(exc)
    for marker in ("key=", "secret=", "token=", "aws_secret_access_key", "aws_access_key_id"):
        if marker in text:
            return type(exc).__name__
    return text[:300]
