"""Order checks: two jobs (or a job and a delete) touching one key, in every order the port
allows, then an audit of what the tier says against what it does.

Each scenario runs on its own keys of one tier (see :mod:`kvhex.testing.tier_model`); results
are polled in whatever order the tier finishes. After each one the audit checks: every job
reported exactly once; replaying ``take_events()`` gives what probes find; keys whose end
state the order decides are in that state; every resident key loads with exactly its bytes
and no other key loads; a put of the resident keys announces nothing; deleting them
announces each once and leaves none readable. The racy shapes that found real bugs run
``race_trials`` times on blocks large enough for the windows to open on threaded tiers. For a
tier that has no delete (``kvhex.ports.tier_store.Deletes``) the scenarios with a delete skip
and the audits delete nothing.
"""

from __future__ import annotations

import time

from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.ports.tier_store import Deletes
from kvhex.testing.tier_bench import Bench
from kvhex.testing.tier_kit import TierKit, tier_key, tier_key_id
from kvhex.testing.tier_model import (
    Delete,
    Job,
    KeyModel,
    Poll,
    Step,
    Wait,
    describe,
    describe_ids,
    interleavings,
)

PUT, GET, PROBE = JobKind.PUT, JobKind.GET, JobKind.PROBE


class OrderContract(TierKit):
    """Concurrent jobs on one key in every order the port allows (part of
    ``TierStoreContract``)."""

    race_trials = 10
    """Repetitions of each racy shape."""
    race_bulk_blocks = 256
    """Blocks of the get that misses a key while a put of that key runs."""
    race_slot_bytes = 1 << 16
    """Block size of that get."""
    race_wide_slot_bytes = 1 << 20
    """Block size of two puts in flight that share a key."""

    # -- the checks ----------------------------------------------------------------------
    def test_two_puts_sharing_a_key_in_every_order(self) -> None:
        self._each_order(Job("A", PUT, (0, *range(1, 8))), Job("B", PUT, (0,)), [set(), {0}])

    def test_put_and_get_of_an_absent_key_in_every_order(self) -> None:
        self._each_order(Job("P", PUT, (0,)), Job("G", GET, (0,)), [set()])

    def test_put_and_get_of_a_present_key_in_every_order(self) -> None:
        self._each_order(Job("P", PUT, (0, 1)), Job("G", GET, (0,)), [{0}])

    def test_put_and_delete_of_one_key_in_every_order(self) -> None:
        self._each_order(Job("P", PUT, (0, 1)), Delete((0,)), [set(), {0}])

    def test_get_and_delete_of_one_key_in_every_order(self) -> None:
        self._each_order(Job("G", GET, (0, 1)), Delete((0,)), [{0, 1}])

    def test_probe_and_put_of_one_key_in_every_order(self) -> None:
        self._each_order(Job("Q", PROBE, (0, 1)), Job("P", PUT, (0,)), [set(), {0}])

    def test_probe_and_delete_of_one_key_in_every_order(self) -> None:
        self._each_order(Job("Q", PROBE, (0, 1)), Delete((0,)), [{0, 1}])

    def test_a_get_that_missed_a_key_keeps_the_put_of_it_that_followed(self) -> None:
        """A get of many blocks and an absent key, then at once a put of that key: whichever
        finishes first, the key ends up stored, announced once and deletable."""
        n = self.race_bulk_blocks
        bench = self._bench(self.race_slot_bytes, n + 4, n + self.race_trials + 8)
        try:
            self._room(bench, n + self.race_trials + 8)
            bulk = tuple(range(1, n + 1))
            self._prepare(bench, bulk, need=True)
            for trial in range(self.race_trials):
                k = n + 1 + trial
                steps = (Job("G", GET, (*bulk, k)), Job("P", PUT, (k,)), Wait())
                self._play(bench, steps, set(bulk), audit=(k,), fresh=False)
            problems = bench.audit([tier_key(bench.base + i) for i in bulk], {})
            assert not problems, "after the trials:\n  " + "\n  ".join(problems)
            bench.refill()
        finally:
            bench.store.close()

    def test_two_puts_in_flight_sharing_a_key_keep_it_deletable(self) -> None:
        """A put of eight large blocks, then at once a put of the first of them (which may
        skip it): whichever is polled first, the key is indexed once."""
        bench = self._bench(self.race_wide_slot_bytes, 12, 16)
        try:
            self._room(bench, 16, try_it=True)
            for _ in range(self.race_trials):
                steps = (Job("A", PUT, tuple(range(8))), Job("B", PUT, (0,)), Wait())
                self._play(bench, steps, set())
            bench.refill()
        finally:
            bench.store.close()

    # -- running scenarios ---------------------------------------------------------------
    def _bench(self, slot_bytes: int, host_slots: int, capacity: int) -> Bench:
        host = self.new_host(host_slots, slot_bytes)
        store = self.open_store(host, capacity)
        known = capacity if self._sized() else None
        if known is None and slot_bytes == self.slot_bytes:
            known = self.capacity_blocks
        bench = Bench(self, store, host, known)
        problems = bench.replay()
        assert not problems, "; ".join(problems)
        return bench

    def _room(self, bench: Bench, blocks: int, *, try_it: bool = False) -> None:
        """Skip the check, saying why, when the tier holds fewer than ``blocks`` blocks of
        its host's size; when its capacity is unknown and ``try_it``, find out by putting
        (then deleting) that many."""
        if bench.capacity is not None and bench.capacity < blocks:
            import pytest

            pytest.skip(
                f"{type(self).__name__}: the check needs {blocks} blocks of "
                f"{bench.host.slot_bytes} bytes, the tier holds {bench.capacity}"
            )
        if bench.capacity is None and try_it:
            bench.base += 1000
            self._prepare(bench, tuple(range(blocks)), need=True)
            if isinstance(bench.store, Deletes):
                problems = bench.delete([tier_key(bench.base + i) for i in range(blocks)])
                assert not problems, "\n".join(problems)

    def _each_order(self, a: Job | Delete, b: Job | Delete, starts: list[set[int]]) -> None:
        bench = self._bench(self.slot_bytes, 16, 64)
        try:
            if isinstance(a, Delete) or isinstance(b, Delete):
                self.deleting(bench.store)  # skips for a tier that has no delete
            for present in starts:
                for steps in interleavings(a, b):
                    self._play(bench, steps, present)
            bench.refill()
        finally:
            bench.store.close()

    def _prepare(self, bench: Bench, ids: tuple[int, ...], *, need: bool = False) -> None:
        """Put ``ids`` (keys of the current base) before a scenario."""
        keys = [tier_key(bench.base + i) for i in ids]
        for result in self.put_all(bench.store, bench.host, keys):
            if not result.success and need and bench.capacity is None:
                import pytest

                pytest.skip(
                    f"{type(self).__name__}: the tier built by make_store could not hold "
                    f"{len(keys)} blocks of {bench.host.slot_bytes} bytes ({result.error}); "
                    "implement make_sized_store(host, capacity_blocks)"
                )
            assert result.success, f"putting the starting keys failed: {result.error}"
        problems = bench.replay()
        assert not problems, "; ".join(problems)

    def _play(
        self,
        bench: Bench,
        steps: tuple[Step, ...],
        present: set[int],
        *,
        audit: tuple[int, ...] | None = None,
        fresh: bool = True,
    ) -> None:
        """Run one scenario (on fresh keys, ``present`` put first), then audit the keys
        ``audit`` (default: every key it used) and delete them."""
        if fresh:
            bench.base += 1000
            self._prepare(bench, tuple(sorted(present)))
        where = (
            f"`{describe(steps)}` with {describe_ids(sorted(present))} stored first "
            f"(key i is #{bench.base}+i)"
        )
        try:
            decided, problems = self._steps(bench, steps, present)
            ids = audit or sorted({i for s in steps if isinstance(s, Job | Delete) for i in s.ids})
            problems += bench.audit([tier_key(bench.base + i) for i in ids], decided)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
        except Exception as exc:  # the tier raised: say in which scenario
            raise AssertionError(f"{where}: the tier raised {exc!r}") from exc
        assert not problems, f"{where}:\n  " + "\n  ".join(problems)

    def _steps(
        self, bench: Bench, steps: tuple[Step, ...], present: set[int]
    ) -> tuple[dict[OffloadKey, bool], list[str]]:
        """Run ``steps``: what the order decides about each key at the end, and problems."""
        model = KeyModel(present)
        store, host, base = bench.store, bench.host, bench.base
        free = list(range(host.num_slots - 1, -1, -1))
        jobs: dict[JobId, tuple[Job, TierJob]] = {}
        labels: dict[str, JobId] = {}
        problems: list[str] = []

        def take(result: JobResult) -> None:
            assert result.job_id in jobs, f"job {result.job_id} reported twice or never submitted"
            job, tier_job = jobs.pop(result.job_id)
            free.extend(tier_job.slots)
            if job.kind is PUT:
                if not result.success:
                    problems.append(f"{job} failed: {result.error}")
                model.put_finished(job, result.success)
                return
            if job.kind is GET:
                has = set(tier_job.keys) if result.success else set(result.ok_keys or ())
                self.check_bytes(host, tier_job.keys, tier_job.slots, has)
            else:
                assert result.success, f"{job} failed: {result.error}"
                has = set(result.found)
            problems.extend(model.answered(job, {tier_key_id(k) - base for k in has}))

        for step in steps:
            if isinstance(step, Job):
                keys = [tier_key(base + i) for i in step.ids]
                slots = [free.pop() for _ in keys] if step.kind is not PROBE else []
                if step.kind is PUT:
                    self.fill(host, keys, slots)
                else:
                    self.spoil(host, slots)
                tier_job = self.new_job(step.kind, keys, slots)
                jobs[tier_job.job_id] = (step, tier_job)
                labels[step.label] = tier_job.job_id
                self.submit(store, tier_job)
                model.submitted(step)
            elif isinstance(step, Delete):
                self.deleting(store).delete([tier_key(base + i) for i in step.ids])
                model.deleted(step.ids)
            else:
                label = step.label if isinstance(step, Wait) else None
                deadline = time.monotonic() + self.timeout_s
                while True:
                    for result in store.poll():
                        take(result)
                    if isinstance(step, Poll) or not (labels[label] in jobs if label else jobs):
                        break
                    assert time.monotonic() < deadline, f"jobs {sorted(jobs)} never finished"
                    time.sleep(0.0005)
        return {tier_key(base + i): s for i, s in model.decided().items()}, problems
