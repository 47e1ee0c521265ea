"""``TierDriver``: the job bookkeeping of one secondary tier, whoever owns the host tier.

Two owners drive kvhex tiers: ``TieringManager`` (kvhex's own host tier) and the vLLM adapter's
``KvhexSecondaryTier`` (vLLM's host tier). Everything that concerns the tier alone lives here,
once: the jobs in flight and when they were submitted, the existence probes (``ProbeCache``),
the keys whose get failed ("missing": never promoted from this tier again until a put stores
them, so a lost block cannot loop through promotion, vLLM #49176), the tier's counters, and
the store's faults (a submission or a poll that raises). It also passes the request lifecycle
to a ``RequestAware`` tier, when its owner says, and is the owner's only way to the store:
its events (counted as they pass), ``drain``, ``close`` and the stats ``snapshot`` (with what
an ``Occupancy`` or ``TierHealth`` store says of itself). The owner applies the host-side
effects of each finished put and get: unpin, complete a promotion, admission.

Job ids: the owner allocates those of puts and gets; probe ids come from ``probe_ids``
(kvhex's manager shares one counter across tiers; inside vLLM they are negative, so they never
meet vLLM's). An id must be unique within one driver while its job is in flight.

Threading: scheduler thread only. Nothing here blocks but ``drain`` and ``close``; ``submit``
and ``poll`` call the store, whose contract is not to block either.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import structlog

from kvhex.domain.cost import TierCost, TierEstimate
from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult, TierIdentity
from kvhex.ports.capabilities import TenantRefusals, TierHealth
from kvhex.ports.tier_store import Indexed, Occupancy, RequestAware, ScheduledWork, TierStore
from kvhex.service.probes import ProbeCache
from kvhex.service.stats import TierStats

log = structlog.get_logger(__name__)

_PUT, _GET, _PROBE = JobKind.PUT, JobKind.GET, JobKind.PROBE
_HIT, _MISS = LookupResult.HIT, LookupResult.MISS


def loaded_keys(job: TierJob, result: JobResult) -> tuple[list[OffloadKey], list[OffloadKey]]:
    """The keys a finished get loaded and those it did not, each in job order. A failed get
    with ``ok_keys`` is a partial success; without them every key failed."""
    if result.success:
        return list(job.keys), []
    ok = result.ok_keys
    if ok is None:
        return [], list(job.keys)
    return [k for k in job.keys if k in ok], [k for k in job.keys if k not in ok]


class TierDriver:
    """Submits one tier's jobs, polls their results and keeps what they teach about the tier."""

    __slots__ = (
        "_health",
        "_held_now",
        "_hooks",
        "_jobs",
        "_missing",
        "_occupancy",
        "_probe_ids",
        "_probes",
        "_refusals",
        "_scheduled",
        "_stats",
        "_store",
        "get_cost",
        "identity",
        "on_job",
    )

    def __init__(self, store: TierStore, name: str, *, probe_ids: Callable[[], JobId]) -> None:
        """Args:
        store: the tier (from now on driven through this driver only).
        name: the tier's name in stats and logs.
        probe_ids: a new job id for each probe job (never one the owner uses for a put or
            get in flight on this tier).
        """
        self._store = store
        self._hooks = store if isinstance(store, RequestAware) else None
        self._occupancy = store if isinstance(store, Occupancy) else None
        self._health = store if isinstance(store, TierHealth) else None
        self._refusals = store if isinstance(store, TenantRefusals) else None
        self._held_now = store.held_now if isinstance(store, Indexed) else None
        self._scheduled = store.next_poll_at if isinstance(store, ScheduledWork) else None
        self.identity: TierIdentity = store.identity
        """The tier's identity (read-only; a plain attribute: lookups read it per key)."""
        self._stats = TierStats(name, self.identity.medium)
        self._probe_ids = probe_ids
        self._jobs: dict[JobId, tuple[TierJob, float]] = {}  # job, submitted (perf_counter)
        self._probes = ProbeCache()
        self._missing: set[OffloadKey] = set()
        self.on_job: Callable[[TierJob, JobResult, float], None] | None = None
        """Called with each finished put or get, its result and its latency (seconds from
        submission to the result reaching this driver): the owner's metrics."""
        self.get_cost = TierCost()
        """The tier's gets fitted (latency and throughput, submission to result)."""

    @property
    def name(self) -> str:
        """The tier's name in stats and logs."""
        return self._stats.name

    @property
    def stats(self) -> TierStats:
        """The live counters (``snapshot`` for a copy that does not move)."""
        return self._stats

    def snapshot(self, *, admission_ema_s: float | None = None) -> TierStats:
        """A copy of the counters, with the occupancy and damage counts the store reports
        now (``Occupancy``, ``TierHealth``) and the owner's ``admission_ema_s``."""
        stats = self._stats
        occupancy, health = self._occupancy, self._health
        return attrs.evolve(
            stats,
            put_latency=stats.put_latency.copy(),
            get_latency=stats.get_latency.copy(),
            used_bytes=occupancy.used_bytes if occupancy is not None else None,
            capacity_bytes=occupancy.capacity_bytes if occupancy is not None else None,
            corrupt_blocks=health.corrupt_blocks if health is not None else None,
            lost_blocks=health.lost_blocks if health is not None else None,
            io_errors=health.io_errors if health is not None else None,
            refused_blocks=(self._refusals.refused_blocks if self._refusals is not None else None),
            admission_ema_s=admission_ema_s,
        )

    def count_dropped(self, n_keys: int) -> None:
        """The owner's admission policy refused a cascade of ``n_keys`` chunks to this tier."""
        self._stats.cascades_dropped += 1
        self._stats.keys_dropped += n_keys

    def count_no_room(self) -> None:
        """A hit on this tier found no host slot to promote into (the owner answered MISS)."""
        self._stats.promotion_slot_failures += 1

    def get_estimate(self, slot_bytes: int) -> TierEstimate | None:
        """The fitted cost of a get submitted now, queued behind the gets in flight
        (``slot_bytes`` per key they write); ``None`` until a get was measured."""
        return self.get_cost.estimate(queued_bytes=self._stats.keys_in_flight_get * slot_bytes)

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet reported."""
        return len(self._jobs)

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """``MISS`` for a key whose get failed here; otherwise the answer of the tier's own
        index where it has one (``Indexed``), else the probe's: ``HIT`` or ``MISS`` once
        answered, ``RETRY`` before (the first ask queues the key for the probe
        ``submit_probes`` sends). ``ctx`` keeps the answer alive until ``forget_request``."""
        stats = self._stats
        stats.lookups += 1
        if key in self._missing:
            stats.misses += 1
            return _MISS
        if self._held_now is not None and (held := self._held_now(key)) is not None:
            if held:  # the tier's own index answers (``Indexed``): no probe, no step
                stats.hits += 1
                return _HIT
            stats.misses += 1
            return _MISS
        answer = self._probes.lookup(key, ctx)
        if answer is _HIT:
            stats.hits += 1
        elif answer is _MISS:
            stats.misses += 1
        return answer

    def peek(self, key: OffloadKey) -> bool | None:
        """What ``lookup`` would answer now, without counting, probing or remembering:
        ``True`` hit, ``False`` miss, ``None`` not known yet (a probe would be needed)."""
        if key in self._missing:
            return False
        if self._held_now is not None and (held := self._held_now(key)) is not None:
            return held
        return self._probes.peek(key)

    def submit(self, job: TierJob) -> JobResult | None:
        """Send a put or get job to the store.

        Returns ``None`` when the store took the job (its result comes from a later ``poll``).
        When the submission raised, the failed result, already counted (``submit_errors``,
        ``puts_failed`` / ``gets_failed``), logged and applied to this driver (a failed get
        marks its keys missing); ``poll`` never reports that job, so the owner applies its
        own effects of the failure now or reports it later.

        Raises:
            ValueError: ``job`` is a probe (probes are the driver's own: ``submit_probes``).
        """
        if job.kind is _PUT:
            self._stats.puts_submitted += 1
            return self._send(job, self._store.submit_put)
        if job.kind is _GET:
            self._stats.gets_submitted += 1
            return self._send(job, self._store.submit_get)
        raise ValueError(f"job {job.job_id}: probes are sent by submit_probes")

    def submit_probes(self) -> None:
        """Once per step: send the keys lookups queued since the last call as one probe job.
        A probe whose submission raises answers ``MISS`` for its keys at once."""
        batch = self._probes.take_batch()
        if batch:
            job = TierJob(self._probe_ids(), _PROBE, tuple(batch))
            self._probes.sent(batch, job.job_id)
            self._stats.probes_submitted += 1
            self._send(job, self._store.submit_probe)

    def _send(self, job: TierJob, send: Callable[[TierJob], None]) -> JobResult | None:
        submitted = time.perf_counter()
        self._jobs[job.job_id] = (job, submitted)
        self._in_flight(job, 1)
        try:
            send(job)
        except Exception as exc:
            self._stats.submit_errors += 1
            log.warning(
                "tier_submit_failed",
                tier=self._stats.name,
                job_id=job.job_id,
                kind=job.kind.value,
                error=repr(exc),
            )
            failed = JobResult(job.job_id, False, error=repr(exc))
            self._finish(job, failed, submitted)
            return failed
        return None

    def _in_flight(self, job: TierJob, delta: int) -> None:
        stats = self._stats
        stats.in_flight += delta
        if job.kind is _PUT:
            stats.puts_in_flight += delta
            stats.keys_in_flight_put += delta * len(job.keys)
        elif job.kind is _GET:
            stats.gets_in_flight += delta
            stats.keys_in_flight_get += delta * len(job.keys)

    def poll(self) -> list[tuple[TierJob, JobResult]]:
        """The puts and gets the store finished since the last call, with their results, in
        the order reported; their effects on this driver (counters, missing keys, probe
        answers) are applied. Probe results are applied to the probe answers and not returned.
        A result for a job this driver does not know is logged and dropped; a poll that
        raises is counted (``poll_errors``), logged, and returns nothing."""
        try:
            results = self._store.poll()
        except Exception as exc:
            self._stats.poll_errors += 1
            log.warning("tier_poll_failed", tier=self._stats.name, error=repr(exc))
            return []
        finished = []
        for result in results:
            entry = self._jobs.get(result.job_id)
            if entry is None:
                log.warning(
                    "tier_reported_unknown_job", tier=self._stats.name, job_id=result.job_id
                )
                continue
            job = entry[0]
            self._finish(job, result, entry[1])
            if job.kind is not _PROBE:
                finished.append((job, result))
        return finished

    def _finish(self, job: TierJob, result: JobResult, submitted: float) -> None:
        del self._jobs[job.job_id]
        self._in_flight(job, -1)
        if job.kind is _PROBE:
            self._finish_probe(job, result)
            return
        if result.seconds is not None:
            self._stats.add_busy(job.kind, submitted, submitted + result.seconds)
        latency = time.perf_counter() - submitted
        if job.kind is _PUT:
            self._stats.put_latency.observe(latency)
        else:
            self._stats.get_latency.observe(latency)
            if result.success:
                self.get_cost.observe(result.nbytes, latency)
        if self.on_job is not None:
            self.on_job(job, result, latency)
        if job.kind is _PUT:
            self._finish_put(job, result)
        else:
            self._finish_get(job, result)

    def _finish_put(self, job: TierJob, result: JobResult) -> None:
        stats = self._stats
        if result.success:
            stats.puts_ok += 1
            stats.keys_put += len(job.keys)
            stats.bytes_put += result.nbytes
            if self._missing:
                self._missing.difference_update(job.keys)
            if len(self._probes):
                self._probes.set_answer(job.keys, found=True)
        else:
            stats.puts_failed += 1
            log.info(
                "tier_put_failed",
                tier=stats.name,
                job_id=job.job_id,
                keys=len(job.keys),
                error=result.error,
            )

    def _finish_get(self, job: TierJob, result: JobResult) -> None:
        stats = self._stats
        loaded, failed = loaded_keys(job, result)
        if failed:
            self._missing.update(failed)
            self._probes.set_answer(failed, found=False)
            log.info(
                "tier_get_failed",
                tier=stats.name,
                job_id=job.job_id,
                keys=len(failed),
                error=result.error,
            )
        if result.success:
            stats.gets_ok += 1
        else:
            stats.gets_failed += 1
        stats.keys_promoted += len(loaded)
        stats.keys_failed_to_promote += len(failed)
        stats.bytes_got += result.nbytes

    def _finish_probe(self, job: TierJob, result: JobResult) -> None:
        if not result.success:
            self._stats.probes_failed += 1
            log.info(
                "tier_probe_failed", tier=self._stats.name, job_id=job.job_id, error=result.error
            )
        self._probes.resolve(job.job_id, job.keys, result.found, result.success)

    # -- request lifecycle (the owner decides when) ---------------------------------------
    def wants_every_chunk(self, ctx: ReqContext) -> bool:
        """Whether the tier is ``RequestAware`` and wants every chunk of ``ctx``."""
        return self._hooks is not None and self._hooks.wants_every_chunk(ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """``ctx`` used ``keys``: a recency hint for a ``RequestAware`` tier."""
        if self._hooks is not None:
            self._hooks.touch(keys, ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        """``ctx`` finished: drop the probe answers only it still wanted, and tell a
        ``RequestAware`` tier."""
        self._probes.forget_request(ctx)
        if self._hooks is not None:
            self._hooks.on_request_finished(ctx)

    def clear(self) -> None:
        """Forget probe answers and missing keys (after a reset drained and polled every job;
        the tier keeps its data and its counters)."""
        self._probes.clear()
        self._missing.clear()

    def has_pending_work(self) -> bool:
        """True while jobs are in flight or keys wait for the next probe."""
        return bool(self._jobs) or self._probes.pending

    def next_poll_at(self) -> float | None:
        """When the store's own work next wants a poll (``time.monotonic``; a time past:
        now), or ``None`` when it has none scheduled (:class:`ScheduledWork`). Plain reads:
        callable from an engine's idle timer thread too."""
        scheduled = self._scheduled
        return None if scheduled is None else scheduled()

    # -- the store's events and lifecycle (the owner decides when) ------------------------
    def take_events(self) -> list[TierEvent]:
        """The store's events since the last call (see ``EventSource``), counted into the
        stats as they pass: its own keys stored, removed and resident; not the other
        instances' blocks a ``PeerView`` also announces."""
        events = self._store.take_events()
        if events:
            self._count_events(events)
        return events

    def _count_events(self, events: list[TierEvent]) -> None:
        stats, own = self._stats, self.identity
        for event in events:
            if event.tier != own:
                continue
            if type(event) is Stored:
                stats.blocks_stored += len(event.keys)
                stats.resident_blocks += len(event.keys)
            elif type(event) is Removed:
                stats.blocks_removed += len(event.keys)
                stats.resident_blocks = max(0, stats.resident_blocks - len(event.keys))
            else:
                stats.resident_blocks = 0

    def drain(self) -> None:
        """Block until the store finished every job submitted; ``poll`` then reports them."""
        self._store.drain()

    def close(self) -> None:
        """Close the store (idempotent; jobs still queued fail). Raises what it raises."""
        self._store.close()
