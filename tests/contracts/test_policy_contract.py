"""Every eviction policy kvhex ships (and the third-party fixture) passes the shipped contract."""

from __future__ import annotations

from collections.abc import Sequence

from kvhex.domain import OffloadKey
from kvhex.domain.policies import ArcPolicy, EvictionPolicy, LruPolicy
from kvhex.testing import EvictionPolicyContract


class TestLruContract(EvictionPolicyContract):
    def make_policy(self, capacity: int) -> EvictionPolicy:
        return LruPolicy(capacity)


class TestArcContract(EvictionPolicyContract):
    def make_policy(self, capacity: int) -> EvictionPolicy:
        return ArcPolicy(capacity)


class TestArcSmallCapacityContract(EvictionPolicyContract):
    capacity = 2

    def make_policy(self, capacity: int) -> EvictionPolicy:
        return ArcPolicy(capacity)


class BrokenPolicy(LruPolicy):
    """Ignores pins: the contract must catch it."""

    def mark_pinned(self, keys: Sequence[OffloadKey]) -> None:
        return None


def test_the_contract_catches_a_policy_that_evicts_pinned_keys() -> None:
    class Suite(EvictionPolicyContract):
        def make_policy(self, capacity: int) -> EvictionPolicy:
            return BrokenPolicy(capacity)

    suite = Suite()
    try:
        suite.test_pinned_keys_are_never_evicted()
    except AssertionError:
        return
    raise AssertionError("the contract accepted a policy that evicts pinned keys")
