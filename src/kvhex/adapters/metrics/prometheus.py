"""``PrometheusCollector``: an ``OffloadEngine``'s counters as Prometheus metrics.

The engine keeps plain counters as it works; this collector reads their snapshot
(``OffloadEngine.stats()``: every tier's counters, the events published) when the registry is
scraped, so a lookup costs the same whether or not anyone scrapes. Nothing is registered
globally: :func:`register_metrics` adds one collector to the ``CollectorRegistry`` the host
application passes, and :func:`serve_metrics` serves that registry over HTTP only when asked.

Every metric, its labels and its meaning are listed in ``docs/metrics.md`` (a test checks the
list against what a scrape returns). Tiers are labelled by ``tier`` (their name; the host
memory tier is ``host``) and ``medium`` (``CPU``, ``STORAGE``, ...).

Scrapes run on the HTTP server's thread while the scheduler thread works: each scrape reads a
snapshot the engine builds from counters (copies of small lists and dicts, atomic under the
GIL), so values within one scrape can be a step apart, never torn.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from kvhex.domain.histogram import Histogram
from kvhex.errors import ConfigError
from kvhex.service.engine import OffloadEngine
from kvhex.service.stats import TieringStats

__all__ = [
    "METRICS",
    "MetricsServer",
    "PrometheusCollector",
    "parse_metrics_address",
    "register_metrics",
    "serve_metrics",
]

log = structlog.get_logger(__name__)

HOST_TIER = "host"
"""The ``tier`` label of the host memory (primary) tier."""

_TIER = ("tier", "medium")

# name (without _total), kind, labels, help: the one list docs/metrics.md is checked against
METRICS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    (
        "kvhex_tier_lookups",
        "counter",
        _TIER,
        "Chunk lookups that asked this tier (host: hits plus misses).",
    ),
    (
        "kvhex_tier_hits",
        "counter",
        _TIER,
        "Lookups this tier answered with a hit (host: once per key and scheduler step).",
    ),
    (
        "kvhex_tier_misses",
        "counter",
        _TIER,
        "Lookups this tier could not serve (host: not readable in host memory; "
        "secondary: answered absent).",
    ),
    (
        "kvhex_tier_promoted_blocks",
        "counter",
        (*_TIER, "result"),
        "Chunks promoted from this tier into host memory (result ok or failed).",
    ),
    (
        "kvhex_tier_promotion_no_room",
        "counter",
        _TIER,
        "Hits on this tier that found no host slot to promote into (answered as misses).",
    ),
    (
        "kvhex_tier_jobs",
        "counter",
        (*_TIER, "kind", "result"),
        "Jobs this tier finished, by kind (put, get) and result (ok, failed).",
    ),
    (
        "kvhex_tier_blocks_put",
        "counter",
        _TIER,
        "Chunks written to this tier (host: device stores completed).",
    ),
    (
        "kvhex_tier_bytes",
        "counter",
        (*_TIER, "direction"),
        "Bytes moved by this tier's finished jobs (direction put or get).",
    ),
    (
        "kvhex_tier_job_seconds",
        "histogram",
        (*_TIER, "kind"),
        "Seconds from a job's submission to its result reaching the engine (queueing "
        "included), by kind (put, get).",
    ),
    ("kvhex_tier_jobs_in_flight", "gauge", _TIER, "Jobs submitted to this tier, not yet done."),
    (
        "kvhex_tier_evictions",
        "counter",
        _TIER,
        "Chunks that left this tier (host: evicted for room; secondary: announced removed: "
        "evicted, deleted, lost or found corrupt).",
    ),
    (
        "kvhex_tier_dropped_blocks",
        "counter",
        _TIER,
        "Chunks not written to this tier because its admission policy (backpressure) refused.",
    ),
    ("kvhex_tier_resident_blocks", "gauge", _TIER, "Chunks readable on this tier now."),
    (
        "kvhex_tier_corrupt_blocks",
        "counter",
        _TIER,
        "Chunks a get found damaged on this tier (failed integrity check, truncated): never "
        "served, dropped and announced removed (tiers that check integrity).",
    ),
    (
        "kvhex_tier_refused_blocks",
        "counter",
        _TIER,
        "Chunks a keyed codec (aes-gcm) refused to a request of another tenant or master key: "
        "a miss for that request, the block kept (0 on a tier without one).",
    ),
    (
        "kvhex_tier_lost_blocks",
        "counter",
        _TIER,
        "Chunks this tier dropped as unreadable other than by eviction or delete (missing or "
        "corrupt at a get, missing at a probe, an unwritten put, a lost store).",
    ),
    (
        "kvhex_tier_io_errors",
        "counter",
        _TIER,
        "Storage operations of this tier that failed outside a job's per-chunk outcome "
        "(a write, a removal).",
    ),
    (
        "kvhex_tier_used_bytes",
        "gauge",
        _TIER,
        "Bytes held or reserved on this tier (tiers that report their occupancy).",
    ),
    (
        "kvhex_tier_capacity_bytes",
        "gauge",
        _TIER,
        "Bytes this tier may hold (tiers that report their occupancy).",
    ),
    (
        "kvhex_host_store_allocation_failures",
        "counter",
        (),
        "Device stores refused because no host slot could be freed.",
    ),
    ("kvhex_requests_active", "gauge", (), "Requests the engine is tracking."),
    (
        "kvhex_load_decisions",
        "counter",
        ("decision",),
        "Load-or-recompute plans for prefixes held by secondary tiers, by decision "
        "(load_all, load_part, recompute; explore: loaded to re-measure a tier).",
    ),
    (
        "kvhex_load_chunks",
        "counter",
        ("decision",),
        "Secondary-tier chunks those plans chose to load or to leave to recompute.",
    ),
    (
        "kvhex_prefill_tokens_per_second",
        "gauge",
        (),
        "The engine's prefill speed load decisions use (measured or configured).",
    ),
    (
        "kvhex_load_wait_seconds",
        "gauge",
        ("source",),
        "What a load costs a request in engine steps, as load decisions count it: from host "
        "memory (host), and beyond its gets with a promotion (promotion); medians of recent "
        "loads.",
    ),
    (
        "kvhex_events_published",
        "counter",
        ("type", "medium"),
        "KV events published, by type (BlockStored, BlockRemoved, AllBlocksCleared) and medium.",
    ),
    (
        "kvhex_events_stored_keys",
        "counter",
        ("payload",),
        "Keys announced stored, by payload: full (hashes, parent, tokens, extra keys) or "
        "placeholder (no tokens: external work, shapes events cannot describe).",
    ),
    (
        "kvhex_sink_batches_sent",
        "counter",
        ("sink",),
        "Event batches each sink took (sink: position and type).",
    ),
    (
        "kvhex_sink_batches_dropped",
        "counter",
        ("sink",),
        "Event batches a sink refused (its publish raised): lost for that sink.",
    ),
)


class PrometheusCollector(Collector):
    """Reads one engine's counters at every scrape (``collect``)."""

    def __init__(self, engine: OffloadEngine, labels: Mapping[str, str] | None = None) -> None:
        """Args:
        engine: the engine to report.
        labels: constant labels added to every series (e.g. ``{"engine": "0"}`` when one
            registry holds several engines).
        """
        self._engine = engine
        self._const = dict(labels or {})
        self._slot_bytes = engine.slot_bytes

    def describe(self) -> Iterator[Metric]:
        """The metric families, without samples (lets the registry refuse duplicates)."""
        for name, kind, labels, doc in METRICS:
            yield _family(kind, name, doc, [*self._const, *labels])

    def collect(self) -> Iterator[Metric]:
        """Every metric, read from the engine now."""
        stats = self._stats()
        families = {
            name: _family(kind, name, doc, [*self._const, *labels])
            for name, kind, labels, doc in METRICS
        }
        const = list(self._const.values())

        def add(name: str, labels: Sequence[str], value: float) -> None:
            family = families[name]
            assert isinstance(family, CounterMetricFamily | GaugeMetricFamily)
            family.add_metric([*const, *labels], value)

        self._host(stats, add)
        for tier in stats.tiers:
            t = [tier.name, str(tier.medium)]
            add("kvhex_tier_lookups", t, tier.lookups)
            add("kvhex_tier_hits", t, tier.hits)
            add("kvhex_tier_misses", t, tier.misses)
            add("kvhex_tier_promoted_blocks", [*t, "ok"], tier.keys_promoted)
            add("kvhex_tier_promoted_blocks", [*t, "failed"], tier.keys_failed_to_promote)
            add("kvhex_tier_promotion_no_room", t, tier.promotion_slot_failures)
            add("kvhex_tier_jobs", [*t, "put", "ok"], tier.puts_ok)
            add("kvhex_tier_jobs", [*t, "put", "failed"], tier.puts_failed)
            add("kvhex_tier_jobs", [*t, "get", "ok"], tier.gets_ok)
            add("kvhex_tier_jobs", [*t, "get", "failed"], tier.gets_failed)
            add("kvhex_tier_blocks_put", t, tier.keys_put)
            add("kvhex_tier_bytes", [*t, "put"], tier.bytes_put)
            add("kvhex_tier_bytes", [*t, "get"], tier.bytes_got)
            _observe(families["kvhex_tier_job_seconds"], [*const, *t, "put"], tier.put_latency)
            _observe(families["kvhex_tier_job_seconds"], [*const, *t, "get"], tier.get_latency)
            add("kvhex_tier_jobs_in_flight", t, tier.in_flight)
            add("kvhex_tier_evictions", t, tier.blocks_removed)
            add("kvhex_tier_dropped_blocks", t, tier.keys_dropped)
            add("kvhex_tier_resident_blocks", t, tier.resident_blocks)
            if tier.used_bytes is not None and tier.capacity_bytes is not None:
                add("kvhex_tier_used_bytes", t, tier.used_bytes)
                add("kvhex_tier_capacity_bytes", t, tier.capacity_bytes)
            if tier.corrupt_blocks is not None:
                add("kvhex_tier_corrupt_blocks", t, tier.corrupt_blocks)
            if tier.lost_blocks is not None:
                add("kvhex_tier_lost_blocks", t, tier.lost_blocks)
            if tier.io_errors is not None:
                add("kvhex_tier_io_errors", t, tier.io_errors)
            if tier.refused_blocks is not None:
                add("kvhex_tier_refused_blocks", t, tier.refused_blocks)
        add("kvhex_host_store_allocation_failures", [], stats.primary.store_allocation_failures)
        add("kvhex_requests_active", [], stats.active_requests)
        loading = stats.loading
        add("kvhex_load_decisions", ["load_all"], loading.loaded_all)
        add("kvhex_load_decisions", ["load_part"], loading.loaded_part)
        add("kvhex_load_decisions", ["recompute"], loading.recomputed)
        add("kvhex_load_decisions", ["explore"], loading.explored)
        add("kvhex_load_chunks", ["load"], loading.chunks_loaded)
        add("kvhex_load_chunks", ["recompute"], loading.chunks_recomputed)
        if stats.prefill_tokens_per_s is not None:
            add("kvhex_prefill_tokens_per_second", [], stats.prefill_tokens_per_s)
        add("kvhex_load_wait_seconds", ["host"], loading.wait_host_s)
        add("kvhex_load_wait_seconds", ["promotion"], loading.wait_promote_s)
        events = stats.events
        for (kind, medium), count in sorted(events.published.items()):
            add("kvhex_events_published", [kind, medium], count)
        add("kvhex_events_stored_keys", ["full"], events.full_stores)
        add("kvhex_events_stored_keys", ["placeholder"], events.placeholder_stores)
        for i, sink in enumerate(events.sinks):
            label = [f"{i}:{sink.name}"]
            add("kvhex_sink_batches_sent", label, sink.batches_sent)
            add("kvhex_sink_batches_dropped", label, sink.batches_dropped)
        yield from families.values()

    def _host(self, stats: TieringStats, add: Any) -> None:
        host = stats.primary
        t = [HOST_TIER, "CPU"]
        add("kvhex_tier_lookups", t, stats.lookups)
        add("kvhex_tier_hits", t, stats.host_hits)
        add("kvhex_tier_misses", t, stats.lookups - stats.host_hits)
        add("kvhex_tier_blocks_put", t, host.stores_completed)
        add("kvhex_tier_evictions", t, host.evictions)
        add("kvhex_tier_resident_blocks", t, host.resident)
        add("kvhex_tier_used_bytes", t, (host.resident + host.pending) * self._slot_bytes)
        add("kvhex_tier_capacity_bytes", t, host.num_slots * self._slot_bytes)

    def _stats(self) -> TieringStats:
        # the scheduler thread may resize a dict the snapshot copies: try again
        for _ in range(3):
            try:
                return self._engine.stats()
            except RuntimeError:
                continue
        return self._engine.stats()


