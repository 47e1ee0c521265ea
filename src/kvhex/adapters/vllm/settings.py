"""vLLM's ``kv_connector_extra_config`` -> validated settings for kvhex's vLLM adapter.

Pure data checking, no vLLM import: the same checks run in kvhex's own test environment and
inside vLLM. Every problem is collected and raised at once as one ``ConfigError`` whose paths
name the keys (``$.secondary_tiers[1].root_dir``), so a bad configuration fails vLLM's
start-up with a message that says what to fix.

Drop-in keys (vLLM's ``CPUOffloadingSpec`` and ``TieringOffloadingSpec``, same meaning):
``cpu_bytes_to_use``, ``eviction_policy``, ``store_threshold``, ``max_tracker_size``,
``offload_prompt_only``, ``self_describing_kv_events``, ``secondary_tiers`` (types ``fs`` and
``obj`` with their keys). Keys vLLM's connector itself reads (``spec_name``, ``block_size``,
...) are accepted and left to vLLM. kvhex-only settings live in one ``kvhex`` sub-object, at
the top level (engine-wide) and inside a tier entry (that tier's). A tier entry of type
``KvhexSecondaryTier`` names any ``kvhex.tiers`` entry point; the same entry works in vLLM's
own ``TieringOffloadingSpec`` (see ``kvhex.adapters.vllm.tier``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

import attrs

from kvhex.domain.tiers import Locality
from kvhex.errors import ConfigError, ConfigIssue

__all__ = [
    "KVHEX_TIER_TYPE",
    "SOURCE",
    "BackpressureSettings",
    "TierSettings",
    "VllmSettings",
    "parse_settings",
    "parse_tier",
]

SOURCE = "kv_connector_extra_config"
KVHEX_TIER_TYPE = "KvhexSecondaryTier"

_VLLM_ONLY_KEYS = frozenset(
    {
        # read by vLLM's connector, scheduler or config builder, not by the spec
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "sync_load_budget_bytes",
        "max_recompute_pending_tokens",
        "tier_poll_interval_s",
    }
)
_SPEC_KEYS = frozenset(
    {
        "cpu_bytes_to_use",
        "eviction_policy",
        "cache_policy_module_path",
        "store_threshold",
        "max_tracker_size",
        "offload_prompt_only",
        "self_describing_kv_events",
        "secondary_tiers",
        "backpressure",
        "kvhex",
    }
)
_TOP_KVHEX_KEYS = ("policy",)
_TIER_KVHEX_KEYS = ("name", "capacity_bytes", "backpressure")
_FS_KEYS = (
    "type",
    "module_path",
    "root_dir",
    "n_read_threads",
    "n_write_threads",
    "enable_kv_events",
    "locality",
    "backpressure",
    "kvhex",
)
_OBJ_KEYS = (
    "type",
    "module_path",
    "store_config",
    "prefix",
    "io_threads",
    "enable_kv_events",
    "locality",
    "backpressure",
    "kvhex",
)
_STORE_CONFIG_KEYS = (
    "bucket",
    "endpoint_override",
    "access_key",
    "secret_key",
    "session_token",
    "region",
    "scheme",
    "ca_bundle",
)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


@attrs.frozen
class BackpressureSettings:
    """kvhex's cascade admission for one tier (``kvhex.domain.backpressure.EmaBackpressure``:
    seconds per put job, not vLLM's seconds per MiB)."""

    alpha: float = 0.3
    high_water_s: float = 1.0
    low_water_s: float = 0.5
    warmup: int = 3
    probe_every: int = 8


@attrs.frozen
class TierSettings:
    """One secondary tier: which kvhex tier plugin to build, with which options.

    Attributes:
        path: where the entry is in the extra config (``$.secondary_tiers[0]``).
        type: the entry's vLLM ``type`` (``fs``, ``obj`` or ``KvhexSecondaryTier``).
        plugin: the ``kvhex.tiers`` entry point that implements it.
        name: the tier's ownership name (events, stats); unique per engine.
        options: keyword arguments for the plugin (``host`` and ``namespace`` come later).
        enable_kv_events: announce this tier's stores and removals (vLLM's key; effective
            only with vLLM's global KV events on).
        locality: announced locality (vLLM's key), ``None`` when unspecified.
        backpressure: admission for cascades to this tier; ``None`` admits all.
        default_capacity: ``options`` has no ``capacity_bytes``: the builder picks one.
    """

    path: str
    type: str
    plugin: str
    name: str
    options: Mapping[str, Any]
    enable_kv_events: bool = False
    locality: Locality | None = None
    backpressure: BackpressureSettings | None = None
    default_capacity: bool = False


