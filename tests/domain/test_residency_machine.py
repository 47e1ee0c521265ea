"""A hypothesis state machine over a tier's residency: put jobs reserved and committed in any
order (several on one key), reads and probes that observe storage and end in any order,
deletes, losses in storage and losing everything, checked at every step against the storage
the jobs act on and against the replay of the events."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from kvhex.domain import ArcPolicy, LruPolicy, OffloadKey, Removed, ReqContext, Stored
from kvhex.domain.residency import Reservation, Residency, Snapshot
from kvhex.domain.tiers import Medium, TierIdentity
from tests.domain.conftest import key

CAPACITY = 5
IDENTITY = TierIdentity(Medium.STORAGE, None, "t")
KEY_IDS = st.lists(st.integers(0, 9), min_size=1, max_size=4)


class Job:
    """A put in flight: its reservation and the step it started."""

    def __init__(self, reservation: Reservation) -> None:
        self.reservation = reservation


class Read:
    """A read or probe in flight: its snapshot and what it saw in storage when it ran."""

    def __init__(
        self, snapshot: Snapshot, keys: list[OffloadKey], seen: set[OffloadKey], started: int
    ) -> None:
        self.snapshot = snapshot
        self.keys = keys
        self.seen = seen
        self.started = started


class ResidencyMachine(RuleBasedStateMachine):
    policy_cls: type = LruPolicy
    jobs = Bundle("jobs")
    reads = Bundle("reads")

    def __init__(self) -> None:
        super().__init__()
        self.res = Residency(IDENTITY, CAPACITY * 100, 100, self.policy_cls)
        self.storage: set[OffloadKey] = set()  # blocks that exist (what jobs act on)
        self.replayed: set[OffloadKey] = set()
        self.ctx = ReqContext("r")
        self.step = 0
        self.arrived: dict[OffloadKey, int] = {}  # step at which a key last became readable
        self.lost_behind: set[OffloadKey] = set()  # lost in storage, not yet observed

    def _drain(self) -> None:
        for event in self.res.take_events():
            if isinstance(event, Stored):
                assert not (set(event.keys) & self.replayed), "stored twice without removal"
                self.replayed |= set(event.keys)
                for k in event.keys:
                    self.arrived[k] = self.step
            elif isinstance(event, Removed):
                assert set(event.keys) <= self.replayed, "removal of an unannounced key"
                self.replayed -= set(event.keys)
        self.step += 1

    @rule(target=jobs, ids=KEY_IDS, verify=st.booleans())
    def reserve(self, ids: list[int], verify: bool) -> object:
        keys = [key(i) for i in ids]
        readable_before = set(self.res.keys())
        reservation = self.res.reserve(keys, self.ctx, verify=verify)
        if reservation is None:
            self._drain()
            return multiple()
        assert set(reservation.owned).isdisjoint(readable_before)
        assert set(reservation.present) <= readable_before
        assert set(reservation.victims).isdisjoint(keys)
        self.storage -= set(reservation.victims)  # the job deletes them before it writes
        self._drain()
        return Job(reservation)

    @rule(job=consumes(jobs), data=st.data())
    def commit(self, job: Job, data: st.DataObject) -> None:
        r = job.reservation
        written = set(data.draw(st.lists(st.sampled_from(list(r.owned) or [key(99)]))))
        written &= set(r.owned)
        lost: set[OffloadKey] = set()
        if r.verify is not None:
            lost = {k for k in r.present if k not in self.storage}
            rewrite = set(data.draw(st.lists(st.sampled_from(sorted(lost) or [key(99)]))))
            written |= rewrite & lost
        self.storage |= written
        self.lost_behind -= written
        strays = self.res.commit(r, written, lost)
        self.storage -= set(strays)
        for k in r.owned:
            assert not self.res.is_pending(k)
        self._drain()

    @rule(target=reads, ids=KEY_IDS, pin=st.booleans())
    def start_read(self, ids: list[int], pin: bool) -> Read:
        keys = [key(i) for i in ids]
        snapshot = self.res.snapshot(keys, pin=pin)
        # the worst case for a late observation: storage seen as it is now, the job ending
        # after any number of other changes
        read = Read(snapshot, keys, {k for k in keys if k in self.storage}, self.step)
        self._drain()
        return read

    @rule(read=consumes(reads))
    def end_read(self, read: Read) -> None:
        lost = [k for k in read.keys if k not in read.seen]
        ok = [k for k in read.keys if k in read.seen]
        newer = {k for k in self.res if self.arrived.get(k, -1) >= read.started}
        removed = self.res.release(read.snapshot, ok, lost, self.ctx)
        assert not (set(removed) & newer), "an old observation dropped a newer residency"
        self.storage -= set(removed)
        self._drain()

    @rule(ids=KEY_IDS)
    def delete(self, ids: list[int]) -> None:
        keys = [key(i) for i in ids] * 2  # duplicates are part of the contract
        removed = self.res.delete(keys)
        assert len(removed) == len(set(removed))
        self.storage -= set(removed)
        self._drain()

    @rule(ids=KEY_IDS)
    def lose_in_storage(self, ids: list[int]) -> None:
        """The storage lost blocks behind the tier's back (an object store wiped)."""
        gone = {key(i) for i in ids} & self.storage
        self.storage -= gone
        self.lost_behind |= gone

    @rule()
    def drop_all(self) -> None:
        self.res.drop_all()
        self._drain()

    @invariant()
    def replay_equals_residency(self) -> None:
        assert self.replayed == set(self.res.keys())

    @invariant()
    def readable_blocks_exist_unless_lost_behind_the_tiers_back(self) -> None:
        assert set(self.res.keys()) - self.storage <= self.lost_behind

    @invariant()
    def within_capacity(self) -> None:
        assert self.res.used_bytes <= CAPACITY * 100
        assert len(self.res) + self.res.pending_count <= CAPACITY


class ArcResidencyMachine(ResidencyMachine):
    policy_cls = ArcPolicy


TestResidencyLru = ResidencyMachine.TestCase
TestResidencyLru.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestResidencyArc = ArcResidencyMachine.TestCase
TestResidencyArc.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
