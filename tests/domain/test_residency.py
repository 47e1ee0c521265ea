"""A tier's residency, scenario by scenario: the orders of jobs that broke storage tiers, each
as the smallest sequence of calls that shows it."""

from __future__ import annotations

import pytest

from kvhex.domain import ArcPolicy, Removed, ReqContext, Stored, TierEvent
from kvhex.domain.residency import Residency
from kvhex.domain.tiers import Medium, TierIdentity
from tests.domain.conftest import key, keys

TIER = TierIdentity(Medium.STORAGE, None, "t")


def residency(blocks: int = 4, **kw: object) -> Residency:
    return Residency(TIER, blocks * 10, 10, **kw)  # type: ignore[arg-type]


def shape(events: list[TierEvent]) -> list[tuple[str, list[int]]]:
    """Events as (kind, key ids)."""
    out = []
    for event in events:
        assert isinstance(event, Stored | Removed)
        ids = [int.from_bytes(k[:-4], "big") for k in event.keys]
        out.append(("stored" if isinstance(event, Stored) else "removed", ids))
    return out


def put(res: Residency, *ids: int) -> None:
    r = res.reserve(keys(*ids))
    assert r is not None
    res.commit(r, r.owned)


def test_a_read_that_found_a_key_missing_never_drops_the_key_a_later_put_stored() -> None:
    res = residency()
    read = res.snapshot([key(1)], pin=True)  # key 1 absent: the read will find it missing
    put(res, 1)
    assert res.release(read, ok=(), lost=[key(1)]) == []
    assert key(1) in res
    assert shape(res.take_events()) == [("stored", [1])]


def test_a_read_that_found_a_key_lost_drops_it_when_it_is_still_the_residency_it_saw() -> None:
    res = residency()
    put(res, 1)
    res.take_events()
    read = res.snapshot([key(1)], pin=True)
    assert res.release(read, lost=[key(1)]) == [key(1)]
    assert shape(res.take_events()) == [("removed", [1])]


def test_a_loss_seen_before_a_delete_and_a_new_put_leaves_the_new_block() -> None:
    res = residency()
    put(res, 1)
    read = res.snapshot([key(1)])
    res.delete([key(1)])
    put(res, 1)
    assert res.release(read, lost=[key(1)]) == []
    assert key(1) in res


def test_two_puts_sharing_a_key_each_own_only_what_they_write_whatever_the_order() -> None:
    for first_done in ("big", "small"):
        res = residency(blocks=8)
        big = res.reserve(keys(0, 1, 2, 3))
        small = res.reserve(keys(0))
        assert big is not None
        assert small is not None
        assert small.owned == ()
        assert small.busy == (key(0),)
        order = [(big, big.owned), (small, ())]
        for r, written in order if first_done == "big" else reversed(order):
            res.commit(r, written)
        assert res.keys() == keys(0, 1, 2, 3)
        assert res.used_bytes == 40
        assert shape(res.take_events()) == [("stored", [0, 1, 2, 3])]
        put(res, 0)  # a re-put finds it readable: nothing new
        assert res.take_events() == []
        assert res.used_bytes == 40


def test_a_failed_put_releases_its_room_and_announces_nothing() -> None:
    res = residency(blocks=2)
    r = res.reserve(keys(1, 2))
    assert r is not None
    assert res.reserve(keys(3)) is None  # the room is reserved
    res.commit(r, written=[key(1)])
    assert res.keys() == [key(1)]
    assert shape(res.take_events()) == [("stored", [1])]
    assert res.used_bytes == 10


def test_evictions_are_announced_when_the_room_is_reserved_before_the_store() -> None:
    res = residency(blocks=2)
    put(res, 1, 2)
    r = res.reserve(keys(3), ReqContext("a"))
    assert r is not None
    assert r.victims == (key(1),)
    res.commit(r, r.owned)
    assert shape(res.take_events()) == [("stored", [1, 2]), ("removed", [1]), ("stored", [3])]


def test_pinned_and_pending_blocks_are_never_evicted() -> None:
    res = residency(blocks=2)
    put(res, 1)
    read = res.snapshot([key(1)], pin=True)
    writing = res.reserve(keys(2))
    assert writing is not None
    assert res.reserve(keys(3)) is None
    res.release(read, ok=[key(1)])
    r = res.reserve(keys(3))
    assert r is not None
    assert r.victims == (key(1),)


