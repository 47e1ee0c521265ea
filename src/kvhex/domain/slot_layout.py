"""``SlotLayout``: where a chunk's device blocks live inside a host slot.

The layout every ``BlockTransfer`` shares, so any process reading the host bytes agrees on
them: one region per registered KV tensor in registration order, a chunk of a KV group
filling the regions of that group's tensors (a tensor may belong to several groups). It
checks jobs (:mod:`kvhex.domain.transfer`) against the layout and plans their copies as
``ChunkRun`` and ``ByteRange`` values. Pure arithmetic: no torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import attrs

from kvhex.domain.transfer import TransferJob, TransferKind
from kvhex.errors import TransferError


class ChunkRun(NamedTuple):
    """Consecutive chunks of one KV group inside a job: what one planned copy step moves.

    The run's blocks fill positions ``skip .. skip + num_blocks - 1`` of its chunks laid end to
    end (``num_chunks * blocks_per_chunk`` positions): the first ``skip`` positions of its
    first chunk and the unfilled tail of its last chunk are not part of the job.

    Attributes:
        group: the KV group (index into the layout's ``blocks_per_chunk``).
        slot_pos: index into ``job.slots`` of the run's first chunk.
        num_chunks: chunks (host slots) the run covers.
        skip: positions skipped at the start of the first chunk (``0 <= skip < bpc``).
        block_pos: index into ``job.block_ids`` of the run's first block.
        num_blocks: device blocks the run moves (at least one).
    """

    group: int
    slot_pos: int
    num_chunks: int
    skip: int
    block_pos: int
    num_blocks: int


class ByteRange(NamedTuple):
    """One contiguous copy between a staging area laid out like the job's slots and the host.

    ``stage`` is the offset in the staging area (row ``i`` is the batch's ``i``-th slot),
    ``host`` the offset in the host buffer (``slot * slot_stride + offset in the slot``).
    """

    stage: int
    host: int
    length: int


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _group_sets(values: Iterable[int | Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    """Each entry as a tuple of groups: an int is one group; anything else (checked later)
    is taken as the groups sharing that tensor."""
    return tuple(tuple(entry) if isinstance(entry, Iterable) else (entry,) for entry in values)


def _positive_ints(name: str, values: tuple[int, ...]) -> None:
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TransferError(f"entry {i} is {value!r}, must be a positive int", field=name)


def _tensor_members(
    tensor_groups: tuple[tuple[int, ...], ...], blocks_per_chunk: tuple[int, ...]
) -> list[list[int]]:
    """The tensors of each group, after checking every entry of ``tensor_groups``."""
    num_groups = len(blocks_per_chunk)
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for t, groups in enumerate(tensor_groups):
        if not groups:
            raise TransferError(f"tensor {t} belongs to no group", field="tensor_groups")
        for group in groups:
            if isinstance(group, bool) or not isinstance(group, int):
                raise TransferError(
                    f"tensor {t}: group {group!r} is not an int", field="tensor_groups"
                )
            if not 0 <= group < num_groups:
                raise TransferError(
                    f"tensor {t}: group {group} outside 0..{num_groups - 1} "
                    f"(blocks_per_chunk names {num_groups} groups)",
                    field="tensor_groups",
                )
        if len(set(groups)) != len(groups):
            raise TransferError(
                f"tensor {t} names a group twice: {list(groups)}", field="tensor_groups"
            )
        sizes = {blocks_per_chunk[g] for g in groups}
        if len(sizes) > 1:
            per = ", ".join(f"group {g}: {blocks_per_chunk[g]}" for g in groups)
            raise TransferError(
                f"tensor {t} is shared by groups {list(groups)} whose blocks_per_chunk "
                f"differ ({per}); groups sharing a tensor need one region size",
                field="tensor_groups",
            )
        for group in groups:
            members[group].append(t)
    empty = [g for g, tensors in enumerate(members) if not tensors]
    if empty:
        raise TransferError(f"group(s) {empty} have no tensor", field="tensor_groups")
    return members


@attrs.frozen(slots=True)
class SlotLayout:
    """Where each registered KV tensor's blocks live inside one host slot.

    A slot holds one chunk of one KV group. Its bytes are split into one region per registered
    tensor, in registration order, each ``blocks_per_chunk[group] * page_bytes[tensor]`` bytes
    long; ``slot_bytes`` is the sum of every region (like vLLM's CPU layout, where a slot spans
    every tensor). Block ``j`` of a chunk of group ``g`` goes to
    ``region_offsets[t] + j * page_bytes[t]`` for every tensor ``t`` of group ``g``; the regions
    of the other tensors in that slot are left alone.

    A tensor may be shared by several groups (vLLM's hybrid models: one KV tensor holds the
    blocks of layers of different groups). Each group's chunk still lives in its own slot, so
    the groups use the same region of different slots; they must agree on
    ``blocks_per_chunk``, which sizes the region.

    Attributes:
        page_bytes: bytes of one device block, per tensor.
        tensor_groups: the KV groups of each tensor (positions in a job's group order); an
            entry given as an int is a one-group tuple.
        blocks_per_chunk: device blocks per chunk (per host slot), per group.
        region_offsets: where each tensor's region starts inside a slot.
        slot_bytes: bytes per slot.
        group_tensors: the tensors of each group, in registration order.

    Raises:
        TransferError: naming the argument, for empty or non-positive sizes, a tensor with no
            group, a group outside ``0 .. len(blocks_per_chunk) - 1`` or named twice for one
            tensor, groups sharing a tensor with different ``blocks_per_chunk``, or a group
            with no tensor.
    """

    page_bytes: tuple[int, ...] = attrs.field(converter=_ints)
    tensor_groups: tuple[tuple[int, ...], ...] = attrs.field(converter=_group_sets)
    blocks_per_chunk: tuple[int, ...] = attrs.field(converter=_ints)
    region_offsets: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    slot_bytes: int = attrs.field(init=False, eq=False)
    group_tensors: tuple[tuple[int, ...], ...] = attrs.field(init=False, eq=False, repr=False)
    # per group: the merged (offset, length) spans a full chunk writes inside its slot
    _full_spans: tuple[tuple[tuple[int, int], ...], ...] = attrs.field(
        init=False, eq=False, repr=False
    )
    # the distinct group sets that share a tensor (a load must not write one block twice)
    _shared: tuple[tuple[int, ...], ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.page_bytes:
            raise TransferError("no KV cache tensor registered", field="kv_caches")
        if len(self.tensor_groups) != len(self.page_bytes):
            raise TransferError(
                f"{len(self.tensor_groups)} entries for {len(self.page_bytes)} tensors",
                field="tensor_groups",
            )
        if not self.blocks_per_chunk:
            raise TransferError("no KV group", field="blocks_per_chunk")
        _positive_ints("page_bytes", self.page_bytes)
        _positive_ints("blocks_per_chunk", self.blocks_per_chunk)
        members = _tensor_members(self.tensor_groups, self.blocks_per_chunk)
        offsets = []
        offset = 0
        for page, groups in zip(self.page_bytes, self.tensor_groups, strict=True):
            offsets.append(offset)
            offset += self.blocks_per_chunk[groups[0]] * page
        object.__setattr__(self, "region_offsets", tuple(offsets))
        object.__setattr__(self, "slot_bytes", offset)
        object.__setattr__(self, "group_tensors", tuple(tuple(m) for m in members))
        object.__setattr__(
            self,
            "_full_spans",
            tuple(self._spans(g, 0, self.blocks_per_chunk[g]) for g in range(len(members))),
        )
        shared = {tuple(sorted(groups)) for groups in self.tensor_groups if len(groups) > 1}
        object.__setattr__(self, "_shared", tuple(sorted(shared)))

    @property
    def num_groups(self) -> int:
        """KV groups (entries of a job's ``group_sizes``)."""
        return len(self.blocks_per_chunk)

    def _spans(self, group: int, first: int, end: int) -> tuple[tuple[int, int], ...]:
        """Merged (offset, length) spans of positions ``first .. end - 1`` of a chunk."""
        spans: list[tuple[int, int]] = []
        for t in self.group_tensors[group]:
            page = self.page_bytes[t]
            start = self.region_offsets[t] + first * page
            length = (end - first) * page
            if spans and spans[-1][0] + spans[-1][1] == start:
                spans[-1] = (spans[-1][0], spans[-1][1] + length)
            else:
                spans.append((start, length))
        return tuple(spans)

    def plan(
        self, job: TransferJob, *, num_slots: int, num_blocks: Sequence[int]
    ) -> tuple[ChunkRun, ...]:
        """Check ``job`` against this layout and split it into one run per non-empty group.

        ``num_blocks[g]`` is the number of device blocks of group ``g``; ``num_slots`` the
        host slots. Group ``g`` skips ``block_indices[g] % blocks_per_chunk[g]`` positions
        and covers ``ceil((skip + group_sizes[g]) / blocks_per_chunk[g])`` slots; empty groups
        cover none.

        Raises:
            TransferError: naming the job and the field: a group count that differs from the
                layout's, a block id or slot out of range, a slot count that does not match
                the blocks and skips, a slot written twice by a store, a device block written
                twice by a load (also by two groups that share a tensor).
        """
        job_id = job.job_id
        sizes = job.group_sizes
        if len(sizes) != len(self.blocks_per_chunk):
            raise TransferError(
                f"{len(sizes)} groups, the registered layout has {len(self.blocks_per_chunk)}",
                job_id=job_id,
                field="group_sizes",
            )
        block_ids = job.block_ids
        runs: list[ChunkRun] = []
        slot_pos = 0
        block_pos = 0
        for group, (size, index) in enumerate(zip(sizes, job.block_indices, strict=True)):
            if size == 0:
                continue
            per_chunk = self.blocks_per_chunk[group]
            skip = index % per_chunk
            chunks = (skip + size + per_chunk - 1) // per_chunk
            ids = block_ids[block_pos : block_pos + size]
            highest = max(ids)
            if highest >= num_blocks[group]:
                raise TransferError(
                    f"block {highest} of group {group} outside 0..{num_blocks[group] - 1}",
                    job_id=job_id,
                    field="block_ids",
                )
            if job.kind is TransferKind.LOAD and len(set(ids)) != size:
                raise TransferError(
                    f"group {group} names a device block twice (a load would write it twice)",
                    job_id=job_id,
                    field="block_ids",
                )
            runs.append(ChunkRun(group, slot_pos, chunks, skip, block_pos, size))
            slot_pos += chunks
            block_pos += size
        if job.kind is TransferKind.LOAD and self._shared:
            self._check_shared_loads(job, runs)
        slots = job.slots
        if slot_pos != len(slots):
            need = ", ".join(f"group {r.group}: {r.num_chunks}" for r in runs) or "none"
            raise TransferError(
                f"{len(slots)} slots, but the blocks and skips need {slot_pos} ({need})",
                job_id=job_id,
                field="slots",
            )
        if slots:
            highest = max(slots)
            if highest >= num_slots:
                raise TransferError(
                    f"slot {highest} outside 0..{num_slots - 1}", job_id=job_id, field="slots"
                )
            if job.kind is TransferKind.STORE and len(set(slots)) != len(slots):
                raise TransferError(
                    "a slot appears twice (a store would write it twice)",
                    job_id=job_id,
                    field="slots",
                )
        return tuple(runs)

    def _check_shared_loads(self, job: TransferJob, runs: Sequence[ChunkRun]) -> None:
        """Groups sharing a tensor write the same device tensor: no block twice among them."""
        ids = {r.group: job.block_ids[r.block_pos : r.block_pos + r.num_blocks] for r in runs}
        for groups in self._shared:
            named = [b for g in groups for b in ids.get(g, ())]
            if len(set(named)) != len(named):
                raise TransferError(
                    f"groups {list(groups)} share a tensor and name one device block more "
                    "than once (a load would write it twice)",
                    job_id=job.job_id,
                    field="block_ids",
                )

    def batches(self, runs: Sequence[ChunkRun], max_chunks: int) -> list[tuple[ChunkRun, ...]]:
        """Split planned runs into batches of at most ``max_chunks`` slots each, cutting runs
        at chunk boundaries (each batch then fits a staging area of ``max_chunks`` slots).
        Batches cover consecutive slots and consecutive block ids of the job."""
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        batches: list[tuple[ChunkRun, ...]] = []
        current: list[ChunkRun] = []
        room = max_chunks
        for whole in runs:
            run = whole
            while run.num_chunks > room:
                # the first ``room`` chunks are full but for the skipped head of the first
                head_blocks = room * self.blocks_per_chunk[run.group] - run.skip
                current.append(run._replace(num_chunks=room, num_blocks=head_blocks))
                batches.append(tuple(current))
                run = ChunkRun(
                    run.group,
                    run.slot_pos + room,
                    run.num_chunks - room,
                    0,
                    run.block_pos + head_blocks,
                    run.num_blocks - head_blocks,
                )
                current, room = [], max_chunks
            if run.num_chunks:
                current.append(run)
                room -= run.num_chunks
            if room == 0:
                batches.append(tuple(current))
                current, room = [], max_chunks
        if current:
            batches.append(tuple(current))
        return batches

    def byte_ranges(
        self, runs: Sequence[ChunkRun], slots: Sequence[int], *, slot_stride: int | None = None
    ) -> list[ByteRange]:
        """The host bytes a batch of runs touches, as copies to or from a staging area whose
        row ``i`` is the batch's ``i``-th slot; adjacent copies are merged.

        Exactly the bytes of the job's blocks: skipped positions, the unfilled tail of a last
        chunk and other groups' regions are never part of a range (a store leaves them as they
        were). Slot ``s`` starts at host byte ``s * slot_stride`` (default ``slot_bytes``: slots
        back to back; larger for padded rows, whose padding no range touches).
        """
        slot_bytes = self.slot_bytes
        stride = slot_bytes if slot_stride is None else slot_stride
        if stride < slot_bytes:
            raise ValueError(f"slot_stride {stride} < slot_bytes {slot_bytes}")
        ranges: list[ByteRange] = []
        if not runs:
            return ranges
        first_pos = runs[0].slot_pos
        for run in runs:
            per_chunk = self.blocks_per_chunk[run.group]
            full = self._full_spans[run.group]
            end = run.skip + run.num_blocks
            for c in range(run.num_chunks):
                lo = run.skip if c == 0 else 0
                hi = min(per_chunk, end - c * per_chunk)
                spans = full if lo == 0 and hi == per_chunk else self._spans(run.group, lo, hi)
                pos = run.slot_pos + c
                stage_base = (pos - first_pos) * slot_bytes
                host_base = slots[pos] * stride
                for offset, length in spans:
                    stage = stage_base + offset
                    host = host_base + offset
                    if ranges:
                        last = ranges[-1]
                        if last.stage + last.length == stage and last.host + last.length == host:
                            ranges[-1] = ByteRange(last.stage, last.host, last.length + length)
                            continue
                    ranges.append(ByteRange(stage, host, length))
        return ranges
