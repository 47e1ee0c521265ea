"""Eviction policies for the host primary tier.

A policy only orders keys; the primary tier owns the index, the slots and the ref counts and
tells the policy about every state change. LRU and ARC ship with kvhex and are found through
the ``kvhex.policies`` entry-point group exactly like a third party's policy.
"""

from kvhex.domain.policies.arc import ArcPolicy
from kvhex.domain.policies.base import EvictionPolicy, PolicyFactory
from kvhex.domain.policies.lru import LruPolicy

__all__ = ["ArcPolicy", "EvictionPolicy", "LruPolicy", "PolicyFactory"]
