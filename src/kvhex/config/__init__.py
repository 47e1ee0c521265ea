"""kvhex configuration: the attrs model and its loaders (TOML, JSON, mappings, and vLLM's
``kv_connector_extra_config``)."""

from kvhex.config.loader import (
    load_config,
    load_vllm_config,
    load_vllm_tier,
    loads_json,
    loads_toml,
    make_converter,
    structure,
)
from kvhex.config.model import (
    BackpressureConfig,
    EventsConfig,
    KvhexConfig,
    LoadingConfig,
    PluginName,
    PositiveInt,
    PrimaryConfig,
    SinkConfig,
    TierConfig,
)
from kvhex.config.vllm import VllmExtraConfig

__all__ = [
    "BackpressureConfig",
    "EventsConfig",
    "KvhexConfig",
    "LoadingConfig",
    "PluginName",
    "PositiveInt",
    "PrimaryConfig",
    "SinkConfig",
    "TierConfig",
    "VllmExtraConfig",
    "load_config",
    "load_vllm_config",
    "load_vllm_tier",
    "loads_json",
    "loads_toml",
    "make_converter",
    "structure",
]
