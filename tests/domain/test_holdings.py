"""``StreamHoldings``: a consumer that forgets a stream and reads its snapshot instead holds
exactly what the whole stream announces, and meets every live parent before its children."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvhex.domain.events import AllBlocksCleared, BlockRemoved, BlockStored, PublicEvent
from kvhex.domain.holdings import StreamHoldings

MEDIA = ("CPU", "STORAGE")
BLOCK = 2


def stored(medium: str, hashes: list[int], parent: int | None) -> BlockStored:
    tokens = [t for h in hashes for t in (h, h + 1000)]
    return BlockStored(hashes, parent, tokens, BLOCK, None, medium, None)


def held_by(events: list[PublicEvent]) -> dict[str, set[int]]:
    """What a consumer keeping a set per medium holds after ``events``."""
    held: dict[str, set[int]] = {m: set() for m in MEDIA}
    for event in events:
        if isinstance(event, BlockStored):
            held[event.medium or ""].update(event.block_hashes)  # type: ignore[arg-type]
        elif isinstance(event, BlockRemoved):
            held[event.medium or ""].difference_update(event.block_hashes)  # type: ignore[arg-type]
        else:
            for blocks in held.values():
                blocks.clear()
    return held


@st.composite
def streams(draw: st.DrawFn) -> list[PublicEvent]:
    """Chains of hashes 1..n (each hash's parent the one before it), stored in runs per
    medium in any order, removed and cleared at random."""
    n = draw(st.integers(2, 12))
    events: list[PublicEvent] = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(("store", "store", "remove", "clear")))
        medium = draw(st.sampled_from(MEDIA))
        if kind == "store":
            first = draw(st.integers(1, n))
            last = draw(st.integers(first, n))
            hashes = list(range(first, last + 1))
            events.append(stored(medium, hashes, first - 1 if first > 1 else None))
        elif kind == "remove":
            gone = draw(st.lists(st.integers(1, n), min_size=1, max_size=4, unique=True))
            events.append(BlockRemoved(gone, medium))
        elif draw(st.integers(0, 4)) == 0:  # clears are rare: a stream mostly grows
            events.append(AllBlocksCleared())
    return events


@settings(max_examples=300, deadline=None)
@given(streams(), st.integers(0, 25))
def test_the_snapshot_stands_for_the_stream_parents_first(
    events: list[PublicEvent], cut: int
) -> None:
    holdings = StreamHoldings()
    holdings.fold(events[:cut])  # folded in two calls: the fold keeps no per-call state
    holdings.fold(events[cut:])
    snapshot = holdings.snapshot()
    want = held_by(events)
    assert held_by([AllBlocksCleared(), *snapshot]) == want
    assert len(holdings) == sum(len(blocks) for blocks in want.values())
    # every run's parent, where some medium still holds it, came before the run
    live = set().union(*want.values())
    seen: set[int] = set()
    for event in snapshot:
        parent = event.parent_block_hash
        assert parent is None or parent not in live or parent in seen, (event, snapshot)
        seen.update(event.block_hashes)  # type: ignore[arg-type]
        # each block keeps its own tokens, whatever run it was cut into
        assert event.token_ids == [t for h in event.block_hashes for t in (h, h + 1000)]  # type: ignore[operator]
    # without orphans: exactly the runs whose parents all went out before them
    rooted, out = holdings.snapshot(orphans=False), set()
    for event in snapshot:
        if event.parent_block_hash is None or event.parent_block_hash in out:
            out.update(event.block_hashes)  # type: ignore[arg-type]
    assert [h for e in rooted for h in e.block_hashes] == [
        h for e in snapshot for h in e.block_hashes if h in out
    ]


def test_a_block_stored_twice_and_removed_once_is_gone_as_a_set_consumer_sees_it() -> None:
    holdings = StreamHoldings()
    holdings.fold([stored("CPU", [1, 2], None), stored("CPU", [2, 3], 1)])
    holdings.fold([BlockRemoved([2], "CPU")])
    kept = Counter(h for e in holdings.snapshot() for h in e.block_hashes)
    assert kept == Counter({1: 1, 3: 1})
    holdings.clear()
    assert len(holdings) == 0
    assert holdings.snapshot() == []


def test_without_orphans_a_run_whose_parent_is_gone_is_left_out_with_its_children() -> None:
    holdings = StreamHoldings()
    holdings.fold([stored("CPU", [1, 2, 3], None), stored("STORAGE", [5, 6], 4)])
    holdings.fold([BlockRemoved([2], "CPU")])  # 3's parent is gone; 5's (4) was never here
    assert [e.block_hashes for e in holdings.snapshot()] == [[1], [3], [5, 6]]
    assert [e.block_hashes for e in holdings.snapshot(orphans=False)] == [[1]]


def test_the_removal_of_a_block_left_out_is_unsaid_until_it_is_stored_again() -> None:
    holdings = StreamHoldings()
    holdings.fold([stored("CPU", [1], None), stored("CPU", [5, 6], 4)])
    assert [e.block_hashes for e in holdings.snapshot(orphans=False)] == [[1]]
    later = holdings.unsaid([BlockRemoved([1, 5], "CPU"), stored("CPU", [6], 1)])
    assert later == [BlockRemoved([1], "CPU"), stored("CPU", [6], 1)]
    holdings.fold(later)
    assert holdings.unsaid([BlockRemoved([6], "CPU")]) == [BlockRemoved([6], "CPU")]
