"""SlotLayout: regions per tensor, job checks that name the field, runs, batches and the exact
host byte ranges a job touches (checked against an independent oracle)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhex.domain import ChunkRun, JobId, SlotLayout, TransferJob, TransferKind
from kvhex.errors import TransferError
from tests.domain.transfers import Layout, jobs, layouts, placements

STORE, LOAD = TransferKind.STORE, TransferKind.LOAD


def _layout(spec: Layout) -> SlotLayout:
    return SlotLayout(spec.page_bytes, spec.tensor_groups, spec.blocks_per_chunk)


def test_regions_follow_registration_order_and_slot_spans_every_tensor() -> None:
    layout = SlotLayout(page_bytes=[64, 32, 64], tensor_groups=[0, 1, 0], blocks_per_chunk=[2, 3])
    assert layout.region_offsets == (0, 128, 224)
    assert layout.slot_bytes == 128 + 96 + 128
    assert layout.group_tensors == ((0, 2), (1,))
    assert layout.num_groups == 2


def test_a_tensor_shared_by_groups_has_one_region_each_group_fills_in_its_own_slots() -> None:
    # tensor 1 holds blocks of groups 0 and 1 (both 2 blocks per chunk); tensor 2 only group 1
    layout = SlotLayout(
        page_bytes=[8, 16, 4], tensor_groups=[0, (0, 1), [1]], blocks_per_chunk=[2, 2]
    )
    assert layout.tensor_groups == ((0,), (0, 1), (1,))
    assert layout.region_offsets == (0, 16, 48)
    assert layout.slot_bytes == 16 + 32 + 8
    assert layout.group_tensors == ((0, 1), (1, 2))
    job = TransferJob(
        JobId(1), STORE, slots=[3, 5], block_ids=[7, 7], group_sizes=[1, 1], block_indices=[1, 0]
    )
    runs = layout.plan(job, num_slots=8, num_blocks=[10, 10])
    # group 0, position 1 of slot 3: tensors 0 and 1; group 1, position 0 of slot 5: 1 and 2
    assert [tuple(r) for r in layout.byte_ranges(runs, job.slots)] == [
        (8, 3 * 56 + 8, 8),
        (32, 3 * 56 + 32, 16),
        (56 + 16, 5 * 56 + 16, 16),
        (56 + 48, 5 * 56 + 48, 4),
    ]


def test_one_group_as_an_int_or_a_sequence_is_the_same_layout() -> None:
    assert SlotLayout([8, 4], [0, 1], [1, 2]) == SlotLayout([8, 4], [(0,), [1]], [1, 2])


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"page_bytes": []}, "kv_caches", "no KV cache tensor"),
        ({"tensor_groups": [0, ()]}, "tensor_groups", "tensor 1 belongs to no group"),
        (
            {"tensor_groups": [0, (1, 1)]},
            "tensor_groups",
            r"tensor 1 names a group twice: \[1, 1\]",
        ),
        ({"tensor_groups": [0, (1, "x")]}, "tensor_groups", "tensor 1: group 'x' is not an int"),
        ({"tensor_groups": [(0, 1, 2), 1]}, "tensor_groups", "tensor 0: group 2 outside 0..1"),
        (
            {"tensor_groups": [0, (0, 1)], "blocks_per_chunk": [1, 3]},
            "tensor_groups",
            r"tensor 1 is shared by groups \[0, 1\] whose blocks_per_chunk differ "
            r"\(group 0: 1, group 1: 3\)",
        ),
        ({"tensor_groups": [0]}, "tensor_groups", "1 entries for 2 tensors"),
        ({"blocks_per_chunk": []}, "blocks_per_chunk", "no KV group"),
        ({"page_bytes": [8, 0]}, "page_bytes", "entry 1 is 0"),
        ({"blocks_per_chunk": [1, -2]}, "blocks_per_chunk", "entry 1 is -2"),
        ({"tensor_groups": [0, 2]}, "tensor_groups", "tensor 1: group 2 outside 0..1"),
        ({"tensor_groups": [0, 0]}, "tensor_groups", r"group\(s\) \[1\] have no tensor"),
    ],
)
def test_bad_layouts_name_the_argument(
    kwargs: dict[str, list[int]], field: str, words: str
) -> None:
    args = {"page_bytes": [8, 8], "tensor_groups": [0, 1], "blocks_per_chunk": [1, 1], **kwargs}
    with pytest.raises(TransferError, match=words) as info:
        SlotLayout(**args)  # type: ignore[arg-type]
    assert info.value.field == field


LAYOUT = SlotLayout(page_bytes=[16, 8], tensor_groups=[0, 1], blocks_per_chunk=[4, 2])


def _job(kind: TransferKind = STORE, **kwargs: object) -> TransferJob:
    args: dict[str, object] = {
        "slots": [0, 1, 2],
        "block_ids": [1, 2, 3, 4, 5],
        "group_sizes": [3, 2],
        "block_indices": [2, 0],
        **kwargs,
    }
    return TransferJob(JobId(7), kind, **args)  # type: ignore[arg-type]


def test_plan_skips_the_first_positions_and_counts_slots_per_group() -> None:
    # group 0: skip 2 + 3 blocks = 2 chunks of 4; group 1: 2 blocks = 1 chunk of 2
    runs = LAYOUT.plan(_job(), num_slots=8, num_blocks=[10, 10])
    assert runs == (ChunkRun(0, 0, 2, 2, 0, 3), ChunkRun(1, 2, 1, 0, 3, 2))


def test_empty_groups_cover_no_slot() -> None:
    job = _job(slots=[5], block_ids=[1, 2], group_sizes=[0, 2], block_indices=[3, 4])
    assert LAYOUT.plan(job, num_slots=8, num_blocks=[10, 10]) == (ChunkRun(1, 0, 1, 0, 0, 2),)
    empty = _job(slots=[], block_ids=[], group_sizes=[0, 0], block_indices=[0, 0])
    assert LAYOUT.plan(empty, num_slots=8, num_blocks=[10, 10]) == ()


@pytest.mark.parametrize(
    ("kind", "kwargs", "field", "words"),
    [
        (STORE, {"group_sizes": [5], "block_indices": [0]}, "group_sizes", "1 groups, the"),
        (STORE, {"block_ids": [1, 2, 30, 4, 5]}, "block_ids", "block 30 of group 0 outside 0..9"),
        (STORE, {"block_ids": [1, 2, 3, 4, 12]}, "block_ids", "block 12 of group 1 outside 0..10"),
        (STORE, {"slots": [0, 1, 8]}, "slots", "slot 8 outside 0..7"),
        (STORE, {"slots": [0, 1]}, "slots", r"2 slots, but .* need 3 \(group 0: 2, group 1: 1\)"),
        (STORE, {"slots": [0, 1, 2, 3]}, "slots", "4 slots"),
        (STORE, {"slots": [0, 1, 0]}, "slots", "a slot appears twice"),
        (LOAD, {"block_ids": [1, 2, 1, 4, 5]}, "block_ids", "group 0 names a device block twice"),
    ],
)
def test_jobs_that_do_not_fit_name_job_and_field(
    kind: TransferKind, kwargs: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(TransferError, match=words) as info:
        LAYOUT.plan(_job(kind, **kwargs), num_slots=8, num_blocks=[10, 11])
    assert (info.value.job_id, info.value.field) == (7, field)
    assert str(info.value).startswith(f"transfer job 7: {field}: ")


def test_a_load_refuses_one_block_in_two_groups_that_share_a_tensor() -> None:
    layout = SlotLayout(page_bytes=[8, 8, 8], tensor_groups=[0, (0, 1), 1], blocks_per_chunk=[1, 1])
    apart = SlotLayout(page_bytes=[8, 8], tensor_groups=[0, 1], blocks_per_chunk=[1, 1])
    args = {"slots": [0, 1], "block_ids": [4, 4], "group_sizes": [1, 1]}
    load = TransferJob(JobId(3), LOAD, **args)  # type: ignore[arg-type]
    with pytest.raises(TransferError, match=r"groups \[0, 1\] share a tensor") as info:
        layout.plan(load, num_slots=4, num_blocks=[8, 8])
    assert (info.value.job_id, info.value.field) == (3, "block_ids")
    assert len(apart.plan(load, num_slots=4, num_blocks=[8, 8])) == 2  # separate tensors
    store = TransferJob(JobId(4), STORE, **args)  # type: ignore[arg-type]
    assert len(layout.plan(store, num_slots=4, num_blocks=[8, 8])) == 2  # reading twice is fine
    fine = TransferJob(JobId(5), LOAD, slots=[0, 1], block_ids=[4, 5], group_sizes=[1, 1])
    assert len(layout.plan(fine, num_slots=4, num_blocks=[8, 8])) == 2


def test_a_load_may_read_one_slot_twice_and_a_store_may_read_one_block_twice() -> None:
    load = _job(LOAD, slots=[0, 1, 0])
    assert len(LAYOUT.plan(load, num_slots=8, num_blocks=[10, 10])) == 2
    store = _job(STORE, block_ids=[1, 1, 1, 4, 4])
    assert len(LAYOUT.plan(store, num_slots=8, num_blocks=[10, 10])) == 2


def test_ranges_are_exact_for_skipped_and_partial_chunks() -> None:
    layout = SlotLayout(page_bytes=[10], tensor_groups=[0], blocks_per_chunk=[4])
    job = TransferJob(JobId(1), STORE, slots=[3, 4, 9], block_ids=list(range(7)), block_indices=[3])
    runs = layout.plan(job, num_slots=10, num_blocks=[10])
    # positions 3 | 0-3 | 0-1: slots 3 and 4 are adjacent on both sides, so they merge
    assert [tuple(r) for r in layout.byte_ranges(runs, job.slots)] == [
        (30, 150, 50),
        (80, 360, 20),
    ]


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    spec=layouts(),
    kind=st.sampled_from([STORE, LOAD]),
    padding=st.sampled_from([None, 0, 1, 24]),
)
def test_byte_ranges_touch_exactly_the_oracle_bytes(
    data: st.DataObject, spec: Layout, kind: TransferKind, padding: int | None
) -> None:
    layout = _layout(spec)
    assert layout.slot_bytes == spec.slot_bytes
    assert list(layout.region_offsets) == spec.offsets
    for t in range(len(spec.page_bytes)):
        assert layout.tensor_groups[t] == spec.groups(t)
    num_slots = 40
    job = data.draw(jobs(spec, num_slots, kind, ordered=data.draw(st.booleans())))
    runs = layout.plan(job, num_slots=num_slots, num_blocks=spec.num_blocks)
    stride = layout.slot_bytes + (padding or 0)  # None: the default stride
    writes = placements(spec, job, slot_stride=stride)
    expected = {b for w in writes for b in range(w.host, w.host + w.length)}
    max_chunks = data.draw(st.integers(1, 6))
    touched: list[int] = []
    for batch in layout.batches(runs, max_chunks):
        assert sum(r.num_chunks for r in batch) <= max_chunks
        first = batch[0].slot_pos
        ranges = (
            layout.byte_ranges(batch, job.slots)
            if padding is None
            else layout.byte_ranges(batch, job.slots, slot_stride=stride)
        )
        for r in ranges:
            # a range never crosses from one slot into a non-adjacent one on either side
            row, offset = divmod(r.stage, layout.slot_bytes)
            slot = job.slots[first + row]
            assert r.host == slot * stride + offset
            if padding:  # padded rows: a range stays inside its slot's bytes
                assert offset + r.length <= layout.slot_bytes
            assert r.stage + r.length <= sum(x.num_chunks for x in batch) * layout.slot_bytes
            touched.extend(range(r.host, r.host + r.length))
    assert len(touched) == len(set(touched))  # no byte twice
    assert set(touched) == expected


@settings(max_examples=200, deadline=None)
@given(data=st.data(), spec=layouts())
def test_batches_keep_blocks_and_slots_consecutive(data: st.DataObject, spec: Layout) -> None:
    layout = _layout(spec)
    job = data.draw(jobs(spec, 40, STORE))
    runs = layout.plan(job, num_slots=40, num_blocks=spec.num_blocks)
    batches = layout.batches(runs, data.draw(st.integers(1, 5)))
    flat = [run for batch in batches for run in batch]
    assert sum(r.num_blocks for r in flat) == len(job.block_ids)
    assert sum(r.num_chunks for r in flat) == len(job.slots)
    slot_at = block_at = 0
    for run in flat:
        assert (run.slot_pos, run.block_pos) == (slot_at, block_at)
        per = layout.blocks_per_chunk[run.group]
        assert 0 <= run.skip < per
        assert (run.num_chunks - 1) * per < run.skip + run.num_blocks <= run.num_chunks * per
        slot_at += run.num_chunks
        block_at += run.num_blocks


def test_batches_refuse_zero_room_and_byte_ranges_a_stride_below_the_slot() -> None:
    with pytest.raises(ValueError, match="max_chunks"):
        LAYOUT.batches((), 0)
    with pytest.raises(ValueError, match="slot_stride 47 < slot_bytes 80"):
        LAYOUT.byte_ranges((), (), slot_stride=47)
