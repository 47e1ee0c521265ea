"""``BlockTierStore``: a secondary tier over any :class:`~kvhex.adapters.storage.block_io.BlockIo`
(slab files, objects, NIXL), its residency kept by the domain's
:class:`~kvhex.domain.residency.Residency`.

What the residency decides on the scheduler thread, the IO threads carry out:

* A put reserves room (evictions announced now), and its IO job removes the victims' blocks
  and writes the new ones; when polled, the written keys become readable and are announced
  with the job's context. Keys another job is writing are left to it; present keys are skipped
  or, where the storage is not this instance's alone (object stores), checked: a block the
  store lost is announced removed and written again.
* A get pins the readable keys it names and reads every key (another instance's block on a
  shared root too); what it finds missing or corrupt is dropped (announced) if it is still the
  block it looked for, and removed from storage. A probe answers from the index for this
  instance's blocks and from the storage for the rest (all of them on object stores, where the
  storage is the truth).
* ``delete`` and every other removal leaves the index at once (announced), the blocks on an
  IO thread. Until a key's block is gone, the key is not read, and a put of it or any put
  (whose room the removal frees) waits for it: nothing announced removed is ever served again,
  and a put right after a delete finds the room the delete freed.
* Losing the storage itself (a deleted bucket) drops and announces everything.
* Records: a put whose job has a request keeps each block's chunk record (computed here, on
  the scheduler thread, from the request's live tokens; encoded on the IO thread) in the
  block's header, so a restart announces adopted blocks in full, and with ``announce_peers``
  the tier also announces the blocks other instances hold on the same storage under its
  ``peer_identity`` (:mod:`kvhex.adapters.storage.peers`).
* Codecs: with a ``codec`` chain (:mod:`kvhex.adapters.codecs`) a put encodes each block on
  its IO thread for the tenant (cache salt) of the job's request, and a get reads each block
  (up to the chain's longest) into a scratch buffer and decodes it into its host slot. A
  block a keyed codec refuses for the asking request (another tenant's) fails that get and
  stays, announced as before; a block that does not decode is corrupt.

Threads: submissions, ``poll``, ``delete`` and every use of the residency and the event list
run on the scheduler thread only; IO runs on a pool of ``io_threads`` and never touches them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple, TypeVar

import structlog

from kvhex.adapters.codecs.chain import CodecChain
from kvhex.adapters.storage._io_pool import IoPool, IoTask, TaskCancelled
from kvhex.adapters.storage.adoption import Adoption, described
from kvhex.adapters.storage.block_io import (
    BlockIo,
    Located,
    Locating,
    PeerListing,
    PeerPresence,
    RecordReading,
    Relisting,
    StoreLost,
    safe_error,
)
from kvhex.adapters.storage.format import Verdict
from kvhex.adapters.storage.peers import PeerScan
from kvhex.adapters.storage.records import chunk_records, encode_records, sealed_records
from kvhex.domain.events import Stored, TierEvent
from kvhex.domain.jobs import JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import ChunkRecord
from kvhex.domain.request import ReqContext
from kvhex.domain.residency import Reservation, Residency, Snapshot
from kvhex.domain.tiers import TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.codec import CodecCorrupt, CodecRefused
from kvhex.ports.host_buffer import HostBuffer

log = structlog.get_logger(__name__)

T = TypeVar("T")

_PutOutcome = tuple[list[OffloadKey], list[OffloadKey], str | None]
"""A put's IO: the keys written, the keys found lost (and written again), the first error."""
_GetOutcome = tuple[list[OffloadKey], list[OffloadKey], list[OffloadKey], list[OffloadKey]]
"""A get's IO: the keys read and verified, found corrupt, found missing, refused by a keyed
codec (another tenant's blocks: left in place)."""
_ProbeOutcome = frozenset[OffloadKey]
"""A probe's IO: the keys found."""


class _Origin(NamedTuple):
    """What a put's request gives its blocks: their chunk records (``None``: no request)
    and the tenant a keyed codec seals them for."""

    records: dict[OffloadKey, ChunkRecord] | None
    tenant: str | None


