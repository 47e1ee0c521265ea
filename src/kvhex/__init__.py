"""kvhex: multi-tier KV-cache offloading with provenance-carrying KV events.

Importing ``kvhex`` does no work: no plugin is loaded, no logging is configured. Start with
:mod:`kvhex.domain` (values and the primary tier), :mod:`kvhex.config` (the configuration
model) and :mod:`kvhex.plugins` (entry-point registry).
"""

from kvhex.errors import (
    ConfigError,
    InvalidKeyError,
    KvhexError,
    PluginError,
    StateError,
    TierError,
    TierUnavailable,
    TransferError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "InvalidKeyError",
    "KvhexError",
    "PluginError",
    "StateError",
    "TierError",
    "TierUnavailable",
    "TransferError",
    "__version__",
]
