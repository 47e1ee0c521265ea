"""A secondary tier on any fsspec filesystem: local files (slab files with a shared index,
:mod:`kvhex.adapters.storage.files.slabs`) or object stores (one object per block,
:mod:`kvhex.adapters.storage.objects`), both in the block format of
:mod:`kvhex.adapters.storage.format`.

Layout under the configured root::

    ROOT/<namespace digest>/config.json       what makes blocks compatible (model, chunk
                                              geometry, dtype, layout version), recorded
    ROOT/<namespace digest>/index.sqlite      local files: shared index, key -> (slab, slot)
    ROOT/<namespace digest>/slabs/<id>.slab   local files: preallocated slabs of block slots
    ROOT/<namespace digest>/<k0k1>/<key hex>.blk   object stores: one object per block

Names are built only from hex (offload keys, random slab ids) under the configured root, so no
input can name a path outside it. Local files are created ``0600`` and directories ``0700``.

Every read verifies the block's header and checksum: a mismatch or a short read is a failed
load, and a block this instance owns is dropped and its removal announced. A crash mid-write
leaves no block that can be read torn (local blocks are published by one index transaction
per job after their bytes are written; object writes are single ``PUT``s). At start-up an
instance announces what it finds that is its own: the slabs of dead instances it adopts, or
the object-store listing. Other live instances' blocks are found and read, never announced or
evicted here.

The tier keeps an LRU index of the blocks it owns and a byte capacity: blocks are evicted
least recently used first, and announced.

Threads: all IO runs on a pool of ``io_threads``; submissions, ``poll``, ``delete`` and the
index and event bookkeeping run on the scheduler thread only.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from kvhex.adapters.storage.files.slabs import SlabIo
from kvhex.adapters.storage.format import (
    CONFIG,
    HEADER_AREA,
    LAYOUT_VERSION,
    header_matches,
    namespace_digest,
    safe_error,
)
from kvhex.adapters.storage.object_errors import start_up_error
from kvhex.adapters.storage.objects import ObjectIo
from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.jobs import JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer

__all__ = ["FsspecTierStore"]

log = structlog.get_logger(__name__)


class FsspecTierStore:
    """A file or object-store tier. See the module docstring for layout and guarantees.

    Args:
        host: the host buffer whose slots jobs name.
        url: root, e.g. ``/var/cache/kvhex`` or ``s3://bucket/prefix``.
        capacity_bytes: bytes the tier may hold (headers included); LRU eviction beyond.
        name: ownership name announced in events and used in errors.
        namespace: what makes blocks compatible (model, geometry, dtype, ...).
        medium, locality: announced in events.
        io_threads: concurrent IO jobs (IO threads); by default as many as this machine
            has cores, up to 4, on local files (page-cache copies are CPU work: more
            threads only contend), and 8 on object stores (requests wait on the network).
        fsync: flush each job's blocks to the device before publishing them (local files
            only; without it a power loss can lose recent blocks, never tear one).
        storage_options: passed to fsspec (credentials never reach logs or events).

    Raises:
        TierUnavailable: the root cannot be created, written or listed (on an object store
            the message names the cause: no such bucket, an unknown access key id, a wrong
            secret, access denied, an endpoint down), or holds a namespace whose recorded
            configuration differs.
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
        io_threads: int | None = None,
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
        if io_threads is not None and io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        ns = dict(namespace or {})
        ns.setdefault("slot_bytes", host.slot_bytes)
        self.namespace = ns
        digest = namespace_digest(ns)
        try:
            fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
            self.io_threads = io_threads or _default_io_threads("file" in _protocols(fs))
            base = root.rstrip("/") + "/" + digest
            self._io: Any = self._make_io(fs, base)
            self._io.prepare()
            config = json.dumps({**ns, "layout_version": LAYOUT_VERSION}, sort_keys=True)
            recorded = self._io.write_config(CONFIG, config.encode())
        except Exception as exc:
            raise start_up_error(exc, url=url, tier=name) from exc
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
        # futures of submitted jobs (and deletions) in flight; a finished one is queued by its
        # done callback on whichever thread finished it, so poll costs what finished, not
        # what is in flight
        self._jobs: dict[cf.Future[Any], tuple[TierJob, float]] = {}
        self._finished: deque[cf.Future[Any]] = deque()
        self._pool = cf.ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"kvhex-{name}")
        self._closed = False
        self.corrupt_blocks = 0
        self.foreign_files = 0
        self.io_errors = 0
        try:
            self._recover()  # lists the root: refused, it is a start-up failure too
        except Exception as exc:
            self.close()
            raise start_up_error(exc, url=url, tier=name) from exc

    def _make_io(self, fs: Any, base: str) -> Any:
        """The IO strategy for this filesystem (subclasses move the data path elsewhere)."""
        if "file" in _protocols(fs):
            return SlabIo(base, *self._slab_geometry(), fsync=self._fsync, stripes=self.io_threads)
        return ObjectIo(fs, base)

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
            self._start(job, future)
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
        self._start(job, future)

    def submit_get(self, job: TierJob) -> None:
        """Read and verify ``job.keys`` into ``job.slots``."""
        self._check_open(job, JobKind.GET)
        items = [
            (k, slot)
            for k, slot in zip(job.keys, job.slots, strict=True)
            if k not in self._deleting
        ]
        self._start(job, self._pool.submit(self._do_get, items))

    def submit_probe(self, job: TierJob) -> None:
        """Which keys exist: the index answers for known blocks, the root for the rest."""
        self._check_open(job, JobKind.PROBE)
        unknown = [k for k in job.keys if k not in self._index and k not in self._deleting]
        known = frozenset(k for k in job.keys if k in self._index)
        self._start(job, self._pool.submit(self._do_probe, known, unknown))

    def poll(self) -> list[JobResult]:
        """Results of finished jobs, each once; applies them to the index and events."""
        results = []
        finished = self._finished
        while finished:
            future = finished.popleft()
            for key in self._deletions.pop(future, ()):
                if self._deleting.get(key) is future:
                    del self._deleting[key]
            entry = self._jobs.pop(future, None)
            if entry is not None:
                job, started = entry
                results.append(self._apply(job, future, time.perf_counter() - started))
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
                future.add_done_callback(self._finished.append)

    def drain(self) -> None:
        """Block until every submitted job finished."""
        cf.wait(list(self._jobs))

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
    def _start(self, job: TierJob, future: cf.Future[Any]) -> None:
        self._jobs[future] = (job, time.perf_counter())
        future.add_done_callback(self._finished.append)

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
            return JobResult(job.job_id, False, seconds=seconds, error=safe_error(outcome))
        return JobResult(job.job_id, True, found=outcome, seconds=seconds)

    def _apply_put(self, job: TierJob, outcome: Any, seconds: float) -> JobResult:
        written: list[OffloadKey]
        error: str | None
        if isinstance(outcome, Exception):
            written, error = [], safe_error(outcome)
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
            return JobResult(job.job_id, False, seconds=seconds, error=safe_error(outcome))
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
        room = self._remove_all(victims, defer=True)  # published with this job's blocks
        errors = self._io.write_many(
            [(key, self._host.slot_view(slot)) for key, slot in items], room
        )
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

    def _remove_all(self, keys: list[OffloadKey], *, defer: bool = False) -> Sequence[Any]:
        """Remove ``keys``' blocks (a failure is logged: they are already announced gone);
        with ``defer``, the room freed for the put that follows."""
        if not keys:
            return ()
        try:
            return self._io.remove_many(keys, defer=defer)  # type: ignore[no-any-return]
        except Exception as exc:
            log.warning("tier_remove_failed", tier=self._identity.ownership, error=safe_error(exc))
            return ()


def _default_io_threads(local: bool) -> int:
    """Local files: the cores, up to 4 (page-cache copies are CPU work); object stores: 8
    (requests wait on the network)."""
    return min(4, os.cpu_count() or 1) if local else 8


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
