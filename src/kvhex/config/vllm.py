"""vLLM's ``kv_connector_extra_config`` in kvhex's configuration model.

The same attrs classes, converter and error paths as TOML and JSON (``kvhex.config.loader``);
no vLLM import. The top level holds the keys of vLLM's ``CPUOffloadingSpec`` and
``TieringOffloadingSpec`` (same meaning), the keys vLLM's connector and spec base class read
themselves (declared, checked where vLLM would misread a value, and left to vLLM), and a
``kvhex`` object with kvhex-only settings. A ``secondary_tiers`` entry is a tagged union on
``type``: vLLM's ``fs`` and ``obj``, which kvhex builds as its ``fsspec`` and ``nixl`` tiers,
and ``KvhexSecondaryTier``, any ``kvhex.tiers`` entry point whose other keys are its options.
What each entry means in kvhex's terms is ``kvhex.vllm.settings``.
"""

# No ``from __future__ import annotations`` here: cattrs reads these annotations at runtime.

from collections.abc import Sequence
from typing import Annotated, Any

import attrs

from kvhex.config.model import (
    HINT,
    STORE_THRESHOLD_WITH_TIERS,
    BackpressureConfig,
    ByteCount,
    CodecList,
    LoadingConfig,
    NonEmptyStr,
    NonNegativeInt,
    Options,
    PluginName,
    PositiveInt,
    RouterName,
    TaggedUnion,
    TierName,
    Unsupported,
    check_router_block_size,
    check_tier_name,
    duplicate_tier_names,
    empty_url,
)
from kvhex.domain.tiers import Locality
from kvhex.errors import ConfigError, ConfigIssue

SOURCE = "kv_connector_extra_config"
"""What a ``ConfigError`` from vLLM's extra config names as its source."""

KVHEX_TIER_TYPE = "KvhexSecondaryTier"
"""The ``type`` of a ``secondary_tiers`` entry that names any kvhex tier."""

VLLM_READS = "vllm_reads"
"""Field metadata: the key is read by vLLM itself; kvhex declares it and passes it by."""


_READ_BY_VLLM = {VLLM_READS: True}


_VLLM_BACKPRESSURE = Unsupported(
    "vLLM's backpressure detectors are not used by kvhex; set kvhex.backpressure inside the "
    "tier entry instead (seconds per put job)"
)


@attrs.frozen(kw_only=True)
class VllmEngineOptions:
    """The top-level ``kvhex`` object: kvhex-only engine settings.

    Attributes:
        policy: the host tier's eviction policy (overrides ``eviction_policy``).
        loading: load or recompute prefixes held by secondary tiers (as TOML's
            ``[loading]``).
        transfer: on vLLM's CPU platform, the ``kvhex.transfers`` entry point kvhex's worker
            copies with between vLLM's KV tensors and the host region (``torch``, or a third
            party's taking the same arguments); elsewhere vLLM's own worker copies.
        transfer_options: keyword arguments of that transfer's factory besides what the
            worker passes (the cells, the tensors, ``tensor_groups``, ``blocks_per_chunk``).
        router: the KV-aware router reading this engine's events (``dynamo``,
            ``vllm-router``), as TOML's ``[events] router``: kvhex warns at start-up about
            every setting (its own, and vLLM's block size and event topic) whose events that
            router would drop or miscredit.
        router_block_size: the block size that router reads (default: its own default).
    """

    policy: PluginName | None = None
    loading: LoadingConfig = attrs.field(factory=LoadingConfig)
    transfer: PluginName = attrs.field(default=PluginName("torch"))
    transfer_options: Options = attrs.field(factory=lambda: Options({}))
    router: RouterName | None = None
    router_block_size: PositiveInt | None = None

    def __attrs_post_init__(self) -> None:
        problem = check_router_block_size(self.router, self.router_block_size)
        if problem is not None:
            raise ValueError(problem)


@attrs.frozen(kw_only=True)
class VllmTierOptions:
    """A tier entry's ``kvhex`` object: kvhex-only settings of that tier.

    Attributes:
        name: the tier's name (stats, logs, and the ownership of its events where they
            announce one); unique among the tiers.
        capacity_bytes: bytes the tier may hold (``fs``: default the free space of its
            filesystem at start-up; ``obj``: default unbounded, as vLLM's).
        backpressure: kvhex's cascade admission for this tier (default: admit all).
        announce_ownership: name the tier as the ``ownership`` of its events (off by
            default: Dynamo's indexer drops events that name one).
        announce_peers: also announce the blocks other instances sharing the tier's storage
            hold there (``fs``, ``obj``: the file and object tiers' option).
        peer_scan_interval_s: how often the other instances' blocks are looked for.
        medium: the medium the tier's events announce (default ``STORAGE``; ``DISK``,
            ``SHARED_STORAGE``, ...: what the routers reading them expect).
        codec: the tier's codec chain (``["zstd"]``, ``["fp8", "zstd"]``, ``["aes-gcm"]``;
            docs/codecs.md): ``fs`` and kvhex tiers that take one.
    """

    name: TierName | None = None
    capacity_bytes: PositiveInt | None = None
    backpressure: BackpressureConfig | None = None
    announce_ownership: bool = False
    announce_peers: bool | None = None
    peer_scan_interval_s: float | None = None
    medium: str | None = None
    codec: CodecList | None = None


