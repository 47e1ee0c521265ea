"""A secondary tier on any fsspec filesystem: local files (with a fast path) or object stores.

Layout under the configured root::

    ROOT/<namespace digest>/config.json          what makes blocks compatible (model, chunk
                                                 geometry, dtype, layout version), recorded
    ROOT/<namespace digest>/<k0k1>/<key hex>.blk    256 shard directories, made at start-up
    ROOT/<namespace digest>/tmp/                 in-flight writes (local filesystems)

Paths are built only from the hex of the offload key under the configured root, so no input
can name a path outside it. Local files are created ``0600`` and directories ``0700``.

A block file is a 4 KiB header area (magic, payload length, XXH3-64 of the payload, the key,
zero padding) and the host
slot's bytes. Every read verifies all of it; a mismatch or a truncated file is a failed load,
the file is deleted and, if this tier had announced it, its removal is announced. Local writes
go to ``tmp/`` and are renamed into place, so a crash mid-write never leaves a torn block
readable (leftovers in ``tmp/`` are removed at start-up). Object-store writes are single
``PUT``s, atomic by nature.

The tier keeps an LRU index of the blocks it knows (rebuilt at start-up by listing the
namespace, oldest first; the blocks found are announced once as stored, without provenance)
and a byte capacity: blocks are evicted least recently used first, and announced. Probes and
loads also find blocks another process sharing the root wrote.

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
import shutil
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import structlog
import xxhash

from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.jobs import JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer

__all__ = ["HEADER_AREA", "LAYOUT_VERSION", "FsspecTierStore", "namespace_digest"]

log = structlog.get_logger(__name__)

LAYOUT_VERSION = 1
MAGIC = b"KVHXBLK1"
HEADER = struct.Struct(">8sQQH")  # magic, payload length, xxh3-64 of the payload, key length
HEADER_AREA = 4096
"""Bytes before the payload (header, key, zero padding): a page-aligned payload is written
4x faster through the page cache than one at an odd offset (docs/tiers.md), and suits
NIXL and direct IO."""
SUFFIX = ".blk"


def namespace_digest(namespace: Mapping[str, Any]) -> str:
    """16 hex digits naming a namespace: blocks are shared only between identical ones."""
    canonical = json.dumps({**namespace, "layout_version": LAYOUT_VERSION}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _key_from_name(name: str) -> OffloadKey | None:
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return OffloadKey(key) if len(key) > 4 and key.hex() == stem else None


class _Found(NamedTuple):
    key: OffloadKey
    mtime: float


class _LocalIo:
    """One file per block with ``os`` calls (the local fast path).

    Every instance writes inside a work directory of its own (``work/<id>/``, held with an
    exclusive ``flock`` while it lives): a block is written there, then renamed into place.
    Evicted and deleted block files are not unlinked but renamed back into that directory and
    reused for the next writes: overwriting an allocated file runs at page-cache speed, where
    filling a new file pays for fresh allocation (measured 6.5 GB/s against 0.4 GB/s for 2 MiB
    blocks; docs/tiers.md). Work directories of instances that died (their lock is free) are
    removed at start-up, with whatever a crash left half-written in them.
    """

    POOL_MAX = 256

    def __init__(self, root: str) -> None:
        self.root = root
        self.work_root = os.path.join(root, "work")
        self.tmp = os.path.join(self.work_root, uuid.uuid4().hex)
        self._dirs: set[str] = set()
        self._pool: list[str] = []
        self._pool_lock = threading.Lock()
        self._lock_fd: int | None = None

    def prepare(self) -> None:
        os.makedirs(self.tmp, mode=0o700, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.tmp, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for shard in range(256):  # once, so writes never pay for a mkdir
            directory = os.path.join(self.root, f"{shard:02x}")
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self._dirs.add(directory)
        for name in os.listdir(self.work_root):
            other = os.path.join(self.work_root, name)
            if other != self.tmp and _owner_is_gone(other):
                shutil.rmtree(other, ignore_errors=True)  # a dead instance's leftovers

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def take(self) -> tuple[str, bool]:
        """A file to write a block into: a recycled one (True) or a new name (False)."""
        with self._pool_lock:
            if self._pool:
                return self._pool.pop(), True
        return os.path.join(self.tmp, uuid.uuid4().hex), False

    def recycle(self, path: str) -> None:
        """Retire a block file: keep it for reuse (it stops being readable at once)."""
        with self._pool_lock:
            full = len(self._pool) >= self.POOL_MAX
        if full:
            self.remove(path)
            return
        spare = os.path.join(self.tmp, uuid.uuid4().hex)
        try:
            os.replace(path, spare)
        except FileNotFoundError:
            return
        with self._pool_lock:
            self._pool.append(spare)

    def ensure_dir(self, path: str) -> None:
        directory = os.path.dirname(path)
        if directory not in self._dirs:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self._dirs.add(directory)

    def write_config(self, name: str, data: bytes) -> bytes | None:
        path = os.path.join(self.root, name)
        try:
            with open(path, "rb") as existing:
                return existing.read()
        except FileNotFoundError:
            self.write_atomic(path, [data])
            return None

    def write_atomic(self, path: str, parts: Sequence[bytes | memoryview]) -> None:
        self.ensure_dir(path)
        tmp, recycled = self.take()
        flags = os.O_WRONLY if recycled else os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = os.open(tmp, flags, 0o600)
        try:
            offset = 0
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    written = os.pwrite(fd, view, offset)
                    offset += written
                    view = view[written:]
            if recycled and os.fstat(fd).st_size != offset:
                os.ftruncate(fd, offset)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)

    def read_into(self, path: str, header_size: int, view: memoryview) -> bytes | None:
        """The header, with the payload read straight into ``view``: ``None`` if the file is
        missing, ``b""`` if its size is not exactly header plus payload (truncated, foreign)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            header = os.read(fd, header_size)
            if len(header) != header_size or os.readv(fd, [view]) != len(view):
                return b""
            if os.read(fd, 1):
                return b""
        finally:
            os.close(fd)
        return header

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def write_many(self, items: list[tuple[str, list[bytes | memoryview]]]) -> list[str | None]:
        errors: list[str | None] = []
        for path, parts in items:
            try:
                self.write_atomic(path, parts)
                errors.append(None)
            except OSError as exc:
                errors.append(f"{type(exc).__name__}: {exc.strerror or exc}")
        return errors

    def read_many(self, items: list[tuple[str, int, memoryview]]) -> list[bytes | None]:
        return [self.read_into(path, size, view) for path, size, view in items]

    def exists_many(self, paths: list[str]) -> set[str]:
        return {p for p in paths if os.path.exists(p)}

    def walk(self) -> Iterator[tuple[str, int, float]]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            if dirpath == self.work_root:
                dirnames[:] = []
                continue
            for name in filenames:
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                yield os.path.join(dirpath, name), st.st_size, st.st_mtime


