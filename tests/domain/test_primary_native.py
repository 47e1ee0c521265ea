"""The host tier's two paths under LRU, driven alike: the native module (``_hostslots``) and
the Python path over ``LruPolicy`` must give the same answers, slots, victims, events,
errors, recency order and counters after every operation, including the ones that fail."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvhex.domain import ArcPolicy, LruPolicy, PrimaryTier, ReqContext
from kvhex.domain.primary import native_module
from tests.domain.conftest import key, keys

NATIVE, WHY_NOT = native_module()
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"_hostslots: {WHY_NOT}")

CAPACITY = 5
IDS = st.lists(st.integers(0, 12), max_size=5)
ODD_KEYS = st.sampled_from(
    [
        b"short",  # a length the tier did not learn
        bytearray(36),  # not bytes
        "text",
        7,
        [1],  # unhashable
    ]
)


def test_the_native_path_is_there_when_the_run_requires_it() -> None:
    """``make test`` exports ``KVHEX_NATIVE=required``: a .venv built without the module
    fails the suite instead of testing the Python path twice."""
    if os.environ.get("KVHEX_NATIVE") != "required":
        pytest.skip("KVHEX_NATIVE is not 'required' (make test sets it): either path may run")
    assert NATIVE is not None, f"KVHEX_NATIVE=required, but _hostslots: {WHY_NOT}"


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What ``call`` returned, or the type and message of what it raised."""
    try:
        return "ok", call()
    except Exception as exc:  # both paths must fail alike: compared by type and message
        return type(exc).__name__, str(exc)


@needs_native
class TwoPaths(RuleBasedStateMachine):
    threshold = 1  # offers a chunk needs before it is stored

    def __init__(self) -> None:
        super().__init__()
        self.native = PrimaryTier(
            CAPACITY, LruPolicy(CAPACITY), native=True, store_threshold=self.threshold
        )
        self.python = PrimaryTier(
            CAPACITY, LruPolicy(CAPACITY), native=False, store_threshold=self.threshold
        )
        self.ctx = ReqContext("r")

    def both(self, call: Callable[[PrimaryTier], Any]) -> Any:
        theirs = outcome(lambda: call(self.native))
        ours = outcome(lambda: call(self.python))
        assert theirs == ours
        return theirs[1]

    @rule(ids=IDS, protect=IDS)
    def prepare_store(self, ids: list[int], protect: list[int]) -> None:
        self.both(lambda t: t.prepare_store(keys(*ids), self.ctx, protect=keys(*protect)))

    @rule(ids=IDS, extra=IDS, success=st.booleans(), pin=st.integers(0, 2))
    def complete_store(self, ids: list[int], extra: list[int], success: bool, pin: int) -> None:
        pending = [k for k in keys(*range(13)) if self.python.ref_count(k) == -1]
        chosen = [k for i, k in enumerate(pending) if i in ids] + keys(*extra)
        jobs_keys = list(set(chosen))  # in a set's order, as vLLM reports a job's keys
        self.both(lambda t: t.complete_store(jobs_keys, self.ctx, success, pin=pin))

    @rule(ids=IDS, times=st.integers(1, 3))
    def pin(self, ids: list[int], times: int) -> None:
        self.both(lambda t: t.pin(keys(*ids), times))

    @rule(ids=IDS)
    def load(self, ids: list[int]) -> None:
        self.both(lambda t: t.prepare_load(keys(*ids), self.ctx))

    @rule(ids=IDS)
    def unpin(self, ids: list[int]) -> None:
        self.both(lambda t: t.unpin(keys(*ids)))

    @rule(ids=IDS)
    def complete_load(self, ids: list[int]) -> None:
        self.both(lambda t: t.complete_load(keys(*ids), self.ctx))

    @rule(ids=IDS)
    def touch(self, ids: list[int]) -> None:
        self.both(lambda t: t.touch(keys(*ids), self.ctx))

    @rule(ids=IDS, odd=ODD_KEYS, at=st.integers(0, 5), operation=st.integers(0, 5))
    def bad_key(self, ids: list[int], odd: Any, at: int, operation: int) -> None:
        """A key that is no key (or not of the tier's length) among good ones."""
        listed: list[Any] = keys(*ids)
        listed.insert(min(at, len(listed)), odd)
        call = (
            lambda t: t.prepare_store(listed, self.ctx),
            lambda t: t.prepare_load(listed, self.ctx),
            lambda t: t.pin(listed, 2),
            lambda t: t.unpin(listed),
            lambda t: t.touch(listed, self.ctx),
            lambda t: t.lookup(odd),
        )[operation]
        self.both(call)

    @rule(i=st.integers(0, 12))
    def lookup(self, i: int) -> None:
        self.both(lambda t: t.lookup(key(i)))

    @rule()
    def reset(self) -> None:
        self.both(lambda t: t.reset())

    @invariant()
    def alike(self) -> None:
        native, python = self.native, self.python
        assert native.take_events() == python.take_events()
        assert native.stats() == python.stats()
        index, refs = native.read_view()
        assert (dict(index), list(refs)) == tuple(map(_copy, python.read_view()))
        # the recency order, every resident key in it
        assert native._native.order() == list(python._policy._order)  # type: ignore[union-attr,attr-defined]
        assert native._native.free_count == python._pool.free_count  # type: ignore[union-attr]


