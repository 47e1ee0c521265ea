"""The CUDA copy scheme: device blocks <-> host slots through a staging area on the device laid
out exactly like the job's host slots (row ``i`` is its ``i``-th slot).

* store: per registered tensor one ``index_select`` gathers the job's blocks into a dense
  buffer; one strided copy per span of equal neighbouring tensors (typically all layers of a
  group) moves them to their regions in the staging rows; one copy per contiguous host byte
  range (adjacent slots merge) moves staging -> host;
* load: the same steps backwards, ending in one ``index_put_`` per tensor.

So a batch costs one device op per tensor, one per span and one per host byte range, never
one per block; the host side only sees large contiguous copies, which DMA engines are fast
at. Runs of one chunk skip the dense buffer. Staging is bounded; larger jobs go in batches.
The code is plain torch and runs on CPU tensors too, which is how it is tested without a GPU;
``TorchBlockTransfer`` copies CPU tensors with :mod:`kvhex.adapters.torch.direct` instead.
"""

from __future__ import annotations

import torch

from kvhex.domain.slot_layout import ChunkRun, SlotLayout
from kvhex.domain.transfer import TransferJob
from kvhex.errors import TransferError

_WIDE = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


def widest(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.dtype, int]:
    """``blocks`` viewed as the widest integer type its rows allow: gathers and scatters move
    elements, and wide elements are several times faster than bytes (measured on the CPU;
    fewer threads on CUDA)."""
    page = blocks.shape[1]
    for dtype, size in _WIDE:
        if page % size or blocks.stride(0) % size or blocks.data_ptr() % size:
            continue
        try:
            return blocks.view(dtype), dtype, size
        except RuntimeError:  # e.g. a storage offset torch will not reinterpret
            continue
    return blocks, torch.uint8, 1


class Span:
    """Neighbouring registered tensors of one group with one page size (typically every
    layer of a group): their regions are adjacent in a slot, so the copy between the dense
    buffer and the staging rows is one strided copy for all of them."""

    __slots__ = ("chunk_bytes", "count", "dtype", "itemsize", "offset", "page", "wides")

    def __init__(self, offset: int, page: int, per_chunk: int, dtype: torch.dtype) -> None:
        self.offset = offset
        self.page = page
        self.chunk_bytes = per_chunk * page
        self.dtype = dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.wides: list[torch.Tensor] = []
        self.count = 0

    def add(self, wide: torch.Tensor) -> None:
        self.wides.append(wide)
        self.count += 1


def spans_of(layout: SlotLayout, blocks: list[torch.Tensor]) -> list[list[Span]]:
    """Per group, its tensors cut into spans: neighbours in the group's order with one page
    size and dtype whose regions follow each other in a slot."""
    spans: list[list[Span]] = []
    for group, members in enumerate(layout.group_tensors):
        per_chunk = layout.blocks_per_chunk[group]
        cut: list[Span] = []
        for t in members:
            wide, dtype, _ = widest(blocks[t])
            page = layout.page_bytes[t]
            offset = layout.region_offsets[t]
            last = cut[-1] if cut else None
            if (
                last is None
                or page != last.page
                or dtype != last.dtype
                or offset != last.offset + last.count * last.chunk_bytes
            ):
                last = Span(offset, page, per_chunk, dtype)
                cut.append(last)
            last.add(wide)
        spans.append(cut)
    return spans


class Staging:
    """One direction's staging buffers (slot rows and dense blocks), grown on demand.

    Used by one thread (the submitting thread under the direction's CUDA stream; the CPU
    path copies directly, :mod:`kvhex.adapters.torch.direct`), so a buffer replaced on CUDA
    is reused only by work the allocator orders after it on that stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stage: torch.Tensor | None = None
        self.dense: torch.Tensor | None = None

    def buffers(self, nbytes: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Staging rows and dense buffer of at least ``nbytes`` each."""
        if self.stage is None or self.dense is None or self.stage.numel() < nbytes:
            size = max(nbytes, min(cap, 2 * (self.stage.numel() if self.stage is not None else 0)))
            self.stage = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.dense = torch.empty(size, dtype=torch.uint8, device=self.device)
            if self.device.type == "cpu":  # fault the pages in now, not during a timed copy
                self.stage.fill_(0)
                self.dense.fill_(0)
        return self.stage, self.dense

    def release(self) -> None:
        """Drop the buffers."""
        self.stage = self.dense = None


