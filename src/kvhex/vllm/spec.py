"""``KvhexOffloadingSpec``: a vLLM ``OffloadingSpec`` whose manager is kvhex's engine.

Select it with ``kv_connector_extra_config["spec_name"] = "KvhexOffloadingSpec"`` (the
``vllm.general_plugins`` entry point registers the name; ``spec_module_path:
"kvhex.vllm"`` works without it). It takes the keys of vLLM's ``CPUOffloadingSpec``
and ``TieringOffloadingSpec`` with their meaning (see ``settings``), so switching an
existing configuration to kvhex changes ``spec_name`` alone.

Scheduler side (``get_manager``): the host primary tier lives in vLLM's shared offload region
(the same ``/dev/shm`` mapping, layout and capacity arithmetic as vLLM's tiering spec), kvhex
tiers read and write it through slot views, and ``KvhexOffloadingManager`` drives it all.

Worker side (``get_worker``): on CUDA-alike and XPU platforms, vLLM's own
``CPUOffloadingWorker`` on that region, exactly as ``TieringOffloadingSpec`` builds it
(docs/vllm.md says why: its pinning and DMA/Triton copy kernels, canonical layout). On vLLM's
CPU platform, where vLLM's worker refuses to run, kvhex's ``KvhexCpuOffloadingWorker`` on the
same region and in the same layout (``kvhex.vllm.worker``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import secrets
from typing import Any

import structlog
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
    canonical_format_id,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvhex.config.vllm import SOURCE
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import ConfigError
from kvhex.plugins import TRANSFERS, Registry
from kvhex.ports.tier_store import tier_identities
from kvhex.vllm._compat import (
    HASH_SCHEME,
    HOST_LAYOUT,
    connector_configs,
    group_kind,
    hash_lookahead_tokens,
)
from kvhex.vllm._convert import vllm_locality, vllm_medium
from kvhex.vllm.compose import RegionHostBuffer, build_engine, check_router
from kvhex.vllm.manager import KvhexOffloadingManager
from kvhex.vllm.metrics import metric_definitions
from kvhex.vllm.settings import VllmSettings, parse_settings

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


def namespace_of(
    config: OffloadingConfig,
    kv_bytes_per_chunk: int,
    engine: tuple[VllmConfig, KVCacheConfig] | None = None,
) -> dict[str, Any]:
    """What makes stored blocks interchangeable between engines: kvhex tiers share blocks
    only between equal namespaces (``ROOT/<namespace digest>/``), so everything that changes a
    block's bytes or its key is in it (docs/tiers.md gives each field's reason). Something
    left out would let one engine serve another's KV as a hit, silently (vLLM #55191).

    ``engine``: this engine's ``VllmConfig`` and ``KVCacheConfig``; by default those of the
    vLLM connector building ``config`` (``compat.connector_configs``). Without them (a spec
    built outside vLLM's connector) the hash scheme, model revision, quantization, HF config
    and cache specs are unknown, and the namespace is this process's own: never shared.
    """
    p = config.parallel
    namespace: dict[str, Any] = {
        "engine": "vllm",
        "hash_scheme": HASH_SCHEME,
        "model": config.model.name,
        "kv_cache_dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "world_size": p.world_size,
        "tp_pp_pcp_dcp": [p.tp_size, p.pp_size, p.pcp_size, p.dcp_size],
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "canonical_format": (
            canonical_format_id(config.kv_cache_layout)
            if config.canonical_layout and config.kv_cache_layout
            else None
        ),
        "kv_cache_layout": config.kv_cache_layout,
        "host_layout": HOST_LAYOUT,
        "kv_bytes_per_chunk": kv_bytes_per_chunk,
    }
    found = engine or connector_configs(config)
    if found is None:
        log.warning(
            "namespace_unshared",
            why="no vLLM connector is building this spec: its blocks are this process's own",
        )
        namespace["groups"] = _groups(config, None)
        namespace["unshared"] = _process_token()
        return namespace
    vllm_config, kv_cache_config = found
    namespace["groups"] = _groups(config, kv_cache_config)
    namespace |= _engine_fields(vllm_config)
    return namespace


RANDOM_HASH_ROOT = "random-per-process"
"""``hash_root`` of an engine whose vLLM draws its hash seed per process."""


def _engine_fields(vllm_config: VllmConfig) -> dict[str, Any]:
    """The namespace fields only ``VllmConfig`` holds: how keys are hashed, which weights and
    numerics computed the KV, how tokens are spread over context-parallel ranks."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    algo = cache.prefix_caching_hash_algo
    draft = vllm_config.speculative_config
    return {
        "hash_algo": algo,
        "hash_root": _hash_root(algo),
        "hash_lookahead_tokens": hash_lookahead_tokens(vllm_config),
        "model_weights": model.model_weights or None,
        "revision": model.revision,
        "code_revision": model.code_revision,
        "hf_config": _digest(_without_volatile(model.hf_config.to_dict())),
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "quantization": model.quantization,
        "quantization_config": (
            None if model.quantization_config is None else _digest(model.quantization_config)
        ),
        "disable_sliding_window": model.disable_sliding_window,
        "kv_cache_dtype_skip_layers": sorted(map(str, cache.kv_cache_dtype_skip_layers)),
        "mamba_cache_dtypes": [str(cache.mamba_cache_dtype), str(cache.mamba_ssm_cache_dtype)],
        "cp_interleave": vllm_config.parallel_config.cp_kv_cache_interleave_size,
        # a drafter with KV layers (EAGLE, MTP, a draft model); n-gram drafting has none
        "draft_model": (
            [draft.method, draft.model, draft.revision, draft.quantization]
            if draft is not None and draft.uses_draft_kv_cache()
            else None
        ),
    }


def _groups(config: OffloadingConfig, kv_cache_config: KVCacheConfig | None) -> list[Any]:
    """Each offloaded KV group: its index (the key's suffix), tokens per block, layers, and
    its cache spec's kind and window as vLLM's events name them (None when unknown)."""
    out = []
    for group in config.groups:
        kind = window = None
        if kv_cache_config is not None:
            spec = kv_cache_config.kv_cache_groups[group.group_id].kv_cache_spec
            kind = get_kv_cache_spec_kind(spec).value
            window = get_kv_cache_spec_sliding_window(spec)
        out.append([group.group_id, group.tokens_per_block, list(group.layer_names), kind, window])
    return out


def _hash_root(algo: str) -> str:
    """A digest of the ``NONE_HASH`` every block-hash chain of this engine starts from (the
    algorithm applied to vLLM's seed: ``PYTHONHASHSEED`` when set, else a fixed default for
    SHA-256, else random per process), resolved as vLLM will resolve it: the spec is built
    before vLLM initializes it. A per-process seed gives ``RANDOM_HASH_ROOT``: one namespace
    for all such runs, whose blocks no other process can hit (their keys differ), so they only
    age out of the tier's capacity. The seed is never recorded, only a digest of the root."""
    hash_fn = get_hash_fn_by_name(algo)
    seed = resolve_none_hash_seed(hash_fn)
    if seed != resolve_none_hash_seed(hash_fn):
        log.warning(
            "block_hashes_random_per_process",
            hash_algo=algo,
            why="no other process or restart can hit this engine's blocks; set "
            "PYTHONHASHSEED (the same in every engine) or use sha256",
        )
        return RANDOM_HASH_ROOT
    return _digest(hash_fn(seed).hex())


_VOLATILE_HF_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})
"""HF config keys that say how or where a config was saved, not what the model computes."""


