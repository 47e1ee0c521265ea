"""A hypothesis state machine over the primary tier: random stores, completions (ok or
failed), loads, touches, lookups and resets, checked against a plain model at every step.
Its events are exact (each key once, stored only when not readable, removed only when it
was), and the announcer's path for exact tiers announces them as its general path does."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvhex.domain import (
    ArcPolicy,
    Cleared,
    LookupResult,
    LruPolicy,
    OffloadKey,
    PrimaryTier,
    Removed,
    ReqContext,
    Stored,
)
from kvhex.domain.announce import Announcer
from kvhex.domain.primary import PRIMARY_IDENTITY
from tests.domain.conftest import key

CAPACITY = 6
KEY_IDS = st.lists(st.integers(0, 14), min_size=1, max_size=5)


class PrimaryMachine(RuleBasedStateMachine):
    policy_cls: type = LruPolicy

    def __init__(self) -> None:
        super().__init__()
        self.tier = PrimaryTier(CAPACITY, self.policy_cls(CAPACITY))
        self.state: dict[OffloadKey, int] = {}  # model ref counts
        self.pins: Counter[OffloadKey] = Counter()
        self.replayed: set[OffloadKey] = set()  # what the event stream says is readable
        self.ctx = ReqContext("r")
        self.exact = Announcer(exact=(PRIMARY_IDENTITY,))
        self.general = Announcer()

    def _drain(self) -> None:
        events = self.tier.take_events()
        assert self.exact.order(events) == self.general.order(events)
        for event in events:
            if not isinstance(event, Cleared):
                assert len(set(event.keys)) == len(event.keys), "a key listed twice"
            if isinstance(event, Stored):
                assert event.ctx is self.ctx
                assert not (set(event.keys) & self.replayed), "stored twice without removal"
                self.replayed |= set(event.keys)
            elif isinstance(event, Removed):
                assert set(event.keys) <= self.replayed, "removal of an unannounced key"
                self.replayed -= set(event.keys)
            elif isinstance(event, Cleared):
                self.replayed.clear()

    @rule(ids=KEY_IDS)
    def prepare_store(self, ids: list[int]) -> None:
        offered = [key(i) for i in ids]
        before = dict(self.state)
        plan = self.tier.prepare_store(offered, self.ctx)
        new = list(dict.fromkeys(k for k in offered if k not in before))
        evictable = [k for k, r in before.items() if r == 0 and k not in offered]
        free = CAPACITY - len(before)
        if plan is None:
            assert len(new) - free > len(evictable)
            assert self.state == before
            return
        assert plan.keys == new
        assert len(set(plan.slots)) == len(plan.slots)
        for victim in plan.evicted:
            assert before[victim] == 0, "evicted a pinned or pending key"
            assert victim not in offered, "evicted an offered key"
            del self.state[victim]
        assert len(plan.evicted) == max(0, len(new) - free)
        for k in plan.keys:
            self.state[k] = -1

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        pending = [k for k, r in self.state.items() if r == -1]
        extra = [key(i) for i in data.draw(st.lists(st.integers(0, 14), max_size=2))]
        chosen = data.draw(st.lists(st.sampled_from(pending), unique=True)) if pending else []
        self.tier.complete_store(chosen + extra, self.ctx, success=success)
        # every listed key whose write is pending is affected, listed on purpose or not
        for k in dict.fromkeys(k for k in chosen + extra if self.state.get(k) == -1):
            if success:
                self.state[k] = 0
            else:
                del self.state[k]

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        ready = [k for k, r in self.state.items() if r >= 0]
        if not ready:
            return
        chosen = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3))
        slots = self.tier.prepare_load(chosen, self.ctx)
        assert slots == [self.tier.slot_of(k) for k in chosen]
        for k in chosen:
            self.state[k] += 1
            self.pins[k] += 1

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        pinned = [k for k, n in self.pins.items() if n > 0]
        if not pinned:
            return
        k = data.draw(st.sampled_from(pinned))
        self.tier.complete_load([k], self.ctx)
        self.state[k] -= 1
        self.pins[k] -= 1

    @rule(ids=KEY_IDS)
    def touch(self, ids: list[int]) -> None:
        self.tier.touch([key(i) for i in ids], self.ctx)

    @rule()
    def take_events(self) -> None:
        self._drain()

    @rule()
    def reset(self) -> None:
        self.tier.reset()
        self.state.clear()
        self.pins.clear()

    @invariant()
    def agrees_with_model(self) -> None:
        for k, r in self.state.items():
            assert self.tier.ref_count(k) == r
            expected = LookupResult.HIT if r >= 0 else LookupResult.HIT_PENDING
            assert self.tier.lookup(k) is expected
        assert len(self.tier) == len(self.state)
        s = self.tier.stats()
        assert s.pending == sum(1 for r in self.state.values() if r == -1)
        assert s.evictable == sum(1 for r in self.state.values() if r == 0)
        assert s.pinned == sum(1 for r in self.state.values() if r > 0)
        slots = [self.tier.slot_of(k) for k in self.state]
        assert len(set(slots)) == len(slots)

    @invariant()
    def events_replay_to_the_readable_set(self) -> None:
        self._drain()
        assert self.replayed == {k for k, r in self.state.items() if r >= 0}


class ArcMachine(PrimaryMachine):
    policy_cls = ArcPolicy


TestLruPrimaryMachine = PrimaryMachine.TestCase
TestLruPrimaryMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestArcPrimaryMachine = ArcMachine.TestCase
TestArcPrimaryMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
