"""kvhex's in-memory tier passes the shipped TierStore contract, and the contract catches a
tier that breaks it."""

from __future__ import annotations

import pytest

from kvhex.adapters.memory import MemoryTierStore
from kvhex.domain.jobs import TierJob
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.testing import TierStoreContract


class TestMemoryTierContract(TierStoreContract):
    def make_store(self, host: HostBuffer) -> TierStore:
        return MemoryTierStore(host, capacity_bytes=1 << 20, name="mem")


class TestSlowMemoryTierContract(TierStoreContract):
    """Jobs that finish only on the third poll still satisfy the contract."""

    def make_store(self, host: HostBuffer) -> TierStore:
        return MemoryTierStore(host, capacity_bytes=1 << 20, complete_after_polls=3)


class FailsEveryGet(MemoryTierStore):
    """Fails every get: the contract must notice."""

    def submit_get(self, job: TierJob) -> None:
        self.fail_next_gets()
        super().submit_get(job)


def test_the_contract_catches_a_tier_whose_gets_fail() -> None:
    class Suite(TierStoreContract):
        def make_store(self, host: HostBuffer) -> TierStore:
            return FailsEveryGet(host, capacity_bytes=1 << 20)

    with pytest.raises(AssertionError):
        Suite().test_put_then_get_round_trips_bytes_into_other_slots()