def _without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in _VOLATILE_HF_KEYS}
    if isinstance(value, list | tuple):
        return [_without_volatile(v) for v in value]
    return value


def _digest(value: Any) -> str:
    """16 hex digits of SHA-256 over canonical JSON: the same in every process."""
    text = json.dumps(value, sort_keys=True, default=_plain)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(map(str, value))  # never in hash order, which differs per process
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


@functools.cache
def _process_token() -> str:
    return secrets.token_hex(8)


class KvhexOffloadingSpec(TieringOffloadingSpec):
    """vLLM's offloading spec for kvhex: host tier + kvhex tiers behind vLLM's manager API.

    Raises (at construction, so vLLM fails at start-up):
        ConfigError: the extra config is malformed; every bad key is named.
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        # vLLM's CPU and tiering definitions (kvhex's manager emits both); not those of vLLM's
        # tier classes, whose resolution would also reject kvhex-only tier entries
        return metric_definitions(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return ()

    def __init__(self, config: OffloadingConfig) -> None:
        self.settings: VllmSettings = parse_settings(config.extra_config)
        _check_transfer(self.settings.transfer)
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
        from kvhex.vllm.worker import KvhexCpuOffloadingWorker

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
                transfer=self.settings.transfer,
                transfer_options=self.settings.transfer_options,
            )
        except BaseException:
            region.cleanup()
            raise

    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager (built once).

        Raises:
            ConfigError: the host memory holds no chunk, the policy or a tier is unknown or
                misconfigured, or a tier cannot start (an unwritable root, an object store
                that is down or refuses the credentials), each at the key to correct.
            TierError: a tier failed otherwise while it started.
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
        if events:
            self._check_router(stores, int_hashes=bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES))
        silent = [
            identity
            for store, tier in zip(stores, self.settings.tiers, strict=True)
            if not tier.enable_kv_events
            for identity in tier_identities(store)
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
            host=host,
            store_threshold=self.settings.store_threshold,
        )

    def _check_router(self, stores: list[Any], *, int_hashes: bool) -> None:
        """Warn about what ``kvhex.router`` would drop or miscredit (``compose.check_router``),
        reading vLLM's publisher topic and connector from the engine's ``VllmConfig`` where a
        connector builds this spec: vLLM's stock connector publishes kvhex's tiers through
        vLLM's events tracker, which names only ``CPU`` and ``STORAGE`` and no ``SHARED``
        locality (``_convert``); kvhex's connector publishes them as they are."""
        if self.settings.router is None:
            return
        topic: str | None = None
        published = _as_published
        found = connector_configs(self.config)
        if found is not None:
            vllm_config = found[0]
            if vllm_config.kv_events_config is not None:
                topic = vllm_config.kv_events_config.topic
            transfer = vllm_config.kv_transfer_config
            if transfer is not None and transfer.kv_connector != KVHEX_CONNECTOR:
                published = _as_vllm_tracker_publishes
        check_router(
            self.settings,
            stores,
            int_hashes=int_hashes,
            topic=topic,
            block_sizes=[group.tokens_per_block for group in self.config.groups],
            published=published,
        )


KVHEX_CONNECTOR = "KvhexOffloadingConnector"
"""The ``kv_connector`` whose events kvhex's translator publishes (``kvhex.vllm.connector``)."""


def _as_published(identity: TierIdentity) -> TierIdentity:
    return identity


def _as_vllm_tracker_publishes(identity: TierIdentity) -> TierIdentity:
    """A tier's identity as vLLM's own events tracker names it (the stock connector)."""
    locality = vllm_locality(identity)
    return TierIdentity(
        Medium(vllm_medium(identity).value),
        Locality(locality.value) if locality is not None else None,
        identity.ownership,
    )


def _check_transfer(name: str) -> None:
    """Refuse an unknown ``kvhex.transfer`` when the spec is built, in the scheduler as in
    each worker, so no process starts with a worker that cannot.

    Raises:
        ConfigError: at ``$.kvhex.transfer``, listing the installed transfers.
    """
    names = Registry.discover([TRANSFERS]).names(TRANSFERS)
    if name not in names:
        available = ", ".join(names) or "none installed"
        raise ConfigError(
            [("$.kvhex.transfer", f"unknown transfer {name!r}; available: {available}")], SOURCE
        )
