"""``MemoryTierStore``: a secondary tier in host memory that keeps real bytes.

A real tier in miniature, on the same residency core as the storage tiers
(:class:`~kvhex.domain.residency.Residency`): a byte capacity with LRU eviction announced
before the stores that take the room, jobs that finish on a later ``poll`` (in submission
order), any number of jobs on one key in flight, and deterministic faults.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from kvhex.domain.events import TierEvent
from kvhex.domain.jobs import JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.residency import Reservation, Residency, Snapshot
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer


class _Queued:
    __slots__ = ("job", "polls_left", "state", "submitted")

    def __init__(self, job: TierJob, polls_left: int, state: Reservation | Snapshot | None) -> None:
        self.job = job
        self.polls_left = polls_left
        self.state = state  # a put's reservation, a get's pinned snapshot
        self.submitted = time.perf_counter()


class MemoryTierStore:
    """A secondary tier holding blocks as ``bytes`` in host memory.

    Args:
        host: the buffer whose slots jobs name.
        capacity_bytes: bytes the tier may hold (at least one slot); least recently used
            blocks are evicted (and announced) to make room.
        name: the ownership name announced in events and used in stats.
        medium: the medium announced (default ``STORAGE``).
        locality: announced locality (default ``LOCAL``).
        complete_after_polls: a job is reported by the N-th ``poll`` after its submission.
        get_delay_s: a get (a read) is reported no earlier than this many seconds after
            its submission: a slow or throttled store whose index answers at once (probes
            and puts are not delayed), for benchmarks and tests; ``drain`` waits it out.
        indexed: lookups are answered from the tier's index at once (``held_now``), as for
            a store whose index is the truth; off (the default), they wait for a probe.
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
        get_delay_s: float = 0.0,
        indexed: bool = False,
    ) -> None:
        if complete_after_polls < 1:
            raise ValueError(f"complete_after_polls must be >= 1, got {complete_after_polls}")
        if not (isinstance(get_delay_s, int | float) and 0 <= get_delay_s < float("inf")):
            raise ValueError(
                f"get_delay_s must be a finite number of seconds >= 0, got {get_delay_s!r}"
            )
        if not isinstance(indexed, bool):
            raise ValueError(f"indexed must be true or false, got {indexed!r}")
        self.get_delay_s = float(get_delay_s)
        self.indexed = indexed
        self._host = host
        self.capacity_bytes = capacity_bytes
        self._identity = TierIdentity(medium, locality, name)
        self._index = Residency(self._identity, capacity_bytes, host.slot_bytes)
        self.complete_after_polls = complete_after_polls
        self._blocks: dict[OffloadKey, bytes] = {}  # exactly the readable keys
        self._queue: deque[_Queued] = deque()
        self._results: list[JobResult] = []
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

    def held_now(self, key: OffloadKey) -> bool | None:
        """With ``indexed``: whether ``key`` is readable now (``Indexed``); else ``None``."""
        return key in self._blocks if self.indexed else None

    def submit_put(self, job: TierJob) -> None:
        """Reserve room (evicting and announcing now) and queue the copy."""
        self._check(job, JobKind.PUT)
        reservation = self._index.reserve(job.keys, job.ctx)
        if reservation is not None:
            for victim in reservation.victims:
                del self._blocks[victim]
        self._queue.append(_Queued(job, self.complete_after_polls, reservation))

    def submit_get(self, job: TierJob) -> None:
        """Pin the readable keys and queue the copy."""
        self._check(job, JobKind.GET)
        snapshot = self._index.snapshot(job.keys, pin=True)
        self._queue.append(_Queued(job, self.complete_after_polls, snapshot))

    def submit_probe(self, job: TierJob) -> None:
        """Queue a probe."""
        self._check(job, JobKind.PROBE)
        self._queue.append(_Queued(job, self.complete_after_polls, None))

    def _check(self, job: TierJob, kind: JobKind) -> None:
        if self._closed:
            raise TierUnavailable("closed", tier=self._identity.ownership or "memory")
        if job.kind is not kind:
            raise ValueError(f"job {job.job_id} is a {job.kind.value}, not a {kind.value}")

    def poll(self) -> list[JobResult]:
        """Run every queued job whose poll count is reached, in submission order."""
        for entry in self._queue:
            entry.polls_left -= 1
        now = time.perf_counter()
        while self._queue and self._queue[0].polls_left <= 0 and self._due(self._queue[0]) <= now:
            self._run(self._queue.popleft())
        results, self._results = self._results, []
        return results

    def drain(self) -> None:
        """Run every queued job now (a get after its ``get_delay_s``); results wait for the
        next poll."""
        while self._queue:
            wait = self._due(self._queue[0]) - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            self._run(self._queue.popleft())

    def _due(self, entry: _Queued) -> float:
        delay = self.get_delay_s if entry.job.kind is JobKind.GET else 0.0
        return entry.submitted + delay

    def close(self) -> None:
        """Fail queued jobs (reported by the next poll, their room released); refuse new
        ones. Idempotent."""
        while self._queue:
            entry = self._queue.popleft()
            self._settle(entry, ())
            self._results.append(JobResult(entry.job.job_id, False, error="tier closed"))
        self._closed = True

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        """Remove ``keys`` that are readable (each once) and announce them."""
        for key in self._index.delete(keys):
            del self._blocks[key]

    def take_events(self) -> list[TierEvent]:
        """Events since the last call."""
        return self._index.take_events()

    # -- introspection for tests ---------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._index

    def keys(self) -> list[OffloadKey]:
        """Readable keys, in the order they became readable."""
        return self._index.keys()

    def block(self, key: OffloadKey) -> bytes | None:
        """The stored bytes of ``key``."""
        return self._blocks.get(key)

    @property
    def used_bytes(self) -> int:
        """Bytes held or reserved by puts in flight."""
        return self._index.used_bytes

    # -- execution -----------------------------------------------------------------------
    def _run(self, entry: _Queued) -> None:
        job = entry.job
        measured = time.perf_counter() - entry.submitted
        seconds = self._latency_s if self._latency_s is not None else measured
        if job.kind is JobKind.PUT:
            result = self._put(job, entry.state)
        elif job.kind is JobKind.GET:
            result = self._get(job, entry.state)
        else:
            result = self._probe(job)
        self._results.append(result._replace(seconds=seconds))

    def _settle(self, entry: _Queued, ok: Sequence[OffloadKey]) -> None:
        """Hand a job's reservation or pins back to the index (``ok``: what it wrote/read)."""
        if isinstance(entry.state, Reservation):
            self._index.commit(entry.state, ok)
        elif isinstance(entry.state, Snapshot):
            self._index.release(entry.state, ok, ctx=entry.job.ctx)

    def _put(self, job: TierJob, reservation: Reservation | Snapshot | None) -> JobResult:
        if not isinstance(reservation, Reservation):
            return JobResult(job.job_id, False, error="the job does not fit the tier's capacity")
        if self._fail_puts:
            self._fail_puts -= 1
            self._index.commit(reservation, ())
            return JobResult(job.job_id, False, error="injected put failure")
        owned = set(reservation.owned)
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key in owned:
                self._blocks[key] = bytes(self._host.slot_view(slot))
        self._index.commit(reservation, reservation.owned)
        return JobResult(job.job_id, True, nbytes=len(owned) * self._host.slot_bytes)

    def _get(self, job: TierJob, snapshot: Reservation | Snapshot | None) -> JobResult:
        assert isinstance(snapshot, Snapshot)
        if self._fail_gets:
            self._fail_gets -= 1
            self._index.release(snapshot)
            return JobResult(job.job_id, False, error="injected get failure")
        allowed = self._partial_gets.popleft() if self._partial_gets else None
        ok: list[OffloadKey] = []
        nbytes = 0
        for key, slot in zip(job.keys, job.slots, strict=True):
            data = self._blocks.get(key)
            if data is None or (allowed is not None and key not in allowed):
                continue
            self._host.slot_view(slot)[:] = data
            ok.append(key)
            nbytes += len(data)
        self._index.release(snapshot, ok, ctx=job.ctx)
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
