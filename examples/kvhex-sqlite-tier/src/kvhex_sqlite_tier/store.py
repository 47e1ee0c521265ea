"""``SqliteTierStore``: a kvhex secondary tier keeping KV-cache blocks in one SQLite file.

A worked example of a third-party ``kvhex.tiers`` plugin (kvhex's docs/plugins.md walks
through it). Each duty of kvhex's ``TierStore`` port maps to one piece of this module:

* **Submits never block.** ``submit_*`` only queue the job on a small thread pool. SQLite
  has one writer at a time, so one lock serialises the database together with what must
  change with it: the index of readable keys, least recently used first.
* **Each result exactly once.** A worker posts its job's one result to an outbox before it
  finishes, even if the work raised; ``poll`` hands the outbox over and empties it.
* **The tier owns its events.** ``Stored(keys, identity, job.ctx)`` once the transaction that
  made ``keys`` readable committed, only for keys not readable before; ``Removed`` for every
  key that stops being readable (eviction, ``delete``, corruption), before the ``Stored``
  that takes its room; nothing for a failure.
* **Never serve corrupt bytes.** Each block is stored with its BLAKE2b digest and checked on
  every read; a block that fails fails its load, is deleted and its removal announced.
* **Restart.** Blocks already in the file are announced once, as ``Stored`` without a request
  (``ctx=None``), so replaying the tier's events reproduces what it holds.

Keys are BLOBs, never paths. The file is created ``0600`` and held by one process at a time;
it records the slot size and kvhex's block namespace, and a file written for another model is
refused rather than served.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from kvhex.domain import (
    JobKind,
    JobResult,
    Locality,
    Medium,
    OffloadKey,
    Removed,
    Stored,
    TierEvent,
    TierIdentity,
    TierJob,
)
from kvhex.errors import TierError, TierUnavailable
from kvhex.ports import HostBuffer

__all__ = ["SqliteTierStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (key BLOB PRIMARY KEY, digest BLOB NOT NULL, data BLOB NOT NULL);
"""
_DELETE = "DELETE FROM blocks WHERE key = ?"


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()  # releases the GIL: workers overlap


