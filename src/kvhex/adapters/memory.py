"""In-memory adapters that keep real bytes: a host buffer, a secondary tier and a transfer.

What service tests and domain-only users run on. Per-instance state only (no class-level
stores). ``MemoryTierStore`` is a real tier in miniature: a byte capacity with LRU eviction
that announces its removals, asynchronous jobs that finish on a later ``poll``, and
deterministic faults (fail the next put or get, a partial get, completion after N polls).
``MemoryBlockTransfer`` copies between ``bytearray`` "device" caches and host slots with the
same ``SlotLayout`` as the torch transfer, so the whole stack runs without torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence

from kvhex.domain.events import EventBatch, Removed, Stored, TierEvent
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.slot_layout import ChunkRun, SlotLayout
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.domain.transfer import TransferJob, TransferKind, TransferResult, check_submission
from kvhex.errors import TierUnavailable, TransferError
from kvhex.ports.host_buffer import HostBuffer

__all__ = ["MemoryBlockTransfer", "MemoryEventSink", "MemoryHostBuffer", "MemoryTierStore"]


class MemoryHostBuffer:
    """``num_slots`` x ``slot_bytes`` of ordinary host memory (a ``bytearray``)."""

    __slots__ = ("_buffer", "_view", "num_slots", "slot_bytes")

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        if num_slots < 0 or slot_bytes <= 0:
            raise ValueError(
                f"need num_slots >= 0 and slot_bytes > 0, got {num_slots}, {slot_bytes}"
            )
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._buffer: bytearray | None = bytearray(num_slots * slot_bytes)
        self._view: memoryview | None = memoryview(self._buffer)

    def slot_view(self, slot: int) -> memoryview:
        """A writable view of one slot. ``IndexError`` outside the buffer or after close."""
        if self._view is None:
            raise IndexError("host buffer is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")
        start = slot * self.slot_bytes
        return self._view[start : start + self.slot_bytes]

    def close(self) -> None:
        """Release the memory. Views handed out before stay valid until dropped."""
        self._view = None
        self._buffer = None

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._view is None


class _Queued:
    __slots__ = ("job", "polls_left", "submitted")

    def __init__(self, job: TierJob, polls_left: int) -> None:
        self.job = job
        self.polls_left = polls_left
        self.submitted = time.perf_counter()


class MemoryTierStore:
    """A secondary tier holding blocks as ``bytes`` in host memory.

    Args:
        host: the buffer whose slots jobs name.
        capacity_bytes: bytes the tier may hold; least recently used blocks are evicted (and
            announced) to make room.
        name: the ownership name announced in events and used in stats.
        medium: the medium announced (default ``STORAGE``).
        locality: announced locality (default ``LOCAL``).
        complete_after_polls: a job is reported by the N-th ``poll`` after its submission.
    """

    def __init__(
        self,
        host: HostBuffer,
        *,
        capacity_bytes: int,
        name: str = "memory",
        medium: Medium = Medium.STORAGE,
        locality: Locality | None = Locality.LOCAL,
        complete_after_polls: int = 1,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if complete_after_polls < 1:
            raise ValueError(f"complete_after_polls must be >= 1, got {complete_after_polls}")
        self._host = host
        self.capacity_bytes = capacity_bytes
        self._identity = TierIdentity(medium, locality, name)
        self.complete_after_polls = complete_after_polls
        self._blocks: OrderedDict[OffloadKey, bytes] = OrderedDict()
        self._used = 0
        self._queue: deque[_Queued] = deque()
        self._results: list[JobResult] = []
        self._events: list[TierEvent] = []
        self._fail_puts = 0
        self._fail_gets = 0
        self._fail_probes = 0
        self._partial_gets: deque[frozenset[OffloadKey]] = deque()
        self._latency_s: float | None = None
        self._closed = False

    # -- faults (deterministic) ----------------------------------------------------------
    def fail_next_puts(self, n: int = 1) -> None:
        """The next ``n`` put jobs fail and store nothing."""
        self._fail_puts += n

    def fail_next_gets(self, n: int = 1) -> None:
        """The next ``n`` get jobs fail and load nothing."""
        self._fail_gets += n

    def fail_next_probes(self, n: int = 1) -> None:
        """The next ``n`` probe jobs fail."""
        self._fail_probes += n

    def partial_next_get(self, ok_keys: Sequence[OffloadKey]) -> None:
        """The next get job loads only ``ok_keys`` (those present) and fails the rest."""
        self._partial_gets.append(frozenset(ok_keys))

    def report_latency(self, seconds: float | None) -> None:
        """Report this latency for every job instead of the measured one (``None``: measure)."""
        self._latency_s = seconds

    # -- TierStore -----------------------------------------------------------------------
    @property
    def identity(self) -> TierIdentity:
        """Medium, locality and ownership announced in events."""
        return self._identity

    def submit_put(self, job: TierJob) -> None:
        """Queue a put; it runs when a later poll reaches it."""
        self._enqueue(job, JobKind.PUT)

    def submit_get(self, job: TierJob) -> None:
        """Queue a get."""
        self._enqueue(job, JobKind.GET)

    def submit_probe(self, job: TierJob) -> None:
        """Queue a probe."""
        self._enqueue(job, JobKind.PROBE)

    def _enqueue(self, job: TierJob, kind: JobKind) -> None:
        if self._closed:
            raise TierUnavailable("closed", tier=self._identity.ownership or "memory")
        if job.kind is not kind:
            raise ValueError(f"job {job.job_id} is a {job.kind.value}, not a {kind.value}")
        self._queue.append(_Queued(job, self.complete_after_polls))

    def poll(self) -> list[JobResult]:
        """Run every queued job whose poll count is reached, in submission order."""
        for entry in self._queue:
            entry.polls_left -= 1
        while self._queue and self._queue[0].polls_left <= 0:
            self._run(self._queue.popleft())
        results, self._results = self._results, []
        return results

    def drain(self) -> None:
        """Run every queued job now; results wait for the next poll."""
        while self._queue:
            self._run(self._queue.popleft())

    def close(self) -> None:
        """Fail queued jobs (reported by the next poll); refuse new ones. Idempotent."""
        while self._queue:
            job = self._queue.popleft().job
            self._results.append(JobResult(job.job_id, False, error="tier closed"))
        self._closed = True

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        """Remove ``keys`` that are present and announce them."""
        gone = [k for k in keys if k in self._blocks]
        for key in gone:
            self._used -= len(self._blocks.pop(key))
        if gone:
            self._events.append(Removed(tuple(gone), self._identity))

    def take_events(self) -> list[TierEvent]:
        """Events since the last call."""
        events, self._events = self._events, []
        return events

    # -- introspection for tests ---------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def keys(self) -> list[OffloadKey]:
        """Resident keys, least recently used first."""
        return list(self._blocks)

    def block(self, key: OffloadKey) -> bytes | None:
        """The stored bytes of ``key``."""
        return self._blocks.get(key)

    @property
    def used_bytes(self) -> int:
        """Bytes held."""
        return self._used

    # -- execution -----------------------------------------------------------------------
    def _run(self, entry: _Queued) -> None:
        job = entry.job
        measured = time.perf_counter() - entry.submitted
        seconds = self._latency_s if self._latency_s is not None else measured
        if job.kind is JobKind.PUT:
            result = self._put(job)
        elif job.kind is JobKind.GET:
            result = self._get(job)
        else:
            result = self._probe(job)
        self._results.append(result._replace(seconds=seconds))

    def _put(self, job: TierJob) -> JobResult:
        if self._fail_puts:
            self._fail_puts -= 1
            return JobResult(job.job_id, False, error="injected put failure")
        blocks = self._blocks
        new = [(k, s) for k, s in zip(job.keys, job.slots, strict=True) if k not in blocks]
        for key in job.keys:
            if key in blocks:
                blocks.move_to_end(key)
        need = len(new) * self._host.slot_bytes
        if need > self.capacity_bytes:
            return JobResult(job.job_id, False, error="job larger than tier capacity")
        evicted = []
        protected = set(job.keys)
        while self._used + need > self.capacity_bytes:
            victim = next(k for k in blocks if k not in protected)
            self._used -= len(blocks.pop(victim))
            evicted.append(victim)
        if evicted:
            self._events.append(Removed(tuple(evicted), self._identity))
        for key, slot in new:
            data = bytes(self._host.slot_view(slot))
            blocks[key] = data
            self._used += len(data)
        if new:
            self._events.append(Stored(tuple(k for k, _ in new), self._identity, job.ctx))
        return JobResult(job.job_id, True, nbytes=need)

    def _get(self, job: TierJob) -> JobResult:
        if self._fail_gets:
            self._fail_gets -= 1
            return JobResult(job.job_id, False, error="injected get failure")
        allowed = self._partial_gets.popleft() if self._partial_gets else None
        ok: set[OffloadKey] = set()
        nbytes = 0
        for key, slot in zip(job.keys, job.slots, strict=True):
            data = self._blocks.get(key)
            if data is None or (allowed is not None and key not in allowed):
                continue
            self._host.slot_view(slot)[:] = data
            self._blocks.move_to_end(key)
            ok.add(key)
            nbytes += len(data)
        if len(ok) == len(job.keys):
            return JobResult(job.job_id, True, nbytes=nbytes)
        missing = len(job.keys) - len(ok)
        error = f"{missing} of {len(job.keys)} blocks missing"
        return JobResult(job.job_id, False, ok_keys=frozenset(ok), nbytes=nbytes, error=error)

    def _probe(self, job: TierJob) -> JobResult:
        if self._fail_probes:
            self._fail_probes -= 1
            return JobResult(job.job_id, False, error="injected probe failure")
        return JobResult(
            job.job_id, True, found=frozenset(k for k in job.keys if k in self._blocks)
        )


class MemoryEventSink:
    """Keeps every published batch in a list (for tests and embedding)."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.closed = False

    def publish(self, batch: EventBatch) -> None:
        """Append ``batch``."""
        if self.closed:
            raise RuntimeError("memory event sink is closed")
        self.batches.append(batch)

    def close(self) -> None:
        """Refuse further batches."""
        self.closed = True


