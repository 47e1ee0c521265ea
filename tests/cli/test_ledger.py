"""The consumer-side ledger ``kvhex events`` keeps: sequences, reference counts per
residency, and when a stream counts as inconsistent."""

from __future__ import annotations

from kvhex.adapters.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvhex.cli._ledger import StreamLedger, residency_label

H1, H2, H3 = b"\1" * 32, b"\2" * 32, b"\3" * 32


def stored(*hashes: bytes | int, medium: str = "CPU", group: int | None = None) -> BlockStored:
    return BlockStored(list(hashes), None, [], 0, None, medium, None, group_idx=group)


def removed(*hashes: bytes | int, medium: str = "CPU", group: int | None = None) -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, group_idx=group)


def test_sequences_gaps_and_regressions() -> None:
    ledger = StreamLedger(expected_first=0)
    for seq in (2, 3, 5, 4):
        ledger.batch(seq)
    assert ledger.gaps == [(0, 1), (4, 4)]
    assert ledger.regressions == [(5, 4)]
    assert (ledger.first_seq, ledger.last_seq, ledger.batches) == (2, 4, 4)
    assert ledger.failures() == ["3 batch(es) missing", "the sequence went back 1 time(s)"]
    assert not ledger.consistent


def test_a_stream_joined_live_may_start_anywhere() -> None:
    ledger = StreamLedger()
    ledger.batch(7)
    ledger.batch(8)
    assert ledger.gaps == []
    assert ledger.joined_late
    ledger.event(removed(H1))  # stored before we joined, perhaps
    assert ledger.unknown_removals == {"CPU": 1}
    assert ledger.consistent


def test_stores_and_removals_are_reference_counted_per_residency() -> None:
    ledger = StreamLedger(expected_first=0)
    ledger.batch(0)
    ledger.event(stored(H1, H2))
    ledger.event(stored(H2))  # a second chunk announcing a shared block
    ledger.event(stored(H2, medium="STORAGE"))
    ledger.event(stored(H3, group=1))
    assert ledger.duplicate_stores == {"CPU": 1}
    ledger.event(removed(H2))
    assert ledger.blocks() == {"CPU": 3, "STORAGE": 1}  # H2 still held once on CPU
    ledger.event(removed(H2))
    ledger.event(removed(H2))
    ledger.event(removed(H3))  # group 0 never held it: group 1 did
    assert ledger.unknown_removals == {"CPU": 2}
    assert ledger.blocks() == {"CPU": 2, "STORAGE": 1}
    assert ledger.failures() == ["2 removal(s) of hashes not stored"]


def test_all_blocks_cleared_forgets_every_medium() -> None:
    ledger = StreamLedger(expected_first=0)
    ledger.batch(0)
    ledger.event(stored(H1))
    ledger.event(stored(H2, medium="STORAGE"))
    ledger.event(AllBlocksCleared())
    ledger.event(removed(H2, medium="STORAGE"))  # what a consumer sees after a clear
    assert ledger.clears == 1
    assert ledger.blocks() == {"STORAGE": 0}  # seen, holding nothing
    assert ledger.unknown_removals == {"STORAGE": 1}
    summary = ledger.summary()
    assert summary["events"] == {"AllBlocksCleared": 1, "BlockRemoved": 1, "BlockStored": 2}
    assert summary["consistent"] is False


def test_int_hashes_and_undecodable_batches() -> None:
    ledger = StreamLedger(expected_first=0)
    ledger.batch(0)
    ledger.event(stored(2**63 + 5))
    ledger.bad_batch(1)
    ledger.batch(2)
    ledger.event(removed(2**63 + 5))
    assert ledger.blocks() == {"CPU": 0}
    assert ledger.gaps == []
    assert ledger.failures() == ["1 batch(es) did not decode"]


def test_labels_name_locality_and_ownership() -> None:
    assert residency_label("CPU", None, None) == "CPU"
    assert residency_label("STORAGE", "LOCAL", "files") == "STORAGE(LOCAL,files)"
    assert residency_label("STORAGE", None, "s3") == "STORAGE(-,s3)"
    assert residency_label(None, None, None) == "-"


def full(*hashes: bytes, parent: bytes | None, medium: str = "CPU") -> BlockStored:
    return BlockStored(list(hashes), parent, [1] * 4 * len(hashes), 4, None, medium, None)


def test_a_block_announced_before_its_parent_makes_the_stream_inconsistent() -> None:
    ledger = StreamLedger(expected_first=0)
    ledger.batch(0)
    ledger.event(full(H1, parent=None))
    ledger.event(full(H2, parent=H1, medium="STORAGE"))  # its parent is held on CPU: fine
    ledger.event(removed(H1))
    ledger.event(full(H3, parent=H1))  # H1 is nowhere now
    assert ledger.orphan_stores == {"CPU": 1}
    assert ledger.failures() == ["1 store(s) announced before their parent"]
    late = StreamLedger()
    late.batch(5)
    late.event(full(H3, parent=H2))  # its parent may have been announced before we joined
    assert late.orphan_stores == {"CPU": 1}
    assert late.consistent


def test_a_gap_before_a_clear_loses_nothing_a_gap_before_anything_else_does() -> None:
    ledger = StreamLedger(expected_first=0)
    ledger.batch(3)  # a replay's snapshot: the clear, then what the older batches hold
    ledger.event(AllBlocksCleared())
    ledger.event(stored(H1))
    ledger.batch(5)
    ledger.event(stored(H2))
    assert ledger.cleared_gaps == [(0, 2)]
    assert ledger.gaps == [(4, 4)]
    assert ledger.failures() == ["1 batch(es) missing"]
