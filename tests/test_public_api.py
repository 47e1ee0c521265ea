"""kvhex's public surface, pinned: the modules below are the API docs/plugins.md, docs/vllm.md
and the README promise (third-party tiers, transfers, sinks and policies; engines built in
Python; kvhex inside vLLM; the shipped test kits), each with exactly the names it exports.
Every other module is an implementation module: it declares no ``__all__`` (or has a private
name), so nothing outside kvhex should import from it. Changing a list here is changing the
API: say so in the change. Importing kvhex does no work."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"

API: dict[str, list[str]] = {
    "kvhex": [
        "ConfigError", "InvalidKeyError", "KvhexError", "PluginError", "StateError", "TierError",
        "TierUnavailable", "TransferError", "__version__",
    ],
    "kvhex.errors": [
        "ConfigError", "ConfigIssue", "InvalidKeyError", "KvhexError", "MissingPackage",
        "PluginError", "StateError", "TierError", "TierUnavailable", "TransferError",
    ],
    "kvhex.domain": [
        "AdmissionPolicy", "AllBlocksCleared", "AlwaysAdmit", "ArcPolicy", "BlockRemoved",
        "BlockStored", "ByteRange", "CacheKind", "ChunkRun", "Cleared", "EmaBackpressure",
        "EventBatch", "EventTranslator", "EvictionPolicy", "JobId", "JobKind", "JobResult",
        "KvGeometry", "KvGroup", "Locality", "LookupResult", "LruPolicy", "Medium", "MmFeature",
        "OffloadKey", "OffloadPolicy", "PolicyFactory", "PrimaryStats", "PrimaryTier",
        "Provenance", "PublicEvent", "Removed", "ReqContext", "Reservation", "Residency",
        "SlotLayout", "Snapshot", "StorePlan", "Stored", "TierEvent", "TierFilter",
        "TierIdentity", "TierJob", "TierMatcher", "TransferJob", "TransferKind",
        "TransferResult", "make_offload_key", "offload_key_group", "offload_key_hash",
        "unpack_offload_key",
    ],
    "kvhex.domain.policies": ["ArcPolicy", "EvictionPolicy", "LruPolicy", "PolicyFactory"],
    "kvhex.ports": [
        "BlockCodec", "BlockTransfer", "Closeable", "CodecCorrupt", "CodecRefused", "Deletes",
        "EventSink", "EventSource", "HostBuffer", "Indexed", "Occupancy", "PeerView",
        "RecordSealing", "RequestAware", "ScheduledWork", "TenantRefusals", "TierHealth",
        "TierStore",
    ],
    "kvhex.service": [
        "EngineCalls", "EventPipeline", "EventStats", "LoadDecider", "LoadStats", "OffloadEngine",
        "ProbeCache", "SinkStats", "TierDriver", "TierStats", "TieringManager", "TieringStats",
    ],
    "kvhex.config": [
        "BackpressureConfig", "EventsConfig", "KvhexConfig", "LoadingConfig", "PluginName",
        "PositiveInt", "PrimaryConfig", "SinkConfig", "TierConfig", "VllmExtraConfig",
        "load_config", "load_vllm_config", "load_vllm_tier", "loads_json", "loads_toml",
        "make_converter", "structure",
    ],
    "kvhex.plugins": [
        "CODECS", "GROUPS", "LoadReport", "LoadedPlugin", "POLICIES", "PluginSpec", "Registry",
        "SINKS", "TIERS", "TRANSFERS", "USER_EXTRAS", "install_hint_for_module",
        "missing_package",
    ],
    "kvhex.bootstrap": [
        "EntryPaths", "TierSpec", "assemble_engine", "build_engine", "build_policy",
        "build_primary_tier", "build_sink", "build_tier", "load_decider", "tier_options",
    ],
    "kvhex.testing": [
        "CodecContract", "CrashContract", "EvictionPolicyContract", "OrderContract", "TierKit",
        "TierStoreContract", "block_payload", "codec_key", "kv_like", "policy_key", "tier_key",
    ],
    # built-in tiers and sinks are reached by their entry-point names (kvhex.tiers,
    # kvhex.sinks), not imported: these packages export nothing
    "kvhex.adapters": [],
    "kvhex.adapters.events": [],
    "kvhex.adapters.storage": [],
    "kvhex.adapters.metrics": [],
    "kvhex.adapters.memory": [
        "MemoryBlockTransfer", "MemoryEventSink", "MemoryHostBuffer", "MemoryTierStore",
    ],
    "kvhex.adapters.torch": [
        "DEFAULT_STAGING_BYTES", "MAX_COPY_THREADS", "TensorHostBuffer", "TorchBlockTransfer",
        "TorchHostBuffer", "shm_path",
    ],
    "kvhex.adapters.metrics.prometheus": [
        "METRICS", "MetricsServer", "PrometheusCollector", "parse_metrics_address",
        "register_metrics", "serve_metrics",
    ],
    "kvhex.vllm": [
        "KvhexOffloadingConnector", "KvhexOffloadingManager", "KvhexOffloadingSpec",
        "KvhexSecondaryTier", "register",
    ],
    # kvhex.vllm's earlier name, forwarding for one release
    "kvhex.adapters.vllm": [
        "KvhexOffloadingConnector", "KvhexOffloadingManager", "KvhexOffloadingSpec",
        "KvhexSecondaryTier", "register",
    ],
    "kvhex.cli": ["build_parser", "main"],
}  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _declares_all(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


@pytest.mark.parametrize("name", sorted(API))
def test_each_public_module_exports_exactly_its_pinned_names(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the forwarding alias warns
        module = importlib.import_module(name)
    exported = list(module.__all__)
    assert sorted(exported) == sorted(API[name])
    assert len(set(exported)) == len(exported)
    if name.endswith(".vllm") and importlib.util.find_spec("vllm") is None:
        return  # its names resolve on first access, importing vLLM (checked where it is)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's and torch's import-time deprecations
        assert [n for n in exported if not hasattr(module, n)] == []


def test_no_other_module_declares_names_to_export() -> None:
    """An ``__all__`` outside the pinned modules would be API nobody decided on."""
    declaring = {_module_name(p) for p in SRC.rglob("*.py") if _declares_all(p)}
    assert sorted(declaring - set(API)) == []


def test_importing_kvhex_loads_no_heavy_module_and_no_plugin() -> None:
    code = (
        "import sys, kvhex, kvhex.domain, kvhex.plugins, kvhex.config;"
        "heavy = [m for m in ('torch','numpy','fsspec','zmq','msgspec','vllm','structlog')"
        " if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
