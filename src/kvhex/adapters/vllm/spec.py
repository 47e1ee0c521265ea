"""``KvhexOffloadingSpec``: a vLLM ``OffloadingSpec`` whose manager is kvhex's engine.

Select it with ``kv_connector_extra_config["spec_name"] = "KvhexOffloadingSpec"`` (the
``vllm.general_plugins`` entry point registers the name; ``spec_module_path:
"kvhex.adapters.vllm"`` works without it). It takes the keys of vLLM's ``CPUOffloadingSpec``
and ``TieringOffloadingSpec`` with their meaning (see ``settings``), so switching an
existing configuration to kvhex changes ``spec_name`` alone.

Scheduler side (``get_manager``): the host primary tier lives in vLLM's shared offload region
(the same ``/dev/shm`` mapping, layout and capacity arithmetic as vLLM's tiering spec), kvhex
tiers read and write it through slot views, and ``KvhexOffloadingManager`` drives it all.

Worker side (``get_worker``): on CUDA-alike and XPU platforms, vLLM's own
``CPUOffloadingWorker`` on that region, exactly as ``TieringOffloadingSpec`` builds it
(docs/vllm.md says why: its pinning and DMA/Triton copy kernels, canonical layout). On vLLM's
CPU platform, where vLLM's worker refuses to run, kvhex's ``KvhexCpuOffloadingWorker`` on the
same region and in the same layout (``kvhex.adapters.vllm.worker``).
"""

from __future__ import annotations

from typing import Any

import structlog
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvhex.adapters.vllm.compat import group_kind
from kvhex.adapters.vllm.compose import RegionHostBuffer, build_engine
from kvhex.adapters.vllm.manager import KvhexOffloadingManager
from kvhex.adapters.vllm.settings import SOURCE, VllmSettings, parse_settings
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.errors import ConfigError
from kvhex.plugins import Registry

__all__ = ["KvhexOffloadingSpec", "geometry_of", "namespace_of"]

log = structlog.get_logger(__name__)


def geometry_of(config: OffloadingConfig) -> KvGeometry | None:
    """The KV groups as far as the offloading config tells: full attention when a group has
    no sliding window, else ``UNKNOWN`` (placeholders) until the connector names the kind.
    vLLM 0.32's config does not say (``compat.group_kind``): every group is
    ``UNKNOWN`` there until the connector binds the scheduler's exact kinds."""
    try:
        return KvGeometry(
            tuple(
                KvGroup(
                    group.group_id,
                    group.tokens_per_block,
                    config.cache.blocks_per_chunk,
                    group_kind(group),
                )
                for group in config.groups
            ),
            config.cache.tokens_per_hash,
        )
    except ValueError as exc:
        log.warning("kv_geometry_unsupported", error=str(exc))
        return None


def namespace_of(config: OffloadingConfig, kv_bytes_per_chunk: int) -> dict[str, Any]:
    """What makes stored blocks interchangeable between engines (kvhex tiers share a root
    only between equal namespaces), in the spirit of vLLM's file-mapper run config."""
    p = config.parallel
    return {
        "engine": "vllm",
        "model": config.model.name,
        "dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "world_size": p.world_size,
        "tp_pp_pcp_dcp": [p.tp_size, p.pp_size, p.pcp_size, p.dcp_size],
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_bytes_per_chunk": kv_bytes_per_chunk,
    }


class KvhexOffloadingSpec(TieringOffloadingSpec):
    """vLLM's offloading spec for kvhex: host tier + kvhex tiers behind vLLM's manager API.

    Raises (at construction, so vLLM fails at start-up):
        ConfigError: the extra config is malformed; every bad key is named.
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        # kvhex reports no vLLM tiering metrics; resolving vLLM tier classes here would also
        # reject kvhex-only tier entries before kvhex could name the bad key
        definitions: dict[str, OffloadingMetricMetadata] = (
            CPUOffloadingSpec.build_metric_definitions(extra_config)
        )
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return ()

    def __init__(self, config: OffloadingConfig) -> None:
        self.settings: VllmSettings = parse_settings(config.extra_config)
        super().__init__(config)
        self._kvhex_manager: KvhexOffloadingManager | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """vLLM's worker on CUDA-alike and XPU platforms; kvhex's CPU worker on vLLM's CPU
        platform, where vLLM's own refuses (built once, by ``create_worker``).

        Raises:
            ConfigError: ``canonical_layout`` on the CPU platform (kvhex's CPU worker writes
                the direct, per-rank layout only).
            TransferError: the KV tensors do not fit the region's cells.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            worker: OffloadingWorker = super().get_worker(kv_caches)
            return worker
        built: OffloadingWorker | None = getattr(self, "_worker", None)  # vLLM's cache
        if built is None:
            built = self._worker = self.create_worker(kv_caches)
        return built

    def create_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        """vLLM's ``CPUOffloadingWorker`` (``TieringOffloadingSpec``'s) off the CPU platform;
        on it, kvhex's ``KvhexCpuOffloadingWorker`` on this rank's cells of the same shared
        region (rank 0's under the replicated layout)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return super().create_worker(kv_caches)
        from kvhex.adapters.vllm.worker import KvhexCpuOffloadingWorker

        if self.config.canonical_layout:
            raise ConfigError(
                [
                    (
                        "$.canonical_layout",
                        "not supported on vLLM's CPU platform: kvhex's CPU worker writes "
                        "the direct per-rank layout (remove the key)",
                    )
                ],
                SOURCE,
            )
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            cells = region.create_next_worker_view(self.cpu_page_size_per_worker)
            return KvhexCpuOffloadingWorker(
                kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                cells=cells,
                release=region.cleanup,
            )
        except BaseException:
            region.cleanup()
            raise

    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager (built once).

        Raises:
            ConfigError: the host memory holds no chunk, the policy or a tier is unknown or
                misconfigured.
            TierError: a tier cannot run (e.g. an unwritable root).
        """
        if self._kvhex_manager is None:
            self._kvhex_manager = self._build_manager()
        return self._kvhex_manager

    def _build_manager(self) -> KvhexOffloadingManager:
        if self.num_chunks < 1:
            raise ConfigError(
                [
                    (
                        "$.cpu_bytes_to_use",
                        f"{self.settings.cpu_bytes_to_use} bytes hold no chunk of "
                        f"{self.kv_bytes_per_chunk} bytes",
                    )
                ],
                SOURCE,
            )
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=None,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        host = RegionHostBuffer(
            region.create_kv_memoryview(), self.num_chunks, self.kv_bytes_per_chunk, region.cleanup
        )
        try:
            from vllm import envs

            events = self.kv_events_config.enable_kv_cache_events
            geometry = geometry_of(self.config)
            engine, stores = build_engine(
                self.settings,
                host,
                registry=Registry.discover(),
                namespace=namespace_of(self.config, self.kv_bytes_per_chunk),
                record_events=events,
                geometry=geometry,
                int_hashes=bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES),
            )
        except BaseException:
            host.close()
            raise
        silent = [
            store.identity
            for store, tier in zip(stores, self.settings.tiers, strict=True)
            if not tier.enable_kv_events
        ]
        log.info(
            "kvhex_offloading_ready",
            chunks=self.num_chunks,
            chunk_bytes=self.kv_bytes_per_chunk,
            policy=self.settings.policy,
            tiers=[t.name for t in self.settings.tiers],
        )
        return KvhexOffloadingManager(
            engine,
            events_enabled=events,
            silent_tiers=silent,
            geometry=geometry,
            tier_stores=stores,
        )
