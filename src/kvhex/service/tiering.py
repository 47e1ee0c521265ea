"""``TieringManager``: one host primary tier and ordered secondary tiers.

Store path (cascade): after a successful device -> host store, one put job per admitted
secondary tier, the host slots pinned once per tier until that tier's job is polled. Load path
(promotion): a secondary-tier hit reserves a host slot at lookup time (evicting if needed) and
answers ``HIT_PENDING``; at step end one batched get per (tier, request) fills the slots; the
keys become ``HIT`` once the job is polled. Tiers that cannot answer at once are probed
asynchronously (``RETRY`` first).

Events: the manager builds none. ``take_events`` concatenates the primary tier's events, then
each secondary tier's, in configured order: each tier owns the events of the storage it owns.

Request lifecycle is keyed by ``ReqContext`` identity. Secondary tiers hear "finished" only
after the last cascade for that request was submitted; a job's completion is processed with the
context the job carries, even when a newer request reuses the id.

Threading: every method runs on the scheduler thread. Only ``reset`` and ``shutdown`` block
(they drain tiers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import structlog

from kvhex.domain.backpressure import AdmissionPolicy, AlwaysAdmit
from kvhex.domain.events import TierEvent
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.primary import PrimaryStats, PrimaryTier, StorePlan
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult, OffloadPolicy
from kvhex.errors import TierError
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import RequestAware, TierStore
from kvhex.service.probes import ProbeCache

__all__ = ["TierStats", "TieringManager", "TieringStats"]

log = structlog.get_logger(__name__)

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY


@attrs.define
class TierStats:
    """Cumulative counters of one secondary tier, as seen by the manager."""

    name: str
    puts_submitted: int = 0
    puts_ok: int = 0
    puts_failed: int = 0
    keys_put: int = 0
    gets_submitted: int = 0
    gets_ok: int = 0
    gets_failed: int = 0
    keys_promoted: int = 0
    keys_failed_to_promote: int = 0
    promotion_slot_failures: int = 0
    probes_submitted: int = 0
    probes_failed: int = 0
    cascades_dropped: int = 0
    keys_dropped: int = 0
    submit_errors: int = 0
    poll_errors: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    put_seconds: float = 0.0
    """Time with at least one put running (jobs overlapping in time count once)."""
    get_seconds: float = 0.0
    """Time with at least one get running."""
    in_flight: int = 0
    _put_until: float = attrs.field(default=0.0, repr=False, eq=False)
    _get_until: float = attrs.field(default=0.0, repr=False, eq=False)

    def add_busy(self, kind: JobKind, start: float, end: float) -> None:
        """Add a job that ran from ``start`` to ``end`` to the busy time of its direction,
        counting only what does not overlap the jobs added before (results arrive about in
        completion order, so this is the union of the intervals)."""
        if kind is JobKind.PUT:
            self.put_seconds += max(0.0, end - max(start, self._put_until))
            self._put_until = max(self._put_until, end)
        elif kind is JobKind.GET:
            self.get_seconds += max(0.0, end - max(start, self._get_until))
            self._get_until = max(self._get_until, end)


@attrs.frozen
class TieringStats:
    """Primary-tier stats and one ``TierStats`` per secondary tier, in order."""

    primary: PrimaryStats
    tiers: tuple[TierStats, ...]
    active_requests: int
    jobs_in_flight: int


@attrs.define(eq=False)
class _Request:
    ctx: ReqContext
    pending_stores: int = 0
    finished: bool = False
    every_chunk_tiers: tuple[int, ...] = ()
    parked: list[OffloadKey] = attrs.field(factory=list)


@attrs.define(eq=False)
class _Tier:
    index: int
    store: TierStore
    admission: AdmissionPolicy
    hooks: RequestAware | None
    probes: ProbeCache
    missing: set[OffloadKey]
    stats: TierStats


class TieringManager:
    """Composes a primary tier and secondary tiers behind vLLM's manager contract."""

    def __init__(
        self,
        primary: PrimaryTier,
        tiers: Sequence[TierStore] = (),
        *,
        host: HostBuffer | None = None,
        admission: Callable[[int], AdmissionPolicy] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        """Args:
        primary: the host tier (its store threshold must be 1 when tiers exist: promotions
            and cascades cannot wait for repeated offers).
        tiers: secondary tiers, in lookup and event order.
        host: the host buffer the tiers read and write; kept alive until every tier closed.
        admission: builds the admission policy of tier ``i`` (default: always admit).
        names: tier names for stats and logs (default: each tier's ownership or ``tier{i}``).
        """
        if tiers and primary.store_threshold > 1:
            raise ValueError("store_threshold > 1 is not supported with secondary tiers")
        make_admission = admission or (lambda _i: AlwaysAdmit())
        self._primary = primary
        self._host = host
        self._tiers: list[_Tier] = []
        for i, store in enumerate(tiers):
            name = names[i] if names else (store.identity.ownership or f"tier{i}")
            hooks = store if isinstance(store, RequestAware) else None
            self._tiers.append(
                _Tier(i, store, make_admission(i), hooks, ProbeCache(), set(), TierStats(name))
            )
        self._jobs: dict[JobId, tuple[TierJob, _Tier, float]] = {}  # job, tier, submitted
        self._next_job = 0
        self._promotions: list[dict[ReqContext, tuple[list[OffloadKey], list[int]]]] = [
            {} for _ in self._tiers
        ]
        self._requests: dict[ReqContext, _Request] = {}
        self._hits_this_step: set[OffloadKey] = set()
        self._remember_hit = self._hits_this_step.add
        index, self._refs = primary.read_view()
        self._index_get = index.get
        self._polled = False
        self._closed = False

    # -- lookups -------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """``HIT`` readable in host memory; ``HIT_PENDING`` being written or promoted (a
        secondary hit starts its promotion here); ``RETRY`` some tier's answer is pending;
        ``MISS`` nowhere, or the host tier has no room to promote into."""
        if not self._polled:
            self._poll()
        try:
            slot = self._index_get(key)
        except TypeError:
            return self._primary.lookup(key)  # raises the typed InvalidKeyError
        if slot is not None:
            if self._refs[slot] < 0:
                return _PENDING
            # a promotion later this step must not evict a chunk already answered HIT
            self._remember_hit(key)
            return _HIT
        if not self._tiers:
            return _MISS
        retry = False
        allows = ctx.tier_filter.allows
        for tier in self._tiers:
            identity = tier.store.identity
            if not allows(identity.medium, identity.locality) or key in tier.missing:
                continue
            answer = tier.probes.lookup(key, ctx)
            if answer is _HIT:
                return self._start_promotion(tier, key, ctx)
            if answer is _RETRY:
                retry = True
        return _RETRY if retry else _MISS

    def _start_promotion(self, tier: _Tier, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        plan = self._primary.prepare_store([key], ctx, protect=self._hits_this_step)
        if plan is None or not plan.keys:
            tier.stats.promotion_slot_failures += 1
            return _MISS
        keys, slots = self._promotions[tier.index].setdefault(ctx, ([], []))
        keys.append(key)
        slots.append(plan.slots[0])
        return _PENDING

    # -- loads to the device (delegated) -------------------------------------------------
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]:
        """Pin host slots for a device load (keys answered ``HIT`` this step)."""
        return self._primary.prepare_load(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Unpin after the device load."""
        self._primary.complete_load(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Recency for the host tier, then every request-aware secondary tier."""
        self._primary.touch(keys, ctx)
        for tier in self._tiers:
            if tier.hooks is not None:
                tier.hooks.touch(keys, ctx)

    # -- stores from the device ----------------------------------------------------------
    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> StorePlan | None:
        """Reserve host slots for new keys (evicting if needed); ``None`` when full.

        For tiers that want every chunk of this request, offered keys the host tier already
        holds are cascaded to those tiers right away (or parked while their write is pending).
        """
        if not self._polled:
            self._poll()
        plan = self._primary.prepare_store(keys, ctx)
        if plan is None:
            return None
        request = self._request(ctx)
        if plan.keys:
            request.pending_stores += 1
        if request.every_chunk_tiers:
            new = set(plan.keys)
            present = [k for k in keys if k not in new]
            ready = [k for k in present if self._primary.lookup(k) is _HIT]
            request.parked.extend(k for k in present if self._primary.lookup(k) is _PENDING)
            if ready:
                self._cascade(ready, ctx, request.every_chunk_tiers)
        return plan

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Finish a device -> host store; on success cascade to every admitted tier.
        A failed store never cascades."""
        if success and self._tiers:
            admitted = self._admit(range(len(self._tiers)), len(keys))
            # complete and pin once per admitted tier in one pass over the keys
            done = self._primary.complete_store(keys, ctx, True, pin=len(admitted))
            if done and admitted:
                self._submit_puts(admitted, done, ctx)
        else:
            self._primary.complete_store(keys, ctx, success)
        request = self._requests.get(ctx)
        if request is not None:
            if request.pending_stores > 0:
                request.pending_stores -= 1
            self._maybe_finalize(request)

    def _admit(self, tier_indices: Sequence[int], n_keys: int) -> list[_Tier]:
        admitted = []
        for i in tier_indices:
            tier = self._tiers[i]
            if tier.admission.admit(n_keys):
                admitted.append(tier)
            else:
                tier.stats.cascades_dropped += 1
                tier.stats.keys_dropped += n_keys
        return admitted

    def _cascade(
        self, keys: Sequence[OffloadKey], ctx: ReqContext | None, tier_indices: Sequence[int]
    ) -> None:
        """Put ready host chunks ``keys`` into the given tiers (those admitting them)."""
        admitted = self._admit(tier_indices, len(keys))
        if admitted:
            self._primary.pin(keys, times=len(admitted))
            self._submit_puts(admitted, keys, ctx)

    def _submit_puts(
        self, admitted: list[_Tier], keys: Sequence[OffloadKey], ctx: ReqContext | None
    ) -> None:
        """One put job per tier over chunks already pinned once per tier."""
        slots = tuple(self._primary.slots_of(keys))
        job_keys = tuple(keys)
        for tier in admitted:
            self._next_job += 1
            job = TierJob(JobId(self._next_job), JobKind.PUT, job_keys, slots, ctx)
            tier.stats.puts_submitted += 1
            self._submit(tier, job, tier.store.submit_put)

    def _submit(self, tier: _Tier, job: TierJob, submit: Callable[[TierJob], None]) -> None:
        self._jobs[job.job_id] = (job, tier, time.perf_counter())
        tier.stats.in_flight += 1
        try:
            submit(job)
        except Exception as exc:
            tier.stats.submit_errors += 1
            log.warning(
                "tier_submit_failed",
                tier=tier.stats.name,
                job_id=job.job_id,
                kind=job.kind.value,
                error=repr(exc),
            )
            failed = JobResult(job.job_id, False, error=repr(exc))
            self._finish(tier, job, failed, self._jobs[job.job_id][2])

    def _new_job_id(self) -> JobId:
        self._next_job += 1
        return JobId(self._next_job)

    # -- request lifecycle ---------------------------------------------------------------
    def _request(self, ctx: ReqContext) -> _Request:
        request = self._requests.get(ctx)
        if request is None:
            request = self._requests[ctx] = _Request(ctx)
        return request

    def on_new_request(self, ctx: ReqContext) -> OffloadPolicy:
        """First sight of a request: ``REQUEST_LEVEL`` when some tier wants every chunk of it,
        else ``CHUNK_LEVEL``."""
        every = tuple(
            t.index for t in self._tiers if t.hooks is not None and t.hooks.wants_every_chunk(ctx)
        )
        self._requests[ctx] = _Request(ctx, every_chunk_tiers=every)
        return OffloadPolicy.REQUEST_LEVEL if every else OffloadPolicy.CHUNK_LEVEL

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No more submissions for ``ctx``. Secondary tiers are told once its last pending
        host store completed and its cascades were submitted."""
        request = self._request(ctx)
        request.finished = True
        self._maybe_finalize(request)

    def _maybe_finalize(self, request: _Request) -> None:
        if not request.finished or request.pending_stores > 0 or request.parked:
            return
        ctx = request.ctx
        if any(ctx in pending for pending in self._promotions):
            return  # its promotions go out at step end; then tiers hear "finished"
        del self._requests[ctx]
        for tier in self._tiers:
            tier.probes.forget_request(ctx)
            if tier.hooks is not None:
                tier.hooks.on_request_finished(ctx)

    # -- steps ---------------------------------------------------------------------------
    def on_schedule_end(self) -> None:
        """Once per scheduler step: poll finished jobs, submit this step's promotions (one
        get per tier and request) and probes (one per tier), retry parked cascades."""
        if not self._polled:
            self._poll()
        self._polled = False
        self._hits_this_step.clear()
        for tier, pending in zip(self._tiers, self._promotions, strict=True):
            for ctx, (keys, slots) in pending.items():
                job = TierJob(self._new_job_id(), JobKind.GET, tuple(keys), tuple(slots), ctx)
                tier.stats.gets_submitted += 1
                self._submit(tier, job, tier.store.submit_get)
            pending.clear()
        for request in list(self._requests.values()):
            if request.parked:
                self._retry_parked(request)
            else:
                self._maybe_finalize(request)
        for tier in self._tiers:
            batch = tier.probes.take_batch()
            if batch:
                job = TierJob(self._new_job_id(), JobKind.PROBE, tuple(batch))
                tier.probes.sent(batch, job.job_id)
                tier.stats.probes_submitted += 1
                self._submit(tier, job, tier.store.submit_probe)

    def _retry_parked(self, request: _Request) -> None:
        ready, still = [], []
        for key in request.parked:
            state = self._primary.lookup(key)
            if state is _HIT:
                ready.append(key)
            elif state is _PENDING:
                still.append(key)
        request.parked = still
        if ready:
            self._cascade(ready, request.ctx, request.every_chunk_tiers)
        self._maybe_finalize(request)

    def _poll(self) -> None:
        self._polled = True
        for tier in self._tiers:
            try:
                results = tier.store.poll()
            except Exception as exc:
                tier.stats.poll_errors += 1
                log.warning("tier_poll_failed", tier=tier.stats.name, error=repr(exc))
                continue
            for result in results:
                entry = self._jobs.get(result.job_id)
                if entry is None or entry[1] is not tier:
                    log.warning(
                        "tier_reported_unknown_job", tier=tier.stats.name, job_id=result.job_id
                    )
                    continue
                self._finish(tier, entry[0], result, entry[2])

    def _finish(self, tier: _Tier, job: TierJob, result: JobResult, submitted: float) -> None:
        """Apply one job's result with the context the job carries."""
        del self._jobs[job.job_id]
        tier.stats.in_flight -= 1
        stats = tier.stats
        if result.seconds is not None and job.kind is not JobKind.PROBE:
            stats.add_busy(job.kind, submitted, submitted + result.seconds)
        if job.kind is JobKind.PUT:
            self._primary.unpin(job.keys)
            tier.admission.on_completed(result)
            if result.success:
                stats.puts_ok += 1
                stats.keys_put += len(job.keys)
                stats.bytes_put += result.nbytes
                if tier.missing:
                    tier.missing.difference_update(job.keys)
                if len(tier.probes):
                    tier.probes.set_answer(job.keys, found=True)
            else:
                stats.puts_failed += 1
                log.info(
                    "tier_put_failed",
                    tier=stats.name,
                    job_id=job.job_id,
                    keys=len(job.keys),
                    error=result.error,
                )
        elif job.kind is JobKind.GET:
            if result.success:
                ok, failed = list(job.keys), []
            elif result.ok_keys is not None:
                ok = [k for k in job.keys if k in result.ok_keys]
                failed = [k for k in job.keys if k not in result.ok_keys]
            else:
                ok, failed = [], list(job.keys)
            if ok:
                self._primary.complete_store(ok, job.ctx, True)
            if failed:
                self._primary.complete_store(failed, job.ctx, False)
                tier.missing.update(failed)
                tier.probes.set_answer(failed, found=False)
                log.info(
                    "tier_get_failed",
                    tier=stats.name,
                    job_id=job.job_id,
                    keys=len(failed),
                    error=result.error,
                )
            stats.gets_ok += 1 if result.success else 0
            stats.gets_failed += 0 if result.success else 1
            stats.keys_promoted += len(ok)
            stats.keys_failed_to_promote += len(failed)
            stats.bytes_got += result.nbytes
        else:
            if not result.success:
                stats.probes_failed += 1
                log.info(
                    "tier_probe_failed", tier=stats.name, job_id=job.job_id, error=result.error
                )
            tier.probes.resolve(job.job_id, job.keys, result.found, result.success)

    # -- events, state, stats ------------------------------------------------------------
    def take_events(self) -> list[TierEvent]:
        """The primary tier's events, then each secondary tier's, in configured order."""
        events = self._primary.take_events()
        for tier in self._tiers:
            events.extend(tier.store.take_events())
        return events

    def has_pending_work(self) -> bool:
        """True while jobs are in flight or step-end work is queued (keep stepping)."""
        return bool(
            self._jobs
            or any(self._promotions)
            or any(r.parked for r in self._requests.values())
            or any(t.probes.pending for t in self._tiers)
        )

    def reset(self) -> None:
        """Drain every tier and apply the results, drop promotions not yet submitted, reset
        the host tier (announcing ``Cleared``). Active requests stay known (their pending
        stores are forgotten); finished ones are finalized. Secondary tiers keep their data.
        """
        for tier in self._tiers:
            tier.store.drain()
        self._polled = False
        self._poll()
        if self._jobs:
            names = sorted({tier.stats.name for _, tier, _ in self._jobs.values()})
            raise TierError(
                f"{len(self._jobs)} jobs still unreported after drain", tier=",".join(names)
            )
        for pending in self._promotions:
            pending.clear()
        self._hits_this_step.clear()
        for request in list(self._requests.values()):
            request.pending_stores = 0
            request.parked.clear()
            self._maybe_finalize(request)
        for tier in self._tiers:
            tier.probes.clear()
            tier.missing.clear()
            tier.admission.reset()
        self._primary.reset()
        self._polled = False

    def shutdown(self) -> None:
        """Close tiers in reverse order. If any fails, raise ``TierError`` naming them and
        keep the host buffer referenced (a failed tier may still write into it)."""
        if self._closed:
            return
        failed: list[tuple[str, str]] = []
        for tier in reversed(self._tiers):
            try:
                tier.store.close()
            except Exception as exc:
                failed.append((tier.stats.name, repr(exc)))
                log.error("tier_close_failed", tier=tier.stats.name, error=repr(exc))
        if failed:
            raise TierError(
                "shutdown failed; host buffer kept: " + "; ".join(f"{n}: {e}" for n, e in failed),
                tier=",".join(name for name, _ in failed),
            )
        self._closed = True
        close: Any = getattr(self._host, "close", None)
        self._host = None
        if callable(close):
            close()

    @property
    def host(self) -> HostBuffer | None:
        """The host buffer, until a clean shutdown released it."""
        return self._host

    @property
    def primary(self) -> PrimaryTier:
        """The host primary tier."""
        return self._primary

    def stats(self) -> TieringStats:
        """Snapshot of the primary tier's and every secondary tier's counters."""
        tiers = tuple(attrs.evolve(t.stats) for t in self._tiers)
        return TieringStats(self._primary.stats(), tiers, len(self._requests), len(self._jobs))