class SqliteTierStore:
    """Blocks in one SQLite file, bounded by a byte capacity with least-recently-used eviction.

    Args:
        host: the host buffer whose slots jobs name (kvhex passes it first).
        path: the database file; created (mode 0600, missing directories 0700) if absent.
        capacity_bytes: block bytes the tier keeps; least recently used blocks make room.
        name: the ownership name in events (kvhex passes the ``[[tiers]]`` entry's name).
        namespace: what makes blocks compatible (model, geometry); kvhex passes its own.
        medium, locality: announced in events.
        io_threads: worker threads running jobs.

    Raises:
        ValueError: a bad option (kvhex reports it at ``$.tiers[i]``).
        TierUnavailable: the file cannot be opened, another process holds it, or it holds
            blocks of another namespace or slot size.
    """

    def __init__(
        self,
        host: HostBuffer,
        path: str,
        *,
        capacity_bytes: int,
        name: str = "sqlite",
        namespace: Mapping[str, Any] | None = None,
        medium: Medium = Medium.STORAGE,
        locality: Locality | None = Locality.LOCAL,
        io_threads: int = 2,
    ) -> None:
        if capacity_bytes <= 0 or io_threads <= 0:
            raise ValueError(f"need capacity_bytes, io_threads > 0: {capacity_bytes}, {io_threads}")
        self._host = host
        self.capacity_bytes = capacity_bytes
        self._identity = TierIdentity(medium, locality, name)
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> bytes, LRU first
        self._used = 0
        self._lock = threading.Lock()  # the database and the index, changed together
        self._out_lock = threading.Lock()  # the outbox: held only to append or swap a list
        self._events: list[TierEvent] = []
        self._results: list[JobResult] = []
        self._jobs: dict[Future[None], TierJob] = {}  # submitted, maybe unfinished
        self._closed = False
        meta = {"slot_bytes": host.slot_bytes, "namespace": dict(namespace or {})}
        self._db = self._open(Path(path), json.dumps(meta, sort_keys=True))
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix=f"kvhex-sqlite-{name}")

    def _open(self, path: Path, meta: str) -> sqlite3.Connection:
        """Create or reopen the file, hold it, check its namespace, announce what it holds."""
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))  # sqlite would make it 0644
            db = sqlite3.connect(path, timeout=0, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise TierUnavailable(f"cannot open {path}: {exc}", tier=self._name) from exc
        try:
            db.execute("PRAGMA locking_mode = EXCLUSIVE")  # no other process, from now on
            db.execute("PRAGMA journal_mode = WAL")  # + synchronous NORMAL: survives a crash intact
            db.execute("PRAGMA synchronous = NORMAL")
            db.executescript(_SCHEMA)
            with db:
                db.execute("INSERT OR IGNORE INTO meta VALUES ('config', ?)", (meta,))
            (recorded,) = db.execute("SELECT value FROM meta WHERE name = 'config'").fetchone()
            rows = db.execute("SELECT key, length(data) FROM blocks ORDER BY rowid").fetchall()
        except sqlite3.Error as exc:
            db.close()
            raise TierUnavailable(f"cannot use {path}: {exc}", tier=self._name) from exc
        if recorded != meta:
            db.close()
            problem = f"{path} holds blocks of another namespace: {recorded}"
            raise TierUnavailable(problem, tier=self._name)
        self._index.update((OffloadKey(key), size) for key, size in rows)  # oldest first
        self._used = sum(self._index.values())  # over capacity? the next put evicts the rest
        if self._index:
            self._events.append(Stored(tuple(self._index), self._identity, None))
        return db

    # -- the TierStore port: called on the engine's scheduler thread ---------------------------
    @property
    def identity(self) -> TierIdentity:
        """Medium, locality and ownership name announced in this tier's events."""
        return self._identity

    def submit_put(self, job: TierJob) -> None:
        """Queue a copy of ``job.slots`` into the file. kvhex keeps the slots pinned until this
        job's result was polled, so workers read them in place."""
        self._submit(job, JobKind.PUT, self._put)

    def submit_get(self, job: TierJob) -> None:
        """Queue a copy of verified blocks into the slots kvhex reserved for them."""
        self._submit(job, JobKind.GET, self._get)

    def submit_probe(self, job: TierJob) -> None:
        """Queue the question "which of ``job.keys`` are readable?" (answered as ``found``)."""
        self._submit(job, JobKind.PROBE, self._probe)

    def poll(self) -> list[JobResult]:
        """Results posted since the last call, each job exactly once. Never waits on IO."""
        with self._out_lock:
            results, self._results = self._results, []
        return results

    def take_events(self) -> list[TierEvent]:
        """Events since the last call, in the order the file changed."""
        with self._out_lock:
            events, self._events = self._events, []
        return events

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        """Delete the readable ``keys`` and announce them; absent ones are ignored. Waits for
        a running job's transaction (kvhex's manager never calls it on the hot path)."""
        self._check_open()
        with self._lock:
            gone = [k for k in dict.fromkeys(keys) if k in self._index]
            if not gone:
                return
            try:
                with self._db:
                    self._db.executemany(_DELETE, [(k,) for k in gone])
            except sqlite3.Error as exc:
                raise TierError(f"delete failed: {exc}", tier=self._name) from exc
            self._forget(gone)

    def drain(self) -> None:
        """Block until every submitted job has posted its result."""
        wait(list(self._jobs))

    def close(self) -> None:
        """Finish running jobs, fail queued ones (the next poll reports them), release the
        file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        cancelled = [job for future, job in self._jobs.items() if future.cancelled()]
        with self._out_lock:
            self._results += [JobResult(j.job_id, False, error="tier closed") for j in cancelled]
        self._jobs.clear()
        self._db.close()

    # -- jobs: run on the pool's worker threads -------------------------------------------------
    def _submit(self, job: TierJob, kind: JobKind, work: Callable[[TierJob], JobResult]) -> None:
        self._check_open()
        if job.kind is not kind:
            raise ValueError(f"job {job.job_id} is a {job.kind.value}, not a {kind.value}")
        self._jobs = {f: j for f, j in self._jobs.items() if not f.done()}
        self._jobs[self._pool.submit(self._run, job, work, time.perf_counter())] = job

    def _run(self, job: TierJob, work: Callable[[TierJob], JobResult], submitted: float) -> None:
        """Do one job and post its one result, also when the work raised: then the transaction
        rolled back, nothing changed, and nothing is announced."""
        try:
            result = work(job)
        except Exception as exc:
            result = JobResult(job.job_id, False, error=f"{type(exc).__name__}: {exc}")
        with self._out_lock:
            self._results.append(result._replace(seconds=time.perf_counter() - submitted))

    def _put(self, job: TierJob) -> JobResult:
        """Write the blocks that are not readable yet, evicting least recently used ones."""
        rows = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            data = bytes(self._host.slot_view(slot))
            rows.append((key, _digest(data), data))  # outside the lock: puts hash in parallel
        with self._lock:
            new = [row for row in rows if row[0] not in self._index]
            for key in job.keys:
                if key in self._index:
                    self._index.move_to_end(key)
            need = sum(len(data) for _, _, data in new)
            victims = self._victims(need, frozenset(job.keys))
            if victims is None:
                return JobResult(job.job_id, False, error=f"{need} bytes do not fit the tier")
            with self._db:  # one transaction: all of it or, on an error, nothing
                self._db.executemany(_DELETE, [(k,) for k in victims])
                self._db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)", new)
            self._forget(victims)  # announced before the blocks that take their room
            for key, _, data in new:
                self._index[key] = len(data)
                self._used += len(data)
            if new:
                self._announce(Stored(tuple(k for k, _, _ in new), self._identity, job.ctx))
        return JobResult(job.job_id, True, nbytes=need)

    def _get(self, job: TierJob) -> JobResult:
        """Copy each block that passes its checksum; delete and announce the ones that fail."""
        ok: set[OffloadKey] = set()
        corrupt: list[OffloadKey] = []
        with self._lock:
            for key, slot in zip(job.keys, job.slots, strict=True):
                row = self._db.execute("SELECT digest, data FROM blocks WHERE key = ?", (key,))
                found = row.fetchone()
                if found is None:
                    continue
                digest, data = found
                if len(data) != self._host.slot_bytes or _digest(data) != digest:
                    corrupt.append(key)
                    continue
                self._host.slot_view(slot)[:] = data
                self._index.move_to_end(key)
                ok.add(key)
            if corrupt:
                with self._db:
                    self._db.executemany(_DELETE, [(k,) for k in corrupt])
                self._forget(corrupt)
        nbytes = len(ok) * self._host.slot_bytes
        if len(ok) == len(job.keys):
            return JobResult(job.job_id, True, nbytes=nbytes)
        error = f"{len(corrupt)} corrupt, {len(job.keys) - len(ok) - len(corrupt)} missing"
        return JobResult(job.job_id, False, ok_keys=frozenset(ok), nbytes=nbytes, error=error)

    def _probe(self, job: TierJob) -> JobResult:
        """The index is exactly the readable keys: it changes only with the file, under the
        same lock."""
        with self._lock:
            found = frozenset(k for k in job.keys if k in self._index)
        return JobResult(job.job_id, True, found=found)

    # -- bookkeeping, under the lock ------------------------------------------------------------
    def _victims(self, need: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """Least recently used keys to drop so that ``need`` more bytes fit (``None``: they
        cannot without dropping ``protected`` keys). Changes nothing."""
        excess = self._used + need - self.capacity_bytes
        victims = []
        for key, size in self._index.items():
            if excess <= 0:
                break
            if key not in protected:
                victims.append(key)
                excess -= size
        return victims if excess <= 0 else None

    def _forget(self, keys: Sequence[OffloadKey]) -> None:
        """Drop ``keys`` (already deleted from the file) and announce their removal."""
        for key in keys:
            self._used -= self._index.pop(key)
        if keys:
            self._announce(Removed(tuple(keys), self._identity))

    def _announce(self, event: TierEvent) -> None:
        with self._out_lock:
            self._events.append(event)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("the tier is closed", tier=self._name)

    @property
    def _name(self) -> str:
        return self._identity.ownership or "sqlite"
