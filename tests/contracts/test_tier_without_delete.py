"""A tier need not delete: ``delete`` is the ``Deletes`` capability, not a member of the
``TierStore`` port (kvhex never deletes from a tier). The kit runs every other check on such a
tier, crash checks included, skips the delete checks saying why, and deletes nothing in the
rest; the registry takes such a tier class."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain.events import TierEvent
from kvhex.domain.jobs import JobResult, TierJob
from kvhex.domain.tiers import TierIdentity
from kvhex.plugins import TIERS, Registry
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import Deletes, TierStore
from kvhex.testing import CrashContract, TierStoreContract
from tests.contracts.dir_tier import DirTierStore


class WithoutDelete:
    """Forwards the ``TierStore`` port, and nothing else, to a tier that could delete."""

    def __init__(self, inner: TierStore) -> None:
        self.inner = inner

    @property
    def identity(self) -> TierIdentity:
        return self.inner.identity

    def submit_put(self, job: TierJob) -> None:
        self.inner.submit_put(job)

    def submit_get(self, job: TierJob) -> None:
        self.inner.submit_get(job)

    def submit_probe(self, job: TierJob) -> None:
        self.inner.submit_probe(job)

    def poll(self) -> list[JobResult]:
        return self.inner.poll()

    def drain(self) -> None:
        self.inner.drain()

    def close(self) -> None:
        self.inner.close()

    def take_events(self) -> list[TierEvent]:
        return self.inner.take_events()


class TestMemoryTierWithoutDelete(TierStoreContract):
    def make_store(self, host: HostBuffer) -> TierStore:
        return WithoutDelete(MemoryTierStore(host, capacity_bytes=1 << 20))

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        tier = MemoryTierStore(host, capacity_bytes=capacity_blocks * host.slot_bytes)
        return WithoutDelete(tier)


class TestDirTierWithoutDelete(TierStoreContract, CrashContract):
    """The writers put, get and probe, and never delete; recovery deletes nothing."""

    crash_cycles = 3
    race_trials = 3

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def make_store(self, host: HostBuffer) -> TierStore:
        return WithoutDelete(DirTierStore(host, self.root, 1024))

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return WithoutDelete(DirTierStore(host, self.root, capacity_blocks))


def test_the_tier_satisfies_the_port_and_not_the_capability() -> None:
    host = MemoryHostBuffer(4, 4096)
    store = TestMemoryTierWithoutDelete().make_store(host)
    assert isinstance(store, TierStore)
    assert not isinstance(store, Deletes)
    assert isinstance(MemoryTierStore(host, capacity_bytes=1 << 20), Deletes)


DELETE_CHECKS = [
    "test_delete_announces_exactly_the_present_keys",
    "test_delete_naming_a_key_twice_announces_it_once_and_it_is_gone",
    "test_delete_then_put_at_full_capacity_evicts_nothing_else",
    "test_put_and_delete_of_one_key_in_every_order",
    "test_get_and_delete_of_one_key_in_every_order",
    "test_probe_and_delete_of_one_key_in_every_order",
]


@pytest.mark.parametrize("check", DELETE_CHECKS)
def test_the_delete_checks_skip_saying_why(check: str) -> None:
    with pytest.raises(pytest.skip.Exception, match=r"has no delete \(.*Deletes\)"):
        getattr(TestMemoryTierWithoutDelete(), check)()


def test_the_registry_takes_a_tier_class_without_delete() -> None:
    registry = Registry.discover([TIERS])
    registry.register(TIERS, "plain", WithoutDelete)
    assert registry.load(TIERS, "plain") is WithoutDelete
