"""``SqliteTierStore``: a kvhex secondary tier keeping KV-cache blocks in one SQLite file.

A worked example of a third-party ``kvhex.tiers`` plugin (kvhex's docs/plugins.md walks
through it). Each duty of kvhex's ``TierStore`` port maps to one piece of this module:

* **Submits never block.** ``submit_*`` only queue the job on a small thread pool. SQLite
  has one writer at a time, so one lock serialises the database together with what must
  change with it: kvhex's residency index (``kvhex.domain.Residency``: which keys are
  readable, least recently used first, the byte capacity, which blocks to evict, and the
  events), so this tier writes none of that bookkeeping itself.
* **Each result exactly once.** A worker posts its job's one result to an outbox before it
  finishes, even if the work raised; ``poll`` hands the outbox over and empties it.
* **The tier owns its events.** The residency announces ``Stored(keys, identity, job.ctx)``
  once the transaction that made ``keys`` readable committed, only for keys not readable
  before; ``Removed`` for every key that stops being readable (eviction, ``delete``,
  corruption), before the ``Stored`` that takes its room; nothing for a failure. They are
  moved to the outbox under the lock, so ``take_events`` never waits for a transaction.
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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from kvhex.domain import (
    JobKind,
    JobResult,
    Locality,
    Medium,
    OffloadKey,
    Residency,
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
        if io_threads <= 0:
            raise ValueError(f"io_threads must be > 0, got {io_threads}")
        self._host = host
        self.capacity_bytes = capacity_bytes
        self._identity = TierIdentity(medium, locality, name)
        try:
            self._index = Residency(self._identity, capacity_bytes, host.slot_bytes)
        except ValueError as exc:
            raise ValueError(f"capacity_bytes: {exc}") from None
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
            raise TierUnavailable(
                f"cannot open {path}: {exc}", tier=self._name, option="path"
            ) from exc
        try:
            db.execute("PRAGMA locking_mode = EXCLUSIVE")  # no other process, from now on
            db.execute("PRAGMA journal_mode = WAL")  # + synchronous NORMAL: survives a crash intact
            db.execute("PRAGMA synchronous = NORMAL")
            db.executescript(_SCHEMA)
            with db:
                db.execute("INSERT OR IGNORE INTO meta VALUES ('config', ?)", (meta,))
            (recorded,) = db.execute("SELECT value FROM meta WHERE name = 'config'").fetchone()
            if recorded != meta:
                problem = f"{path} holds blocks of another namespace: {recorded}"
                raise TierUnavailable(problem, tier=self._name, option="path")
            rows = db.execute("SELECT key FROM blocks ORDER BY rowid").fetchall()  # oldest first
            over = self._index.adopt(OffloadKey(key) for (key,) in rows)  # announced once
            with db:  # what a smaller capacity no longer holds
                db.executemany(_DELETE, [(k,) for k in over])
        except sqlite3.Error as exc:
            db.close()
            raise TierUnavailable(
                f"cannot use {path}: {exc}", tier=self._name, option="path"
            ) from exc
        except TierUnavailable:
            db.close()
            raise
        self._events += self._index.take_events()
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
            gone = self._index.readable(dict.fromkeys(keys))
            if not gone:
                return
            try:
                with self._db:
                    self._db.executemany(_DELETE, [(k,) for k in gone])
            except sqlite3.Error as exc:
                raise TierError(f"delete failed: {exc}", tier=self._name) from exc
            self._index.delete(gone)
            self._publish()

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
        data = {}
        for key, slot in zip(job.keys, job.slots, strict=True):
            view = bytes(self._host.slot_view(slot))
            data[key] = (_digest(view), view)  # outside the lock: puts hash in parallel
        with self._lock:
            reservation = self._index.reserve(job.keys, job.ctx)  # evictions announced
            if reservation is None:
                return JobResult(job.job_id, False, error="the job does not fit the tier")
            new = [(k, *data[k]) for k in reservation.owned]
            victims = [(k,) for k in reservation.victims]
            try:
                with self._db:  # one transaction: all of it or, on an error, nothing
                    self._db.executemany(_DELETE, victims)
                    self._db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)", new)
            except sqlite3.Error:
                with self._db:  # the victims were announced gone: they must not stay
                    self._db.executemany(_DELETE, victims)
                self._index.commit(reservation, ())
                self._publish()
                raise
            self._index.commit(reservation, reservation.owned)  # announced
            self._publish()
        return JobResult(job.job_id, True, nbytes=len(new) * self._host.slot_bytes)

    def _get(self, job: TierJob) -> JobResult:
        """Copy each block that passes its checksum; delete and announce the ones that fail."""
        ok: list[OffloadKey] = []
        corrupt: list[OffloadKey] = []
        with self._lock:
            seen = self._index.snapshot(job.keys)
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
                ok.append(key)
            if corrupt:
                with self._db:
                    self._db.executemany(_DELETE, [(k,) for k in corrupt])
            self._index.release(seen, ok, corrupt, job.ctx)  # touched; corrupt ones announced
            self._publish()
        nbytes = len(ok) * self._host.slot_bytes
        if len(ok) == len(job.keys):
            return JobResult(job.job_id, True, nbytes=nbytes)
        error = f"{len(corrupt)} corrupt, {len(job.keys) - len(ok) - len(corrupt)} missing"
        return JobResult(job.job_id, False, ok_keys=frozenset(ok), nbytes=nbytes, error=error)

    def _probe(self, job: TierJob) -> JobResult:
        """The index is exactly the readable keys: it changes only with the file, under the
        same lock."""
        with self._lock:
            found = frozenset(self._index.readable(job.keys))
        return JobResult(job.job_id, True, found=found)

    # -- bookkeeping, under the lock ------------------------------------------------------------
    def _publish(self) -> None:
        """Move the residency's events to the outbox (under the lock)."""
        events = self._index.take_events()
        if events:
            with self._out_lock:
                self._events += events

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("the tier is closed", tier=self._name)

    @property
    def _name(self) -> str:
        return self._identity.ownership or "sqlite"
