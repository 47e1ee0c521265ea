"""The native hit path (``TieringManager.hit_path``) beside the manager's own lookup: two
worlds driven alike, one looked up through the path, one through ``lookup``, must answer,
remember, count and evict alike; the path hands every other case to its fallback, and stops
answering where its conditions say it must."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvhex.domain import LookupResult, ReqContext
from kvhex.domain.primary import native_module
from kvhex.errors import InvalidKeyError, StateError
from tests.service.harness import World, key, keys

MODULE, WHY_NOT = native_module()
pytestmark = pytest.mark.skipif(MODULE is None, reason=f"_hostslots: {WHY_NOT}")

HIT, MISS = "hit!", "miss!"  # an adapter's own answers, as vLLM's are not kvhex's


class PathAndLookup(RuleBasedStateMachine):
    tiers = 0

    def __init__(self) -> None:
        super().__init__()
        self.pathed = World(num_slots=6, tiers=self.tiers)
        self.plain = World(num_slots=6, tiers=self.tiers)
        self.idle: list[int] = []  # the adapter's own reason to see lookups, when not empty
        self.fallbacks = 0
        path = self.pathed.manager.hit_path(self.fallback, HIT, MISS, idle=(self.idle,))
        assert path is not None
        self.path = path
        self.ctxs = [ReqContext(f"r{i}") for i in range(3)]

    def fallback(self, k: Any, ctx: ReqContext) -> Any:
        self.fallbacks += 1
        return _as_adapter(self.pathed.manager.lookup(k, ctx))

    def both(self, call: Any) -> None:
        for world in (self.pathed, self.plain):
            call(world)

    @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=4), r=st.integers(0, 2))
    def store(self, ids: list[int], r: int) -> None:
        def store(world: World) -> None:
            plan = world.manager.prepare_store(keys(*ids), self.ctxs[r])
            if plan is not None:
                world.manager.complete_store(plan.keys, self.ctxs[r], True)

        self.both(store)

    @rule(ids=st.lists(st.integers(0, 9), min_size=1, max_size=3), r=st.integers(0, 2))
    def pending_store(self, ids: list[int], r: int) -> None:
        """A store whose write is still pending (answered ``HIT_PENDING``: the fallback's)."""
        self.both(lambda world: world.manager.prepare_store(keys(*ids), self.ctxs[r]))

    @rule(i=st.integers(0, 11), r=st.integers(0, 2))
    def lookup(self, i: int, r: int) -> None:
        ours = self.path(key(i), self.ctxs[r])
        theirs = _as_adapter(self.plain.manager.lookup(key(i), self.ctxs[r]))
        assert ours == theirs

    @rule(r=st.integers(0, 2))
    def load_what_hit(self, r: int) -> None:
        """A device load of the chunks answered ``HIT`` this step and still readable (a
        store may have evicted one since), pinned, then done."""
        answered = self.plain.manager._hits_this_step
        hits = sorted(k for k in answered if self.plain.primary.lookup(k) is LookupResult.HIT)
        if hits:
            self.both(lambda world: world.manager.prepare_load(hits, self.ctxs[r]))
            self.both(lambda world: world.manager.complete_load(hits, self.ctxs[r]))

    @rule()
    def step(self) -> None:
        self.both(lambda world: world.step())

    @rule(busy=st.booleans())
    def adapter_busy(self, busy: bool) -> None:
        """The adapter's own container not empty: every lookup goes to the fallback."""
        self.idle[:] = [1] if busy else []

    @precondition(lambda self: self.idle)
    @rule(i=st.integers(0, 11))
    def busy_adapter_falls_back(self, i: int) -> None:
        before = self.fallbacks
        self.lookup(i, 0)
        assert self.fallbacks == before + 1

    @invariant()
    def alike(self) -> None:
        pathed, plain = self.pathed.manager, self.plain.manager
        assert pathed.stats().lookups == plain.stats().lookups
        assert pathed.stats().host_hits == plain.stats().host_hits
        assert set(pathed.host_keys()) == set(plain.host_keys())
        assert pathed._hits_this_step == plain._hits_this_step


class PathAndLookupWithATier(PathAndLookup):
    """A secondary tier: misses are the fallback's (the tier is asked)."""

    tiers = 1


def _as_adapter(result: LookupResult) -> Any:
    return {LookupResult.HIT: HIT, LookupResult.MISS: MISS}.get(result, result)


PathAndLookup.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
PathAndLookupWithATier.TestCase.settings = PathAndLookup.TestCase.settings
TestPathAndLookup = PathAndLookup.TestCase
TestPathAndLookupWithATier = PathAndLookupWithATier.TestCase


def test_the_path_answers_natively_only_once_no_poll_is_due() -> None:
    """With a secondary tier the step's first lookup is the fallback's (it polls the tier);
    then host hits are the path's until the step ends. With none there is nothing to poll:
    the path answers from the step after the first poll on, until a reset."""
    for tiers in (1, 0):
        world = World(num_slots=4, tiers=tiers)
        calls: list[bytes] = []

        def fallback(
            k: Any, ctx: ReqContext, world: World = world, calls: list[bytes] = calls
        ) -> Any:
            calls.append(k)
            return _as_adapter(world.manager.lookup(k, ctx))

        path = world.manager.hit_path(fallback, HIT, MISS)
        assert path is not None
        ctx = ReqContext("r")
        world.store([1, 2], ctx)
        world.step()
        assert path(key(1), ctx) == HIT  # with a tier: the step's first lookup polls
        assert path(key(2), ctx) == HIT
        first = [key(1)] if tiers else []
        assert calls == first
        if not tiers:  # a miss with no tier to ask is the path's too
            assert path(key(3), ctx) == MISS
            assert path.misses == 1
            assert calls == first
        world.step()  # a new step
        assert path(key(2), ctx) == HIT
        assert calls == ([*first, key(2)] if tiers else [])
        world.manager.reset()  # the host tier is empty, and a poll is due again
        before = len(calls)
        assert path(key(2), ctx) != HIT  # (with a tier: its probe's RETRY)
        assert calls[before:] == [key(2)]


def test_a_bad_key_gets_the_lookups_own_error_and_a_shut_manager_refuses() -> None:
    world = World(num_slots=4, tiers=0)
    path = world.manager.hit_path(lambda k, c: _as_adapter(world.manager.lookup(k, c)), HIT, MISS)
    assert path is not None
    ctx = ReqContext("r")
    world.store([1], ctx)
    assert path(key(1), ctx) == HIT
    with pytest.raises(InvalidKeyError):
        path([1], ctx)
    world.manager.shutdown()
    with pytest.raises(StateError, match="shut down"):
        path(key(1), ctx)