@attrs.frozen(kw_only=True)
class _TierEntry:
    """What every ``secondary_tiers`` entry may hold.

    Attributes:
        module_path: vLLM's: the module of the tier class (kvhex's are registered).
        enable_kv_events: announce this tier's stores and removals (only while vLLM's KV
            events are on).
        locality: ``LOCAL``, ``REMOTE`` or ``SHARED`` (any case), announced in events.
        backpressure: vLLM's detector settings; refused (kvhex has its own, in ``kvhex``).
        kvhex: kvhex-only settings of the tier.
    """

    module_path: str | None = attrs.field(default=None, metadata=_READ_BY_VLLM)
    enable_kv_events: bool = False
    locality: Locality | None = None
    backpressure: Annotated[Any, _VLLM_BACKPRESSURE] = None
    kvhex: VllmTierOptions = attrs.field(factory=VllmTierOptions)

    def tier_name(self, index: int) -> str:
        """The tier's name: ``kvhex.name``, else the entry's kind (``fs``, ``obj``, the
        kvhex plugin), followed by the entry's index unless it is the first."""
        return self.kvhex.name or self._kind() + (str(index) if index else "")

    def _kind(self) -> str:
        raise NotImplementedError


@attrs.frozen(kw_only=True)
class FsTierEntry(_TierEntry):
    """vLLM's file tier (``type = "fs"``), built as kvhex's ``fsspec`` tier on local files.

    Attributes:
        root_dir: the tier's directory.
        n_read_threads, n_write_threads: vLLM's IO threads; kvhex's tier gets their sum.
    """

    type: str = "fs"
    root_dir: NonEmptyStr = attrs.field(metadata={HINT: "the tier's directory"})
    n_read_threads: PositiveInt | None = None
    n_write_threads: PositiveInt | None = None

    def _kind(self) -> str:
        return "fs"


@attrs.frozen(kw_only=True)
class ObjStoreConfig:
    """vLLM's ``store_config`` of an ``obj`` tier (an S3 endpoint and bucket)."""

    bucket: NonEmptyStr = attrs.field(metadata={HINT: "an existing bucket's name"})
    endpoint_override: NonEmptyStr = attrs.field(
        metadata={HINT: "the S3 endpoint: host:port, or a URL with its scheme"}
    )
    access_key: str = ""
    secret_key: str = ""
    region: str = ""
    scheme: str = ""
    session_token: Annotated[Any, Unsupported("not supported by kvhex's object-store tier")] = None
    ca_bundle: Annotated[Any, Unsupported("not supported by kvhex's object-store tier")] = None


@attrs.frozen(kw_only=True)
class ObjTierEntry(_TierEntry):
    """vLLM's object-store tier (``type = "obj"``), built as kvhex's ``nixl`` tier on NIXL's
    OBJ backend.

    Attributes:
        store_config: the endpoint, bucket and credentials.
        prefix: the key prefix in the bucket.
        io_threads: IO threads of the tier.
    """

    type: str = "obj"
    store_config: ObjStoreConfig = attrs.field(
        metadata={HINT: "an object with bucket, endpoint_override and the credentials"}
    )
    prefix: str = ""
    io_threads: PositiveInt | None = None

    def _kind(self) -> str:
        return "obj"


@attrs.frozen(kw_only=True)
class KvhexTierEntry(_TierEntry):
    """Any kvhex tier (``type = "KvhexSecondaryTier"``); the same entry works in vLLM's own
    ``TieringOffloadingSpec``.

    Attributes:
        tier: the ``kvhex.tiers`` entry point.
        options: every other key of the entry: the tier's options, checked against its
            factory's signature before anything is built.
    """

    type: str = KVHEX_TIER_TYPE
    tier: PluginName = attrs.field(metadata={HINT: "a kvhex.tiers entry point"})
    options: Options = attrs.field(factory=lambda: Options({}), metadata={"rest": True})

    def tier_name(self, index: int) -> str:
        """As for every entry, except that a string ``name`` option comes before the kind."""
        named = self.options.get("name")
        if self.kvhex.name is None and isinstance(named, str):
            return named
        return super().tier_name(index)

    def _kind(self) -> str:
        return self.tier


VllmTierEntry = FsTierEntry | ObjTierEntry | KvhexTierEntry