@attrs.frozen
class VllmSettings:
    """What ``KvhexOffloadingSpec`` builds from the extra config."""

    cpu_bytes_to_use: int
    policy: str
    store_threshold: int
    max_tracker_size: int
    offload_prompt_only: bool
    self_describing_kv_events: bool
    tiers: tuple[TierSettings, ...]


class _Checker:
    """Collects issues; each getter returns a checked value or a default."""

    def __init__(self) -> None:
        self.issues: list[ConfigIssue] = []

    def add(self, path: str, problem: str) -> None:
        self.issues.append((path, problem))

    def unknown(self, data: Mapping[str, Any], known: tuple[str, ...], path: str) -> None:
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.add(f"{path}.{key}", f"unknown key{hint}; known keys: {', '.join(known)}")

    def integer(
        self, data: Mapping[str, Any], key: str, path: str, default: int, minimum: int
    ) -> int:
        value = data.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(f"{path}.{key}", f"expected an integer, got {type(value).__name__} {value!r}")
            return default
        if value < minimum:
            self.add(f"{path}.{key}", f"must be >= {minimum}, got {value}")
            return default
        return value

    def number(self, data: Mapping[str, Any], key: str, path: str, default: float) -> float:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.add(f"{path}.{key}", f"expected a number, got {type(value).__name__} {value!r}")
            return default
        return float(value)

    def boolean(self, data: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
        value = data.get(key, default)
        if not isinstance(value, bool):
            self.add(
                f"{path}.{key}", f"expected true or false, got {type(value).__name__} {value!r}"
            )
            return default
        return value

    def string(
        self, data: Mapping[str, Any], key: str, path: str, default: str | None = None
    ) -> str | None:
        value = data.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str):
            self.add(f"{path}.{key}", f"expected a string, got {type(value).__name__} {value!r}")
            return default
        return value

    def mapping(self, data: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
        value = data.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.add(f"{path}.{key}", f"expected an object, got {type(value).__name__}")
            return {}
        return value

    def locality(self, data: Mapping[str, Any], path: str) -> Locality | None:
        value = data.get("locality")
        if value is None:
            return None
        if isinstance(value, str):
            try:
                return Locality(value.upper())
            except ValueError:
                pass
        self.add(f"{path}.locality", f"must be 'LOCAL' or 'REMOTE', got {value!r}")
        return None


def parse_settings(extra: Mapping[str, Any]) -> VllmSettings:
    """Check vLLM's ``kv_connector_extra_config`` for ``KvhexOffloadingSpec``.

    Raises:
        ConfigError: every problem found, each with the path of its key.
    """
    check = _Checker()
    if not isinstance(extra, Mapping):
        raise ConfigError([("$", f"expected an object, got {type(extra).__name__}")], SOURCE)
    check.unknown(extra, tuple(sorted(_SPEC_KEYS | _VLLM_ONLY_KEYS)), "$")

    cpu_bytes = extra.get("cpu_bytes_to_use")
    cpu_bytes_to_use = 0
    if cpu_bytes is None:
        check.add("$.cpu_bytes_to_use", "required key is missing (bytes of host memory)")
    elif isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int | float):
        check.add(
            "$.cpu_bytes_to_use",
            f"expected a number of bytes, got {type(cpu_bytes).__name__} {cpu_bytes!r}",
        )
    elif cpu_bytes < 1:
        check.add("$.cpu_bytes_to_use", f"must be > 0, got {cpu_bytes!r}")
    else:
        cpu_bytes_to_use = int(cpu_bytes)  # vLLM's --kv-offloading-size gives a float

    kvhex = check.mapping(extra, "kvhex", "$")
    check.unknown(kvhex, _TOP_KVHEX_KEYS, "$.kvhex")
    policy = check.string(extra, "eviction_policy", "$", "lru") or "lru"
    policy = check.string(kvhex, "policy", "$.kvhex", policy) or policy
    if extra.get("cache_policy_module_path") is not None:
        check.add(
            "$.cache_policy_module_path",
            "names a vLLM CachePolicy class, which kvhex cannot run; install the policy as a "
            "kvhex.policies entry point and name it in eviction_policy",
        )
    if extra.get("backpressure") is not None:
        check.add(
            "$.backpressure",
            "vLLM's backpressure detectors are not used by kvhex; set kvhex.backpressure "
            "inside the tier entry (seconds per put job) instead",
        )
    store_threshold = check.integer(extra, "store_threshold", "$", 0, 0)
    max_tracker_size = check.integer(extra, "max_tracker_size", "$", 64_000, 1)
    offload_prompt_only = check.boolean(extra, "offload_prompt_only", "$", True)
    self_describing = check.boolean(extra, "self_describing_kv_events", "$", False)

    raw_tiers = extra.get("secondary_tiers", [])
    tiers: list[TierSettings] = []
    if not isinstance(raw_tiers, list):
        check.add(
            "$.secondary_tiers", f"must be a list of tier objects, got {type(raw_tiers).__name__}"
        )
        raw_tiers = []
    for i, entry in enumerate(raw_tiers):
        tier = _parse_tier(check, entry, f"$.secondary_tiers[{i}]", i)
        if tier is not None:
            tiers.append(tier)
    seen: dict[str, str] = {}
    for tier in tiers:
        if tier.name in seen:
            check.add(
                f"{tier.path}.kvhex.name",
                f"tier name {tier.name!r} is already used by {seen[tier.name]}; names must be "
                "unique (they are the ownership announced in events)",
            )
        seen[tier.name] = tier.path
    if raw_tiers and store_threshold >= 2:
        check.add(
            "$.store_threshold",
            "store_threshold >= 2 is not supported with secondary_tiers (as in vLLM's "
            "TieringOffloadingSpec): cascades and promotions cannot wait for repeated offers",
        )
    if check.issues:
        raise ConfigError(check.issues, SOURCE)
    return VllmSettings(
        cpu_bytes_to_use=cpu_bytes_to_use,
        policy=policy,
        store_threshold=max(1, store_threshold),
        max_tracker_size=max_tracker_size,
        offload_prompt_only=offload_prompt_only,
        self_describing_kv_events=self_describing,
        tiers=tuple(tiers),
    )


