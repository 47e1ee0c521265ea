"""kvhex's in-memory tier passes the shipped TierStore contract (see
test_contract_catches.py for tiers that break it)."""

from __future__ import annotations

from kvhex.adapters.memory import MemoryTierStore
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.testing import TierStoreContract


class TestMemoryTierContract(TierStoreContract):
    def make_store(self, host: HostBuffer) -> TierStore:
        return MemoryTierStore(host, capacity_bytes=1 << 20, name="mem")

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return MemoryTierStore(host, capacity_bytes=capacity_blocks * host.slot_bytes, name="mem")


class TestSlowMemoryTierContract(TierStoreContract):
    """Jobs that finish only on the third poll still satisfy the contract; the capacity is
    given as an attribute instead of a sized factory."""

    capacity_blocks = 300

    def make_store(self, host: HostBuffer) -> TierStore:
        return MemoryTierStore(
            host, capacity_bytes=self.capacity_blocks * host.slot_bytes, complete_after_polls=3
        )