class MemoryBlockTransfer:
    """A ``BlockTransfer`` whose "device" KV caches are ``bytearray``s (pure Python).

    Args:
        host: the buffer whose slots jobs name; ``slot_bytes`` must equal the layout's.
        kv_caches: one ``bytearray`` per registered tensor, ``num_blocks * page_bytes`` long.
        page_bytes: bytes per block, per tensor.
        tensor_groups: the KV group of each tensor, or the groups sharing it.
        blocks_per_chunk: blocks per host slot, per group.

    The slot layout is ``SlotLayout``'s, as for the torch transfer. Submitted jobs are copied
    by the next ``poll`` (or ``wait``), in submission order per direction;
    ``fail_next_stores`` / ``fail_next_loads`` make the next jobs fail without copying.

    Raises:
        TransferError: naming the argument, for caches that do not fit the layout or a host
            buffer whose ``slot_bytes`` differs (naming both numbers).
    """

    def __init__(
        self,
        host: HostBuffer,
        kv_caches: Sequence[bytearray],
        *,
        page_bytes: Sequence[int],
        tensor_groups: Sequence[int | Sequence[int]],
        blocks_per_chunk: Sequence[int],
    ) -> None:
        layout = SlotLayout(page_bytes, tensor_groups, blocks_per_chunk)
        if len(kv_caches) != len(layout.page_bytes):
            raise TransferError(
                f"{len(kv_caches)} caches for {len(layout.page_bytes)} page sizes",
                field="kv_caches",
            )
        num_blocks: list[int] = []
        for group, members in enumerate(layout.group_tensors):
            counts = set()
            for t in members:
                blocks, rest = divmod(len(kv_caches[t]), layout.page_bytes[t])
                if rest or not blocks:
                    raise TransferError(
                        f"cache {t} has {len(kv_caches[t])} bytes, not a positive multiple of "
                        f"its page of {layout.page_bytes[t]}",
                        field="kv_caches",
                    )
                counts.add(blocks)
            if len(counts) > 1:
                raise TransferError(
                    f"caches of group {group} differ in num_blocks: {sorted(counts)}",
                    field="kv_caches",
                )
            num_blocks.append(counts.pop())
        if host.slot_bytes != layout.slot_bytes:
            raise TransferError(
                f"host buffer has slot_bytes {host.slot_bytes}, the KV layout needs "
                f"{layout.slot_bytes}",
                field="host",
            )
        self.layout = layout
        self._host = host
        self._caches = [memoryview(c) for c in kv_caches]
        self._num_blocks = tuple(num_blocks)
        self._queues: dict[TransferKind, deque[tuple[TransferJob, tuple[ChunkRun, ...]]]] = {
            kind: deque() for kind in TransferKind
        }
        self._done: list[TransferResult] = []
        self._fail = dict.fromkeys(TransferKind, 0)
        self._closed = False

    def fail_next_stores(self, n: int = 1) -> None:
        """The next ``n`` store jobs fail and copy nothing."""
        self._fail[TransferKind.STORE] += n

    def fail_next_loads(self, n: int = 1) -> None:
        """The next ``n`` load jobs fail and copy nothing."""
        self._fail[TransferKind.LOAD] += n

    def submit_store(self, job: TransferJob) -> None:
        """Queue a device -> host copy. ``TransferError`` for a job that does not fit."""
        self._submit(TransferKind.STORE, job)

    def submit_load(self, job: TransferJob) -> None:
        """Queue a host -> device copy. ``TransferError`` for a job that does not fit."""
        self._submit(TransferKind.LOAD, job)

    def _submit(self, kind: TransferKind, job: TransferJob) -> None:
        check_submission(job, kind, closed=self._closed)
        runs = self.layout.plan(job, num_slots=self._host.num_slots, num_blocks=self._num_blocks)
        self._queues[kind].append((job, runs))

    def poll(self) -> list[TransferResult]:
        """Copy every queued job (stores, then loads) and report them with earlier ones."""
        self._run_all()
        results, self._done = self._done, []
        return results

    def wait(self, job_ids: Collection[JobId]) -> None:
        """Copy every queued job now; results wait for ``poll``."""
        self._run_all()

    def close(self) -> None:
        """Copy what is queued, then refuse new jobs. Idempotent."""
        self._run_all()
        self._closed = True

    def _run_all(self) -> None:
        for kind, queue in self._queues.items():
            while queue:
                job, runs = queue.popleft()
                if self._fail[kind]:
                    self._fail[kind] -= 1
                    error = f"injected {kind.value} failure"
                    self._done.append(TransferResult(job.job_id, False, error=error))
                    continue
                began = time.perf_counter()
                nbytes = self._copy(kind, job, runs)
                seconds = time.perf_counter() - began
                self._done.append(TransferResult(job.job_id, True, nbytes, seconds))

    def _copy(self, kind: TransferKind, job: TransferJob, runs: tuple[ChunkRun, ...]) -> int:
        layout = self.layout
        nbytes = 0
        for run in runs:
            per_chunk = layout.blocks_per_chunk[run.group]
            tensors = layout.group_tensors[run.group]
            for k in range(run.num_blocks):
                chunk, position = divmod(run.skip + k, per_chunk)
                view = self._host.slot_view(job.slots[run.slot_pos + chunk])
                block = job.block_ids[run.block_pos + k]
                for t in tensors:
                    page = layout.page_bytes[t]
                    at = layout.region_offsets[t] + position * page
                    device = self._caches[t][block * page : (block + 1) * page]
                    if kind is TransferKind.STORE:
                        view[at : at + page] = device
                    else:
                        device[:] = view[at : at + page]
                    nbytes += page
        return nbytes