def parse_tier(entry: Any, path: str = "$", index: int = 0) -> TierSettings:
    """Check one tier entry (as ``SecondaryTierFactory`` hands it over, or from the list).

    Raises:
        ConfigError: every problem found in the entry.
    """
    check = _Checker()
    tier = _parse_tier(check, entry, path, index)
    if check.issues or tier is None:
        raise ConfigError(check.issues or [(path, "not a tier")], SOURCE)
    return tier


def _parse_tier(check: _Checker, entry: Any, path: str, index: int) -> TierSettings | None:
    if not isinstance(entry, Mapping):
        check.add(path, f"expected a tier object, got {type(entry).__name__}")
        return None
    kind = entry.get("type")
    if kind is None:
        check.add(f"{path}.type", "required key is missing ('fs', 'obj' or 'KvhexSecondaryTier')")
        return None
    before = len(check.issues)
    kvhex = check.mapping(entry, "kvhex", path)
    check.unknown(kvhex, _TIER_KVHEX_KEYS, f"{path}.kvhex")
    if entry.get("backpressure") is not None:
        check.add(
            f"{path}.backpressure",
            "vLLM's backpressure detectors are not used by kvhex; set kvhex.backpressure "
            "(seconds per put job) instead",
        )
    backpressure = _backpressure(check, kvhex, f"{path}.kvhex")
    enable_events = check.boolean(entry, "enable_kv_events", path, False)
    locality = check.locality(entry, path)
    options: dict[str, Any] = {}
    if kind == "fs":
        check.unknown(entry, _FS_KEYS, path)
        plugin = "fsspec"
        root = check.string(entry, "root_dir", path)
        if root is None:
            if "root_dir" not in entry:
                check.add(f"{path}.root_dir", "required key is missing (the tier's directory)")
        else:
            options["url"] = root
        threads = [
            check.integer(entry, key, path, 0, 1)
            for key in ("n_read_threads", "n_write_threads")
            if key in entry
        ]
        if threads:
            options["io_threads"] = sum(threads)
        options["locality"] = locality
    elif kind == "obj":
        check.unknown(entry, _OBJ_KEYS, path)
        plugin = "nixl"
        options.update(_object_store(check, entry, path))
        if "io_threads" in entry:
            options["io_threads"] = check.integer(entry, "io_threads", path, 4, 1)
        options["locality"] = locality
    elif kind == KVHEX_TIER_TYPE:
        plugin_name = check.string(entry, "tier", path)
        if plugin_name is None:
            if "tier" not in entry:
                check.add(f"{path}.tier", "required key is missing (a kvhex.tiers entry point)")
            plugin_name = ""
        plugin = plugin_name
        reserved = {"type", "module_path", "tier", "enable_kv_events", "backpressure", "kvhex"}
        options.update({k: v for k, v in entry.items() if k not in reserved})
        if locality is not None:
            options["locality"] = locality
    else:
        check.add(
            f"{path}.type",
            f"unknown tier type {kind!r}; KvhexOffloadingSpec builds 'fs', 'obj' and "
            f"'{KVHEX_TIER_TYPE}' (any kvhex.tiers entry point, named by 'tier')",
        )
        return None
    name = check.string(kvhex, "name", f"{path}.kvhex")
    if name is None and isinstance(options.get("name"), str):
        name = options["name"]
    if name is None:
        name = str(kind if kind != KVHEX_TIER_TYPE else plugin) + (f"{index}" if index else "")
    if not _NAME.fullmatch(name):
        check.add(f"{path}.kvhex.name", f"must be letters, digits, '_', '-' or '.', got {name!r}")
    default_capacity = False
    if "capacity_bytes" in kvhex:
        options["capacity_bytes"] = check.integer(kvhex, "capacity_bytes", f"{path}.kvhex", 1, 1)
    elif kind != KVHEX_TIER_TYPE:
        default_capacity = True
    if len(check.issues) > before:
        return None
    return TierSettings(
        path=path,
        type=str(kind),
        plugin=plugin,
        name=name,
        options=options,
        enable_kv_events=enable_events,
        locality=locality,
        backpressure=backpressure,
        default_capacity=default_capacity,
    )


