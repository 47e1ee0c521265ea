"""kvhex-sqlite-tier: a kvhex secondary tier that keeps KV-cache blocks in one SQLite file.

Declared as the ``kvhex.tiers`` entry point ``sqlite``; configure it with
``[[tiers]] type = "sqlite"`` and ``options = { path = "...", capacity_bytes = ... }``.
"""

from kvhex_sqlite_tier.store import SqliteTierStore

__all__ = ["SqliteTierStore"]
