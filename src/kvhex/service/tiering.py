"""``TieringManager``: one host primary tier and ordered secondary tiers.

Store path (cascade): after a successful device -> host store, one put job per admitted
secondary tier, the host slots pinned once per tier until that tier's job is polled. Load path
(promotion): a secondary-tier hit answers ``HIT_PENDING`` and is read into a reserved host slot
at step end, by ``Promotions``. Tiers that cannot answer at once are probed asynchronously
(``RETRY`` first). Each tier's own bookkeeping (jobs, probes, failed keys, counters, faults, its
events, drain and close) is its ``TierDriver``'s, and load-or-recompute scans are the
``LoadDecider``'s; the manager applies the host side of each job.

Events: the manager builds none. ``take_events`` concatenates the primary tier's events, then
each secondary tier's, in configured order: each tier owns the events of the storage it owns.

Request lifecycle is keyed by ``ReqContext`` identity. Secondary tiers hear "finished" only
after the last cascade for that request was submitted; a job's completion is processed with the
context the job carries, even when a newer request reuses the id.

Threading: every method runs on the scheduler thread. Only ``reset`` and ``shutdown`` block
(they drain tiers).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence, Sized
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from kvhex.domain.backpressure import AdmissionPolicy, AlwaysAdmit, EmaBackpressure
from kvhex.domain.cost import LoadMode, TierCost
from kvhex.domain.events import TierEvent
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.primary import PrimaryTier, StorePlan, native_module
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult, OffloadPolicy, TierIdentity
from kvhex.errors import StateError, TierError
from kvhex.ports.capabilities import Closeable
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.service.loading import LoadDecider
from kvhex.service.promotions import Promotions
from kvhex.service.stats import EventStats, TieringStats
from kvhex.service.tier_driver import TierDriver

if TYPE_CHECKING:
    from kvhex.domain._hostslots import HitPath

log = structlog.get_logger(__name__)

_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
_PENDING = LookupResult.HIT_PENDING
_CHUNK_LEVEL = OffloadPolicy.CHUNK_LEVEL  # (per request: a global, not an enum lookup)


@attrs.define(eq=False)
class _Tier:
    index: int
    driver: TierDriver
    admission: AdmissionPolicy


class _Request:
    """What the manager tracks of an active request (one per request, built per
    ``on_new_request``: a plain class, a third of attrs' keyword ``__init__``)."""

    __slots__ = ("ctx", "every_chunk_tiers", "finished", "parked", "pending_stores")

    def __init__(self, ctx: ReqContext, every_chunk_tiers: tuple[_Tier, ...] = ()) -> None:
        self.ctx = ctx
        self.pending_stores = 0
        self.finished = False
        self.every_chunk_tiers = every_chunk_tiers  # tiers that want every chunk of it
        self.parked: list[OffloadKey] = []  # present chunks whose cascade waits for a write


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
        loading: LoadDecider | None = None,
    ) -> None:
        """Args:
        primary: the host tier (its store threshold must be 1 when tiers exist: promotions
            and cascades cannot wait for repeated offers).
        tiers: secondary tiers, in lookup and event order.
        host: the host buffer the tiers read and write; kept alive until every tier closed.
        admission: builds the admission policy of tier ``i`` (default: always admit).
        names: tier names for stats and logs (default: each tier's ownership or ``tier{i}``).
        loading: load-or-recompute decisions for secondary-tier hits (default: ``OFF``,
            every hit is promoted at its first lookup).
        """
        if tiers and primary.store_threshold > 1:
            raise ValueError("store_threshold > 1 is not supported with secondary tiers")
        make_admission = admission or (lambda _i: AlwaysAdmit())
        self._primary = primary
        self._host = host
        self._stores = tuple(tiers)
        self._next_job = 0
        self._tiers: list[_Tier] = []
        for i, store in enumerate(tiers):
            name = names[i] if names else (store.identity.ownership or f"tier{i}")
            driver = TierDriver(store, name, probe_ids=self._new_job_id)
            self._tiers.append(_Tier(i, driver, make_admission(i)))
        self._loading = loading or LoadDecider(LoadMode.OFF)
        self._scans = self._loading.open_scans  # read-only, live: tested per host hit
        self._declined = self._loading.host_declined  # read-only, live: tested per host hit
        self._host_hits = 0  # up to the last step end (this step's: _hits_this_step)
        self._host_misses = 0  # (and those native hit paths answered: _hit_paths)
        self._hit_paths: list[HitPath] = []
        self._requests: dict[ReqContext, _Request] = {}
        self._hits_this_step: set[OffloadKey] = set()
        self._remember_hit = self._hits_this_step.add
        self._promotions = Promotions(
            primary,
            [t.driver for t in self._tiers],
            self._loading,
            protect=self._hits_this_step,
            new_job_id=self._new_job_id,
        )
        self._lookup_tiers = self._promotions.lookup
        index, self._refs = primary.read_view()
        self._index_get = index.get
        # not empty once this step's tiers were polled, until the step ends (with no tier to
        # poll, until a reset or shutdown): a list, so that a native hit path can read it
        self._polled: list[bool] = []
        self._closed = False

    # -- lookups -------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """``HIT`` readable in host memory; ``HIT_PENDING`` being written or promoted (a
        secondary hit starts its promotion here); ``RETRY`` some tier's answer is pending;
        ``MISS`` nowhere, the host tier has no room to promote into, or the request's plan
        recomputes it."""
        if not self._polled:
            self._poll("lookup")
        try:
            slot = self._index_get(key)
        except TypeError:
            return self._primary.lookup(key)  # raises the typed InvalidKeyError
        if slot is not None:
            if self._scans:  # a request's scan is open (load decisions): note the key
                self._loading.note_host(key, ctx)
            if self._declined and key in self._declined.get(ctx, ()):
                return _MISS  # its plan recomputes this chunk (cheaper than a load's step)
            if self._refs[slot] < 0:
                self._host_misses += 1
                return _PENDING
            # a promotion later this step must not evict a chunk already answered HIT (and
            # the hits are counted from this set at step end: nothing to count here)
            self._remember_hit(key)
            return _HIT
        self._host_misses += 1
        return self._lookup_tiers(key, ctx) if self._tiers else _MISS

    def hit_path(
        self,
        fallback: Callable[[OffloadKey, Any], Any],
        hit: object,
        miss: object,
        idle: Sequence[Sized] = (),
    ) -> HitPath | None:
        """A native callable ``path(key, engine_ctx)`` for an engine adapter's per-chunk
        lookups, answering without a Python frame where :meth:`lookup` would answer ``HIT``
        from host memory (``hit``, the key remembered and counted as :meth:`lookup` does) or,
        with no secondary tier, ``MISS`` for a key host memory does not hold (``miss``,
        counted as a host miss). Otherwise it returns ``fallback(key, engine_ctx)``, which
        must call :meth:`lookup`. ``None`` where the native module was not built.

        It answers only while every container of ``idle`` (the adapter's own reasons to see
        a lookup) is empty, and so are this manager's open load scans and declined host hits
        (their requests' lookups note or refuse host hits): a host hit's or miss's answer is
        then the same for every request. And only once no poll is due: after the step's first
        poll until the step ends (with no secondary tier, whose poll would find nothing,
        until a reset), and never after a shutdown, so the path never skips a poll nor
        answers for a shut manager."""
        module, _ = native_module()
        if module is None:
            return None
        index, refs = self._primary.read_view()
        path: HitPath = module.HitPath(
            fallback,
            index,
            refs,
            self._hits_this_step,
            self._polled,
            (self._scans, self._declined, *idle),
            hit,
            None if self._tiers else miss,
        )
        self._hit_paths.append(path)  # (its misses are counted in stats)
        return path

    def plan_ahead(
        self, runs: Sequence[Sequence[OffloadKey]], ctx: ReqContext, *, busy: bool = False
    ) -> None:
        """The scheduler is about to look up ``runs`` for ``ctx`` (one run of keys per KV
        group, in prefix order): decide load or recompute now where every answer is known,
        so its lookups answer as decided and the request waits no step for a plan
        (``Promotions.plan_ahead``). ``busy``: other requests are in the engine, whose steps
        run anyway, so a load's steps cost no engine time (``LoadDecider.busy``)."""
        if not self._polled:
            self._poll("plan_ahead")
        self._loading.busy = busy
        self._promotions.plan_ahead(runs, ctx, self.slot_bytes)

    def load_source(self, key: OffloadKey, ctx: ReqContext) -> TierIdentity | None:
        """The secondary tier whose promotion brought ``key`` into host memory for ``ctx``
        (asked after a lookup answered ``HIT``), or ``None``: host memory held it already, or
        the promotion failed. Known until the request is finalized or the engine reset."""
        return self._promotions.source(key, ctx)

    def lookup_host(self, key: OffloadKey, ctx: ReqContext | None = None) -> LookupResult:
        """``key`` in host memory alone (no tier asked, no promotion, nothing counted);
        ``ctx`` is not used (the signature is ``lookup``'s)."""
        if self._closed:
            raise refused("lookup")
        return self._primary.lookup(key)

    def host_keys(self) -> list[OffloadKey]:
        """The keys host memory holds readable now (not being written), in no order."""
        index, refs = self._primary.read_view()
        return [key for key, slot in index.items() if refs[slot] >= 0]

    # -- loads to the device (delegated) -------------------------------------------------
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]:
        """Pin host slots for a device load (keys answered ``HIT`` this step)."""
        if self._closed:
            raise refused("prepare_load")
        return self._primary.prepare_load(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Unpin after the device load."""
        if self._closed:
            raise refused("complete_load")
        self._primary.complete_load(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Recency for the host tier, then every request-aware secondary tier."""
        if self._closed:
            raise refused("touch")
        self._primary.touch(keys, ctx)
        for tier in self._tiers:
            tier.driver.touch(keys, ctx)

    # -- stores from the device ----------------------------------------------------------
    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> StorePlan | None:
        """Reserve host slots for new keys (evicting if needed); ``None`` when full.

        For tiers that want every chunk of this request, offered keys the host tier already
        holds are cascaded to those tiers right away (or parked while their write is pending).
        """
        if not self._polled:
            self._poll("prepare_store")
        plan = self._primary.prepare_store(keys, ctx)
        if plan is None or not self._tiers:  # (no tier waits for a request's stores)
            return plan
        request = self._request(ctx)
        if plan.keys:
            request.pending_stores += 1
        if request.every_chunk_tiers:
            new = set(plan.keys)
            self._cascade_present(request, [k for k in keys if k not in new])
        return plan

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Finish a device -> host store; on success cascade to every admitted tier.
        A failed store never cascades."""
        if self._closed:
            raise refused("complete_store")
        if not self._tiers:
            self._primary.complete_store(keys, ctx, success)
            return
        if success:
            admitted = self._admit(self._tiers, len(keys))
            # complete and pin once per admitted tier in one pass over the keys
            done = self._primary.complete_store(keys, ctx, True, pin=len(admitted))
            if done and admitted:
                self._submit_puts(admitted, done, ctx)
        else:
            self._primary.complete_store(keys, ctx, success)
        if (request := self._requests.get(ctx)) is not None:
            request.pending_stores = max(0, request.pending_stores - 1)
            self._maybe_finalize(request)

    def _admit(self, tiers: Sequence[_Tier], n_keys: int) -> list[_Tier]:
        admitted = []
        for tier in tiers:
            if tier.admission.admit(n_keys):
                admitted.append(tier)
            else:
                tier.driver.count_dropped(n_keys)
        return admitted

    def _cascade_present(self, request: _Request, keys: Sequence[OffloadKey]) -> None:
        """Put the chunks of ``keys`` the host tier holds into the request's every-chunk tiers
        (those admitting them); park those still being written until a later step end."""
        ready = []
        for key in keys:
            state = self._primary.lookup(key)
            if state is _HIT:
                ready.append(key)
            elif state is _PENDING:
                request.parked.append(key)
        if ready and (admitted := self._admit(request.every_chunk_tiers, len(ready))):
            self._primary.pin(ready, times=len(admitted))
            self._submit_puts(admitted, ready, request.ctx)

    def _submit_puts(self, tiers: list[_Tier], keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """One put job per tier over chunks already pinned once per tier."""
        slots = tuple(self._primary.slots_of(keys))
        job_keys = tuple(keys)
        for tier in tiers:
            self._submit(tier, TierJob(self._new_job_id(), JobKind.PUT, job_keys, slots, ctx))

    def _submit(self, tier: _Tier, job: TierJob) -> None:
        failed = tier.driver.submit(job)
        if failed is not None:  # the store refused it: release what the job held at once
            self._finish(tier, job, failed)

    def _new_job_id(self) -> JobId:
        self._next_job += 1
        return JobId(self._next_job)

    # -- request lifecycle ---------------------------------------------------------------
    def _request(self, ctx: ReqContext) -> _Request:
        if (request := self._requests.get(ctx)) is None:
            request = self._requests[ctx] = _Request(ctx)
        return request

    def on_new_request(self, ctx: ReqContext) -> OffloadPolicy:
        """First sight of a request: ``REQUEST_LEVEL`` when some tier wants every chunk of it,
        else ``CHUNK_LEVEL``."""
        if self._closed:
            raise refused("on_new_request")
        every = (
            tuple(t for t in self._tiers if t.driver.wants_every_chunk(ctx)) if self._tiers else ()
        )
        self._requests[ctx] = _Request(ctx, every)
        return OffloadPolicy.REQUEST_LEVEL if every else _CHUNK_LEVEL

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No more submissions for ``ctx``. Secondary tiers are told once its last pending
        host store completed and its cascades were submitted (with no secondary tier nothing
        waits for them: the request is finalized now)."""
        if self._closed:
            raise refused("on_request_finished")
        request = self._request(ctx)
        request.finished = True
        self._maybe_finalize(request)

    def _maybe_finalize(self, request: _Request) -> None:
        if not request.finished or request.pending_stores > 0 or request.parked:
            return
        ctx = request.ctx
        tiers = self._tiers
        if tiers and self._promotions.waiting(ctx):
            return  # its promotions go out at step end; then tiers hear "finished"
        del self._requests[ctx]
        self._loading.forget(ctx)
        if tiers:  # (promotions come from tiers: with none, nothing to forget)
            self._promotions.forget(ctx)
            for tier in tiers:
                tier.driver.on_request_finished(ctx)

    # -- steps ---------------------------------------------------------------------------
    def on_schedule_end(self) -> None:
        """Once per scheduler step: poll finished jobs, submit this step's promotions (one
        get per tier and request) and probes (one per tier), retry parked cascades."""
        if not self._polled:
            self._poll("on_schedule_end")
        if self._tiers:  # the next step polls them first (with none, no poll is due)
            self._polled.clear()
        if self._scans:
            self._promotions.plan(self.slot_bytes)
        self._host_hits += len(self._hits_this_step)
        self._hits_this_step.clear()
        if not self._tiers:  # nothing to send, park or wait for: requests finalize at once
            return
        self._promotions.send()
        for request in list(self._requests.values()):
            if request.parked:
                parked, request.parked = request.parked, []
                self._cascade_present(request, parked)
            self._maybe_finalize(request)
        for tier in self._tiers:
            tier.driver.submit_probes()

    def _poll(self, operation: str) -> None:
        if self._closed:  # shutdown left _polled empty: every polling call lands here
            raise refused(operation)
        if not self._polled:
            self._polled.append(True)
        for tier in self._tiers:
            for job, result in tier.driver.poll():
                self._finish(tier, job, result)

    def _finish(self, tier: _Tier, job: TierJob, result: JobResult) -> None:
        """The host tier's side of a finished put or get, with the context the job carries."""
        if job.kind is JobKind.PUT:
            self._primary.unpin(job.keys)
            tier.admission.on_completed(result)
        else:
            self._promotions.finish(tier.index, job, result)

    # -- events, state, stats ------------------------------------------------------------
    def take_events(self) -> list[TierEvent]:
        """The primary tier's events, then each secondary tier's, in configured order."""
        events = self._primary.take_events()
        for tier in self._tiers:
            if taken := tier.driver.take_events():
                events.extend(taken)
        return events

    def has_pending_work(self) -> bool:
        """True while jobs are in flight, step-end work is queued, or a tier's own work
        (``ScheduledWork``: a peer view's scan) is due or in flight (keep stepping)."""
        tiers = self._promotions.queued or any(t.driver.has_pending_work() for t in self._tiers)
        if tiers or any(r.parked for r in self._requests.values()):
            return True
        due = self.next_poll_at()
        return due is not None and due <= time.monotonic()

    def next_poll_at(self) -> float | None:
        """The earliest time (``time.monotonic``) a tier's own work wants a poll, or
        ``None`` when no tier has any scheduled (see ``ScheduledWork``): an engine that
        stops stepping while idle steps again then. Plain reads: callable from an idle
        timer's thread."""
        due = None
        for tier in self._tiers:
            at = tier.driver.next_poll_at()
            if at is not None and (due is None or at < due):
                due = at
        return due

    def reset(self) -> int:
        """Drain every tier and apply the results, drop promotions not yet submitted, reset
        the host tier (announcing ``Cleared``). Active requests stay known (their pending
        stores are forgotten); finished ones are finalized. Secondary tiers keep their data.

        Returns the host slots that the engine's device copies may still write or read
        (write-pending for a device store, pinned for a device load): until those copies
        finished, the engine must keep promotions out of freed slots.
        """
        for tier in self._tiers:
            tier.driver.drain()
        self._poll("reset")
        if unreported := sum(t.driver.in_flight for t in self._tiers):
            names = ",".join(sorted(t.driver.name for t in self._tiers if t.driver.in_flight))
            raise TierError(f"{unreported} jobs still unreported after drain", tier=names)
        host = self._primary.stats()  # tiers drained: every pin left is a device load's
        device_busy = host.pending - self._promotions.reserved + host.pinned
        self._host_hits += len(self._hits_this_step)
        self._hits_this_step.clear()
        self._promotions.clear()
        self._loading.clear()
        for tier in self._tiers:
            tier.driver.clear()
            tier.admission.reset()
        for request in list(self._requests.values()):
            request.pending_stores = 0
            request.parked.clear()
            self._maybe_finalize(request)
        self._primary.reset()
        self._polled.clear()
        return device_busy

    def shutdown(self) -> None:
        """Close tiers in reverse order. If any fails, raise ``TierError`` naming them and
        keep the host buffer referenced (a failed tier may still write into it)."""
        if self._closed:
            return
        failed: list[tuple[str, str]] = []
        for tier in reversed(self._tiers):
            try:
                tier.driver.close()
            except Exception as exc:
                failed.append((tier.driver.name, repr(exc)))
                log.error("tier_close_failed", tier=tier.driver.name, error=repr(exc))
        if failed:
            detail = "; ".join(f"{name}: {error}" for name, error in failed)
            names = ",".join(name for name, _ in failed)
            raise TierError(f"shutdown failed; host buffer kept: {detail}", tier=names)
        self._closed = True
        self._polled.clear()  # the next lookup, store or step polls, and is refused (and a
        # native hit path answers no more)
        self._host_hits += len(self._hits_this_step)
        self._hits_this_step.clear()
        host: object = self._host  # any buffer may hold memory to give back: ask it
        self._host = None
        if isinstance(host, Closeable):
            host.close()

    def observe_jobs(self, observer: Callable[[int, TierJob, JobResult, float], None]) -> None:
        """Call ``observer(tier_index, job, result, latency_s)`` for every put and get a
        secondary tier finishes from now on (latency: submission to the result reaching the
        manager). One observer; a second call replaces the first."""
        for tier in self._tiers:
            tier.driver.on_job = functools.partial(observer, tier.index)

    @property
    def slot_bytes(self) -> int:
        """Bytes per host slot (one chunk); 0 without a host buffer."""
        return self._host.slot_bytes if self._host is not None else 0

    def set_load_mode(self, mode: LoadMode) -> None:
        """Switch load-or-recompute decisions (``OFF`` promotes every hit at its first
        lookup); decisions already taken for active requests stand."""
        self._promotions.set_load_mode(mode)

    def set_geometry(self, geometry: KvGeometry | None) -> None:
        """Load decisions count the tokens a key saves from ``geometry`` from now on."""
        self._loading.set_geometry(geometry)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The host engine computed ``tokens`` tokens in ``seconds`` (one step)."""
        self._loading.observe_prefill(tokens, seconds)

    def observe_load_wait(self, ctx: ReqContext, seconds: float, *, promoted: bool) -> None:
        """``ctx`` waited ``seconds`` from its lookup until its load was done, its
        prefix loaded from host memory alone or ``promoted`` from a secondary tier: what
        load decisions count a load's engine steps as (``LoadWaits``)."""
        self._loading.observe_wait(ctx, seconds, promoted=promoted)

    def get_cost(self, index: int) -> TierCost:
        """Secondary tier ``index``'s fitted cost of gets (live: load decisions read it; an
        operator or a test reads it, or seeds it with ``observe``)."""
        return self._tiers[index].driver.get_cost

    @property
    def tier_stores(self) -> tuple[TierStore, ...]:
        """The secondary tiers, in lookup order (the same order as ``stats().tiers``)."""
        return self._stores

    def stats(self, events: EventStats | None = None) -> TieringStats:
        """Snapshot of the primary tier's and every secondary tier's counters (with the
        event pipeline's ``events`` counts, when the caller has them)."""
        tiers = tuple(t.driver.snapshot(admission_ema_s=_ema(t.admission)) for t in self._tiers)
        in_flight = sum(t.driver.in_flight for t in self._tiers)
        hits = self._host_hits + len(self._hits_this_step)
        loading = self._loading
        return TieringStats(
            self._primary.stats(),
            tiers,
            len(self._requests),
            in_flight,
            hits + self._host_misses + sum(path.misses for path in self._hit_paths),
            hits,
            loading.snapshot(),
            loading.prefill.tokens_per_s,
            loading.mode,
            events if events is not None else EventStats(),
        )


def _ema(admission: AdmissionPolicy) -> float | None:
    return admission.ema_s if isinstance(admission, EmaBackpressure) else None


def refused(operation: str) -> StateError:
    """The error of ``operation`` called after the engine was shut down."""
    return StateError(operation, b"", "refused: the engine was shut down")