def _object_store(check: _Checker, entry: Mapping[str, Any], path: str) -> dict[str, Any]:
    """vLLM's ``store_config`` and ``prefix`` -> the NIXL tier's url and credentials."""
    store = check.mapping(entry, "store_config", path)
    where = f"{path}.store_config"
    if "store_config" not in entry:
        check.add(where, "required key is missing (bucket, endpoint_override, ...)")
        return {}
    check.unknown(store, _STORE_CONFIG_KEYS, where)
    values = {key: check.string(store, key, where, "") or "" for key in _STORE_CONFIG_KEYS}
    for key in ("bucket", "endpoint_override"):
        if not values[key]:
            check.add(f"{where}.{key}", "required key is missing or empty")
    for key in ("session_token", "ca_bundle"):
        if values[key]:
            check.add(f"{where}.{key}", "not supported by kvhex's object-store tier")
    prefix = (check.string(entry, "prefix", path, "") or "").strip("/")
    endpoint = values["endpoint_override"]
    if endpoint and "://" not in endpoint:
        endpoint = f"{values['scheme'] or 'http'}://{endpoint}"
    url = f"s3://{values['bucket']}" + (f"/{prefix}" if prefix else "")
    return {
        "url": url,
        "endpoint_url": endpoint,
        "access_key": values["access_key"] or None,
        "secret_key": values["secret_key"] or None,
        "region": values["region"] or "us-east-1",
    }


def _backpressure(
    check: _Checker, kvhex: Mapping[str, Any], path: str
) -> BackpressureSettings | None:
    raw = check.mapping(kvhex, "backpressure", path)
    if "backpressure" not in kvhex:
        return None
    where = f"{path}.backpressure"
    check.unknown(raw, ("alpha", "high_water_s", "low_water_s", "warmup", "probe_every"), where)
    default = BackpressureSettings()
    settings = BackpressureSettings(
        alpha=check.number(raw, "alpha", where, default.alpha),
        high_water_s=check.number(raw, "high_water_s", where, default.high_water_s),
        low_water_s=check.number(raw, "low_water_s", where, default.low_water_s),
        warmup=check.integer(raw, "warmup", where, default.warmup, 0),
        probe_every=check.integer(raw, "probe_every", where, default.probe_every, 1),
    )
    if not 0.0 < settings.alpha <= 1.0:
        check.add(f"{where}.alpha", f"must be in (0, 1], got {settings.alpha}")
    if not 0.0 <= settings.low_water_s <= settings.high_water_s:
        check.add(where, "need 0 <= low_water_s <= high_water_s")
    return settings
