"""The CPU copy scheme: device blocks <-> host slots with no staging, each byte moved once.

* Spans: neighbouring tensors of a group (in the group's order) with one page size, one row
  stride, one storage and a uniform distance between their blocks, whose host regions are
  uniformly apart too, are viewed as one strided ``(num_blocks, tensors, page)`` tensor.
  vLLM on the CPU allocates every layer's KV cache inside one backing allocation, layer after
  layer, so a group's layers are typically one span; a lone tensor is a span of one.
* Pieces: a run's blocks cut where the next device block is not the next one or does not land
  in the next host position (whole chunks in consecutive slots join too, up to
  ``MERGE_CAP`` bytes). One strided copy between the span's view and the host slot's region
  per piece and span, handed to the copy threads in tasks of about ``TASK_BYTES``: small
  copies share a task (one queue round trip for many), a bigger piece is split by tensors (so
  that even a job of one big chunk keeps several threads busy).
* The copies are numpy's (``np.copyto`` on strided views of the same memory, or
  ``ctypes.memmove`` where a piece is one contiguous stretch on both sides, which costs less
  per call): one plain copy loop per call with the GIL released, so the copy threads copy in
  parallel. Every offset comes from a job ``SlotLayout.plan`` checked against the tensors'
  sizes.
  torch's own ``copy_`` from a thread other than the main one starts an OpenMP team per
  thread and, with more OpenMP threads than cores, pays a wake-up per copy: measured on 2
  cores, 16 chunks of 16 x 128 KiB, 0.72x of a raw contiguous copy with torch copies
  against 0.82-0.89x with numpy's. A gather-then-scatter batch for small pieces measured no
  better than numpy's copies at 16 KiB pieces and worse at 64 KiB, so there is none.

``plan`` turns a job into tasks (on the submitting thread); ``run`` copies one task (on a
copy thread, :mod:`kvhex.adapters.torch.workers`).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from kvhex.domain.slot_layout import ChunkRun, SlotLayout
from kvhex.domain.transfer import TransferJob

TASK_BYTES = 4 << 20
"""Copies go to the copy threads in tasks of up to this many bytes: small ones share a task,
a bigger piece is split by tensors. Measured on 2 cores at 2 MiB chunks: 1 MiB tasks 0.77x,
2 MiB 0.81-0.84x, 4 MiB 0.88-0.89x, 8 MiB 0.81-0.82x of a raw copy."""
MERGE_CAP = 1 << 20
"""Joined pieces stop growing at this many bytes (so a job still has tasks for every thread)."""

Task = tuple[int, list[tuple[Any, ...]]]
"""``(nbytes, [(span, host offset, device offset, chunks, positions, tensors), ...])``."""


def _disjoint(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """No two elements of a strided view share an address (sufficient test: sorted by stride,
    each dimension steps past everything the smaller ones cover)."""
    extent = 0
    for stride, size in sorted(zip(strides, sizes, strict=True)):
        if size > 1:
            if stride <= extent:
                return False
            extent += stride * (size - 1)
    return True


def _storage_bytes(tensor: torch.Tensor) -> Any:
    """The whole storage behind ``tensor`` as a flat uint8 numpy array (zero-copy)."""
    flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return flat.numpy()


class _Span:
    """Tensors of one group copied as one strided view (see the module docstring)."""

    __slots__ = (
        "base_np",
        "base_ptr",
        "chunk_row",
        "count",
        "dense",
        "dev_step",
        "host_off",
        "host_step",
        "page",
        "row",
        "start",
    )

    def __init__(
        self,
        layout: SlotLayout,
        group: int,
        tensors: list[int],
        blocks: list[torch.Tensor],
    ) -> None:
        first = blocks[tensors[0]]
        per_chunk = layout.blocks_per_chunk[group]
        self.base_np = _storage_bytes(first)
        self.base_ptr = first.untyped_storage().data_ptr()
        self.start = first.storage_offset()
        self.row = first.stride(0)
        self.dense = self.row == layout.page_bytes[tensors[0]]  # a block's successor follows it
        self.chunk_row = per_chunk * self.row
        self.page = layout.page_bytes[tensors[0]]
        self.count = len(tensors)
        self.host_off = layout.region_offsets[tensors[0]]
        two = len(tensors) > 1
        self.dev_step = blocks[tensors[1]].data_ptr() - first.data_ptr() if two else self.page
        self.host_step = layout.region_offsets[tensors[1]] - self.host_off if two else self.page


def _joins(layout: SlotLayout, span: list[int], t: int, blocks: list[torch.Tensor]) -> bool:
    """Whether tensor ``t`` extends the span of tensors ``span`` (same page, row stride and
    storage; the same distance as the span's tensors on the device and in the slot; a view of
    them all whose elements do not overlap)."""
    prev, new = blocks[span[-1]], blocks[t]
    if (
        layout.page_bytes[t] != layout.page_bytes[span[0]]
        or new.stride(0) != prev.stride(0)
        or new.untyped_storage().data_ptr() != prev.untyped_storage().data_ptr()
    ):
        return False
    step = new.data_ptr() - prev.data_ptr()
    host_step = layout.region_offsets[t] - layout.region_offsets[span[-1]]
    if len(span) > 1:
        first, second = blocks[span[0]], blocks[span[1]]
        if step != second.data_ptr() - first.data_ptr():
            return False
        if host_step != layout.region_offsets[span[1]] - layout.region_offsets[span[0]]:
            return False
    sizes = (new.shape[0], len(span) + 1, layout.page_bytes[t])
    return step > 0 and _disjoint(sizes, (new.stride(0), step, 1))


class DirectCopier:
    """The CPU copy code for one registered layout.

    ``blocks`` are the tensors' ``(num_blocks, page_bytes)`` uint8 views; ``host`` a uint8
    CPU tensor ``[num_slots, slot_bytes]`` with contiguous rows ``stride(0) >= slot_bytes``
    apart. The sizes default to the module's constants (tests shrink them to reach every
    path with small tensors). It keeps zero-copy numpy views of both storages: the tensors
    must outlive it.
    """

    def __init__(
        self,
        layout: SlotLayout,
        blocks: list[torch.Tensor],
        host: torch.Tensor,
        *,
        merge_cap: int = MERGE_CAP,
        task_bytes: int = TASK_BYTES,
    ) -> None:
        self.layout = layout
        self._task_bytes = max(1, task_bytes)
        self._host_np = _storage_bytes(host)
        self._host_ptr = host.untyped_storage().data_ptr()
        self._row_stride = host.stride(0) if host.shape[0] > 1 else layout.slot_bytes
        self._host_base = host.storage_offset()
        self._spans: list[list[_Span]] = []
        for group, members in enumerate(layout.group_tensors):
            cuts: list[list[int]] = []
            for t in members:
                if cuts and _joins(layout, cuts[-1], t, blocks):
                    cuts[-1].append(t)
                else:
                    cuts.append([t])
            self._spans.append([_Span(layout, group, cut, blocks) for cut in cuts])
        self._cap = [
            max(1, merge_cap // max(s.count * s.page for s in spans)) for spans in self._spans
        ]

    @property
    def span_sizes(self) -> list[list[int]]:
        """Per group, the tensors in each span (how the tensors were grouped)."""
        return [[s.count for s in spans] for spans in self._spans]

    def plan(self, job: TransferJob, runs: tuple[ChunkRun, ...]) -> tuple[list[Task], int]:
        """A planned job's tasks, in job order, and the bytes they move."""
        tasks: list[Task] = []
        for run in runs:
            self._plan(job, run, tasks)
        return tasks, sum(task[0] for task in tasks)

    def _plan(self, job: TransferJob, run: ChunkRun, tasks: list[Task]) -> None:
        per_chunk = self.layout.blocks_per_chunk[run.group]
        self._plan_copies(self._pieces(job, run, per_chunk), self._spans[run.group], tasks)

    def _plan_copies(self, pieces: list[list[int]], spans: list[_Span], tasks: list[Task]) -> None:
        """One copy per piece and span, in tasks of up to ``task_bytes`` (a big piece goes as
        a few copies of some tensors each, so that a job of few big pieces still keeps several
        threads busy; small ones share a task, so that each costs one copy call only)."""
        limit = self._task_bytes
        host_base, row_stride = self._host_base, self._row_stride
        copies: list[tuple[Any, ...]] = []
        size = 0
        for slot, position, block, chunks, count in pieces:
            for span in spans:
                host_at = host_base + slot * row_stride + span.host_off + position * span.page
                dev_at = span.start + block * span.row
                tensor_bytes = chunks * count * span.page
                per_copy = max(1, limit // tensor_bytes)
                for first in range(0, span.count, per_copy):
                    width = min(per_copy, span.count - first)
                    if copies and size + width * tensor_bytes > limit:
                        tasks.append((size, copies))
                        copies, size = [], 0
                    host_first = host_at + first * span.host_step
                    dev_first = dev_at + first * span.dev_step
                    copies.append((span, host_first, dev_first, chunks, count, width))
                    size += width * tensor_bytes
        if copies:
            tasks.append((size, copies))

    def _pieces(self, job: TransferJob, run: ChunkRun, per_chunk: int) -> list[list[int]]:
        """``[slot, position, first block, chunks, blocks per chunk]`` per piece of a run."""
        cap = self._cap[run.group]
        slots, ids = job.slots, job.block_ids
        pieces: list[list[int]] = []
        last: list[int] | None = None
        for k in range(run.num_blocks):
            chunk, position = divmod(run.skip + k, per_chunk)
            slot = slots[run.slot_pos + chunk]
            block = ids[run.block_pos + k]
            if (
                last is not None
                and last[3] == 1
                and last[0] == slot
                and last[1] + last[4] == position
                and last[2] + last[4] == block
                and last[4] < cap
            ):
                last[4] += 1
            else:
                last = [slot, position, block, 1, 1]
                pieces.append(last)
            if last[4] == per_chunk and len(pieces) > 1:  # a whole chunk: join whole chunks
                prev = pieces[-2]
                if (
                    prev[4] == per_chunk
                    and prev[0] + prev[3] == slot
                    and prev[2] + prev[3] * per_chunk == last[2]
                    and (prev[3] + 1) * per_chunk <= cap
                ):
                    prev[3] += 1
                    pieces.pop()
                    last = prev
        return pieces

    def run(self, task: Task, store: bool) -> None:
        """Copy one task (device -> host for a store, host -> device for a load)."""
        host, row_stride = self._host_np, self._row_stride
        ndarray, copyto, uint8 = np.ndarray, np.copyto, np.uint8
        host_ptr, move = self._host_ptr, ctypes.memmove
        for span, host_at, dev_at, chunks, positions, tensors in task[1]:
            if span.dense and chunks == 1 and tensors == 1:
                # one contiguous stretch on both sides: the cheapest call there is
                nbytes = positions * span.page
                if store:
                    move(host_ptr + host_at, span.base_ptr + dev_at, nbytes)
                else:
                    move(span.base_ptr + dev_at, host_ptr + host_at, nbytes)
                continue
            shape = (chunks, tensors, positions, span.page)
            slot = ndarray(shape, uint8, host, host_at, (row_stride, span.host_step, span.page, 1))
            dev = ndarray(
                shape, uint8, span.base_np, dev_at, (span.chunk_row, span.dev_step, span.row, 1)
            )
            if store:
                copyto(slot, dev)
            else:
                copyto(dev, slot)
