"""The kit catches tiers that break it: each check meets a tier with the fault it is there
for (the faults: broken_tiers.py and dir_tier.py), and fails for that reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryTierStore
from kvhex.domain.jobs import TierJob
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.testing import CrashContract, TierStoreContract
from tests.contracts import broken_tiers as broken
from tests.contracts.dir_tier import DirTierStore


class FailsEveryGet(MemoryTierStore):
    """Fails every get."""

    def __init__(self, host: HostBuffer, capacity_blocks: int) -> None:
        super().__init__(host, capacity_bytes=capacity_blocks * host.slot_bytes)

    def submit_get(self, job: TierJob) -> None:
        self.fail_next_gets()
        super().submit_get(job)


def suite(tier: type[broken.Wrapped] | type[FailsEveryGet]) -> TierStoreContract:
    class Suite(TierStoreContract):
        timeout_s = 2.0
        race_trials = 3

        def make_store(self, host: HostBuffer) -> TierStore:
            return tier(host, 256)

        def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
            return tier(host, capacity_blocks)

    return Suite()


CAUGHT = [
    (FailsEveryGet, "test_put_then_get_round_trips_bytes_into_other_slots", "the get failed"),
    (
        broken.MissedGetDropsKey,
        "test_a_get_that_missed_a_key_keeps_the_put_of_it_that_followed",
        "the order leaves key #257 resident; replaying take_events.. says absent",
    ),
    (broken.MissedGetDropsKey, "test_put_and_get_of_an_absent_key_in_every_order", "probes find"),
    (
        broken.OverlappingPutsForgetKey,
        "test_two_puts_in_flight_sharing_a_key_keep_it_deletable",
        "delete of the resident keys .* announced removed",
    ),
    (
        broken.OverlappingPutsForgetKey,
        "test_two_puts_sharing_a_key_in_every_order",
        "after deleting them, replaying take_events.. gives absent keys that load anyway",
    ),
    (
        broken.RaisesOnDuplicateDelete,
        "test_delete_naming_a_key_twice_announces_it_once_and_it_is_gone",
        "raised KeyError",
    ),
    (
        broken.FreesRoomLate,
        "test_delete_then_put_at_full_capacity_evicts_nothing_else",
        "then a put of as many blocks announced removed",
    ),
    (broken.LosesJobsAtClose, "test_close_reports_every_job_submitted_before_it", "never"),
    (broken.AcceptsWorkAfterClose, "test_close_is_idempotent", "after close did not raise"),
    (broken.DrainIsNotAMethod, "test_satisfies_the_port", "drain is None, not a method"),
]


@pytest.mark.parametrize(("tier", "check", "why"), CAUGHT, ids=[c[0].__name__ for c in CAUGHT])
def test_the_contract_catches_a_broken_tier(
    tier: type[broken.Wrapped] | type[FailsEveryGet], check: str, why: str
) -> None:
    with pytest.raises(AssertionError, match=why):
        getattr(suite(tier), check)()


class _TornBlocks(CrashContract):
    """Writes blocks in place: a crash mid-write leaves a torn block that a restart serves."""

    root: Path

    def make_store(self, host: HostBuffer) -> TierStore:
        return DirTierStore(host, self.root, 64, atomic=False)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return DirTierStore(host, self.root, capacity_blocks, atomic=False)


class _ForgetsRestart(CrashContract):
    """Announces nothing of what it finds at start-up."""

    root: Path

    def make_store(self, host: HostBuffer) -> TierStore:
        return DirTierStore(host, self.root, 64, announce_restart=False)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return DirTierStore(host, self.root, capacity_blocks, announce_restart=False)


class _StorageCheckFails(_ForgetsRestart):
    def check_recovered(self, store: TierStore) -> None:
        raise AssertionError("the storage check found a stale row")


def test_crash_cycles_catch_a_tier_that_serves_torn_blocks(tmp_path: Path) -> None:
    torn = _TornBlocks()
    torn.root = tmp_path
    with pytest.raises(AssertionError, match="served with wrong bytes"):
        torn.test_crash_cycles_recover_consistently()


def test_crash_cycles_catch_a_tier_that_forgets_its_blocks_at_restart(tmp_path: Path) -> None:
    forgets = _ForgetsRestart()
    forgets.root = tmp_path
    with pytest.raises(AssertionError, match="events gives none but probes find #"):
        forgets.test_crash_cycles_recover_consistently()


def test_the_restart_check_catches_a_tier_that_forgets_its_blocks(tmp_path: Path) -> None:
    forgets = _ForgetsRestart()
    forgets.root = tmp_path
    with pytest.raises(AssertionError, match="it announced none, but #"):
        forgets.test_restart_keeps_exactly_what_was_resident()


def test_crash_cycles_run_the_storage_check_after_recovery(tmp_path: Path) -> None:
    checked = _StorageCheckFails()
    checked.root = tmp_path
    with pytest.raises(AssertionError, match="found a stale row"):
        checked.test_crash_cycles_recover_consistently()


def test_crash_cycles_say_how_to_make_an_unpicklable_suite_work() -> None:
    class Local(_TornBlocks):  # defined in a function: the launcher cannot import it
        pass

    with pytest.raises(TypeError, match="at module level"):
        Local().test_crash_cycles_recover_consistently()
