"""The TierStore contract: what the tiering manager relies on from any secondary tier.

Run it against your tier with one factory method::

    from kvhex.testing import TierStoreContract

    class TestMyTier(TierStoreContract):
        def make_store(self, host):
            return MyTierStore(host, root=...)

The suite gives the tier a real host buffer (``MemoryHostBuffer`` of ``num_slots`` x
``slot_bytes``) and checks, with real bytes: put then get round trips exactly; probes find what
was put and nothing else; each job is reported exactly once, by job id; a put of present keys
succeeds without announcing them again; a get of a missing key fails without claiming it
loaded; ``Stored`` carries the job's own ``ReqContext`` and the tier's identity; ``delete``
announces exactly the keys that were present; ``drain`` makes every result pollable at once;
``close`` is idempotent; and replaying the tier's events reproduces what its probes report.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.domain.events import Cleared, Removed, Stored, TierEvent
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey, make_offload_key
from kvhex.domain.request import ReqContext
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore

__all__ = ["TierStoreContract"]


class TierStoreContract:
    """Mix into a ``Test*`` class and implement :meth:`make_store`."""

    num_slots = 16
    slot_bytes = 4096
    timeout_s = 30.0

    def make_store(self, host: HostBuffer) -> TierStore:
        """Build the tier under test over ``host`` (fresh, empty storage per call)."""
        raise NotImplementedError("implement make_store(host) in your test class")

    # -- helpers -------------------------------------------------------------------------
    def _setup(self) -> tuple[MemoryHostBuffer, TierStore]:
        host = MemoryHostBuffer(self.num_slots, self.slot_bytes)
        return host, self.make_store(host)

    _next = 0

    def _job(
        self,
        kind: JobKind,
        keys: Iterable[OffloadKey],
        slots: Iterable[int] = (),
        ctx: ReqContext | None = None,
    ) -> TierJob:
        TierStoreContract._next += 1
        return TierJob(JobId(TierStoreContract._next), kind, tuple(keys), tuple(slots), ctx)

    def _wait(self, store: TierStore, jobs: Iterable[TierJob]) -> dict[JobId, JobResult]:
        wanted = {job.job_id for job in jobs}
        got: dict[JobId, JobResult] = {}
        deadline = time.monotonic() + self.timeout_s
        while not wanted <= got.keys():
            for result in store.poll():
                assert result.job_id not in got, f"job {result.job_id} reported twice"
                got[result.job_id] = result
            if wanted <= got.keys():
                break
            assert time.monotonic() < deadline, f"jobs {sorted(wanted - got.keys())} never finished"
            time.sleep(0.001)
        assert got.keys() == wanted, f"unexpected job ids {sorted(got.keys() - wanted)}"
        return got

    @staticmethod
    def _keys(*ids: int) -> list[OffloadKey]:
        return [make_offload_key(i.to_bytes(32, "big"), 0) for i in ids]

    def _fill(self, host: MemoryHostBuffer, slots: Iterable[int], seed: int) -> list[bytes]:
        rng = random.Random(seed)
        data = []
        for slot in slots:
            payload = rng.randbytes(self.slot_bytes)
            host.slot_view(slot)[:] = payload
            data.append(payload)
        return data

    def _put(
        self,
        store: TierStore,
        host: MemoryHostBuffer,
        ids: list[int],
        *,
        seed: int = 0,
        ctx: ReqContext | None = None,
    ) -> dict[OffloadKey, bytes]:
        keys = self._keys(*ids)
        slots = list(range(len(keys)))
        data = self._fill(host, slots, seed)
        job = self._job(JobKind.PUT, keys, slots, ctx)
        store.submit_put(job)
        assert self._wait(store, [job])[job.job_id].success
        return dict(zip(keys, data, strict=True))

    def _found(self, store: TierStore, keys: list[OffloadKey]) -> frozenset[OffloadKey]:
        job = self._job(JobKind.PROBE, keys)
        store.submit_probe(job)
        result = self._wait(store, [job])[job.job_id]
        assert result.success
        return result.found

    @staticmethod
    def _replay(events: list[TierEvent], resident: set[OffloadKey]) -> None:
        for event in events:
            if isinstance(event, Stored):
                resident.update(event.keys)
            elif isinstance(event, Removed):
                resident.difference_update(event.keys)
            elif isinstance(event, Cleared):
                resident.clear()

    # -- checks --------------------------------------------------------------------------
    def test_satisfies_the_port(self) -> None:
        _, store = self._setup()
        try:
            assert isinstance(store, TierStore)
            assert store.identity.medium.name
        finally:
            store.close()

    def test_put_then_get_round_trips_bytes_into_other_slots(self) -> None:
        host, store = self._setup()
        try:
            stored = self._put(store, host, [1, 2, 3], seed=1)
            self._fill(host, range(self.num_slots), seed=99)  # overwrite the sources
            keys = list(stored)
            targets = [self.num_slots - 1, self.num_slots - 2, self.num_slots - 3]
            job = self._job(JobKind.GET, keys, targets)
            store.submit_get(job)
            result = self._wait(store, [job])[job.job_id]
            assert result.success
            for key, slot in zip(keys, targets, strict=True):
                assert bytes(host.slot_view(slot)) == stored[key]
            assert self._found(store, keys) == frozenset(keys)
        finally:
            store.close()

    def test_stored_event_carries_the_jobs_context_and_the_tiers_identity(self) -> None:
        host, store = self._setup()
        try:
            ctx = ReqContext("req-a")
            self._put(store, host, [1, 2], ctx=ctx)
            events = store.take_events()
            stored = [e for e in events if isinstance(e, Stored)]
            assert {k for e in stored for k in e.keys} == set(self._keys(1, 2))
            assert all(e.ctx is ctx and e.tier == store.identity for e in stored)
            assert store.take_events() == []
        finally:
            store.close()

    def test_putting_present_keys_succeeds_without_a_new_announcement(self) -> None:
        host, store = self._setup()
        try:
            self._put(store, host, [1, 2])
            store.take_events()
            self._put(store, host, [1, 2])
            assert [e for e in store.take_events() if isinstance(e, Stored)] == []
        finally:
            store.close()

    def test_get_of_a_missing_key_fails_and_never_claims_it_loaded(self) -> None:
        host, store = self._setup()
        try:
            self._put(store, host, [1])
            store.take_events()
            present, missing = self._keys(1, 2)
            job = self._job(JobKind.GET, [present, missing], [5, 6])
            store.submit_get(job)
            result = self._wait(store, [job])[job.job_id]
            assert not result.success
            assert result.ok_keys is None or missing not in result.ok_keys
            assert [e for e in store.take_events() if isinstance(e, Stored)] == []
        finally:
            store.close()

    def test_probes_find_exactly_what_was_put(self) -> None:
        host, store = self._setup()
        try:
            assert self._found(store, self._keys(1, 2)) == frozenset()
            self._put(store, host, [1])
            assert self._found(store, self._keys(1, 2)) == frozenset(self._keys(1))
        finally:
            store.close()

    def test_independent_jobs_are_each_reported_once(self) -> None:
        host, store = self._setup()
        try:
            self._fill(host, range(4), seed=3)
            jobs = [self._job(JobKind.PUT, self._keys(10 + i), [i]) for i in range(4)]
            for job in jobs:
                store.submit_put(job)
            results = self._wait(store, jobs)
            assert all(r.success for r in results.values())
            time.sleep(0.01)
            assert store.poll() == []
        finally:
            store.close()

    def test_delete_announces_exactly_the_present_keys(self) -> None:
        host, store = self._setup()
        try:
            self._put(store, host, [1, 2])
            store.take_events()
            store.delete(self._keys(2, 3))
            removed = [k for e in store.take_events() if isinstance(e, Removed) for k in e.keys]
            assert removed == self._keys(2)
            assert self._found(store, self._keys(1, 2)) == frozenset(self._keys(1))
        finally:
            store.close()

    def test_drain_makes_every_result_available(self) -> None:
        host, store = self._setup()
        try:
            self._fill(host, range(3), seed=4)
            jobs = [self._job(JobKind.PUT, self._keys(20 + i), [i]) for i in range(3)]
            for job in jobs:
                store.submit_put(job)
            store.drain()
            got = {r.job_id for r in store.poll()}
            assert got == {job.job_id for job in jobs}
        finally:
            store.close()

    def test_close_is_idempotent(self) -> None:
        _, store = self._setup()
        store.close()
        store.close()

    def test_event_replay_matches_what_probes_report(self) -> None:
        host, store = self._setup()
        try:
            rng = random.Random(5)
            resident: set[OffloadKey] = set()
            universe = list(range(40))
            for step in range(12):
                ids = rng.sample(universe, 3)
                self._put(store, host, ids, seed=step)
                if step % 3 == 2:
                    store.delete(self._keys(*rng.sample(universe, 4)))
                self._replay(store.take_events(), resident)
            keys = self._keys(*universe)
            assert self._found(store, keys) == frozenset(resident)
        finally:
            store.close()
