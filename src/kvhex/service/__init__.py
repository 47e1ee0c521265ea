"""Orchestration over ports (tiering manager, engine facade); no IO of its own."""

from kvhex.service.engine import OffloadEngine
from kvhex.service.events import EventPipeline
from kvhex.service.probes import ProbeCache
from kvhex.service.tier_driver import TierDriver, TierStats
from kvhex.service.tiering import TieringManager, TieringStats

__all__ = [
    "EventPipeline",
    "OffloadEngine",
    "ProbeCache",
    "TierDriver",
    "TierStats",
    "TieringManager",
    "TieringStats",
]
