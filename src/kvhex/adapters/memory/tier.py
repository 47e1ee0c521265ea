"""``MemoryTierStore``: a secondary tier in host memory that keeps real bytes."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence

from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.jobs import JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer

__all__ = ["MemoryTierStore"]


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
