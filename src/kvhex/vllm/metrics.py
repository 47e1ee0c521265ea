"""vLLM's offloading metrics from kvhex's engine: the names, labels and meanings of vLLM's CPU
manager (``vllm:kv_offload_cpu_*``, ``vllm:kv_offload_stores_skipped``) and tiering manager
(``vllm:kv_offload_tiering_*``), so a dashboard built on vLLM's specs keeps working when
``spec_name`` switches to kvhex.

vLLM's connector asks the manager for ``get_stats()`` each scheduler step; the payload holds
counter increments, gauge values and histogram samples since the last call. kvhex keeps
cumulative counters (the engine's stats), so :class:`VllmMetrics` sends the difference since
its last payload, and gathers the samples vLLM's histograms want (lookup durations, promotion
latencies) as they happen, at most ``MAX_SAMPLES`` per payload each.

Labels as vLLM's tiering manager sets them: ``tier="0:primary"`` for host memory,
``"<i>:<name>"`` for the i-th secondary tier (1-based; vLLM writes the tier type, kvhex the
tier's configured name, which defaults to its type). The lookup sync-delay histogram is
observed under ``0:primary`` for the first resolved lookup of each run of lookups of one
request answered in Python (kvhex answers a chunk in one call, whichever tier holds it; host
hits answered natively and the rest of a run are not timed: two clock reads would cost a
quarter of a host hit's lookup), the async-delay histogram for each key whose lookups
deferred (``RETRY``) before resolving; chunk queries and hits are counted per tier that
answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingMetricMetadata
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as Cpu
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics as Tiering
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvhex.domain.jobs import JobKind, JobResult, TierJob
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.service.engine import OffloadEngine
from kvhex.service.stats import TieringStats

MAX_SAMPLES = 65_536
"""Histogram samples kept per metric between two payloads (vLLM asks every step; when it
does not, later samples are dropped rather than kept without bound)."""

PRIMARY: tuple[str, ...] = ("0:primary",)
_PROMOTION_LATENCY: str | None = getattr(Tiering, "PROMOTION_LATENCY", None)  # vLLM 0.33+


def metric_definitions(extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
    """vLLM's own definitions for a tiering spec (its CPU ones included), without those of
    vLLM's secondary tier classes: kvhex's tiers emit only the tiering manager's metrics."""
    definitions: dict[str, OffloadingMetricMetadata] = (
        TieringOffloadingSpec.build_metric_definitions({**extra_config, "secondary_tiers": []})
    )
    return definitions