def _copy(view: Any) -> Any:
    return dict(view) if isinstance(view, dict) else list(view)


class TwoPathsWithAThreshold(TwoPaths):
    """Stores after a second offer: the native path's other way through ``prepare_store``."""

    threshold = 2


TwoPaths.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TwoPathsWithAThreshold.TestCase.settings = TwoPaths.TestCase.settings
TestTwoPaths = TwoPaths.TestCase
TestTwoPathsWithAThreshold = TwoPathsWithAThreshold.TestCase


@needs_native
def test_a_slot_pool_order_is_kept_natively() -> None:
    """vLLM's order: evicting the chunk in slot 0 of a 4-slot pool, then storing three new
    keys, yields slots 2, 3, 0."""
    tier = PrimaryTier(4, LruPolicy(4), native=True)
    tier.prepare_store(keys(0, 1))
    tier.complete_store(keys(0, 1))
    plan = tier.prepare_store(keys(2, 3, 4))
    assert plan is not None
    assert plan.evicted == [key(0)]
    assert plan.slots == [2, 3, 0]


def test_native_true_needs_the_module_and_lru() -> None:
    with pytest.raises(ValueError, match="native=True, but the policy is ArcPolicy"):
        PrimaryTier(4, ArcPolicy(4), native=True)
    assert not PrimaryTier(4, ArcPolicy(4)).native  # another policy: the Python path
    assert not PrimaryTier(4, LruPolicy(4), native=False).native
    assert PrimaryTier(4, LruPolicy(4)).native is (NATIVE is not None)


@needs_native
@pytest.mark.parametrize("threshold", [1, 2])
def test_long_offers_with_keys_listed_twice_take_both_paths_alike(threshold: int) -> None:
    """Offers longer than the native path compares one by one (it builds a set then), keys
    listed twice, evictions protecting the whole offer and a caller's keys."""
    tiers = [
        PrimaryTier(40, LruPolicy(40), native=native, store_threshold=threshold)
        for native in (True, False)
    ]
    offers = [
        keys(*range(30), *range(5)),
        keys(*range(30, 60), 31, 30),
        keys(*range(60, 64), 62, 60, 61),
        keys(*range(64, 100)),
    ]
    for offer in offers * threshold:
        plans = [
            outcome(functools.partial(tier.prepare_store, offer, protect=keys(1, 2, 3)))
            for tier in tiers
        ]
        assert plans[0] == plans[1]
        for tier in tiers:
            tier.complete_store(offer)
        assert tiers[0].take_events() == tiers[1].take_events()
        assert tiers[0].stats() == tiers[1].stats()


@needs_native
def test_native_objects_never_initialized_refuse_instead_of_crashing() -> None:
    assert NATIVE is not None
    slots = NATIVE.LruSlots.__new__(NATIVE.LruSlots)
    calls = (
        lambda: slots.repin([], 1),
        lambda: slots.touch([]),
        lambda: slots.candidates([], 36),
        lambda: slots.evict(1, ()),
        lambda: slots.insert([], 0),
        lambda: slots.store([], 36, 0, (), 0),
        lambda: slots.complete([], 0),
        lambda: slots.fail([]),
        slots.order,
    )
    for call in calls:
        with pytest.raises(RuntimeError, match="not initialized"):
            call()
    path = NATIVE.HitPath.__new__(NATIVE.HitPath)
    with pytest.raises(RuntimeError, match="not initialized"):
        path(key(1), None)