def test_a_job_larger_than_the_tier_does_not_fit_and_changes_nothing() -> None:
    res = residency(blocks=2)
    put(res, 1)
    res.take_events()
    assert res.reserve(keys(2, 3, 4)) is None
    assert res.keys() == [key(1)]
    assert res.take_events() == []


def test_delete_with_duplicates_removes_and_announces_each_key_once() -> None:
    res = residency()
    put(res, 1, 2)
    res.take_events()
    assert res.delete([key(1), key(1), key(7), key(1)]) == [key(1)]
    assert shape(res.take_events()) == [("removed", [1])]
    assert res.delete([key(1)]) == []


def test_delete_then_put_at_full_capacity_evicts_nothing_else() -> None:
    res = residency(blocks=3)
    put(res, 1, 2, 3)
    res.delete(keys(2, 3))
    r = res.reserve(keys(4, 5))
    assert r is not None
    assert r.victims == ()


def test_adopting_a_key_found_twice_counts_it_once() -> None:
    res = residency(blocks=4)
    over = res.adopt([key(1), key(2), key(1)])
    assert over == []
    assert res.keys() == keys(2, 1)
    assert res.used_bytes == 20
    assert shape(res.take_events()) == [("stored", [2, 1])]
    res.delete([key(1)])
    assert key(1) not in res
    assert res.used_bytes == 10


def test_adoption_keeps_the_newest_that_fit_and_returns_the_rest_unannounced() -> None:
    res = residency(blocks=2)
    assert res.adopt(keys(1, 2, 3)) == [key(1)]
    assert shape(res.take_events()) == [("stored", [2, 3])]


def test_a_verified_put_rewrites_a_block_the_store_lost_and_says_so() -> None:
    res = residency()
    put(res, 1, 2)
    res.take_events()
    ctx = ReqContext("b")
    r = res.reserve(keys(1, 2), ctx, verify=True)
    assert r is not None
    assert r.present == (key(1), key(2))
    assert r.owned == ()
    assert res.commit(r, written=[key(1)], lost=[key(1)]) == []
    events = res.take_events()
    assert shape(events) == [("removed", [1]), ("stored", [1])]
    assert events[1].ctx is ctx  # type: ignore[union-attr]
    assert res.keys() == keys(2, 1)


def test_a_verified_put_that_could_not_rewrite_a_lost_block_removes_it() -> None:
    res = residency()
    put(res, 1)
    res.take_events()
    r = res.reserve(keys(1), verify=True)
    assert r is not None
    res.commit(r, written=(), lost=[key(1)])
    assert shape(res.take_events()) == [("removed", [1])]
    assert key(1) not in res
    assert res.used_bytes == 0


def test_a_rewrite_of_a_block_deleted_meanwhile_is_handed_back_for_deletion() -> None:
    res = residency()
    put(res, 1)
    r = res.reserve(keys(1), verify=True)
    assert r is not None
    res.delete([key(1)])
    assert res.commit(r, written=[key(1)], lost=[key(1)]) == [key(1)]
    assert key(1) not in res


def test_losing_everything_removes_every_readable_key_and_leaves_writes_to_their_jobs() -> None:
    res = residency()
    put(res, 1, 2)
    writing = res.reserve(keys(3))
    assert writing is not None
    res.take_events()
    assert sorted(res.drop_all()) == keys(1, 2)
    res.commit(writing, writing.owned)
    assert shape(res.take_events()) == [("removed", [1, 2]), ("stored", [3])]


def test_any_eviction_policy_orders_the_victims() -> None:
    res = residency(blocks=2, policy=ArcPolicy)
    put(res, 1, 2)
    read = res.snapshot([key(1)], pin=True)
    res.release(read, ok=[key(1)])  # a hit: ARC keeps key 1 (frequent) over key 2
    r = res.reserve(keys(3))
    assert r is not None
    assert r.victims == (key(2),)


def test_a_capacity_below_one_block_is_refused_naming_both_numbers() -> None:
    with pytest.raises(ValueError, match="capacity_bytes 5 holds no block of 10 bytes"):
        Residency(TIER, 5, 10)
