"""An independent oracle for device <-> host block placement, and hypothesis strategies for
layouts and jobs. Written from the rule in the brief, not from ``SlotLayout``'s code:

    slot = regions of every tensor in registration order, tensor t's region
    blocks_per_chunk[group(t)] * page_bytes[t] bytes; block j of a chunk of group g sits at
    region_offset[t] + j * page_bytes[t] for every tensor t of g; group g skips
    block_indices[g] % blocks_per_chunk[g] positions of its first chunk.
"""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import assume
from hypothesis import strategies as st

from kvhex.domain import JobId, TransferJob, TransferKind


class Layout(NamedTuple):
    page_bytes: list[int]
    tensor_groups: list[int]
    blocks_per_chunk: list[int]
    num_blocks: list[int]  # per group

    @property
    def offsets(self) -> list[int]:
        out, at = [], 0
        for page, group in zip(self.page_bytes, self.tensor_groups, strict=True):
            out.append(at)
            at += self.blocks_per_chunk[group] * page
        return out

    @property
    def slot_bytes(self) -> int:
        return sum(
            self.blocks_per_chunk[g] * p
            for p, g in zip(self.page_bytes, self.tensor_groups, strict=True)
        )


class Write(NamedTuple):
    """Device block ``block`` of tensor ``tensor`` lives at host byte ``host`` (``length``)."""

    tensor: int
    block: int
    host: int
    length: int


def chunks_needed(layout: Layout, group_sizes: list[int], block_indices: list[int]) -> int:
    total = 0
    for g, (n, index) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n:
            per = layout.blocks_per_chunk[g]
            total += -(-(index % per + n) // per)
    return total


def placements(layout: Layout, job: TransferJob) -> list[Write]:
    offsets = layout.offsets
    slot_bytes = layout.slot_bytes
    out: list[Write] = []
    slot_at = block_at = 0
    for g, (n, index) in enumerate(zip(job.group_sizes, job.block_indices, strict=True)):
        if n == 0:
            continue
        per = layout.blocks_per_chunk[g]
        skip = index % per
        for k in range(n):
            chunk, j = divmod(skip + k, per)
            slot = job.slots[slot_at + chunk]
            block = job.block_ids[block_at + k]
            for t, tg in enumerate(layout.tensor_groups):
                if tg == g:
                    page = layout.page_bytes[t]
                    out.append(Write(t, block, slot * slot_bytes + offsets[t] + j * page, page))
        slot_at += -(-(skip + n) // per)
        block_at += n
    return out


@st.composite
def layouts(draw: st.DrawFn, max_groups: int = 3, max_extra_tensors: int = 3) -> Layout:
    num_groups = draw(st.integers(1, max_groups))
    per_chunk = draw(st.lists(st.integers(1, 4), min_size=num_groups, max_size=num_groups))
    extra = draw(st.lists(st.integers(0, num_groups - 1), max_size=max_extra_tensors))
    groups = draw(st.permutations(list(range(num_groups)) + extra))
    page_sizes = st.sampled_from([1, 3, 8, 12, 16, 40, 64])
    if draw(st.booleans()):  # every tensor of a group alike (the usual model: equal layers)
        per_group = draw(st.lists(page_sizes, min_size=num_groups, max_size=num_groups))
        groups = sorted(groups) if draw(st.booleans()) else groups
        pages = [per_group[g] for g in groups]
    else:
        pages = draw(st.lists(page_sizes, min_size=len(groups), max_size=len(groups)))
    num_blocks = draw(st.lists(st.integers(4, 24), min_size=num_groups, max_size=num_groups))
    return Layout(pages, list(groups), per_chunk, num_blocks)


@st.composite
def jobs(
    draw: st.DrawFn, layout: Layout, num_slots: int, kind: TransferKind, job_id: int = 1
) -> TransferJob:
    sizes: list[int] = []
    indices: list[int] = []
    block_ids: list[int] = []
    for g, blocks in enumerate(layout.num_blocks):
        n = draw(st.integers(0, min(blocks, 9)))
        sizes.append(n)
        indices.append(draw(st.integers(0, 3 * layout.blocks_per_chunk[g])))
        block_ids.extend(draw(st.permutations(range(blocks)))[:n])
    need = chunks_needed(layout, sizes, indices)
    assume(need <= num_slots)
    slots = draw(st.permutations(range(num_slots)))[:need]
    return TransferJob(
        JobId(job_id), kind, slots, block_ids, group_sizes=sizes, block_indices=indices
    )
