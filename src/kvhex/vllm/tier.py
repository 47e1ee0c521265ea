"""``KvhexSecondaryTier``: any kvhex tier as a secondary tier of vLLM's own tiering spec.

In vLLM's ``TieringOffloadingSpec`` configuration::

    "secondary_tiers": [{"type": "KvhexSecondaryTier", "module_path": "kvhex.vllm",
                         "tier": "fsspec", "url": "/mnt/kv", "capacity_bytes": 500000000000,
                         "enable_kv_events": true, "locality": "LOCAL"}]

``tier`` names a ``kvhex.tiers`` entry point (``fsspec`` for local files or object stores,
``nixl``, ``memory``, or a third party's); the other keys are that tier's options, checked
against its signature (an unknown option fails vLLM's start-up with a ``ConfigError`` naming
it). vLLM's ``TieringOffloadingManager`` drives it through vLLM's ``SecondaryTierManager``
contract: cascades become kvhex put jobs, promotions get jobs, lookups are answered from
asynchronous existence probes (``RETRY`` until a probe answers, one probe job per step). The
tier's bookkeeping is kvhex's ``TierDriver``, as in kvhex's own manager, and every call to the
store goes through it (its events counted, ``stats()``); vLLM allocates the ids of puts and
gets, probes take negative ids (they never meet vLLM's).

Events: the tier's own stores and removals (``STORAGE``, its locality, its name as
ownership), only when ``enable_kv_events`` is set and vLLM's KV events are on, as vLLM's
file tier does.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

import structlog
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.tiering import base as vtier

from kvhex.config.vllm import KVHEX_TIER_TYPE, SOURCE
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import OffloadPolicy
from kvhex.errors import ConfigError
from kvhex.plugins import Registry
from kvhex.ports.tier_store import TierStore
from kvhex.service.stats import TierStats
from kvhex.service.tier_driver import TierDriver, loaded_keys
from kvhex.vllm._convert import (
    LOOKUP,
    context_of,
    offloading_events,
    policy_of,
    vllm_locality,
)
from kvhex.vllm.compose import RegionHostBuffer, build_tier_store
from kvhex.vllm.settings import parse_tier

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
            ConfigError: a bad entry, or a tier that cannot start (the path names the key).
            TierError: the tier failed otherwise while it started.
        """
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        entry: dict[str, Any] = {"type": KVHEX_TIER_TYPE, "tier": tier, **options}
        entry["enable_kv_events"] = enable_kv_events
        entry |= {k: v for k, v in (("locality", locality), ("kvhex", kvhex)) if v is not None}
        path = f"$.secondary_tiers[{tier_type}:{tier}]"
        settings = parse_tier(entry, path)
        if settings.backpressure is not None:
            why = (
                "inside vLLM's TieringOffloadingSpec admission is vLLM's: set 'backpressure' "
                "in the tier entry"
            )
            raise ConfigError([(f"{path}.kvhex.backpressure", why)], SOURCE)
        num_chunks = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        host = RegionHostBuffer(primary_kv_view, num_chunks, self.block_size_bytes)
        from kvhex.vllm.spec import namespace_of

        namespace = namespace_of(offloading_spec.config, self.block_size_bytes)
        store = build_tier_store(settings, host, Registry.discover(), namespace)
        self._tier_store = store
        self._host = host
        self.name = settings.name
        probe_ids = itertools.count(-1, -1)
        self._driver = TierDriver(store, self.name, probe_ids=lambda: JobId(next(probe_ids)))
        identity = self._driver.identity
        self.locality = vllm_locality(identity)
        if identity.medium.name in ("CPU", "STORAGE"):
            self.medium = vbase.Medium(identity.medium.name)  # type: ignore[misc]
        self._events = enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        if enable_kv_events and not self._events:
            log.warning("tier_events_off_globally", tier=self.name)
        self._refused: list[vtier.JobResult] = []  # failed submissions, for the next poll

    # -- lookups and jobs ----------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: vbase.ReqContext) -> vbase.LookupResult:
        return LOOKUP[self._driver.lookup(key, context_of(req_context)[0])]

    def on_schedule_end(self, context: vbase.ScheduleEndContext) -> None:
        self._driver.submit_probes()

    def submit_store(self, job_metadata: vtier.TransferJob) -> None:
        self._submit(job_metadata, JobKind.PUT)

    def submit_load(self, job_metadata: vtier.TransferJob) -> None:
        self._submit(job_metadata, JobKind.GET)

    def _submit(self, vjob: vtier.TransferJob, kind: JobKind) -> None:
        ctx, _ = context_of(vjob.req_context)
        slots = tuple(int(c) for c in vjob.chunk_ids)
        job = TierJob(JobId(vjob.job_id), kind, tuple(vjob.keys), slots, ctx)
        failed = self._driver.submit(job)
        if failed is not None:  # vLLM hears of it like any failed job, on the next poll
            self._refused.append(_vllm_result(job, failed))

    def get_finished_jobs(self) -> Iterable[vtier.JobResult]:
        out, self._refused = self._refused, []
        out.extend(_vllm_result(job, result) for job, result in self._driver.poll())
        return out

    def drain_jobs(self) -> None:
        self._driver.drain()

    def has_pending_work(self) -> bool:
        return bool(self._refused) or self._driver.has_pending_work()

    # -- requests and events -------------------------------------------------------------
    def on_new_request(self, req_context: vbase.ReqContext) -> vbase.RequestOffloadingContext:
        every = self._driver.wants_every_chunk(context_of(req_context)[0])
        return policy_of(OffloadPolicy.REQUEST_LEVEL if every else OffloadPolicy.CHUNK_LEVEL)

    def touch(self, keys: Collection[OffloadKey], req_context: vbase.ReqContext) -> None:
        self._driver.touch(list(keys), context_of(req_context)[0])

    def on_request_finished(self, req_context: vbase.ReqContext) -> None:
        self._driver.on_request_finished(context_of(req_context)[0])

    def take_events(self) -> Iterable[vbase.OffloadingEvent]:
        raw = self._driver.take_events()  # counted in stats() even when not announced
        return offloading_events(raw) if self._events else []

    @property
    def tier_store(self) -> TierStore:
        """The kvhex tier behind this one, for operators and tests (every call this class
        makes goes through the tier's ``TierDriver``)."""
        return self._tier_store

    def stats(self) -> TierStats:
        """kvhex's counters of this tier (jobs, lookups, announced blocks, occupancy, damage),
        a snapshot: vLLM's tiering manager reports its own metrics, not these."""
        return self._driver.snapshot()

    def shutdown(self) -> None:
        self._driver.close()
        self._host.close()  # our view only: vLLM owns the region


def _vllm_result(job: TierJob, result: JobResult) -> vtier.JobResult:
    """vLLM's result of a put or get; a partly failed get names the keys it did load."""
    successful: Collection[OffloadKey] | None = None
    if job.kind is JobKind.GET and not result.success:
        successful = loaded_keys(job, result)[0] or None
    return vtier.JobResult(
        job_id=int(job.job_id),
        success=result.success,
        successful_keys=successful,
        transfer_time=result.seconds,
        transfer_bytes=result.nbytes or None,
    )