class _FsspecIo:
    """IO through any fsspec filesystem. Object stores get one concurrent batch of requests
    per job (``pipe``/``cat`` of many paths) and existence probes by listing where a listing
    is cheaper than one request per key."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root

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

    def write_many(self, items: list[tuple[str, list[bytes | memoryview]]]) -> list[str | None]:
        if not items:
            return []
        payload = {path: b"".join(bytes(p) for p in parts) for path, parts in items}
        try:
            self.fs.pipe(payload)
        except Exception as exc:
            # the batch is all or nothing from here: find out what actually landed
            error = f"{type(exc).__name__}: {_safe(exc)}"
            try:
                landed = self.exists_many(list(payload))
            except Exception:
                landed = set()
            return [None if path in landed else error for path, _ in items]
        return [None] * len(items)

    def read_many(self, items: list[tuple[str, int, memoryview]]) -> list[bytes | None]:
        if not items:
            return []
        got = self.fs.cat([path for path, _, _ in items], on_error="return")
        out: list[bytes | None] = []
        for path, header_size, view in items:
            data = got.get(path)
            if data is None or isinstance(data, FileNotFoundError):
                out.append(None)
            elif isinstance(data, BaseException):
                raise data
            elif len(data) != header_size + len(view):
                out.append(b"")
            else:
                view[:] = data[header_size:]
                out.append(bytes(data[:header_size]))
        return out

    def exists_many(self, paths: list[str]) -> set[str]:
        by_prefix: dict[str, list[str]] = {}
        for path in paths:
            by_prefix.setdefault(path.rsplit("/", 2)[0], []).append(path)
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

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def walk(self) -> Iterator[tuple[str, int, float]]:
        try:
            listing = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return
        for path, info in listing.items():
            mtime = info.get("mtime") or info.get("LastModified") or 0.0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            yield path, int(info.get("size", 0)), float(mtime)


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
        fsync: fsync each block before publishing it (local files only).
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
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        import fsspec

        self._name = name
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self._host = host
        self._identity = TierIdentity(medium, locality, name)
        self.capacity_bytes = capacity_bytes
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
            recorded = self._io.write_config("config.json", config.encode())
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
        return _LocalIo(base) if "file" in _protocols(fs) else _FsspecIo(fs, base)

    # -- start-up ------------------------------------------------------------------------
    def _recover(self) -> None:
        found: list[_Found] = []
        for path, _size, mtime in self._io.walk():
            name = path.rsplit("/", 1)[-1]
            if name == "config.json":
                continue
            key = _key_from_name(name)
            if key is None or path != self._path(key):
                self.foreign_files += 1
                continue
            found.append(_Found(key, mtime))
        found.sort(key=lambda f: f.mtime)
        for f in found:
            size = self._size(f.key)  # what a write of it costs here, whatever the listing says
            self._index[f.key] = size
            self._used += size
        evicted = self._evict_to(self.capacity_bytes, protected=set())
        for key in evicted:
            self._io.remove(self._path(key))
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

    def _path(self, key: OffloadKey) -> str:
        h = key.hex()
        return f"{self.root}/{h[:2]}/{h}{SUFFIX}"

    def _evict_to(self, limit: int, protected: set[OffloadKey]) -> list[OffloadKey]:
        victims: list[OffloadKey] = []
        if self._used <= limit:
            return victims
        for key in list(self._index):
            if key in protected:
                continue
            self._used -= self._index.pop(key)
            victims.append(key)
            if self._used <= limit:
                break
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
        paths = [self._path(v) for v in victims]
        before = [self._deleting[k] for k, _ in new if k in self._deleting]
        future = self._pool.submit(self._do_put, new, paths, before)
        for victim in victims:
            self._deleting[victim] = future
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
        if self._deleting:
            self._deleting = {k: f for k, f in self._deleting.items() if not f.done()}
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
            paths = [self._path(k) for k in gone]
            if not self._closed:
                future = self._pool.submit(self._remove_all, paths)
                for key in gone:
                    self._deleting[key] = future

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

    def path_of(self, key: OffloadKey) -> str:
        """Where ``key``'s block lives."""
        return self._path(key)

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
        victims: list[str],
        before: list[cf.Future[Any]],
    ) -> tuple[list[OffloadKey], str | None]:
        # deletions of these keys were submitted earlier, so they already hold a thread
        cf.wait(before)
        self._remove_all(victims)
        writes: list[tuple[str, list[bytes | memoryview]]] = []
        for key, slot in items:
            view = self._host.slot_view(slot)
            header = HEADER.pack(MAGIC, len(view), xxhash.xxh3_64_intdigest(view), len(key))
            header = (header + key).ljust(HEADER_AREA, b"\0")
            writes.append((self._path(key), [header, view]))
        errors = self._io.write_many(writes)
        written = [key for (key, _), err in zip(items, errors, strict=True) if err is None]
        error = next((err for err in errors if err is not None), None)
        return written, error

    def _do_get(
        self, items: list[tuple[OffloadKey, int]]
    ) -> tuple[list[OffloadKey], list[OffloadKey], list[OffloadKey]]:
        reads = [(self._path(key), HEADER_AREA, self._host.slot_view(slot)) for key, slot in items]
        headers = self._io.read_many(reads)
        ok: list[OffloadKey] = []
        corrupt: list[OffloadKey] = []
        vanished: list[OffloadKey] = []
        for (key, _), (path, size, view), header in zip(items, reads, headers, strict=True):
            if header is None:
                vanished.append(key)
                continue
            if len(header) != size or not self._valid(header, key, view):
                corrupt.append(key)
                self._io.remove(path)
                continue
            ok.append(key)
        return ok, corrupt, vanished

    @staticmethod
    def _valid(header: bytes, key: OffloadKey, view: memoryview) -> bool:
        magic, length, crc, key_len = HEADER.unpack_from(header)
        return (
            magic == MAGIC
            and length == len(view)
            and key_len == len(key)
            and header[HEADER.size : HEADER.size + key_len] == key
            and xxhash.xxh3_64_intdigest(view) == crc
        )

    def _do_probe(
        self, known: frozenset[OffloadKey], unknown: list[OffloadKey]
    ) -> frozenset[OffloadKey]:
        paths = {self._path(k): k for k in unknown}
        return known | frozenset(paths[p] for p in self._io.exists_many(list(paths)))

    def _remove_all(self, paths: list[str]) -> None:
        retire = getattr(self._io, "recycle", self._io.remove)
        for path in paths:
            try:
                retire(path)
            except Exception as exc:
                log.warning("tier_remove_failed", tier=self._identity.ownership, error=_safe(exc))


def _owner_is_gone(work_dir: str) -> bool:
    """True when no live instance holds ``work_dir``'s lock."""
    try:
        fd = os.open(os.path.join(work_dir, ".lock"), os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


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
