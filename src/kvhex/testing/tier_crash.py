"""Crash and restart checks for tiers whose blocks outlive the process (opt-in).

``CrashContract`` runs writer processes that put, get, probe and delete blocks of a small
universe of keys, kills them with ``SIGKILL`` at random moments, then reopens the tier in
the test process and checks that it tells the truth: every block served holds exactly the
bytes of its key (payloads are derived from keys, so no record is needed); replaying the
reopened tier's own events equals what its probes find; every key it announced loads and no
other key does; deleting some of them announces each once and leaves them unreadable (for a
tier that ``Deletes``; for another one the writers and checks delete nothing); and
:meth:`CrashContract.check_recovered` (a hook: kvhex's file tier runs ``fsck`` there) is
satisfied. It also restarts without a crash and, for tiers that several instances may open
at once (``shared_storage``), after two instances stored the same keys.

The writers are forked, once per cycle, by a launcher process started with
``multiprocessing``'s "spawn" context (:mod:`kvhex.testing.tier_writer`): the launcher is a
fresh interpreter that receives the test instance by pickle, and each writer builds its tier
with the same ``make_sized_store`` / ``make_store``. So the test class must be importable in
a child (a module-level class of a test module pytest imports by name, as its default
"prepend" import mode does; the child gets the parent's ``sys.path``), and what the factory
needs (paths, URLs) must be plain attributes of the instance (fixtures may set them). POSIX
only (``fork``, ``SIGKILL``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import time

from kvhex.domain.keys import OffloadKey
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import Deletes, TierStore
from kvhex.testing.tier_bench import Bench
from kvhex.testing.tier_kit import TierKit, describe_keys, tier_key
from kvhex.testing.tier_writer import HOST_SLOTS, JOB_KEYS, Launcher, WriterPlan


class CrashContract(TierKit):
    """Mix into the test class of a persistent tier next to ``TierStoreContract`` (see the
    module docstring for what the writer processes need)."""

    crash_cycles = 8
    """Writer processes started and killed (pairs with ``shared_storage``)."""
    crash_keys = 48
    """Keys the writers use: more than ``crash_capacity_blocks``, so puts evict."""
    crash_capacity_blocks = 24
    """Capacity asked of ``make_sized_store`` (``make_store`` is used as it is)."""
    crash_slot_bytes = 1 << 16
    """Block size of the crash and restart checks."""
    crash_run_s = 0.3
    """A writer is killed at a uniformly random moment this long after it starts opening."""
    crash_start_timeout_s = 120.0
    """How long a writer process may take to start."""
    shared_storage = False
    """Several live instances may open the same storage at once (two writers per cycle)."""

    def check_recovered(self, store: TierStore) -> None:
        """Optional: check the storage behind ``store`` (just reopened after writers were
        killed, and again before it closes), e.g. with a consistency checker."""

    # -- the checks ----------------------------------------------------------------------
    def test_crash_cycles_recover_consistently(self) -> None:
        seed = random.randrange(1 << 32)
        rng = random.Random(seed)
        writers = 2 if self.shared_storage else 1
        context = multiprocessing.get_context("spawn")
        plan = WriterPlan(self.crash_slot_bytes, self.crash_capacity_blocks, self.crash_keys)
        launcher = Launcher(context, self, plan, self.crash_start_timeout_s)
        try:
            for cycle in range(self.crash_cycles):
                where = f"cycle {cycle} (seed {seed})"
                pids = launcher.start([rng.randrange(1 << 32) for _ in range(writers)])
                started = time.monotonic()
                for pid in pids:
                    delay = rng.uniform(0, self.crash_run_s)
                    time.sleep(max(0.0, delay - (time.monotonic() - started)))
                    with contextlib.suppress(ProcessLookupError):  # it ended: reported below
                        os.kill(pid, signal.SIGKILL)
                failures = launcher.ended(self.timeout_s)
                assert not failures, f"{where}: a writer " + "\n".join(failures)
                self._recover(rng, f"after {where}")
        finally:
            launcher.close()

    def test_restart_keeps_exactly_what_was_resident(self) -> None:
        rng = random.Random(11)
        host = self.new_host(HOST_SLOTS, self.crash_slot_bytes)
        bench = Bench(self, self.open_store(host, self.crash_capacity_blocks), host, None)
        try:
            problems = bench.replay()
            store = bench.store
            for step in range(10):  # a failed put stores nothing: not this check's concern
                ids = rng.sample(range(self.crash_keys), rng.randint(1, JOB_KEYS))
                self.put_all(store, host, [tier_key(i) for i in ids])
                if step % 3 == 2 and isinstance(store, Deletes):
                    keys = [tier_key(i) for i in rng.sample(range(self.crash_keys), 4)]
                    store.delete(keys)
                problems += bench.replay()
            assert not problems, "; ".join(problems)
        finally:
            bench.store.close()
        self._reopen(host, bench.resident, "after a restart")

    def test_restart_after_two_instances_stored_the_same_keys(self) -> None:
        if not self.shared_storage:
            import pytest

            pytest.skip("set shared_storage = True if several instances may share storage")
        keys = [tier_key(i) for i in range(JOB_KEYS)]
        hosts = [self.new_host(HOST_SLOTS, self.crash_slot_bytes) for _ in range(2)]
        stores = [self.open_store(host, self.crash_capacity_blocks) for host in hosts]
        deletes = isinstance(stores[0], Deletes)
        try:
            for store, host in zip(stores, hosts, strict=True):
                for result in self.put_all(store, host, keys):
                    assert result.success, f"a put failed: {result.error}"
        finally:
            for store in stores:
                store.close()
        self._reopen(hosts[0], set(keys), "reopened after both closed", delete=keys)
        if deletes:  # else nothing was deleted: the keys stay, as checked
            self._reopen(hosts[0], set(), "reopened after it deleted them")

    # -- helpers -------------------------------------------------------------------------
    def _recover(self, rng: random.Random, where: str) -> None:
        """Reopen after a crash: the tier tells the truth about what it holds; deleting a
        quarter of it (where the tier ``Deletes``) announces each once and leaves them
        unreadable."""
        host = self.new_host(HOST_SLOTS, self.crash_slot_bytes)
        bench = Bench(self, self.open_store(host, self.crash_capacity_blocks), host, None)
        try:
            problems = bench.replay()
            self._checked(bench.store, where)
            problems += bench.compare(self._universe(), "replaying the reopened tier's events")
            if not problems and isinstance(bench.store, Deletes):
                gone = rng.sample(sorted(bench.resident), len(bench.resident) // 4)
                problems += bench.replay() + bench.delete(gone)
            assert not problems, f"{where}:\n  " + "\n  ".join(problems)
            bench.store.drain()
            bench.store.poll()
            self._checked(bench.store, f"{where}, before closing")
        finally:
            bench.store.close()

    def _reopen(
        self,
        host: HostBuffer,
        want: set[OffloadKey],
        where: str,
        delete: list[OffloadKey] | None = None,
    ) -> None:
        """Reopen after a clean close: exactly ``want`` is announced and tells the truth;
        then ``delete`` is deleted, where the tier ``Deletes``."""
        bench = Bench(self, self.open_store(host, self.crash_capacity_blocks), host, None)
        try:
            problems = bench.replay()
            if bench.resident != want:
                problems.append(
                    f"it announced {describe_keys(bench.resident)}, but {describe_keys(want)} "
                    f"were resident at close: lost {describe_keys(want - bench.resident)}, "
                    f"back {describe_keys(bench.resident - want)}"
                )
            self._checked(bench.store, where)
            problems += bench.compare(self._universe(), "replaying the reopened tier's events")
            if delete and not problems and isinstance(bench.store, Deletes):
                problems += bench.delete(delete)
            assert not problems, f"{where}:\n  " + "\n  ".join(problems)
        finally:
            bench.store.close()

    def _checked(self, store: TierStore, where: str) -> None:
        try:
            self.check_recovered(store)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc

    def _universe(self) -> list[OffloadKey]:
        return [tier_key(i) for i in range(self.crash_keys)]
