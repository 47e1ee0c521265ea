"""The replay log: batches older than the window survive as a snapshot of the blocks they still
announce, so a subscriber asking from any sequence rebuilds exactly the stream's state."""

from __future__ import annotations

import pytest

from kvhex.adapters.events.replay import ReplayLog
from kvhex.adapters.events.wire import decode_batch, encode_batch, to_wire
from kvhex.domain.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

A, B, C, D = (bytes([n]) * 32 for n in (1, 2, 3, 4))


def stored(
    *hashes: bytes, parent: bytes | None, medium: str = "CPU", extra: bool = False
) -> BlockStored:
    tokens = [t for i, _ in enumerate(hashes) for t in range(10 * i, 10 * i + 4)]
    keys = [("lora", i) for i in range(len(hashes))] if extra else None
    return BlockStored(list(hashes), parent, tokens, 4, None, medium, None, keys)


def log_of(*steps: list[object], keep: int) -> ReplayLog:
    log = ReplayLog(keep, encode_batch)
    for seq, events in enumerate(steps):
        batch = EventBatch(float(seq), list(events), 0)  # type: ignore[arg-type]
        log.append(seq, batch, encode_batch(batch))
    return log


def held(
    log: ReplayLog, first: int = 0, orphans: frozenset[bytes] = frozenset()
) -> tuple[list[int], dict[str, set[bytes]]]:
    """Replay as a consumer with a set per medium: sequences seen and the blocks held;
    every store's parent must be held (any medium) when it arrives, but for ``orphans``,
    the blocks whose parent the stream itself removed."""
    seqs: list[int] = []
    blocks: dict[str, set[bytes]] = {}
    for seq, payload in log.since(first):
        seqs.append(seq)
        for event in decode_batch(payload).events:
            if event == to_wire(AllBlocksCleared()):
                blocks.clear()
            elif hasattr(event, "token_ids"):
                parent = event.parent_block_hash
                if event.block_hashes[0] not in orphans:
                    assert parent is None or any(parent in s for s in blocks.values()), "orphan"
                blocks.setdefault(event.medium, set()).update(event.block_hashes)
            else:
                blocks.setdefault(event.medium, set()).difference_update(event.block_hashes)
    return seqs, blocks


def test_a_replay_from_before_the_window_starts_with_the_snapshot() -> None:
    log = log_of(
        [stored(A, B, parent=None)],
        [stored(C, parent=B, medium="STORAGE")],
        [BlockRemoved([A], "CPU")],
        [stored(D, parent=C, medium="STORAGE")],
        keep=1,
    )
    assert log.folded_up_to == 2
    seqs, blocks = held(log, orphans=frozenset({B}))  # B's parent A was removed: as live
    assert seqs == [2, 3]
    assert blocks == {"CPU": {B}, "STORAGE": {C, D}}
    # inside the window: no snapshot (the subscriber holds C already)
    assert held(log, 3, orphans=frozenset({D})) == ([3], {"STORAGE": {D}})
    first = decode_batch(next(iter(log.since(0)))[1])
    snapshot = [e for e in first.events if hasattr(e, "token_ids")]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in snapshot] == [
        ([B], A, [10, 11, 12, 13]),  # what is left of the chain A-B: its own tokens, parent A
        ([C], B, [0, 1, 2, 3]),
    ]


def test_a_part_removed_from_a_chain_leaves_runs_with_their_parents_and_extra_keys() -> None:
    log = log_of(
        [stored(A, B, C, D, parent=None, extra=True)], [BlockRemoved([B], "CPU")], [], keep=1
    )
    first = decode_batch(next(iter(log.since(0)))[1])
    runs = [e for e in first.events if hasattr(e, "token_ids")]
    assert [(r.block_hashes, r.parent_block_hash) for r in runs] == [([A], None), ([C, D], B)]
    assert runs[1].extra_keys == [("lora", 2), ("lora", 3)]
    assert runs[1].token_ids == [20, 21, 22, 23, 30, 31, 32, 33]


def test_a_parent_stored_again_after_its_child_comes_first_in_the_snapshot() -> None:
    log = log_of(
        [stored(A, parent=None), stored(B, parent=A, medium="STORAGE")],
        [BlockRemoved([A], "CPU")],
        [stored(A, parent=None)],
        [],
        keep=1,
    )
    seqs, blocks = held(log)  # held() fails on an orphan
    assert blocks == {"CPU": {A}, "STORAGE": {B}}
    assert seqs == [2, 3]


def test_all_blocks_cleared_empties_the_snapshot() -> None:
    log = log_of(
        [stored(A, parent=None)], [AllBlocksCleared()], [stored(B, parent=None)], [], keep=1
    )
    assert held(log)[1] == {"CPU": {B}}
    assert log.snapshot_blocks == 1


def test_a_window_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="keep"):
        ReplayLog(0, encode_batch)
