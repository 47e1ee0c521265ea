"""``Promotions``: chunks read back from secondary tiers into kvhex's host tier.

The load path of tiering, kept apart from ``TieringManager`` so that the manager is the host
side (host lookups, stores and their cascades, the request lifecycle) and this module the one
place that reads secondary tiers. A key host memory lacks is asked of each tier the request
allows, in order; the first hit reserves a host slot at lookup time (evicting if needed, never
a chunk already answered ``HIT`` this step) and answers ``HIT_PENDING``, unless load-or-recompute
decisions (``LoadDecider``) say otherwise or plan it at step end. At step end every request's
reservations on one tier go out as one batched get, so a tier sees a few large reads per step
rather than one per chunk; once the get is polled its slots become readable, or are freed for
the keys it failed to load. Which tier each key came from is kept per request (``source``)
until the request is forgotten.

Threading: scheduler thread only, called by ``TieringManager``; nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvhex.domain.cost import LoadMode
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.primary import PrimaryTier
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult, TierIdentity
from kvhex.service.loading import LoadDecider
from kvhex.service.tier_driver import TierDriver, loaded_keys

_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
_PENDING, _RETRY = LookupResult.HIT_PENDING, LookupResult.RETRY


class Promotions:
    """Secondary-tier lookups, the host slots their hits reserve, the gets that fill them."""

    __slots__ = (
        "_drivers",
        "_loading",
        "_new_job_id",
        "_origins",
        "_primary",
        "_protect",
        "_queued",
        "_scanning",
        "_tiers",
    )

    def __init__(
        self,
        primary: PrimaryTier,
        drivers: Sequence[TierDriver],
        loading: LoadDecider,
        *,
        protect: set[OffloadKey],
        new_job_id: Callable[[], JobId],
    ) -> None:
        """Args:
        primary: the host tier the slots are reserved in.
        drivers: the secondary tiers, in lookup order (a tier's index is its position).
        loading: load-or-recompute decisions for the hits (shared with the owner).
        protect: the keys answered ``HIT`` this step (live: the owner fills and clears it);
            a reservation never evicts one of them.
        new_job_id: the id of each get (shared with the owner's other jobs).
        """
        self._primary = primary
        self._drivers = tuple(drivers)
        self._tiers = tuple(enumerate(self._drivers))  # (index, driver): no per-lookup tuples
        self._loading = loading
        self._scanning = loading.active and bool(self._drivers)
        self._protect = protect
        self._new_job_id = new_job_id
        self._queued: tuple[dict[ReqContext, tuple[list[OffloadKey], list[int]]], ...] = tuple(
            {} for _ in self._drivers
        )
        """Per tier: this step's promotions (keys, reserved slots) per request."""
        self._origins: dict[ReqContext, dict[OffloadKey, int]] = {}
        """Per request: the tier index each promoted key is being or was loaded from."""

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """``key``, which host memory lacks, in the tiers ``ctx`` allows, in order: the first
        hit starts its promotion (``HIT_PENDING``; ``MISS`` without host room), unless load
        decisions answer otherwise; else ``RETRY`` while some tier's answer is pending, or
        ``MISS``."""
        retry = False
        allows = ctx.tier_filter.allows
        for tier, driver in self._tiers:
            identity = driver.identity
            if not allows(identity.medium, identity.locality):
                continue
            answer = driver.lookup(key, ctx)
            if answer is _HIT:
                if self._scanning:  # load decisions: as decided, or planned at step end
                    answer = self._loading.note_tier(key, ctx, tier)
                return self.start(tier, key, ctx) if answer is _HIT else answer
            if answer is _RETRY:
                retry = True
        if self._scanning:
            self._loading.close_scan(ctx, probing=retry)
        return _RETRY if retry else _MISS

    def plan_ahead(
        self, runs: Sequence[Sequence[OffloadKey]], ctx: ReqContext, slot_bytes: int
    ) -> None:
        """Decide load or recompute for ``ctx`` before the scheduler looks it up, where every
        answer is known now (host memory, tiers with their own index, probes answered):
        ``runs`` are the keys the scheduler will look up, one run per KV group, each in
        prefix order (a run ends at its first miss). Nothing when decisions are off, the
        request decided already, or a tier must still be probed: the lookups then go as
        before (a plan at step end, where a scan needs one)."""
        if not self._loading.active or self._loading.has_decided(ctx):
            return  # its decisions stand (a request waiting for its promotion asks again)
        allows = ctx.tier_filter.allows
        slot_of = self._primary.slot_of
        keys: list[OffloadKey] = []
        tiers: list[int | None] = []
        for run in runs:
            for key in run:
                if slot_of(key) is not None:
                    keys.append(key)
                    tiers.append(None)
                    continue
                found = None
                for tier, driver in self._tiers:
                    identity = driver.identity
                    if not allows(identity.medium, identity.locality):
                        continue
                    held = driver.peek(key)
                    if held is None:
                        return  # only a probe can tell: planned at step end
                    if held:
                        found = tier
                        break
                if found is None:
                    break
                keys.append(key)
                tiers.append(found)
        if keys:
            estimates = [driver.get_estimate(slot_bytes) for driver in self._drivers]
            self._loading.decide_now(ctx, keys, tiers, estimates, slot_bytes)

    def set_load_mode(self, mode: LoadMode) -> None:
        """Switch the load decisions' mode (see ``LoadDecider.set_mode``)."""
        self._loading.set_mode(mode)
        self._scanning = self._loading.active and bool(self._drivers)

    def start(self, tier: int, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Reserve a host slot for ``key``, a hit on tier ``tier``, to be filled at step end:
        ``HIT_PENDING``, or ``MISS`` when the host tier has no room (counted on the tier)."""
        plan = self._primary.prepare_store([key], ctx, protect=self._protect)
        if plan is None or not plan.keys:
            self._drivers[tier].count_no_room()
            return _MISS
        keys, slots = self._queued[tier].setdefault(ctx, ([], []))
        keys.append(key)
        slots.append(plan.slots[0])
        if (origins := self._origins.get(ctx)) is None:
            origins = self._origins[ctx] = {}
        origins[key] = tier
        return _PENDING

    def plan(self, slot_bytes: int) -> None:
        """Step end: plan every complete scan; start what it loads (the rest is refused, so
        recomputed)."""
        estimates = [driver.get_estimate(slot_bytes) for driver in self._drivers]
        for ctx, key, tier in self._loading.plan_scans(estimates, slot_bytes):
            self.start(tier, key, ctx)

    def send(self) -> None:
        """Step end: one get per tier and request, in tier order, over this step's
        reservations. A get the tier refuses is finished at once."""
        for tier, driver in self._tiers:
            queued = self._queued[tier]
            for ctx, (keys, slots) in queued.items():
                job = TierJob(self._new_job_id(), JobKind.GET, tuple(keys), tuple(slots), ctx)
                if (failed := driver.submit(job)) is not None:
                    self.finish(tier, job, failed)
            queued.clear()

    def finish(self, tier: int, job: TierJob, result: JobResult) -> None:
        """The host tier's side of a get tier ``tier`` finished, with the context the job
        carries: loaded slots become readable, failed ones are freed and forget their origin."""
        loaded, failed = loaded_keys(job, result)  # either may be empty: a no-op then
        if failed and job.ctx is not None and (origins := self._origins.get(job.ctx)):
            for key in failed:
                if origins.get(key) == tier:
                    del origins[key]
        self._primary.complete_store(loaded, job.ctx, True)
        self._primary.complete_store(failed, job.ctx, False)

    def source(self, key: OffloadKey, ctx: ReqContext) -> TierIdentity | None:
        """The tier whose promotion brought ``key`` into host memory for ``ctx``, or ``None``."""
        origins = self._origins.get(ctx)
        tier = origins.get(key) if origins is not None else None
        return self._drivers[tier].identity if tier is not None else None

    def waiting(self, ctx: ReqContext) -> bool:
        """True while ``ctx`` has reservations not sent yet (they go out at step end)."""
        return any(ctx in queued for queued in self._queued)

    @property
    def queued(self) -> bool:
        """True while some reservation waits for step end."""
        return any(self._queued)

    @property
    def reserved(self) -> int:
        """The host slots reserved and not sent yet."""
        return sum(len(keys) for queued in self._queued for keys, _ in queued.values())

    def forget(self, ctx: ReqContext) -> None:
        """``ctx`` was finalized: drop where its keys came from."""
        self._origins.pop(ctx, None)

    def clear(self) -> None:
        """Drop every reservation not sent and every origin (the host tier is being reset)."""
        self._origins.clear()
        for queued in self._queued:
            queued.clear()