TIER_ENTRIES = TaggedUnion(
    type=VllmTierEntry,
    key="type",
    members={"fs": FsTierEntry, "obj": ObjTierEntry, KVHEX_TIER_TYPE: KvhexTierEntry},
    noun="tier",
    hint=(
        f"KvhexOffloadingSpec builds 'fs', 'obj' and '{KVHEX_TIER_TYPE}' (any kvhex.tiers "
        "entry point, named by 'tier')"
    ),
)
"""``secondary_tiers`` entries, told apart by ``type``."""


@attrs.frozen(kw_only=True)
class VllmExtraConfig:
    """vLLM's ``kv_connector_extra_config`` for ``KvhexOffloadingSpec``.

    Attributes:
        cpu_bytes_to_use: host memory for KV chunks (vLLM's arithmetic makes the chunks).
        eviction_policy: the host tier's policy, a ``kvhex.policies`` entry point.
        cache_policy_module_path: a vLLM ``CachePolicy`` class; refused (kvhex cannot run
            one).
        store_threshold: offers before a chunk is stored (0 and 1 store at once).
        max_tracker_size: keys whose offers are counted.
        offload_prompt_only: read by vLLM's scheduler (offload prompt blocks only).
        self_describing_kv_events: read by vLLM's events tracker (stock connector).
        secondary_tiers: tiers in lookup and cascade order.
        backpressure: vLLM's detector defaults; refused (see ``kvhex.backpressure`` of a
            tier).
        kvhex: kvhex-only engine settings.
        spec_name ... tier_poll_interval_s: read by vLLM's connector, factory and spec.
    """

    cpu_bytes_to_use: ByteCount = attrs.field(metadata={HINT: "bytes of host memory for KV chunks"})
    eviction_policy: PluginName = attrs.field(default=PluginName("lru"))
    cache_policy_module_path: Annotated[
        Any,
        Unsupported(
            "names a vLLM CachePolicy class, which kvhex cannot run; install the policy as a "
            "kvhex.policies entry point and name it in eviction_policy"
        ),
    ] = None
    store_threshold: NonNegativeInt = attrs.field(default=NonNegativeInt(0))
    max_tracker_size: PositiveInt = attrs.field(default=PositiveInt(64_000))
    offload_prompt_only: bool = attrs.field(default=True, metadata=_READ_BY_VLLM)
    self_describing_kv_events: bool = attrs.field(default=False, metadata=_READ_BY_VLLM)
    secondary_tiers: tuple[VllmTierEntry, ...] = ()
    backpressure: Annotated[Any, _VLLM_BACKPRESSURE] = None
    kvhex: VllmEngineOptions = attrs.field(factory=VllmEngineOptions)
    spec_name: Any = attrs.field(default=None, metadata=_READ_BY_VLLM)
    spec_module_path: Any = attrs.field(default=None, metadata=_READ_BY_VLLM)
    block_size: Any = attrs.field(default=None, metadata=_READ_BY_VLLM)
    blocks_per_chunk: Any = attrs.field(default=None, metadata=_READ_BY_VLLM)
    canonical_layout: Any = attrs.field(default=None, metadata=_READ_BY_VLLM)
    sync_load_budget_bytes: Any = attrs.field(default=None, metadata=_READ_BY_VLLM)
    max_recompute_pending_tokens: Any = attrs.field(default=None, metadata=_READ_BY_VLLM)
    tier_poll_interval_s: Any = attrs.field(default=None, metadata=_READ_BY_VLLM)

    def __attrs_post_init__(self) -> None:
        """Checks across keys, before anything is built.

        Raises:
            ConfigError: ``store_threshold`` >= 2 with tiers; see :func:`tier_issues`.
        """
        issues: list[ConfigIssue] = []
        if self.secondary_tiers and self.store_threshold >= 2:
            issues.append(("$.store_threshold", STORE_THRESHOLD_WITH_TIERS))
        issues += tier_issues(
            [(f"$.secondary_tiers[{i}]", t) for i, t in enumerate(self.secondary_tiers)]
        )
        if issues:
            raise ConfigError(issues)


def tier_issues(entries: Sequence[tuple[str, VllmTierEntry]]) -> list[ConfigIssue]:
    """Checks across an entry's keys, and across entries: names that are not valid or repeat
    an earlier entry's, and an empty ``url`` option; each at the key to change.

    Args:
        entries: each entry with its path, in order (the index names unnamed ones).
    """
    issues: list[ConfigIssue] = []
    named: list[tuple[str, str, str]] = []
    for i, (path, entry) in enumerate(entries):
        name = entry.tier_name(i)
        where = f"{path}.kvhex.name"  # where a name is set, or would be
        if (
            entry.kvhex.name is None
            and isinstance(entry, KvhexTierEntry)
            and "name" in entry.options
        ):
            where = f"{path}.name"  # the tier's own name option
            try:
                check_tier_name(entry.options["name"])
            except (TypeError, ValueError) as exc:
                issues.append((where, str(exc)))
        named.append((name, path, where))
        if isinstance(entry, KvhexTierEntry):
            issues += empty_url(entry.options, f"{path}.url")
    return issues + duplicate_tier_names(named)
