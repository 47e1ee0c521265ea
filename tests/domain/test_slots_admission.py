from __future__ import annotations

import pytest

from kvhex.domain.admission import OfferTracker
from kvhex.domain.slots import SlotPool
from tests.domain.conftest import keys


def test_fresh_slots_in_increasing_order_then_freed_lifo() -> None:
    pool = SlotPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.release(0)
    pool.release(1)
    assert pool.allocate(3) == [2, 3, 1]
    assert pool.allocate(1) == [0]
    assert pool.free_count == 0
    with pytest.raises(ValueError, match="cannot allocate 1"):
        pool.allocate(1)


def test_reset_restarts_fresh_order() -> None:
    pool = SlotPool(3)
    pool.allocate(3)
    pool.release(2)
    pool.reset()
    assert pool.allocate(3) == [0, 1, 2]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_bad_slot_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="num_slots"):
        SlotPool(bad)  # type: ignore[arg-type]


def test_tracker_counts_distinct_offers_and_ages_out_lru() -> None:
    tracker = OfferTracker(threshold=2, max_size=3)
    a, b, c, d = keys(1, 2, 3, 4)
    tracker.offer([a, a, b])
    assert tracker.count(a) == 1
    tracker.offer([c])
    tracker.offer([d])  # full: a is least recently offered
    assert len(tracker) == 3
    assert tracker.count(a) == 0
    tracker.offer([b])
    assert tracker.admitted(b)
    assert not tracker.admitted(c)


def test_tracker_never_drops_a_key_of_the_current_offer() -> None:
    tracker = OfferTracker(threshold=2, max_size=2)
    tracker.offer(keys(1, 2))
    # 1 and 2 are offered again: 3 finds no entry it may drop, so (as in vLLM) it is not
    # tracked, and the tracker never grows past its bound
    tracker.offer(keys(1, 2, 3))
    assert [tracker.count(k) for k in keys(1, 2, 3)] == [2, 2, 0]
    assert len(tracker) == 2
    assert tracker.admitted(keys(1)[0])


def test_tracker_bumps_known_keys_before_new_ones_take_the_oldest_entries() -> None:
    """vLLM's order: re-offered keys become most recent first, then each new key replaces
    the oldest entry not offered now; the recency order decides later drops."""
    tracker = OfferTracker(threshold=2, max_size=4)
    tracker.offer(keys(2, 4, 1, 5))
    tracker.offer(keys(8, 1, 5, 3))  # 1, 5 bumped; 8 replaces 2, 3 replaces 4
    assert [tracker.count(k) for k in keys(1, 2, 3, 4, 5, 8)] == [2, 0, 1, 0, 2, 1]
    tracker.offer(keys(9))  # the oldest now is 1 (bumped before 8 and 3 entered)
    assert [tracker.count(k) for k in keys(1, 5, 8, 3, 9)] == [0, 2, 1, 1, 1]


@pytest.mark.parametrize(("threshold", "size"), [(0, 1), (2, 0), (True, 5), (2, -3)])
def test_tracker_rejects_bad_bounds(threshold: int, size: int) -> None:
    with pytest.raises(ValueError, match=r"store_threshold|max_tracker_size"):
        OfferTracker(threshold, size)
