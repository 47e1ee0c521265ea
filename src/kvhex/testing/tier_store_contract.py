"""The TierStore contract: what the tiering manager relies on from any secondary tier.

Run it against your tier with one factory method::

    from kvhex.testing import TierStoreContract

    class TestMyTier(TierStoreContract):
        def make_store(self, host):
            return MyTierStore(host, root=...)

The suite gives the tier a real host buffer (``MemoryHostBuffer``) and checks, with real
bytes: the port's members are there and callable; put then get round trips exactly; probes
find what was put and nothing else; each job is reported exactly once, by job id; a put of
present keys succeeds without announcing them again; a get of a missing key fails without
claiming it loaded; ``Stored`` carries the job's own ``ReqContext`` and the tier's identity;
``drain`` makes every result pollable at once; ``close`` is idempotent, reports every job
submitted before it and refuses new ones; replaying the tier's events reproduces what its
probes report. For a tier that ``Deletes`` (``kvhex.ports.tier_store``), also: ``delete``
announces exactly the keys that were present, each once even when named twice, and leaves
them unreadable; and a tier at full capacity takes as many new blocks as ``delete`` just
removed, evicting nothing else (for another tier these checks skip, saying so). The order
checks of :class:`~kvhex.testing.tier_order.OrderContract` run too.
"""

from __future__ import annotations

import inspect
import random
import time

from kvhex.domain.events import Removed, Stored
from kvhex.domain.jobs import JobKind
from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import Deletes, TierStore
from kvhex.testing.tier_kit import block_payload, describe_keys, replay, tier_key
from kvhex.testing.tier_order import OrderContract

_JOBS = ("submit_put", "submit_get", "submit_probe")
_CALLS = ("poll", "drain", "close", "take_events")