def cache_hit_source(identity: TierIdentity | None) -> Any:
    """vLLM's ``CacheHitSource`` for a hit served by ``identity`` (``None``: host memory).
    A tier announced ``REMOTE`` (S3, NIXL object stores, a peer) is ``EXTERNAL_UNSPECIFIED``,
    vLLM's name for a remote store; otherwise storage is ``DISK`` and host memory a tier
    holds is ``HOST`` (vLLM's own tiers map their medium the same way)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    if identity is None:
        return CacheHitSource.HOST
    if identity.locality is Locality.REMOTE:
        return CacheHitSource.EXTERNAL_UNSPECIFIED
    if identity.medium == Medium.CPU:
        return CacheHitSource.HOST
    if identity.medium == Medium.STORAGE:
        return CacheHitSource.DISK
    return CacheHitSource.EXTERNAL_UNSPECIFIED


class _Samples:
    """Histogram samples for the next payload, per label tuple, bounded."""

    __slots__ = ("dropped", "values")

    def __init__(self) -> None:
        self.values: dict[tuple[str, ...], list[float]] = {}
        self.dropped = 0

    def add(self, labels: tuple[str, ...], value: float) -> None:
        samples = self.values.get(labels)
        if samples is None:
            samples = self.values[labels] = []
        if len(samples) < MAX_SAMPLES:
            samples.append(value)
        else:
            self.dropped += 1

    def emit(self, stats: OffloadingConnectorStats, name: str) -> None:
        for labels, samples in self.values.items():
            _observe_all(stats, name, samples, labels)
        self.values.clear()


def _observe_all(
    stats: OffloadingConnectorStats, name: str, samples: list[float], labels: tuple[str, ...]
) -> None:
    """``stats.observe_histogram`` of each of ``samples``, in order: the first observed,
    the rest appended to the same series at once where vLLM lends its sections (0.33)."""
    if not samples:
        return
    stats.observe_histogram(name, samples[0], labels)
    sections = getattr(stats, "metric_sections", None)
    if sections is not None:
        sections()[1][name][labels].extend(samples[1:])
        return
    for value in samples[1:]:
        stats.observe_histogram(name, value, labels)


class VllmMetrics:
    """Builds vLLM's ``OffloadingConnectorStats`` payloads from one engine."""

    def __init__(
        self,
        engine: OffloadEngine,
        *,
        tier_names: Sequence[str],
        store_threshold: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """Args:
        engine: the engine; its secondary tiers' finished jobs are observed from now on.
        tier_names: the secondary tiers' names, in lookup order.
        store_threshold: vLLM's ``store_threshold`` (``stores_skipped`` exists from 2).
        """
        self._engine = engine
        self._labels: list[tuple[str, ...]] = [
            (f"{i + 1}:{name}",) for i, name in enumerate(tier_names)
        ]
        self._store_threshold = store_threshold
        self.clock = clock
        self._last: TieringStats | None = None
        self._last_sizes: dict[int, int] = {}
        # the lookup delays of host memory ("0:primary"), appended per lookup by the
        # manager (lookup_delay_recorder), bounded at each step end and payload
        self._delays: list[float] = []
        self._lookup_waits = _Samples()
        self._promotion_latency = _Samples()
        self._jobs: dict[str, dict[tuple[str, ...], float]] = {}
        engine.observe_jobs(self._on_job)

    def on_lookup(self, seconds: float, deferred_since: float | None = None) -> None:
        """A lookup resolved (``HIT`` or ``MISS``) after blocking ``seconds``; when earlier
        lookups of the key answered ``RETRY``, ``deferred_since`` is the clock at the first."""
        if len(self._delays) < MAX_SAMPLES:
            self._delays.append(seconds)
        if deferred_since is not None:
            self.on_lookup_wait(deferred_since)

    def lookup_delay_recorder(self) -> Callable[[float], None]:
        """What ``on_lookup(seconds)`` does, as one bound call for the lookup hot path: the
        samples are bounded at the next ``on_step_end`` or payload instead of per call."""
        return self._delays.append

    def on_lookup_wait(self, deferred_since: float) -> None:
        """A lookup resolved whose key's earlier lookups answered ``RETRY``, the first at
        clock ``deferred_since``."""
        self._lookup_waits.add(PRIMARY, self.clock() - deferred_since)

    def on_step_end(self) -> None:
        """The scheduler's step ended: keep at most ``MAX_SAMPLES`` lookup delays (the
        first) until the next payload."""
        if len(self._delays) > MAX_SAMPLES:
            del self._delays[MAX_SAMPLES:]

    def _on_job(self, index: int, job: TierJob, result: JobResult, latency: float) -> None:
        labels = self._labels[index]
        promotion = job.kind is JobKind.GET
        if not result.success:
            failures = Tiering.PROMOTION_JOB_FAILURES if promotion else Tiering.CASCADE_JOB_FAILURES
            self._count(failures, labels, 1)
        if result.nbytes:
            self._count(
                Tiering.READ_BYTES if promotion else Tiering.WRITE_BYTES, labels, result.nbytes
            )
        if result.seconds is not None and (result.success or result.ok_keys):
            self._count(
                Tiering.READ_TIME if promotion else Tiering.WRITE_TIME, labels, result.seconds
            )
        if promotion and _PROMOTION_LATENCY is not None:
            outcome = "success" if result.success else "failure"
            self._promotion_latency.add((*labels, outcome), latency)

    def _count(self, name: str, labels: tuple[str, ...], value: float) -> None:
        series = self._jobs.setdefault(name, {})
        series[labels] = series.get(labels, 0) + value

    def take(self) -> OffloadingConnectorStats:
        """The payload since the last call (gauges now; counters and samples since then)."""
        stats = OffloadingConnectorStats()
        now = self._engine.stats()
        last = self._last
        self._host(stats, now, last)
        for i, tier in enumerate(now.tiers):
            labels = self._labels[i]
            before = last.tiers[i] if last is not None else None

            def delta(field: str, tier: Any = tier, before: Any = before) -> int:
                return int(getattr(tier, field) - (getattr(before, field) if before else 0))

            queries = delta("hits") + delta("misses")
            if queries:
                stats.increase_counter(Tiering.CHUNK_QUERIES, queries, labels)
            if hits := delta("hits"):
                stats.increase_counter(Tiering.CHUNK_HITS, hits, labels)
            if dropped := delta("cascades_dropped"):
                stats.increase_counter(Tiering.BACKPRESSURE_STORES_DROPPED, dropped, labels)
            if blocks := delta("keys_dropped"):
                stats.increase_counter(Tiering.BACKPRESSURE_BLOCKS_DROPPED, blocks, labels)
            if no_room := delta("promotion_slot_failures"):
                stats.increase_counter(Tiering.PROMOTION_ALLOCATION_FAILURES, no_room)
            slots = now.primary.num_slots or 1
            stats.set_gauge(
                Tiering.PRIMARY_WRITE_USAGE_PERC, tier.keys_in_flight_get / slots, labels
            )
            stats.set_gauge(
                Tiering.PRIMARY_READ_USAGE_PERC, tier.keys_in_flight_put / slots, labels
            )
            stats.set_gauge(Tiering.ACTIVE_PROMOTION_JOBS, tier.gets_in_flight, labels)
            stats.set_gauge(Tiering.ACTIVE_CASCADE_JOBS, tier.puts_in_flight, labels)
            if (ema := tier.admission_ema_s) is not None:
                stats.set_gauge(Tiering.BACKPRESSURE_STORE_LATENCY_EMA, ema, labels)
        for name, series in self._jobs.items():
            for labels, value in series.items():
                stats.increase_counter(name, value, labels)
        self._jobs.clear()
        delays = self._delays
        _observe_all(stats, Tiering.LOOKUP_SYNC_DELAY, delays[:MAX_SAMPLES], PRIMARY)
        delays.clear()  # in place: the manager appends through a bound method
        self._lookup_waits.emit(stats, Tiering.LOOKUP_ASYNC_DELAY)
        if _PROMOTION_LATENCY is not None:
            self._promotion_latency.emit(stats, _PROMOTION_LATENCY)
        self._last = now
        return stats

    def _host(
        self, stats: OffloadingConnectorStats, now: TieringStats, last: TieringStats | None
    ) -> None:
        host = now.primary
        stats.set_gauge(Cpu.CPU_CACHE_USAGE_PERC, host.usage)
        stats.set_gauge(Cpu.CPU_CACHE_WRITE_USAGE_PERC, host.write_usage)
        stats.set_gauge(Cpu.CPU_CACHE_READ_USAGE_PERC, host.read_usage)
        last_sizes = self._last_sizes
        for size, count in host.allocation_sizes.items():
            if (new := count - last_sizes.get(size, 0)) > 0:  # (most sizes: none this step)
                for _ in range(min(new, MAX_SAMPLES)):
                    stats.observe_histogram(Cpu.CPU_ALLOCATION_SIZE, size)
        self._last_sizes = host.allocation_sizes  # (the snapshot's own copy)
        if self._store_threshold >= 2:
            skipped = host.stores_skipped - (last.primary.stores_skipped if last else 0)
            stats.increase_counter(Cpu.STORES_SKIPPED, skipped)
        queries = now.lookups - (last.lookups if last else 0)
        hits = now.host_hits - (last.host_hits if last else 0)
        if queries:
            stats.increase_counter(Tiering.CHUNK_QUERIES, queries, PRIMARY)
        if hits:
            stats.increase_counter(Tiering.CHUNK_HITS, hits, PRIMARY)
