"""A minimal correct persistent tier (one file per block, dir_tier.py) passes the whole kit:
the contract with its order checks, and the crash and restart checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.testing import CrashContract, TierStoreContract
from tests.contracts.dir_tier import DirTierStore


class TestDirTier(TierStoreContract, CrashContract):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def make_store(self, host: HostBuffer) -> TierStore:
        return DirTierStore(host, self.root, 1024)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return DirTierStore(host, self.root, capacity_blocks)