class StagedCopier:
    """The copy code for one registered layout: device byte views of every tensor, the host
    buffer's bytes as one flat tensor (slot ``s`` at ``s * row stride``), and how many slots
    one staging batch holds.

    ``host`` is a uint8 CPU tensor ``[num_slots, slot_bytes]`` whose rows are contiguous and
    ``stride(0) >= slot_bytes`` apart (padding between rows is never touched)."""

    def __init__(
        self,
        layout: SlotLayout,
        blocks: list[torch.Tensor],
        host: torch.Tensor,
        *,
        staging_bytes: int,
    ) -> None:
        self.layout = layout
        self._spans = spans_of(layout, blocks)
        num_slots = host.shape[0]
        self._row_stride = host.stride(0) if num_slots > 1 else layout.slot_bytes
        extent = (num_slots - 1) * self._row_stride + layout.slot_bytes
        self._host = host.as_strided((extent,), (1,), host.storage_offset())
        self._device = blocks[0].device
        self._cuda = self._device.type == "cuda"
        self.max_chunks = max(1, staging_bytes // layout.slot_bytes)
        self._cap = self.max_chunks * layout.slot_bytes

    def copy(
        self,
        staging: Staging,
        job: TransferJob,
        runs: tuple[ChunkRun, ...],
        *,
        store: bool,
        non_blocking: bool,
    ) -> int:
        """Copy a planned job (device -> host for a store, host -> device for a load) through
        ``staging``; returns the bytes moved between host and device. On CUDA, call it under
        the direction's stream: every op is queued there."""
        layout = self.layout
        chunks = sum(run.num_chunks for run in runs)
        batches = layout.batches(runs, self.max_chunks) if chunks > self.max_chunks else [runs]
        host = self._host
        slot_bytes = layout.slot_bytes
        nbytes = 0
        for batch in batches:
            if not batch:
                continue
            rows_bytes = sum(run.num_chunks for run in batch) * slot_bytes
            stage, dense = staging.buffers(rows_bytes, self._cap)
            first_block = batch[0].block_pos
            ids = job.block_ids[first_block : batch[-1].block_pos + batch[-1].num_blocks]
            index = self._index(ids)
            ranges = layout.byte_ranges(batch, job.slots, slot_stride=self._row_stride)
            if not store:
                for r in ranges:
                    stage[r.stage : r.stage + r.length].copy_(
                        host[r.host : r.host + r.length], non_blocking=non_blocking
                    )
            first_slot = batch[0].slot_pos
            for run in batch:
                at = run.block_pos - first_block
                run_index = index[at : at + run.num_blocks]
                rows = run.num_chunks * layout.blocks_per_chunk[run.group]
                base = (run.slot_pos - first_slot) * slot_bytes
                for span in self._spans[run.group]:
                    self._move(
                        span,
                        run,
                        store=store,
                        stage=stage,
                        dense=dense,
                        base=base,
                        rows=rows,
                        index=run_index,
                    )
            if store:
                for r in ranges:
                    host[r.host : r.host + r.length].copy_(
                        stage[r.stage : r.stage + r.length], non_blocking=non_blocking
                    )
            nbytes += sum(r.length for r in ranges)
        return nbytes

    def _move(
        self,
        span: Span,
        run: ChunkRun,
        *,
        store: bool,
        stage: torch.Tensor,
        dense: torch.Tensor,
        base: int,
        rows: int,
        index: torch.Tensor,
    ) -> None:
        """Gather a span's blocks of a run into their regions of the staging rows (store), or
        scatter them from there (load): one gather or scatter per tensor, one strided copy
        for the span (none when the run's regions are already contiguous)."""
        slot_bytes = self.layout.slot_bytes
        start = base + span.offset
        lo, hi = run.skip, run.skip + run.num_blocks
        span_bytes = span.count * span.chunk_bytes
        one_slot = run.num_chunks == 1
        whole_slots = span.count == 1 and slot_bytes == span_bytes
        if (one_slot or whole_slots) and start % span.itemsize == 0:
            # the regions are one contiguous stretch of the staging rows: no dense copy
            # (one slot: tensor after tensor; a lone tensor filling its slots: row after row)
            stretch = stage[start : start + span.count * rows * span.page]
            blocks = stretch.view(span.dtype).view(span.count, rows, -1)
            self._gather_scatter(span, blocks, store=store, lo=lo, hi=hi, index=index)
            return
        flat = dense[: span.count * rows * span.page]
        blocks = flat.view(span.dtype).view(span.count, rows, -1)
        # dense is (tensor, chunk, chunk bytes); the staging rows hold (chunk, tensor, bytes)
        dense_view = flat.view(span.count, run.num_chunks, span.chunk_bytes).permute(1, 0, 2)
        region = stage.as_strided(
            (run.num_chunks, span.count, span.chunk_bytes), (slot_bytes, span.chunk_bytes, 1), start
        )
        if store:
            self._gather_scatter(span, blocks, store=store, lo=lo, hi=hi, index=index)
            region.copy_(dense_view)
        else:
            dense_view.copy_(region)
            self._gather_scatter(span, blocks, store=store, lo=lo, hi=hi, index=index)

    @staticmethod
    def _gather_scatter(
        span: Span, blocks: torch.Tensor, *, store: bool, lo: int, hi: int, index: torch.Tensor
    ) -> None:
        for k, wide in enumerate(span.wides):
            if store:
                torch.index_select(wide, 0, index, out=blocks[k, lo:hi])
            else:
                wide.index_put_((index,), blocks[k, lo:hi])

    def _index(self, ids: tuple[int, ...]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.int64)
        if self._cuda:  # pinned, so the copy is asynchronous on the lane's stream
            return index.pin_memory().to(self._device, non_blocking=True)
        return index


def block_bytes(i: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a ``(num_blocks, page_bytes)`` uint8 view (rows may be strided), or a
    ``TransferError`` saying why it cannot be one."""
    if tensor.dim() == 0 or tensor.shape[0] == 0 or tensor.numel() == 0:
        raise TransferError(
            f"tensor {i} of shape {list(tensor.shape)} has no blocks", field="kv_caches"
        )
    num_blocks = tensor.shape[0]
    try:
        rows = tensor.view(num_blocks, -1)
        if rows.shape[1] > 1 and rows.stride(1) != 1:
            raise RuntimeError("strided within a block")
        blocks = rows.view(torch.uint8)
    except RuntimeError as exc:
        raise TransferError(
            f"tensor {i} (shape {list(tensor.shape)}, strides {list(tensor.stride())}, "
            f"{tensor.dtype}): a block's bytes are not contiguous ({exc}); register "
            "(num_blocks, page_bytes) views whose blocks are contiguous",
            field="kv_caches",
        ) from exc
    if num_blocks > 1 and blocks.stride(0) < blocks.shape[1]:
        raise TransferError(
            f"tensor {i}: blocks overlap (row stride {blocks.stride(0)} bytes < page "
            f"{blocks.shape[1]} bytes)",
            field="kv_caches",
        )
    return blocks
