"""``KvhexSecondaryTier``: any kvhex tier as a secondary tier of vLLM's own tiering spec.

In vLLM's ``TieringOffloadingSpec`` configuration::

    "secondary_tiers": [{"type": "KvhexSecondaryTier", "module_path": "kvhex.adapters.vllm",
                         "tier": "fsspec", "url": "/mnt/kv", "capacity_bytes": 500000000000,
                         "enable_kv_events": true, "locality": "LOCAL"}]

``tier`` names a ``kvhex.tiers`` entry point (``fsspec`` for local files or object stores,
``nixl``, ``memory``, or a third party's); the other keys are that tier's options, checked
against its signature (an unknown option fails vLLM's start-up with a ``ConfigError`` naming
it). vLLM's ``TieringOffloadingManager`` drives it through vLLM's ``SecondaryTierManager``
contract: cascades become kvhex put jobs, promotions get jobs, lookups are answered from
asynchronous existence probes (``RETRY`` until a probe answers, one probe job per step).

Events: the tier's own stores and removals (``STORAGE``, its locality, its name as
ownership), only when ``enable_kv_events`` is set and vLLM's KV events are on, as vLLM's
file tier does.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, ClassVar

import structlog
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.tiering import base as vtier

from kvhex.adapters.vllm.compose import RegionHostBuffer, build_tier_store
from kvhex.adapters.vllm.convert import LOOKUP, context_of, offloading_events, policy_of
from kvhex.adapters.vllm.settings import KVHEX_TIER_TYPE, parse_tier
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import OffloadPolicy
from kvhex.errors import ConfigError
from kvhex.plugins import Registry
from kvhex.ports.tier_store import RequestAware
from kvhex.service.probes import ProbeCache

__all__ = ["KvhexSecondaryTier"]

log = structlog.get_logger(__name__)


class KvhexSecondaryTier(vtier.SecondaryTierManager):
    """A kvhex ``TierStore`` behind vLLM's ``SecondaryTierManager``."""

    medium: ClassVar[vbase.Medium | None] = vbase.Medium.STORAGE

    def __init__(  # noqa: PLR0917 - vLLM's SecondaryTierFactory passes these by keyword
        self,
        offloading_spec: vbase.OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        tier: str | None = None,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: Any = None,
        kvhex: Any = None,
        **options: Any,
    ) -> None:
        """Args (as vLLM's ``SecondaryTierFactory`` passes them):
        offloading_spec, primary_kv_view, tier_type, backpressure_detector: vLLM's.
        tier: the ``kvhex.tiers`` entry point to build.
        enable_kv_events: announce this tier's stores and removals (needs vLLM's KV events).
        locality: ``"LOCAL"`` / ``"REMOTE"``, announced and used by per-request tier filters.
        kvhex: kvhex-only settings of this tier (``name``).
        options: the kvhex tier's own options (e.g. ``url``, ``capacity_bytes``).

        Raises:
            ConfigError: a bad entry (the path names the key).
            TierError: the tier cannot run.
        """
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        entry: dict[str, Any] = {"type": KVHEX_TIER_TYPE, "tier": tier, **options}
        entry["enable_kv_events"] = enable_kv_events
        if locality is not None:
            entry["locality"] = locality
        if kvhex is not None:
            entry["kvhex"] = kvhex
        path = f"$.secondary_tiers[{tier_type}:{tier}]"
        settings = parse_tier(entry, path)
        if settings.backpressure is not None:
            raise ConfigError(
                [
                    (
                        f"{path}.kvhex.backpressure",
                        "inside vLLM's TieringOffloadingSpec admission is vLLM's: set "
                        "'backpressure' in the tier entry",
                    )
                ],
                "kv_connector_extra_config",
            )
        view = primary_kv_view
        num_chunks = view.shape[0] if view.shape else 0
        host = RegionHostBuffer(view, num_chunks, self.block_size_bytes)
        from kvhex.adapters.vllm.spec import namespace_of

        namespace = namespace_of(offloading_spec.config, self.block_size_bytes)
        self._store = build_tier_store(settings, host, Registry.discover(), namespace)
        self._host = host
        self.name = settings.name
        identity = self._store.identity
        self.locality = vbase.Locality(identity.locality.value) if identity.locality else None
        if identity.medium.name in ("CPU", "STORAGE"):
            self.medium = vbase.Medium(identity.medium.name)  # type: ignore[misc]
        self._hooks = self._store if isinstance(self._store, RequestAware) else None
        self._events = enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        if enable_kv_events and not self._events:
            log.warning("tier_events_off_globally", tier=self.name)
        self._jobs: dict[int, TierJob] = {}
        self._failed: list[vtier.JobResult] = []
        self._probes = ProbeCache()
        self._missing: set[OffloadKey] = set()
        self._next_probe = 0

    # -- lookups -------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: vbase.ReqContext) -> vbase.LookupResult:
        if key in self._missing:
            return vbase.LookupResult.MISS
        ctx, _ = context_of(req_context)
        return LOOKUP[self._probes.lookup(key, ctx)]

    def on_schedule_end(self, context: vbase.ScheduleEndContext) -> None:
        batch = self._probes.take_batch()
        if not batch:
            return
        self._next_probe -= 1  # negative ids never meet vLLM's job ids
        job = TierJob(JobId(self._next_probe), JobKind.PROBE, tuple(batch))
        self._probes.sent(batch, job.job_id)
        self._jobs[job.job_id] = job
        try:
            self._store.submit_probe(job)
        except Exception as exc:
            del self._jobs[job.job_id]
            log.warning("tier_probe_submit_failed", tier=self.name, error=repr(exc))
            self._probes.resolve(job.job_id, job.keys, frozenset(), False)

    # -- jobs ----------------------------------------------------------------------------
    def submit_store(self, job_metadata: vtier.TransferJob) -> None:
        self._submit(job_metadata, JobKind.PUT)

    def submit_load(self, job_metadata: vtier.TransferJob) -> None:
        self._submit(job_metadata, JobKind.GET)

    def _submit(self, vjob: vtier.TransferJob, kind: JobKind) -> None:
        ctx, _ = context_of(vjob.req_context)
        job = TierJob(
            JobId(vjob.job_id),
            kind,
            tuple(vjob.keys),
            tuple(int(c) for c in vjob.chunk_ids),
            ctx,
        )
        self._jobs[job.job_id] = job
        submit = self._store.submit_put if kind is JobKind.PUT else self._store.submit_get
        try:
            submit(job)
        except Exception as exc:  # reported like any failed job, on the next poll
            del self._jobs[job.job_id]
            log.warning("tier_submit_failed", tier=self.name, job_id=job.job_id, error=repr(exc))
            self._failed.append(vtier.JobResult(job_id=vjob.job_id, success=False))
            if kind is JobKind.GET:
                self._mark_missing(job.keys)

    def get_finished_jobs(self) -> Iterable[vtier.JobResult]:
        out, self._failed = self._failed, []
        for result in self._store.poll():
            job = self._jobs.pop(result.job_id, None)
            if job is None:
                log.warning("tier_reported_unknown_job", tier=self.name, job_id=result.job_id)
            elif job.kind is JobKind.PROBE:
                self._probes.resolve(job.job_id, job.keys, result.found, result.success)
            else:
                out.append(self._finished(job, result))
        return out

    def _finished(self, job: TierJob, result: JobResult) -> vtier.JobResult:
        successful: Collection[OffloadKey] | None = None
        if job.kind is JobKind.PUT:
            if result.success:
                self._missing.difference_update(job.keys)
                self._probes.set_answer(job.keys, found=True)
        elif not result.success:
            ok = result.ok_keys or frozenset()
            self._mark_missing([k for k in job.keys if k not in ok])
            if result.ok_keys:
                successful = [k for k in job.keys if k in ok]
        return vtier.JobResult(
            job_id=int(job.job_id),
            success=result.success,
            successful_keys=successful,
            transfer_time=result.seconds,
            transfer_bytes=result.nbytes or None,
        )

    def _mark_missing(self, keys: Collection[OffloadKey]) -> None:
        """A failed load: never promote these again from here (no re-promotion loop)."""
        self._missing.update(keys)
        self._probes.set_answer(tuple(keys), found=False)

    def drain_jobs(self) -> None:
        self._store.drain()

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._failed or self._probes.pending)

    # -- requests and events -------------------------------------------------------------
    def on_new_request(self, req_context: vbase.ReqContext) -> vbase.RequestOffloadingContext:
        ctx, _ = context_of(req_context)
        every = self._hooks is not None and self._hooks.wants_every_chunk(ctx)
        return policy_of(OffloadPolicy.REQUEST_LEVEL if every else OffloadPolicy.CHUNK_LEVEL)

    def touch(self, keys: Collection[OffloadKey], req_context: vbase.ReqContext) -> None:
        if self._hooks is not None:
            self._hooks.touch(list(keys), context_of(req_context)[0])

    def on_request_finished(self, req_context: vbase.ReqContext) -> None:
        ctx, _ = context_of(req_context)
        self._probes.forget_request(ctx)
        if self._hooks is not None:
            self._hooks.on_request_finished(ctx)

    def take_events(self) -> Iterable[vbase.OffloadingEvent]:
        raw = self._store.take_events()
        return offloading_events(raw) if self._events else []

    def shutdown(self) -> None:
        self._store.close()
        self._host.close()  # our view only: vLLM owns the region
