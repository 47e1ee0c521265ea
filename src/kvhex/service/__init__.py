"""Orchestration over ports (tiering manager, engine facade); no IO of its own."""

from kvhex.service.engine import EngineCalls, OffloadEngine
from kvhex.service.events import EventPipeline
from kvhex.service.loading import LoadDecider
from kvhex.service.probes import ProbeCache
from kvhex.service.stats import EventStats, LoadStats, SinkStats, TieringStats, TierStats
from kvhex.service.tier_driver import TierDriver
from kvhex.service.tiering import TieringManager

__all__ = [
    "EngineCalls",
    "EventPipeline",
    "EventStats",
    "LoadDecider",
    "LoadStats",
    "OffloadEngine",
    "ProbeCache",
    "SinkStats",
    "TierDriver",
    "TierStats",
    "TieringManager",
    "TieringStats",
]
