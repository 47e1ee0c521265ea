"""kvhex's metrics inside vLLM: the CPU and tiering families vLLM's own specs emit, under
vLLM's names and labels, fed through vLLM's own Prometheus metrics class; and the real source
of each request's hit (host memory or the file tier) in vLLM's per-source split.

Runs on vLLM 0.33 (.venv-vllm) and 0.32 (.venv-vllm32), through vLLM's factories and
scheduler-side connector, as tests/vllm/test_connector.py does.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM (make test runs this in .venv-vllm and .venv-vllm32)"
)

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvhex.vllm import KvhexOffloadingManager, KvhexOffloadingSpec, register
from tests.vllm.scheduler import PAGE, Driver, request, scheduler_connector, vllm_config

PROMPT = list(range(300, 364))  # four blocks of 16 tokens
TIERING = {v for k, v in vars(TieringOffloadingMetrics).items() if k.isupper()}
CPU = {v for k, v in vars(CPUOffloadingMetrics).items() if k.isupper()}


def _extra(root: Path) -> dict[str, Any]:
    return {
        "spec_name": "KvhexOffloadingSpec",
        "cpu_bytes_to_use": 32 * PAGE,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "enable_kv_events": True}],
    }


@pytest.fixture(autouse=True)
def _registered() -> None:
    register()


@pytest.fixture
def connector(tmp_path: Path) -> Iterator[Any]:
    built = scheduler_connector(
        tmp_path / "model", _extra(tmp_path / "kv"), "KvhexOffloadingConnector"
    )
    yield built
    built.shutdown()


def _payloads(connector: Any, into: list[Any]) -> None:
    stats = connector.get_kv_connector_stats()
    if stats is not None and not stats.is_empty():
        into.append(stats)


def test_the_spec_defines_vllms_cpu_and_tiering_families(tmp_path: Path) -> None:
    definitions = KvhexOffloadingSpec.build_metric_definitions(_extra(tmp_path))
    assert set(definitions) >= TIERING
    assert CPU - {CPUOffloadingMetrics.STORES_SKIPPED} <= set(definitions)
    with_threshold = KvhexOffloadingSpec.build_metric_definitions(
        {**_extra(tmp_path), "secondary_tiers": [], "store_threshold": 2}
    )
    assert CPUOffloadingMetrics.STORES_SKIPPED in with_threshold


def test_a_workload_reports_vllms_metrics_and_the_real_hit_sources(
    tmp_path: Path, connector: Any
) -> None:
    manager = connector.connector_scheduler.manager
    assert isinstance(manager, KvhexOffloadingManager)
    host = manager.host
    assert host is not None
    driver = Driver(connector)
    payloads: list[Any] = []

    first = request("m1", PROMPT)
    connector.on_new_request(first)
    assert driver.matched(first) == 0
    meta = driver.prefill(first)
    ((job_id, job),) = meta.store_jobs.items()
    for chunk, slot in enumerate(job.dst_spec.block_ids.tolist()):
        host.slot_view(slot)[:] = bytes([chunk + 1]) * PAGE
    driver.complete([job_id])
    driver.finish(first)
    driver.until(lambda: manager.stats().tiers[0].puts_ok == 1)
    _payloads(connector, payloads)

    # a second request hits in host memory: its source is HOST
    second = request("m2", [*PROMPT, 7])
    connector.on_new_request(second)
    assert driver.matched(second) == 64
    meta = driver.prefill(second, external=64)
    assert connector.get_external_cache_hit_sources(second, 64) == {CacheHitSource.HOST: 64}
    driver.complete(list(meta.load_jobs))
    driver.finish(second)

    # after a reset only the file tier holds the prompt: the hit is promoted, source DISK
    connector.reset_cache()
    for _ in range(3):
        driver.step()
    third = request("m3", [*PROMPT, 8])
    connector.on_new_request(third)
    assert driver.matched(third) == 64
    meta = driver.prefill(third, external=64)
    assert connector.get_external_cache_hit_sources(third, 64) == {CacheHitSource.DISK: 64}
    driver.complete(list(meta.load_jobs))
    driver.finish(third)
    _payloads(connector, payloads)

    merged = payloads[0]
    for more in payloads[1:]:
        merged.aggregate(more)
    types, values = merged.data["types"], merged.data["data"]
    tier = ("1:fs",)
    assert values[TieringOffloadingMetrics.WRITE_BYTES][tier] == 4 * PAGE
    assert values[TieringOffloadingMetrics.READ_BYTES][tier] == 4 * PAGE
    assert values[TieringOffloadingMetrics.CHUNK_HITS][tier] == 4
    # m1 asked for its first chunk only (a miss ends a prefix), m3 for all four (hits)
    assert values[TieringOffloadingMetrics.CHUNK_QUERIES][tier] == 5
    assert values[TieringOffloadingMetrics.CHUNK_HITS][("0:primary",)] >= 4
    assert values[TieringOffloadingMetrics.ACTIVE_CASCADE_JOBS][tier] == 0
    # sampled: the first resolved lookup of each run of one request's lookups answered in
    # Python (host hits, answered natively once the step polled the tier, are not timed)
    assert len(values[TieringOffloadingMetrics.LOOKUP_SYNC_DELAY][("0:primary",)]) >= 1
    # no lookup waited for a probe (RETRY) before resolving: the file tier's own index
    # answered each at once (m1's first chunk a miss, m3's four hits)
    assert not values.get(TieringOffloadingMetrics.LOOKUP_ASYNC_DELAY, {}).get(("0:primary",))
    assert 0 <= values[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC][()] <= 1
    # one sample per store that allocated, its size: every store once over the payloads
    sizes = values[CPUOffloadingMetrics.CPU_ALLOCATION_SIZE][()]
    assert sizes
    assert collections.Counter(sizes) == manager.stats().primary.allocation_sizes
    latency = getattr(TieringOffloadingMetrics, "PROMOTION_LATENCY", None)
    if latency is not None:  # vLLM 0.33
        assert len(values[latency][(*tier, "success")]) == 1
    assert types[TieringOffloadingMetrics.READ_BYTES] == "counter"

    # vLLM's own Prometheus class takes the payload, as its frontend would (it asserts that
    # every metric in it is one the spec defined)
    prom = OffloadPromMetrics(
        vllm_config(tmp_path / "model", _extra(tmp_path / "kv"), "KvhexOffloadingConnector"),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    prom.observe(merged.data, 0)
    registry_values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in REGISTRY.collect()  # vLLM registers into the default registry
        for s in m.samples
    }
    key = (
        "vllm:kv_offload_tiering_read_bytes_total",
        (("engine", "0"), ("model_name", "tiny"), ("tier", "1:fs")),
    )
    assert registry_values[key] == 4 * PAGE


def test_lookups_that_wait_for_a_probe_report_their_async_delay(tmp_path: Path) -> None:
    probed = {"type": "KvhexSecondaryTier", "tier": "memory", "capacity_bytes": 64 * PAGE}
    extra = {**_extra(tmp_path / "kv"), "secondary_tiers": [probed]}  # no index of its own
    connector = scheduler_connector(tmp_path / "model", extra, "KvhexOffloadingConnector")
    try:
        manager = connector.connector_scheduler.manager
        driver = Driver(connector)
        first = request("p1", PROMPT)
        connector.on_new_request(first)
        assert driver.matched(first) == 0
        driver.complete(list(driver.prefill(first).store_jobs))
        driver.finish(first)
        driver.until(lambda: manager.stats().tiers[0].puts_ok == 1)
        connector.reset_cache()
        for _ in range(3):
            driver.step()
        payloads: list[Any] = []
        _payloads(connector, payloads)  # drops what came before
        second = request("p2", [*PROMPT, 9])
        connector.on_new_request(second)
        assert connector.get_num_new_matched_tokens(second, 0)[0] is None  # probing
        assert driver.matched(second) == 64
        payloads.clear()
        _payloads(connector, payloads)
        values = payloads[0].data["data"]
        # the four chunks, each answered RETRY first, then promoted and read
        assert len(values[TieringOffloadingMetrics.LOOKUP_ASYNC_DELAY][("0:primary",)]) == 4
    finally:
        connector.shutdown()
