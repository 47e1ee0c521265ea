"""vLLM's ``kv_connector_extra_config`` -> what kvhex builds from it (no vLLM import).

The keys are checked by kvhex's configuration model (``kvhex.config.vllm``: the same converter
and error paths as TOML, every problem at once, each at its key, with
``kv_connector_extra_config`` as the source). This module says what they mean in kvhex's
terms: the host tier's policy and threshold, and for each ``secondary_tiers`` entry the
``kvhex.tiers`` plugin it builds, its options, and the key each option came from, so that an
error a tier raises while it is built names the key the user wrote (``root_dir``, not
``url``; ``store_config.endpoint_override``, not ``endpoint_url``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvhex.bootstrap import EntryPaths
from kvhex.config.loader import load_vllm_config, load_vllm_tier
from kvhex.config.model import BackpressureConfig, LoadingConfig
from kvhex.config.vllm import KVHEX_TIER_TYPE, FsTierEntry, ObjTierEntry, VllmTierEntry
from kvhex.domain.tiers import Locality


@attrs.frozen
class TierSettings:
    """One secondary tier: which kvhex tier plugin to build, with which options.

    Attributes:
        paths: where the entry and each option's key are in the extra config.
        type: the entry's vLLM ``type`` (``fs``, ``obj`` or ``KvhexSecondaryTier``).
        plugin: the ``kvhex.tiers`` entry point that implements it.
        name: the tier's name (stats, logs; the ownership of its events where they name
            one); unique per engine.
        options: keyword arguments for the plugin (``host`` and ``namespace`` come later).
        enable_kv_events: announce this tier's stores and removals (vLLM's key; effective
            only with vLLM's global KV events on).
        locality: announced locality (vLLM's key), ``None`` when unspecified.
        backpressure: admission for cascades to this tier; ``None`` admits all.
        default_capacity: ``options`` has no ``capacity_bytes``: the builder picks one.
        announce_ownership: the tier's events name it as their ``ownership``.
    """

    paths: EntryPaths
    type: str
    plugin: str
    name: str
    options: Mapping[str, Any]
    enable_kv_events: bool = False
    locality: Locality | None = None
    backpressure: BackpressureConfig | None = None
    default_capacity: bool = False
    announce_ownership: bool = False


@attrs.frozen
class VllmSettings:
    """What ``KvhexOffloadingSpec`` builds from the extra config.

    Attributes:
        policy_path: the key that named ``policy`` (``$.kvhex.policy`` or
            ``$.eviction_policy``).
        store_threshold: at least 1 (vLLM's 0 and 1 both store at once).
        loading: load or recompute (``$.kvhex.loading``).
        transfer, transfer_options: the CPU worker's ``kvhex.transfers`` entry point and
            its factory's options (``$.kvhex.transfer``, ``$.kvhex.transfer_options``).
        router, router_block_size: the KV-aware router reading the events and the block
            size it reads (``$.kvhex.router``, ``$.kvhex.router_block_size``).
    """

    cpu_bytes_to_use: int
    policy: str
    policy_path: str
    store_threshold: int
    max_tracker_size: int
    tiers: tuple[TierSettings, ...]
    loading: LoadingConfig = attrs.field(factory=LoadingConfig)
    transfer: str = "torch"
    transfer_options: Mapping[str, Any] = attrs.field(factory=dict)
    router: str | None = None
    router_block_size: int | None = None


def parse_settings(extra: Mapping[str, Any]) -> VllmSettings:
    """Check vLLM's ``kv_connector_extra_config`` for ``KvhexOffloadingSpec``.

    Raises:
        ConfigError: every problem found, each with the path of its key.
    """
    config = load_vllm_config(extra)
    policy = config.kvhex.policy
    return VllmSettings(
        cpu_bytes_to_use=config.cpu_bytes_to_use,
        policy=policy or config.eviction_policy,
        policy_path="$.kvhex.policy" if policy else "$.eviction_policy",
        store_threshold=max(1, config.store_threshold),
        max_tracker_size=config.max_tracker_size,
        tiers=tuple(
            _tier(entry, f"$.secondary_tiers[{i}]", i)
            for i, entry in enumerate(config.secondary_tiers)
        ),
        loading=config.kvhex.loading,
        transfer=config.kvhex.transfer,
        transfer_options=dict(config.kvhex.transfer_options),
        router=config.kvhex.router,
        router_block_size=config.kvhex.router_block_size,
    )


def parse_tier(entry: Any, path: str = "$") -> TierSettings:
    """Check one tier entry (as ``SecondaryTierFactory`` hands it over).

    Raises:
        ConfigError: every problem found in the entry.
    """
    return _tier(load_vllm_tier(entry, path=path), path, 0)


def _tier(entry: VllmTierEntry, path: str, index: int) -> TierSettings:
    """What entry ``index`` of ``secondary_tiers``, at ``path``, builds."""
    kvhex = f"{path}.kvhex"
    keys = {"name": f"{kvhex}.name", "capacity_bytes": f"{kvhex}.capacity_bytes"}
    options: dict[str, Any]
    if isinstance(entry, FsTierEntry):
        plugin = "fsspec"
        options = {"url": entry.root_dir}
        keys |= {"url": f"{path}.root_dir", "io_threads": path}
        threads = [n for n in (entry.n_read_threads, entry.n_write_threads) if n is not None]
        if threads:
            options["io_threads"] = sum(threads)
        options["locality"] = entry.locality
    elif isinstance(entry, ObjTierEntry):
        plugin = "nixl"
        options, store_keys = _object_store(entry, f"{path}.store_config")
        keys |= store_keys
        if entry.io_threads is not None:
            options["io_threads"] = entry.io_threads
        options["locality"] = entry.locality
    else:
        plugin = entry.tier
        options = dict(entry.options)
        keys = {k: v for k, v in keys.items() if k not in options}  # the entry's own keys
        if entry.locality is not None:
            options["locality"] = entry.locality
    keys["locality"] = f"{path}.locality"  # vLLM's key, on every entry
    if entry.type != KVHEX_TIER_TYPE:
        keys["medium"] = f"{kvhex}.medium"  # the only key that sets it there
    if entry.kvhex.capacity_bytes is not None:
        options["capacity_bytes"] = entry.kvhex.capacity_bytes
        keys["capacity_bytes"] = f"{kvhex}.capacity_bytes"
    for key in ("announce_peers", "peer_scan_interval_s", "medium", "codec"):
        value = getattr(entry.kvhex, key)
        if value is not None:
            options[key] = value
            keys[key] = f"{kvhex}.{key}"
    return TierSettings(
        paths=EntryPaths(
            path, f"{path}.tier" if entry.type == KVHEX_TIER_TYPE else f"{path}.type", path, keys
        ),
        type=entry.type,
        plugin=plugin,
        name=entry.tier_name(index),
        options=options,
        enable_kv_events=entry.enable_kv_events,
        locality=entry.locality,
        backpressure=entry.kvhex.backpressure,
        default_capacity="capacity_bytes" not in options and entry.type != KVHEX_TIER_TYPE,
        announce_ownership=entry.kvhex.announce_ownership,
    )


def _object_store(entry: ObjTierEntry, where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's ``store_config`` and ``prefix`` -> the NIXL tier's url and credentials, and the
    key each came from."""
    store = entry.store_config
    prefix = entry.prefix.strip("/")
    endpoint: str = store.endpoint_override
    if "://" not in endpoint:
        endpoint = f"{store.scheme or 'http'}://{endpoint}"
    options = {
        "url": f"s3://{store.bucket}" + (f"/{prefix}" if prefix else ""),
        "endpoint_url": endpoint,
        "access_key": store.access_key or None,
        "secret_key": store.secret_key or None,
        "region": store.region or "us-east-1",
    }
    keys = {key: f"{where}.{key}" for key in ("access_key", "secret_key", "region")}
    return options, keys | {"url": f"{where}.bucket", "endpoint_url": f"{where}.endpoint_override"}