class TierStoreContract(OrderContract):
    """Mix into a ``Test*`` class and implement :meth:`make_store` (see the module docstring
    of :mod:`kvhex.testing` for the optional hooks)."""

    capacity_rounds = 30
    """Rounds of "delete some, put as many at once" at full capacity."""

    # -- helpers -------------------------------------------------------------------------
    def _setup(self) -> tuple[HostBuffer, TierStore]:
        host = self.new_host(self.num_slots, self.slot_bytes)
        return host, self.make_store(host)

    def _put(
        self, store: TierStore, host: HostBuffer, ids: list[int], ctx: ReqContext | None = None
    ) -> list[OffloadKey]:
        keys = [tier_key(i) for i in ids]
        self.fill(host, keys, range(len(keys)))
        result = self.run_job(store, self.new_job(JobKind.PUT, keys, range(len(keys)), ctx))
        assert result.success, f"a put failed: {result.error}"
        return keys

    @staticmethod
    def _removed(store: TierStore) -> list[OffloadKey]:
        return [k for e in store.take_events() if isinstance(e, Removed) for k in e.keys]

    # -- checks --------------------------------------------------------------------------
    def test_satisfies_the_port(self) -> None:
        _, store = self._setup()
        try:
            identity = store.identity
            assert isinstance(identity, TierIdentity), f"identity is {identity!r}"
            assert identity.medium.name
            assert store.identity == identity, "identity changed between two reads"
            jobs = (*_JOBS, "delete") if isinstance(store, Deletes) else _JOBS
            for name, args in [(n, (None,)) for n in jobs] + [(n, ()) for n in _CALLS]:
                member = getattr(store, name)
                assert callable(member), f"{name} is {member!r}, not a method"
                try:
                    signature = inspect.signature(member)
                except ValueError:  # a builtin without a signature: nothing to check
                    continue
                try:
                    signature.bind(*args)
                except TypeError as exc:
                    raise AssertionError(f"{name}{signature} cannot take {args}: {exc}") from exc
            assert isinstance(store, TierStore), f"{store!r} is not a TierStore"
            assert store.poll() == [], "poll reported results before any job"
            assert isinstance(store.take_events(), list)
        finally:
            store.close()

    def test_put_then_get_round_trips_bytes_into_other_slots(self) -> None:
        host, store = self._setup()
        try:
            keys = self._put(store, host, [1, 2, 3])
            targets = [self.num_slots - 1, self.num_slots - 2, self.num_slots - 3]
            self.spoil(host, range(self.num_slots))  # overwrite the sources too
            result = self.run_job(store, self.new_job(JobKind.GET, keys, targets))
            assert result.success, f"the get failed: {result.error}"
            for key, slot in zip(keys, targets, strict=True):
                assert bytes(host.slot_view(slot)) == block_payload(key, self.slot_bytes)
            assert self.probe(store, keys) == frozenset(keys)
        finally:
            store.close()

    def test_stored_event_carries_the_jobs_context_and_the_tiers_identity(self) -> None:
        host, store = self._setup()
        try:
            ctx = ReqContext("req-a")
            keys = self._put(store, host, [1, 2], ctx=ctx)
            stored = [e for e in store.take_events() if isinstance(e, Stored)]
            assert {k for e in stored for k in e.keys} == set(keys)
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
            (present,) = self._put(store, host, [1])
            store.take_events()
            missing = tier_key(2)
            self.spoil(host, [5, 6])
            result = self.run_job(store, self.new_job(JobKind.GET, [present, missing], [5, 6]))
            assert not result.success
            assert result.ok_keys is None or missing not in result.ok_keys
            assert [e for e in store.take_events() if isinstance(e, Stored)] == []
        finally:
            store.close()

    def test_probes_find_exactly_what_was_put(self) -> None:
        host, store = self._setup()
        try:
            assert self.probe(store, [tier_key(1), tier_key(2)]) == frozenset()
            self._put(store, host, [1])
            assert self.probe(store, [tier_key(1), tier_key(2)]) == frozenset({tier_key(1)})
        finally:
            store.close()

    def test_independent_jobs_are_each_reported_once(self) -> None:
        host, store = self._setup()
        try:
            keys = [tier_key(10 + i) for i in range(4)]
            self.fill(host, keys, range(4))
            jobs = [self.new_job(JobKind.PUT, [k], [i]) for i, k in enumerate(keys)]
            for job in jobs:
                store.submit_put(job)
            results = self.wait_for(store, jobs)
            assert all(r.success for r in results.values())
            time.sleep(0.01)
            assert store.poll() == []
        finally:
            store.close()

    def test_delete_announces_exactly_the_present_keys(self) -> None:
        host, store = self._setup()
        try:
            deleter = self.deleting(store)
            self._put(store, host, [1, 2])
            store.take_events()
            deleter.delete([tier_key(2), tier_key(3)])
            assert self._removed(store) == [tier_key(2)]
            assert self.probe(store, [tier_key(1), tier_key(2)]) == frozenset({tier_key(1)})
        finally:
            store.close()

    def test_delete_naming_a_key_twice_announces_it_once_and_it_is_gone(self) -> None:
        host, store = self._setup()
        try:
            deleter = self.deleting(store)
            k, j, kept = self._put(store, host, [1, 2, 3])
            store.take_events()
            for named, gone in (([k, k], k), ([j, tier_key(9), j], j)):
                try:
                    deleter.delete(named)
                except Exception as exc:
                    raise AssertionError(f"delete({describe_keys(named)}) raised {exc!r}") from exc
                removed = self._removed(store)
                assert removed == [gone], (
                    f"delete({describe_keys(named)}) announced {describe_keys(removed)}"
                )
            deleter.delete([k])
            assert self._removed(store) == [], "a second delete announced the key again"
            assert self.probe(store, [k, j, kept]) == frozenset({kept})
            loaded, _ = self.get_all(store, host, [k, j, kept])
            assert loaded == {kept}, f"deleted keys still load: {describe_keys(loaded - {kept})}"
        finally:
            store.close()

    def test_delete_then_put_at_full_capacity_evicts_nothing_else(self) -> None:
        """Fill the tier, then again and again delete a few blocks and at once put as many
        new ones: each put succeeds and evicts nothing."""
        host = self.new_host(self.num_slots, self.slot_bytes)
        store, capacity = self.bounded_store(host, self.num_slots)
        try:
            deleter = self.deleting(store)
            resident: set[OffloadKey] = set()
            problems = replay(store.take_events(), resident, store.identity)
            keys = [tier_key(i) for i in range(capacity)]
            for result in self.put_all(store, host, keys):
                assert result.success, f"filling the tier failed: {result.error}"
            problems += replay(store.take_events(), resident, store.identity)
            assert not problems, "; ".join(problems)
            assert resident == set(keys), (
                f"filling {capacity} blocks evicted {describe_keys(set(keys) - resident)}"
            )
            rng, next_id = random.Random(7), capacity
            for round_ in range(self.capacity_rounds):
                gone = rng.sample(sorted(resident), rng.randint(1, min(4, capacity)))
                new = [tier_key(next_id + i) for i in range(len(gone))]
                next_id += len(gone)
                deleter.delete(gone)
                self.fill(host, new, range(len(new)))
                result = self.run_job(store, self.new_job(JobKind.PUT, new, range(len(new))))
                assert result.success, (
                    f"round {round_}: a put of {len(new)} blocks right after deleting "
                    f"{len(gone)} at full capacity failed: {result.error}"
                )
                events = store.take_events()
                removed = [k for e in events if isinstance(e, Removed) for k in e.keys]
                assert sorted(removed) == sorted(gone), (
                    f"round {round_}: deleted {describe_keys(gone)}, then a put of as many "
                    f"blocks announced removed {describe_keys(removed)}"
                )
                problems = replay(events, resident, store.identity)
                assert not problems, f"round {round_}: " + "; ".join(problems)
            assert self.probe(store, sorted(resident)) == frozenset(resident)
            loaded, errors = self.get_all(store, host, sorted(resident))
            assert loaded == resident, f"resident keys that do not load: {errors}"
        finally:
            store.close()

    def test_drain_makes_every_result_available(self) -> None:
        host, store = self._setup()
        try:
            keys = [tier_key(20 + i) for i in range(3)]
            self.fill(host, keys, range(3))
            jobs = [self.new_job(JobKind.PUT, [k], [i]) for i, k in enumerate(keys)]
            for job in jobs:
                store.submit_put(job)
            store.drain()
            assert {r.job_id for r in store.poll()} == {job.job_id for job in jobs}
        finally:
            store.close()

    def test_close_is_idempotent(self) -> None:
        """A second close changes nothing; afterwards every submit raises ``TierUnavailable``."""
        _, store = self._setup()
        store.close()
        store.close()
        for kind, submit in (
            (JobKind.PUT, store.submit_put),
            (JobKind.GET, store.submit_get),
            (JobKind.PROBE, store.submit_probe),
        ):
            slots = [0] if kind is not JobKind.PROBE else []
            try:
                submit(self.new_job(kind, [tier_key(1)], slots))
            except TierUnavailable:
                continue
            raise AssertionError(f"a {kind.value} submitted after close did not raise")

    def test_close_reports_every_job_submitted_before_it(self) -> None:
        """Jobs still queued at ``close`` are reported (failed) by the polls after it."""
        host, store = self._setup()
        keys = [tier_key(30 + i) for i in range(self.num_slots)]
        self.fill(host, keys, range(len(keys)))
        jobs = [self.new_job(JobKind.PUT, [k], [i]) for i, k in enumerate(keys)]
        jobs.append(self.new_job(JobKind.PROBE, keys))
        for job in jobs:
            self.submit(store, job)
        store.close()
        self.wait_for(store, jobs)
        assert store.poll() == []

    def test_event_replay_matches_what_probes_report(self) -> None:
        """Puts (and, where the tier ``Deletes``, deletes) of random keys: replaying the
        events gives what probes find."""
        host, store = self._setup()
        try:
            rng = random.Random(5)
            resident: set[OffloadKey] = set()
            problems = []
            universe = list(range(40))
            for step in range(12):
                self._put(store, host, rng.sample(universe, 3))
                if step % 3 == 2 and isinstance(store, Deletes):
                    store.delete([tier_key(i) for i in rng.sample(universe, 4)])
                problems += replay(store.take_events(), resident, store.identity)
            assert not problems, "; ".join(problems)
            keys = [tier_key(i) for i in universe]
            assert self.probe(store, keys) == frozenset(resident)
        finally:
            store.close()
