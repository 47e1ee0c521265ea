"""The eviction-policy contract: what the primary tier relies on from any ``EvictionPolicy``.

* ``evict(n, protected)`` returns exactly ``n`` distinct keys, each inserted, marked evictable
  and not pinned since, not in ``protected``, and forgets them; or ``None`` with no change.
* When at least ``n`` such keys exist it must succeed (the tier checked the count first).
* Pending (inserted, never marked evictable), pinned, removed, evicted and cleared keys are
  never returned.
* ``touch`` of unknown keys is harmless and the request context is accepted as given.
"""

from __future__ import annotations

import random

from kvhex.domain.keys import OffloadKey, make_offload_key
from kvhex.domain.policies.base import EvictionPolicy
from kvhex.domain.request import ReqContext


def policy_key(i: int) -> OffloadKey:
    """A distinct, well-formed 36-byte key for ``i``."""
    return make_offload_key(i.to_bytes(32, "big"), 0)


class EvictionPolicyContract:
    """Mix into a ``Test*`` class and implement :meth:`make_policy`."""

    capacity = 8

    def make_policy(self, capacity: int) -> EvictionPolicy:
        """Build the policy under test for ``capacity`` slots."""
        raise NotImplementedError("implement make_policy(capacity) in your test class")

    # -- helpers -------------------------------------------------------------------------
    def _ready(self, policy: EvictionPolicy, ids: range | list[int]) -> list[OffloadKey]:
        keys = [policy_key(i) for i in ids]
        policy.insert(keys)
        policy.mark_evictable(keys)
        return keys

    # -- checks --------------------------------------------------------------------------
    def test_satisfies_protocol(self) -> None:
        assert isinstance(self.make_policy(self.capacity), EvictionPolicy)

    def test_evict_zero_is_empty(self) -> None:
        policy = self.make_policy(self.capacity)
        self._ready(policy, range(2))
        assert policy.evict(0, ()) == []

    def test_pending_keys_are_never_evicted(self) -> None:
        policy = self.make_policy(self.capacity)
        policy.insert([policy_key(i) for i in range(3)])
        assert policy.evict(1, ()) is None

    def test_pinned_keys_are_never_evicted(self) -> None:
        policy = self.make_policy(self.capacity)
        a, b, c = self._ready(policy, range(3))
        policy.mark_pinned([b])
        victims = policy.evict(2, ())
        assert victims is not None
        assert sorted(victims) == sorted([a, c])
        assert policy.evict(1, ()) is None
        policy.mark_evictable([b])
        assert policy.evict(1, ()) == [b]

    def test_protected_keys_are_never_evicted(self) -> None:
        policy = self.make_policy(self.capacity)
        a, b = self._ready(policy, range(2))
        assert policy.evict(1, {a}) == [b]
        assert policy.evict(1, {a}) is None
        assert policy.evict(1, ()) == [a]

    def test_failed_evict_changes_nothing(self) -> None:
        policy = self.make_policy(self.capacity)
        keys = self._ready(policy, range(3))
        assert policy.evict(4, ()) is None
        victims = policy.evict(3, {policy_key(99)})
        assert victims is not None
        assert sorted(victims) == sorted(keys)
        assert policy.evict(1, ()) is None

    def test_evicted_keys_are_distinct_and_forgotten(self) -> None:
        policy = self.make_policy(self.capacity)
        keys = self._ready(policy, range(5))
        first = policy.evict(2, ())
        assert first is not None
        assert len(set(first)) == 2
        assert set(first) <= set(keys)
        policy.touch(first, ReqContext("r"))
        rest = policy.evict(3, ())
        assert rest is not None
        assert set(rest) == set(keys) - set(first)

    def test_removed_keys_are_never_evicted(self) -> None:
        policy = self.make_policy(self.capacity)
        a = policy_key(1)
        policy.insert([a])
        policy.remove([a])
        b = self._ready(policy, [2])[0]
        assert policy.evict(1, ()) == [b]
        assert policy.evict(1, ()) is None

    def test_clear_forgets_everything(self) -> None:
        policy = self.make_policy(self.capacity)
        self._ready(policy, range(4))
        policy.clear()
        assert policy.evict(1, ()) is None
        again = self._ready(policy, [7])
        assert policy.evict(1, ()) == again

    def test_batches_apply_to_every_key(self) -> None:
        policy = self.make_policy(self.capacity)
        keys = [policy_key(i) for i in range(4)]
        policy.insert(keys)
        policy.mark_evictable(keys)
        policy.mark_pinned(keys[1:3])
        victims = policy.evict(2, ())
        assert victims is not None
        assert sorted(victims) == sorted([keys[0], keys[3]])
        policy.mark_evictable(keys[1:3])
        policy.insert([policy_key(9)])
        policy.remove([policy_key(9)])
        rest = policy.evict(2, ())
        assert rest is not None
        assert sorted(rest) == sorted(keys[1:3])

    def test_reinserted_key_is_evictable_again(self) -> None:
        policy = self.make_policy(self.capacity)
        (a,) = self._ready(policy, [1])
        assert policy.evict(1, ()) == [a]
        policy.insert([a])
        assert policy.evict(1, ()) is None
        policy.mark_evictable([a])
        assert policy.evict(1, ()) == [a]

    def test_touch_of_unknown_keys_is_harmless(self) -> None:
        policy = self.make_policy(self.capacity)
        (a,) = self._ready(policy, [1])
        policy.touch([policy_key(50), policy_key(51)], None)
        policy.touch([], ReqContext("r"))
        assert policy.evict(1, ()) == [a]

    def test_random_operations_against_a_model(self) -> None:
        """Random inserts, completions, pins, touches, removals and evictions; at every step
        evict's answer must agree with a model of which keys are eligible."""
        for seed in range(20):
            rng = random.Random(seed)
            policy = self.make_policy(self.capacity)
            state: dict[OffloadKey, str] = {}
            next_id = 0
            for _ in range(300):
                op = rng.random()
                resident = list(state)
                if op < 0.3 and len(state) < self.capacity:
                    key = policy_key(next_id)
                    next_id += 1
                    policy.insert([key])
                    state[key] = "pending"
                elif op < 0.45 and resident:
                    key = rng.choice(resident)
                    if state[key] == "pending" and rng.random() < 0.2:
                        policy.remove([key])
                        del state[key]
                    elif state[key] in ("pending", "pinned"):
                        policy.mark_evictable([key])
                        state[key] = "evictable"
                elif op < 0.55 and resident:
                    key = rng.choice(resident)
                    if state[key] == "evictable":
                        policy.mark_pinned([key])
                        state[key] = "pinned"
                elif op < 0.75:
                    sample = rng.sample(resident, min(len(resident), 3)) if resident else []
                    policy.touch([*sample, policy_key(10_000 + next_id)], ReqContext("r"))
                else:
                    protected = set(rng.sample(resident, min(len(resident), 2)))
                    eligible = {k for k, s in state.items() if s == "evictable"} - protected
                    n = rng.randint(1, 3)
                    victims = policy.evict(n, protected)
                    if len(eligible) >= n:
                        assert victims is not None, f"seed {seed}: evict({n}) failed"
                    if victims is not None:
                        assert len(victims) == n
                        assert len(set(victims)) == n
                        assert set(victims) <= eligible, f"seed {seed}: ineligible victim"
                        for key in victims:
                            del state[key]
