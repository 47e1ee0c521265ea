"""An independent oracle for device <-> host block placement, and hypothesis strategies for
layouts and jobs. Written from the rule in the brief, not from ``SlotLayout``'s code:

    slot = regions of every tensor in registration order, tensor t's region
    blocks_per_chunk[g] * page_bytes[t] bytes for any group g of t (groups sharing a tensor
    agree on blocks_per_chunk); block j of a chunk of group g sits at
    slot * slot_stride + region_offset[t] + j * page_bytes[t] for every tensor t of g; group g
    skips block_indices[g] % blocks_per_chunk[g] positions of its first chunk.
"""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import assume
from hypothesis import strategies as st

from kvhex.domain import JobId, TransferJob, TransferKind


class Layout(NamedTuple):
    page_bytes: list[int]
    tensor_groups: list[int | tuple[int, ...]]  # as the API takes it: a group or several
    blocks_per_chunk: list[int]
    num_blocks: list[int]  # per group

    def groups(self, t: int) -> tuple[int, ...]:
        entry = self.tensor_groups[t]
        return (entry,) if isinstance(entry, int) else tuple(entry)

    def tensor_blocks(self, t: int) -> int:
        """Device blocks of tensor ``t`` (every group of it has as many)."""
        return self.num_blocks[self.groups(t)[0]]

    @property
    def offsets(self) -> list[int]:
        out, at = [], 0
        for t, page in enumerate(self.page_bytes):
            out.append(at)
            at += self.blocks_per_chunk[self.groups(t)[0]] * page
        return out

    @property
    def slot_bytes(self) -> int:
        return sum(
            self.blocks_per_chunk[self.groups(t)[0]] * page
            for t, page in enumerate(self.page_bytes)
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


def placements(layout: Layout, job: TransferJob, slot_stride: int | None = None) -> list[Write]:
    offsets = layout.offsets
    stride = layout.slot_bytes if slot_stride is None else slot_stride
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
            for t in range(len(layout.page_bytes)):
                if g in layout.groups(t):
                    page = layout.page_bytes[t]
                    out.append(Write(t, block, slot * stride + offsets[t] + j * page, page))
        slot_at += -(-(skip + n) // per)
        block_at += n
    return out


def sharing_components(layout: Layout) -> list[int]:
    """Per group, a representative of the groups it shares tensors with (transitively)."""
    root = list(range(len(layout.blocks_per_chunk)))

    def find(g: int) -> int:
        while root[g] != g:
            g = root[g]
        return g

    for t in range(len(layout.page_bytes)):
        first, *rest = layout.groups(t)
        for g in rest:
            root[find(g)] = find(first)
    return [find(g) for g in range(len(root))]


@st.composite
def layouts(
    draw: st.DrawFn, max_groups: int = 3, max_extra_tensors: int = 3, shared: bool | None = None
) -> Layout:
    """Layouts of 1..max_groups groups; ``shared`` (drawn when None) lets tensors belong to
    several groups of equal blocks_per_chunk."""
    sharing = draw(st.booleans()) if shared is None else shared
    num_groups = draw(st.integers(1, max_groups))
    per_chunk_values = st.integers(1, 2) if sharing else st.integers(1, 4)
    per_chunk = draw(st.lists(per_chunk_values, min_size=num_groups, max_size=num_groups))
    extra = draw(st.lists(st.integers(0, num_groups - 1), max_size=max_extra_tensors))
    primary = draw(st.permutations(list(range(num_groups)) + extra))
    page_sizes = st.sampled_from([1, 3, 8, 12, 16, 40, 64])
    if draw(st.booleans()):  # every tensor of a group alike (the usual model: equal layers)
        per_group = draw(st.lists(page_sizes, min_size=num_groups, max_size=num_groups))
        primary = sorted(primary) if draw(st.booleans()) else primary
        pages = [per_group[g] for g in primary]
    else:
        pages = draw(st.lists(page_sizes, min_size=len(primary), max_size=len(primary)))
    entries: list[int | tuple[int, ...]] = []
    for g in primary:
        alike = [h for h in range(num_groups) if h != g and per_chunk[h] == per_chunk[g]]
        others = (
            draw(st.lists(st.sampled_from(alike), unique=True, max_size=len(alike)))
            if sharing and alike
            else []
        )
        if others:
            entries.append((g, *others))
        else:  # both spellings of one group
            entries.append(g if draw(st.booleans()) else (g,))
    spec = Layout(pages, entries, per_chunk, [])
    components = sharing_components(spec)
    per_component = {c: draw(st.integers(4, 24)) for c in sorted(set(components))}
    return spec._replace(num_blocks=[per_component[c] for c in components])


@st.composite
def jobs(
    draw: st.DrawFn,
    layout: Layout,
    num_slots: int,
    kind: TransferKind,
    job_id: int = 1,
    *,
    loadable: bool | None = None,
    ordered: bool = False,
) -> TransferJob:
    """A job that fits ``layout``. ``loadable`` (default: for loads) keeps the block ids of
    groups that share tensors apart, so that a load writes no device block twice; a store
    may name one block in several groups. ``ordered``: consecutive device blocks (per set of
    groups sharing tensors) in consecutive slots, each run maybe broken once by a swap."""
    apart = (kind is TransferKind.LOAD if loadable is None else loadable) or ordered
    components = sharing_components(layout)
    left = {components[g]: n for g, n in enumerate(layout.num_blocks)}
    sizes: list[int] = []
    indices: list[int] = []
    for g, blocks in enumerate(layout.num_blocks):
        n = draw(st.integers(0, min(left[components[g]] if apart else blocks, 9)))
        left[components[g]] -= n if apart else 0
        sizes.append(n)
        indices.append(draw(st.integers(0, 3 * layout.blocks_per_chunk[g])))
    need = chunks_needed(layout, sizes, indices)
    assume(need <= num_slots)
    block_ids: list[int] = []
    if ordered:
        cursors: dict[int, int] = {}
        for g, n in enumerate(sizes):
            c = components[g]
            total = sum(m for h, m in enumerate(sizes) if components[h] == c)
            at = cursors.setdefault(c, draw(st.integers(0, layout.num_blocks[g] - total)))
            cursors[c] = at + n
            block_ids.extend(_maybe_swapped(draw, list(range(at, at + n))))
        start = draw(st.integers(0, num_slots - need))
        slots = _maybe_swapped(draw, list(range(start, start + need)))
    else:
        pools: dict[int, list[int]] = {}
        for g, n in enumerate(sizes):
            blocks = layout.num_blocks[g]
            if apart:
                pool = pools.setdefault(components[g], draw(st.permutations(range(blocks))))
                ids, pool[:] = pool[:n], pool[n:]
            else:
                ids = draw(st.permutations(range(blocks)))[:n]
            block_ids.extend(ids)
        slots = draw(st.permutations(range(num_slots)))[:need]
    return TransferJob(
        JobId(job_id), kind, slots, block_ids, group_sizes=sizes, block_indices=indices
    )


def _maybe_swapped(draw: st.DrawFn, values: list[int]) -> list[int]:
    if len(values) > 1 and draw(st.booleans()):
        i = draw(st.integers(0, len(values) - 2))
        values[i], values[i + 1] = values[i + 1], values[i]
    return values
