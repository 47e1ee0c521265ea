"""Asynchronous existence probes (reference §F.5, 53-56), adapted to kvhex's ProbeCache."""

from __future__ import annotations

from kvhex.domain import JobId, LookupResult, ReqContext
from kvhex.service import ProbeCache
from tests.service.harness import World, key, keys

RETRY, HIT, MISS = LookupResult.RETRY, LookupResult.HIT, LookupResult.MISS


def test_first_lookup_retries_then_the_answer_sticks() -> None:
    cache = ProbeCache()
    ctx = ReqContext("r")
    assert cache.lookup(key(1), ctx) is RETRY
    batch = cache.take_batch()
    assert batch == keys(1)
    cache.sent(batch, JobId(7))
    assert cache.lookup(key(1), ctx) is RETRY
    cache.resolve(JobId(7), tuple(batch), frozenset(keys(1)), ok=True)
    assert cache.lookup(key(1), ctx) is HIT


def test_one_batch_per_step_without_duplicates() -> None:
    cache = ProbeCache()
    a, b = ReqContext("a"), ReqContext("b")
    for ctx in (a, b, a):
        for k in keys(1, 2, 3):
            cache.lookup(k, ctx)
    assert cache.take_batch() == keys(1, 2, 3)
    assert cache.take_batch() == []
    assert not cache.pending


def test_cleanup_drops_only_what_no_request_still_wants() -> None:
    cache = ProbeCache()
    a, b = ReqContext("a"), ReqContext("b")
    cache.lookup(key(1), a)
    cache.lookup(key(2), a)
    cache.lookup(key(2), b)
    batch = cache.take_batch()
    cache.sent(batch, JobId(1))
    cache.resolve(JobId(1), tuple(batch), frozenset(), ok=True)
    cache.forget_request(a)
    assert len(cache) == 1  # key 2 is still wanted by b
    cache.forget_request(ReqContext("unknown"))  # no-op
    cache.forget_request(b)
    assert len(cache) == 0


def test_in_flight_probes_survive_cleanup_and_are_shared() -> None:
    cache = ProbeCache()
    a, b = ReqContext("a"), ReqContext("b")
    cache.lookup(key(1), a)
    batch = cache.take_batch()
    cache.sent(batch, JobId(3))
    cache.forget_request(a)
    assert cache.lookup(key(1), b) is RETRY  # shares the in-flight probe
    assert cache.take_batch() == []
    cache.resolve(JobId(3), tuple(batch), frozenset(batch), ok=True)
    assert cache.lookup(key(1), b) is HIT


def test_queued_probe_of_a_finished_request_is_never_sent() -> None:
    cache = ProbeCache()
    a = ReqContext("a")
    cache.lookup(key(1), a)
    cache.forget_request(a)
    assert cache.take_batch() == []


def test_probes_across_many_steps_all_resolve_through_the_manager() -> None:
    world = World(tiers=1, complete_after_polls=2)
    world.store([1, 3], ReqContext("seed"))
    world.step(3)
    world.manager.reset()
    ctx = ReqContext("r")
    answers = [world.lookup([1, 2, 3, 4], ctx)]
    for _ in range(4):
        world.step()
        answers.append(world.lookup([2, 4], ctx))
    assert answers[0] == [RETRY] * 4
    assert answers[-1] == [MISS, MISS]
    assert world.manager.stats().tiers[0].probes_submitted == 1
