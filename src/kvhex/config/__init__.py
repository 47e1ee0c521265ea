"""kvhex configuration: the attrs model and its loaders (TOML, JSON, mappings)."""

from kvhex.config.loader import load_config, loads_json, loads_toml, make_converter, structure
from kvhex.config.model import KvhexConfig, PluginName, PositiveInt, PrimaryConfig

__all__ = [
    "KvhexConfig",
    "PluginName",
    "PositiveInt",
    "PrimaryConfig",
    "load_config",
    "loads_json",
    "loads_toml",
    "make_converter",
    "structure",
]