class _Job:
    """A job in flight: the job, what the residency gave it, when it started."""

    __slots__ = ("job", "started", "state")

    def __init__(self, job: TierJob, state: Reservation | Snapshot | None) -> None:
        self.job = job
        self.state = state
        self.started = time.perf_counter()


class BlockTierStore:
    """A tier whose blocks an ``io`` moves. See the module docstring.

    Args:
        host: the host buffer whose slots jobs name.
        io: the data path, its namespace already prepared.
        identity: medium, locality and ownership announced in events.
        capacity_bytes: bytes the tier may hold, ``block_bytes`` a block.
        block_bytes: what one block costs in storage (header area included).
        io_threads: concurrent IO jobs.
        announce_peers: also announce the blocks other instances hold on the same storage,
            under :attr:`peer_identity` (``io`` must list them: local slabs and objects do).
        peer_scan_interval_s: seconds between the scans of the peer view.
        codec: the chain coding every block (``block_bytes`` then sized by its longest
            frame); ``io`` must read blocks of varying length (``read_many(up_to=True)``).

    Raises:
        ValueError: ``capacity_bytes`` holds no block, or ``announce_peers`` on an ``io``
            that cannot list other instances' blocks.
    """

    def __init__(
        self,
        host: HostBuffer,
        io: BlockIo,
        *,
        identity: TierIdentity,
        capacity_bytes: int,
        block_bytes: int,
        io_threads: int,
        announce_peers: bool = False,
        peer_scan_interval_s: float = 1.0,
        codec: CodecChain | None = None,
    ) -> None:
        self._host = host
        self._io = io
        self.codec = codec
        """The chain coding this tier's blocks (``None``: stored as the host holds them)."""
        self._frame_bytes = codec.max_stored_bytes(host.slot_bytes) if codec else 0
        self.refused_blocks = 0
        """Blocks a keyed codec refused to a request (another tenant's, or another key's)."""
        self._identity = identity
        self._name = identity.ownership or "tier"
        self._peer_identity = TierIdentity(
            identity.medium, identity.locality, f"{self._name}@peers"
        )
        self.capacity_bytes = capacity_bytes
        self.io_threads = io_threads
        try:
            self._index = Residency(identity, capacity_bytes, block_bytes)
        except ValueError:
            io.close()
            raise
        self._exclusive = io.exclusive
        # an exclusive storage another instance may share (slabs on one root): its index
        # answers a miss only while no other instance's slab was seen there (looked at
        # start-up, then by an IO thread every ALONE_CHECK_S)
        self._presence = io if isinstance(io, PeerPresence) and io.exclusive else None
        self._alone = False
        self._alone_task: IoTask[bool] | None = None
        self._alone_checked = time.monotonic()
        self._events: list[TierEvent] = []  # the tier's own, before the residency's
        # jobs in flight, by kind (each task's outcome typed); finished tasks queue themselves
        # in the pool, so poll costs what finished, not what is in flight
        self._puts: dict[IoTask[_PutOutcome], _Job] = {}
        self._gets: dict[IoTask[_GetOutcome], _Job] = {}
        self._probes: dict[IoTask[_ProbeOutcome], _Job] = {}
        self._removals: dict[IoTask[None], list[OffloadKey]] = {}  # removals in flight
        # key -> the task removing its block (a removal, or a put replacing it as a victim)
        self._leaving: dict[OffloadKey, IoTask[None] | IoTask[_PutOutcome]] = {}
        self.corrupt_blocks = 0
        self.lost_blocks = 0
        self.io_errors = 0
        self.left_at_start: frozenset[OffloadKey] = frozenset()
        """Blocks found at start-up beyond the capacity on shared storage, left in place
        (neither deleted nor announced; gets and probes still find them)."""
        self._relisting = io if isinstance(io, Relisting) else None  # once, not per poll
        self._pool = IoPool(io_threads, f"kvhex-{self._name}")
        self._closed = False
        self._peers: PeerScan | None = None
        self._adoption: Adoption | None = None
        try:
            if announce_peers:
                if not isinstance(io, PeerListing) or not isinstance(io, RecordReading):
                    raise ValueError(
                        "announce_peers: this storage cannot list other instances' blocks"
                    )
                self._peers = PeerScan(
                    io, self._peer_identity, peer_scan_interval_s, self._pool, tier=self._name
                )
            inventory = io.inventory()
            if self._presence is not None:
                self._alone = not self._presence.others_present()
            self.foreign_files = inventory.foreign
            over = self._index.adopt(inventory.blocks)
            if self._exclusive:
                if over:
                    io.remove_many(over)  # a dead instance's blocks, now this one's to bound
            else:
                # shared storage (an object store, a Valkey pool): what does not fit is left
                # in place, as other instances' blocks it may well be (gets still serve them);
                # their writers, or the server, bound them
                self.left_at_start = frozenset(over)
            self._announce_adopted(self._index.take_events())
        except BaseException:  # nothing half-started stays: locks, files, agents released
            self.close()
            raise
        if inventory.blocks or inventory.foreign:
            log.info(
                "tier_recovered",
                tier=self._name,
                blocks=len(self._index),
                evicted=len(over) - len(self.left_at_start),
                left=len(self.left_at_start),
                foreign_files=inventory.foreign,
            )

    # -- TierStore -----------------------------------------------------------------------
    @property
    def identity(self) -> TierIdentity:
        """Medium, locality and ownership announced in events."""
        return self._identity

    @property
    def announce_peers(self) -> bool:
        """Whether the tier also announces the blocks other instances hold on its storage."""
        return self._peers is not None

    @property
    def peer_identity(self) -> TierIdentity:
        """The identity of other instances' blocks in this tier's events (its medium and
        locality, ownership ``<name>@peers``); announced only with ``announce_peers``."""
        return self._peer_identity

    def submit_put(self, job: TierJob) -> None:
        """Reserve room (evictions announced now) and write the new keys on an IO thread."""
        self._check_open(job, JobKind.PUT)
        reservation = self._index.reserve(job.keys, job.ctx, verify=not self._exclusive)
        if reservation is None:
            unfit: _PutOutcome = ([], [], "the job does not fit the tier's capacity")
            self._puts[self._pool.completed(unfit)] = _Job(job, None)
            return
        owned = reservation.owned
        if len(owned) == len(job.keys):  # every key new here, none twice: the job's own order
            writes = list(zip(job.keys, job.slots, strict=True))
            checks = []
        else:
            slots = dict(zip(job.keys, job.slots, strict=True))
            writes = [(k, slots[k]) for k in owned]
            verify = reservation.verify
            checks = [(k, slots[k]) for k in verify.serials] if verify else []
        leaving = self._leaving
        # the removal of a key this job writes, and any removal whose room it may need
        waits: list[IoTask[None] | IoTask[_PutOutcome]] = list(self._removals)
        if leaving and not leaving.keys().isdisjoint(owned):
            waits += {leaving[k] for k in owned if k in leaving}
        victims = list(reservation.victims)
        records = chunk_records(job.ctx, [k for k, _ in (*writes, *checks)])
        task = self._pool.submit(
            self._do_put, writes, checks, victims, waits, _Origin(records, _tenant(job.ctx))
        )
        self._remove_later(victims, task)
        self._puts[task] = _Job(job, reservation)

    def submit_get(self, job: TierJob) -> None:
        """Read and verify ``job.keys`` into ``job.slots`` on an IO thread."""
        self._check_open(job, JobKind.GET)
        snapshot = self._index.snapshot(job.keys, pin=True)
        items = [(k, s) for k, s in zip(job.keys, job.slots, strict=True) if self._readable_now(k)]
        task = self._pool.submit(self._do_get, items, _tenant(job.ctx))
        self._gets[task] = _Job(job, snapshot)

    def held_now(self, key: OffloadKey) -> bool | None:
        """``Indexed``: on storage whose blocks only this instance removes, a key its index
        holds (it adopted what was found at start-up) is found by a get submitted now; a
        key it lacks is missing while no other instance's blocks were seen on the storage.
        ``None`` otherwise: a probe asks the storage (shared object stores, a root another
        instance also writes, or a key the peer view saw another instance write, which a
        presence check made up to ``ALONE_CHECK_S`` ago may not know of)."""
        if not self._exclusive:
            return None
        if key in self._index and key not in self._leaving:
            return True
        if not self._alone or (self._peers is not None and key in self._peers):
            return None
        return False

    def submit_probe(self, job: TierJob) -> None:
        """Which keys exist: the index answers for this instance's blocks (where it is the
        truth), the storage for the rest."""
        self._check_open(job, JobKind.PROBE)
        readable = self._index.readable(job.keys)
        asked = [k for k in job.keys if self._readable_now(k)]
        if self._exclusive:
            known = set(readable)
            asked = [k for k in asked if k not in known]
            snapshot = None
        else:
            known = set()
            snapshot = self._index.snapshot(readable)
        self._probes[self._pool.submit(self._do_probe, frozenset(known), asked)] = _Job(
            job, snapshot
        )

    def poll(self) -> list[JobResult]:
        """Results of finished jobs, each once; applies them to the residency and events.
        With ``announce_peers``, also applies what the peer view's lister found and the
        reads of its new blocks."""
        results = []
        finished = self._pool.finished
        peers = self._peers
        while finished:
            task = finished.popleft()
            if task is self._alone_task:
                self._alone = task.error is None and not task.value
                self._alone_task = None
                continue
            adoption = self._adoption
            if adoption is not None and task is adoption.task:
                if not self._closed:  # else never announced, as its removals were not
                    self._events += adoption.announce(self._index.take_events())
                    self._adoption = None
                continue
            if peers is not None and peers.owns(task):
                own = None if self._exclusive else self._holds
                peers.finished(task, own, self._events)
                continue
            removed = self._removals.pop(task, None)
            if removed is not None:
                self._removed(task, removed)
                continue
            entry = self._puts.pop(task, None)
            if entry is not None:
                results.append(self._apply_put(entry, task))
                continue
            entry = self._gets.pop(task, None)
            if entry is not None:
                results.append(self._apply_get(entry, task))
                continue
            entry = self._probes.pop(task, None)
            if entry is not None:
                results.append(self._apply_probe(entry, task))
        if peers is not None and not self._closed:
            own = None if self._exclusive else self._holds
            peers.apply(own, self._events)
        if self._presence is not None and self._alone_task is None and not self._closed:
            now = time.monotonic()
            if now - self._alone_checked >= ALONE_CHECK_S:
                self._alone_checked = now
                self._alone_task = self._pool.submit(self._presence.others_present)
        if self._relisting is not None and not self._closed:
            for listed in self._relisting.take_listings():  # the namespace record went alone
                self.drop_lost([k for k in self.keys() if k not in listed])
        return results

    def next_poll_at(self) -> float | None:
        """``-inf`` while something found on the tier's own waits to be announced: with
        ``announce_peers`` a listing that changed the peer view (or a read of its new
        blocks), and the blocks adopted at start-up once read; else ``None``
        (:class:`~kvhex.ports.tier_store.ScheduledWork`: an idle engine polls then)."""
        if self._closed:
            return None
        adoption = self._adoption
        if adoption is not None and adoption.task.done:
            return -math.inf
        return None if self._peers is None else self._peers.next_at()

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        """Remove the readable ``keys`` (each once) and announce them; their blocks go on an
        IO thread."""
        removed = self._index.delete(keys)
        if removed and not self._closed:
            self._remove_later(removed)

    def drop_lost(self, keys: Iterable[OffloadKey]) -> set[OffloadKey]:
        """Drop ``keys`` as blocks the storage lost on its own (a server evicted or expired
        them, an operator deleted them), as a get that finds a block gone does: each one
        readable leaves the index, is announced removed and counted in :attr:`lost_blocks`;
        nothing is deleted (the storage has no block, or one written since, which stays
        unlisted). With ``announce_peers`` the view drops those of other instances.

        Returns:
            The keys whose put is still in flight: their blocks may have gone after they
            were written, so the caller drops them again once they land (or, written again
            right after, dropping them only costs a miss).
        """
        keys = list(dict.fromkeys(keys))
        index = self._index
        now = [k for k in keys if k in index]
        later = {k for k in keys if k not in index and index.is_pending(k)}
        if now:
            self.lost_blocks += len(index.delete(now))
        if self._peers is not None and keys:
            self._peers.lost(keys, self._events)
        return later

    def drain(self) -> None:
        """Block until every submitted job and removal finished (and the reading of the
        records of the blocks adopted at start-up, where it runs after it)."""
        adoption = () if self._adoption is None else (self._adoption.task,)
        self._pool.wait([*self._puts, *self._gets, *self._probes, *self._removals, *adoption])

    def close(self) -> None:
        """Finish running IO, cancel queued jobs (reported failed by the next poll, their room
        released). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._peers is not None:
            self._peers.close()
        self._pool.close()
        self._io.close()

    def take_events(self) -> list[TierEvent]:
        """Events since the last call: under :attr:`identity` the blocks this instance
        holds, and with ``announce_peers`` under :attr:`peer_identity` the blocks other
        instances hold."""
        events = self._index.take_events()
        if self._adoption is not None:  # its blocks are not announced yet
            events = self._adoption.hide(events)
        if self._events:
            events = self._events + events
            self._events = []
        return events

    # -- introspection -------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._index

    def keys(self) -> list[OffloadKey]:
        """Readable keys, in the order they became readable."""
        return self._index.keys()

    @property
    def used_bytes(self) -> int:
        """Bytes held, or reserved by puts in flight."""
        return self._index.used_bytes

    @property
    def peer_blocks(self) -> int:
        """Other instances' blocks announced under :attr:`peer_identity` now."""
        return 0 if self._peers is None else len(self._peers)

    @property
    def peer_scans(self) -> int:
        """Scans of the peer view done so far (failed ones included)."""
        return 0 if self._peers is None else self._peers.scans

    def location(self, key: OffloadKey) -> Located:
        """Where ``key``'s block lives: a file or object path and the offset of its header.

        Raises:
            KeyError: no instance on this storage holds ``key``, or the storage cannot say.
        """
        if not isinstance(self._io, Locating):
            raise KeyError(key.hex())
        return self._io.location(key)

    # -- bookkeeping (scheduler thread) --------------------------------------------------
    def _check_open(self, job: TierJob, kind: JobKind) -> None:
        if self._closed:
            raise TierUnavailable("closed", tier=self._name)
        if job.kind is not kind:
            raise ValueError(f"job {job.job_id} is a {job.kind.value}, not a {kind.value}")

    def _absent(self, key: OffloadKey) -> bool:
        return key not in self._index and not self._index.is_pending(key)

    def _holds(self, key: OffloadKey) -> bool:
        return not self._absent(key)

    def _announce_adopted(self, events: list[TierEvent]) -> None:
        """Announce the blocks adopted at start-up (``events``: their ``Stored``, if any)
        with their records: read now, or by an IO job where each costs a request."""
        io = self._io
        if not isinstance(io, RecordReading):
            self._events = events
            return
        for event in events:
            if not isinstance(event, Stored):
                self._events.append(event)
            elif io.records_by_request:
                self._adoption = Adoption(event, io, self._pool, tier=self._name)
            else:
                self._events.append(described(event, io, tier=self._name))

    def _readable_now(self, key: OffloadKey) -> bool:
        """Whether a read may look for ``key``: not while this instance writes it (not
        announced yet) or removes it (announced gone)."""
        return key not in self._leaving and not self._index.is_pending(key)

    def _remove_later(
        self, keys: list[OffloadKey], task: IoTask[_PutOutcome] | None = None
    ) -> None:
        """``keys`` left the index; their blocks are removed by ``task`` (a put removing
        its victims) or by a removal of their own."""
        if not keys:
            return
        remover: IoTask[None] | IoTask[_PutOutcome]
        if task is None:
            remover = self._pool.submit(self._io.remove_many, keys)
            self._removals[remover] = keys
        else:
            remover = task
        for key in keys:
            self._leaving[key] = remover

    def _removed(self, task: IoTask[None], keys: list[OffloadKey]) -> None:
        self._gone(task, keys)
        exc = task.error
        if exc is not None and not isinstance(exc, TaskCancelled):
            self.io_errors += 1
            log.warning("tier_remove_failed", tier=self._name, error=safe_error(exc))

    def _gone(self, task: IoTask[None] | IoTask[_PutOutcome], keys: Sequence[OffloadKey]) -> None:
        leaving = self._leaving
        for key in keys:
            if leaving.get(key) is task:
                del leaving[key]

    def _outcome(self, task: IoTask[T]) -> T | Exception:
        """What a finished job's IO returned, or the error it ended with (a closed tier's
        for a cancelled one); a lost storage is applied here, once."""
        exc = task.error
        if exc is None:
            return task.value
        if isinstance(exc, TaskCancelled):
            return TierUnavailable("closed", tier=self._name)
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not ours
            raise exc
        if isinstance(exc, StoreLost):
            self._lost_everything(exc)
        return exc  # a bug, a lost store, an IO error outside per-key handling

    def _apply_put(self, entry: _Job, task: IoTask[_PutOutcome]) -> JobResult:
        job, reservation = entry.job, entry.state
        seconds = time.perf_counter() - entry.started
        outcome = self._outcome(task)
        written: list[OffloadKey]
        lost: list[OffloadKey]
        error: str | None
        if isinstance(outcome, Exception):
            written, lost, error = [], [], _describe(outcome)
        else:
            written, lost, error = outcome
        if isinstance(reservation, Reservation):
            self._gone(task, reservation.victims)
            strays = self._index.commit(reservation, set(written), set(lost))
            self.lost_blocks += len(lost)
            again = strays
            if isinstance(outcome, Exception) and not self._closed:
                # the job may have stopped before removing its victims: remove those nobody
                # has stored again since (a new writer of one replaces its block itself)
                again = again + [k for k in reservation.victims if self._absent(k)]
            self._remove_later([k for k in again if k not in self._leaving])
        nbytes = len(written) * self._host.slot_bytes
        if error is not None:
            self.io_errors += 1
            log.warning("tier_write_failed", tier=self._name, job_id=job.job_id, error=error)
            return JobResult(job.job_id, False, nbytes=nbytes, seconds=seconds, error=error)
        return JobResult(job.job_id, True, nbytes=nbytes, seconds=seconds)

    def _apply_get(self, entry: _Job, task: IoTask[_GetOutcome]) -> JobResult:
        job, snapshot = entry.job, entry.state
        seconds = time.perf_counter() - entry.started
        outcome = self._outcome(task)
        assert isinstance(snapshot, Snapshot)
        if isinstance(outcome, Exception):
            self._index.release(snapshot)
            return JobResult(job.job_id, False, seconds=seconds, error=_describe(outcome))
        ok, corrupt, missing, refused = outcome
        dropped = self._index.release(snapshot, ok, corrupt + missing, job.ctx)
        if refused:
            self.refused_blocks += len(refused)
            log.warning(
                "tier_block_refused", tier=self._name, job_id=job.job_id, blocks=len(refused)
            )
        if self._peers is not None and (corrupt or missing):
            # a block not this instance's when the read started is another's: the view
            # drops it
            held = snapshot.serials
            self._peers.lost([k for k in corrupt + missing if k not in held], self._events)
        if dropped:
            self._remove_later(dropped)
            self.lost_blocks += len(dropped)
        if corrupt:
            self.corrupt_blocks += len(corrupt)
            log.warning(
                "tier_block_corrupt", tier=self._name, job_id=job.job_id, blocks=len(corrupt)
            )
        nbytes = len(ok) * self._host.slot_bytes
        if len(ok) == len(job.keys):
            return JobResult(job.job_id, True, nbytes=nbytes, seconds=seconds)
        return JobResult(
            job.job_id,
            False,
            ok_keys=frozenset(ok),
            nbytes=nbytes,
            seconds=seconds,
            error=f"{len(job.keys) - len(ok)} of {len(job.keys)} blocks missing, corrupt "
            "or refused",
        )

    def _apply_probe(self, entry: _Job, task: IoTask[_ProbeOutcome]) -> JobResult:
        job, snapshot = entry.job, entry.state
        seconds = time.perf_counter() - entry.started
        outcome = self._outcome(task)
        if isinstance(outcome, Exception):
            if isinstance(snapshot, Snapshot):
                self._index.release(snapshot)
            return JobResult(job.job_id, False, seconds=seconds, error=_describe(outcome))
        found = outcome
        if isinstance(snapshot, Snapshot):  # the storage is the truth: what it lacks is lost
            lost = [k for k in snapshot.serials if k not in found]
            dropped = self._index.release(snapshot, lost=lost)
            self.lost_blocks += len(dropped)
            self._remove_later(dropped)
        return JobResult(job.job_id, True, found=found, seconds=seconds)

    def _lost_everything(self, exc: StoreLost) -> None:
        dropped = self._index.drop_all()
        self.lost_blocks += len(dropped)
        log.warning("tier_storage_lost", tier=self._name, blocks=len(dropped), error=str(exc))

    # -- IO (pool threads; no shared state touched) ---------------------------------------
    def _do_put(
        self,
        writes: list[tuple[OffloadKey, int]],
        checks: list[tuple[OffloadKey, int]],
        victims: list[OffloadKey],
        waits: list[IoTask[None] | IoTask[_PutOutcome]],
        origin: _Origin,
    ) -> _PutOutcome:
        self._pool.wait(waits)  # removals submitted earlier: they hold a thread or are done
        encoded = encode_records(origin.records)
        chain = self.codec
        if encoded and chain is not None and chain.record_sealer is not None:
            encoded = sealed_records(encoded, chain.record_sealer)
        tenant = origin.tenant
        lost: list[OffloadKey] = []
        if checks:
            there = self._io.exists_many([k for k, _ in checks])
            redo = [(k, s) for k, s in checks if k not in there]
            lost = [k for k, _ in redo]
            writes = writes + redo
        view = self._host.slot_view
        if chain is None:
            items = [(k, view(s)) for k, s in writes]
        else:
            items = [(k, memoryview(chain.encode(view(s), k, tenant))) for k, s in writes]
        errors = self._io.write_many(items, victims, encoded)
        written = [k for (k, _), err in zip(writes, errors, strict=True) if err is None]
        return written, lost, next((e for e in errors if e is not None), None)

    def _do_get(self, items: list[tuple[OffloadKey, int]], tenant: str | None) -> _GetOutcome:
        view = self._host.slot_view
        chain = self.codec
        ok: list[OffloadKey] = []
        corrupt: list[OffloadKey] = []
        missing: list[OffloadKey] = []
        refused: list[OffloadKey] = []
        if chain is None:
            verdicts = self._io.read_many([(k, view(s)) for k, s in items])
        else:  # each block into a scratch frame of the longest length, then decoded
            size = self._frame_bytes
            scratch = memoryview(bytearray(size * len(items)))
            frames = [scratch[i * size : (i + 1) * size] for i in range(len(items))]
            verdicts = self._io.read_many(
                [(k, f) for (k, _), f in zip(items, frames, strict=True)], up_to=True
            )
            for i, ((key, slot), verdict) in enumerate(zip(items, verdicts, strict=True)):
                if verdict is not Verdict.OK:
                    continue
                try:
                    chain.decode(frames[i], view(slot), key, tenant)
                except CodecRefused:
                    refused.append(key)
                except CodecCorrupt:
                    verdicts[i] = Verdict.CORRUPT
        for (key, _), verdict in zip(items, verdicts, strict=True):
            if refused and key in refused:
                continue
            if verdict is Verdict.OK:
                ok.append(key)
            elif verdict is Verdict.CORRUPT:
                corrupt.append(key)
            else:
                missing.append(key)
        return ok, corrupt, missing, refused

    def _do_probe(self, known: _ProbeOutcome, asked: list[OffloadKey]) -> _ProbeOutcome:
        return known | frozenset(self._io.exists_many(asked)) if asked else known


ALONE_CHECK_S = 1.0
"""How often a file tier looks for another instance's slabs on its root (a directory listing
on an IO thread); until it sees one, its own index answers lookups' misses."""


def _tenant(ctx: ReqContext | None) -> str | None:
    """The cache salt of ``ctx``'s request: whose key a keyed codec seals its blocks with."""
    prov = ctx.provenance if ctx is not None else None
    return prov.cache_salt if prov is not None else None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {safe_error(exc)}"