def _family(kind: str, name: str, doc: str, labels: list[str]) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    if kind == "gauge":
        return GaugeMetricFamily(name, doc, labels=labels)
    return HistogramMetricFamily(name, doc, labels=labels)


def _observe(family: Metric, labels: list[str], histogram: Histogram) -> None:
    assert isinstance(family, HistogramMetricFamily)
    buckets = [(_le(bound), float(n)) for bound, n in histogram.cumulative()]
    family.add_metric(labels, buckets, histogram.sum)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def register_metrics(
    engine: OffloadEngine,
    registry: CollectorRegistry,
    *,
    labels: Mapping[str, str] | None = None,
) -> PrometheusCollector:
    """Add ``engine``'s metrics to ``registry`` (and nowhere else); the collector returned
    can be removed again with ``registry.unregister``.

    Raises:
        ValueError: ``registry`` already holds metrics of these names (another engine:
            give each one a distinguishing ``labels`` entry and its own registry, or one
            registry per engine).
    """
    collector = PrometheusCollector(engine, labels)
    registry.register(collector)
    return collector


class MetricsServer:
    """A running ``/metrics`` HTTP endpoint (a daemon thread); ``close`` stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def address(self) -> tuple[str, int]:
        """The host and port it listens on (the port chosen when 0 was asked)."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host, port = self.address
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


def parse_metrics_address(text: str, *, key: str = "--metrics-addr") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6; port 0 picks a free one) as ``(host, port)``.

    Raises:
        ConfigError: at ``key``: not ``HOST:PORT``, a port outside 0-65535, a host that is
            not an IP address or ``localhost``.
    """
    host, sep, port_text = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError([(key, f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9400)")])
    port = int(port_text)
    if port > 65535:
        raise ConfigError([(key, f"port {port} is outside 0-65535")])
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(
                [(key, f"{host!r} is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)")]
            ) from None
    return host, port


def serve_metrics(registry: CollectorRegistry, address: str) -> MetricsServer:
    """Serve ``registry`` at ``http://ADDRESS/metrics`` from a daemon thread.

    Args:
        address: ``HOST:PORT`` (see :func:`parse_metrics_address`).

    Raises:
        ConfigError: a malformed address.
        OSError: the address cannot be bound (in use, not an address of this machine).
    """
    host, port = parse_metrics_address(address)
    server, thread = start_http_server(port, host, registry)
    served = MetricsServer(server, thread)
    log.info("metrics_serving", url=served.url)
    return served
