"""``TorchBlockTransfer``: device KV blocks <-> host slots with torch, on CUDA or on the CPU.

The copies themselves are :mod:`kvhex.adapters.torch.staging`'s on CUDA (a staging area laid
out like the job's slots; a few device ops per tensor and one host copy per contiguous byte
range) and :mod:`kvhex.adapters.torch.direct`'s on the CPU (one strided copy per span of
tensors and piece of consecutive blocks, straight between tensor and slot). This module runs
them in order per direction and reports results:

* CUDA: one stream per direction. A job waits for the work queued on the current (compute)
  stream at submission, runs between two timing events, and completes in submission order
  because its stream runs in order; ``poll`` reports event-measured seconds.
* CPU: a job is planned into tasks at submission and run by copy threads shared by both
  directions (:mod:`kvhex.adapters.torch.workers`; the copies, numpy's and memmove's,
  release the GIL):
  any free thread takes the next task, loads first; a job that writes what an unfinished
  job of its direction writes waits for it. Results still come in submission order per
  direction; ``seconds`` is the wall time from the job's first task to its last.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Collection, Sequence
from typing import Any, Protocol, cast

import structlog
import torch

from kvhex.adapters.torch.direct import DirectCopier
from kvhex.adapters.torch.staging import StagedCopier, Staging, block_bytes
from kvhex.adapters.torch.workers import CopyWorkers, Job
from kvhex.domain.jobs import JobId
from kvhex.domain.slot_layout import ChunkRun, SlotLayout
from kvhex.domain.transfer import TransferJob, TransferKind, TransferResult, check_submission
from kvhex.errors import TransferError
from kvhex.ports.host_buffer import HostBuffer

log = structlog.get_logger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20
"""Staging bytes per direction (two such areas per direction: the slot rows and the dense
block buffer). Jobs larger than this are copied in batches of whole slots."""


MAX_COPY_THREADS = 8
"""The CPU path's default copy threads: the cores this process may run on, at most this many
(not ``torch.get_num_threads()``: vLLM's CPU backend sets that to its model threads)."""


def default_copy_threads() -> int:
    """The cores this process may run on, at most ``MAX_COPY_THREADS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without sched_getaffinity
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_COPY_THREADS))


class TensorHostBuffer(HostBuffer, Protocol):
    """A ``HostBuffer`` whose bytes are also one CPU tensor ``[num_slots, slot_bytes]``
    (``kvhex.adapters.torch.TorchHostBuffer``, or a view of vLLM's shared offload region).

    The tensor is uint8 or int8, each row contiguous (``stride(1) == 1``), rows
    ``stride(0) >= slot_bytes`` bytes apart: padding after a row (or another rank's bytes in
    it) is never read or written."""

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer, zero-copy."""
        ...


class _Pending:
    """A submitted job until its result is polled."""

    __slots__ = ("end", "error", "job_id", "nbytes", "start", "work")

    def __init__(self, job_id: JobId) -> None:
        self.job_id = job_id
        self.nbytes = 0
        self.start: torch.cuda.Event | None = None
        self.end: torch.cuda.Event | None = None
        self.work: Job | None = None  # the CPU path's
        self.error: str | None = None


class _Lane:
    """One direction: its jobs in order, and on CUDA its stream and staging buffers."""

    def __init__(self, kind: TransferKind, device: torch.device) -> None:
        self.kind = kind
        self.pending: deque[_Pending] = deque()
        self.stream: torch.cuda.Stream | None = None
        self.staging: Staging | None = None
        if device.type == "cuda":
            self.stream = _new_stream(device)
            self.staging = Staging(device)


class TorchBlockTransfer:
    """Copies KV blocks between device tensors and a host buffer's slots.

    Args:
        host: the host buffer whose slots jobs name; its ``tensor`` is a uint8 or int8 CPU
            tensor ``[num_slots, slot_bytes]`` with contiguous rows at least ``slot_bytes``
            apart (see ``TensorHostBuffer``), and ``slot_bytes`` must equal the layout's.
        kv_caches: the device KV cache, one tensor per layer (or per group), all on one
            device (CUDA or CPU). Each is ``(num_blocks, page_bytes)`` uint8/int8, or any
            dtype with ``num_blocks`` as its first dimension whose blocks are contiguous
            (viewed as bytes, never copied). Tensors of one group share ``num_blocks``.
        tensor_groups: per tensor, its KV group (its position in a job's group order), or
            the groups sharing it (a sequence; they need equal ``blocks_per_chunk``).
        blocks_per_chunk: device blocks per host slot, per group.
        staging_bytes: CUDA only: device staging per direction (twice over: slot rows and
            dense blocks); larger jobs are copied in batches of whole slots.
        copy_threads: CPU only: copy threads (shared by both directions); ``None``:
            ``default_copy_threads()`` (the cores this process may run on, at most
            ``MAX_COPY_THREADS``).

    The slot layout is ``kvhex.domain.SlotLayout``: each tensor a region of
    ``blocks_per_chunk[group] * page_bytes`` bytes in registration order.

    Raises:
        TransferError: naming the argument: no tensors, tensors on different devices or an
            unsupported device, a tensor whose blocks are not contiguous bytes, tensors of one
            group with different ``num_blocks``, a host buffer whose ``slot_bytes`` does not
            match the layout (naming both numbers) or whose tensor has the wrong shape, dtype
            or strides, non-positive ``staging_bytes`` or ``copy_threads``.
    """

    def __init__(
        self,
        host: TensorHostBuffer,
        kv_caches: Sequence[torch.Tensor],
        *,
        tensor_groups: Sequence[int | Sequence[int]],
        blocks_per_chunk: Sequence[int],
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        copy_threads: int | None = None,
    ) -> None:
        caches = list(kv_caches)
        if not caches:
            raise TransferError("no KV cache tensor given", field="kv_caches")
        device = caches[0].device
        if device.type not in {"cuda", "cpu"}:
            raise TransferError(
                f"device {device} is not supported (cuda or cpu)", field="kv_caches"
            )
        for i, tensor in enumerate(caches):
            if tensor.device != device:
                raise TransferError(
                    f"tensor {i} is on {tensor.device}, tensor 0 on {device}", field="kv_caches"
                )
        blocks = [block_bytes(i, tensor) for i, tensor in enumerate(caches)]
        layout = SlotLayout([b.shape[1] for b in blocks], tensor_groups, blocks_per_chunk)
        num_blocks = []
        for group, members in enumerate(layout.group_tensors):
            counts = {t: blocks[t].shape[0] for t in members}
            if len(set(counts.values())) > 1:
                raise TransferError(
                    f"tensors of group {group} differ in num_blocks: "
                    + ", ".join(f"tensor {t}: {n}" for t, n in counts.items()),
                    field="kv_caches",
                )
            num_blocks.append(blocks[members[0]].shape[0])
        if host.slot_bytes != layout.slot_bytes:
            raise TransferError(
                f"host buffer has slot_bytes {host.slot_bytes}, the KV layout needs "
                f"{layout.slot_bytes} (sum over tensors of blocks_per_chunk * page_bytes)",
                field="host",
            )
        host_tensor = _host_bytes(host)
        if staging_bytes <= 0:
            raise TransferError(f"must be > 0, got {staging_bytes}", field="staging_bytes")
        if copy_threads is not None and copy_threads <= 0:
            raise TransferError(f"must be > 0, got {copy_threads}", field="copy_threads")
        self._host = host
        self._num_slots = host.num_slots
        self._device = device
        self._cuda = device.type == "cuda"
        self.layout = layout
        self._num_blocks = tuple(num_blocks)
        self._staged: StagedCopier | None = None
        self._direct: DirectCopier | None = None
        self._workers: CopyWorkers | None = None
        if self._cuda:
            self._staged = StagedCopier(layout, blocks, host_tensor, staging_bytes=staging_bytes)
        else:
            self._direct = DirectCopier(layout, blocks, host_tensor)
            threads = copy_threads or default_copy_threads()
            self._workers = CopyWorkers(self._direct.run, threads=threads, name="kvhex-copy")
        self._lanes = {kind: _Lane(kind, device) for kind in TransferKind}
        self._closed = False
        if self._cuda and not host_tensor.is_pinned():
            log.warning(
                "transfer_host_not_pinned",
                consequence="device copies block the submitting thread",
            )

    @property
    def spans(self) -> list[list[int]] | None:
        """CPU only: per group, how many tensors each span copies at once (one strided copy
        covers a span); ``None`` on CUDA."""
        return self._direct.span_sizes if self._direct is not None else None

    # -- BlockTransfer ---------------------------------------------------------------------
    def submit_store(self, job: TransferJob) -> None:
        """Copy ``job.block_ids`` from the device into ``job.slots`` (after the work queued on
        the current CUDA stream; the blocks must not be overwritten until the result is
        polled). Raises ``TransferError`` for a job that does not fit the layout, a load job,
        or after ``close``; a copy failure is a failed result."""
        self._submit(TransferKind.STORE, job)

    def submit_load(self, job: TransferJob) -> None:
        """Copy ``job.slots`` into the device blocks ``job.block_ids`` (after the work queued
        on the current CUDA stream). The slots must not change until the result is polled.
        Errors as for :meth:`submit_store`."""
        self._submit(TransferKind.LOAD, job)

    def poll(self) -> list[TransferResult]:
        """Finished jobs since the last call, each once, in submission order per direction
        (stores first, then loads). Never blocks."""
        results: list[TransferResult] = []
        for lane in self._lanes.values():
            queue = lane.pending
            while queue and self._finished(queue[0]):
                results.append(self._result(lane.kind, queue.popleft()))
        return results

    def wait(self, job_ids: Collection[JobId]) -> None:
        """Block until the named jobs finished, and the jobs of their direction submitted
        before them (so the next ``poll`` reports them all: on the CPU later jobs may finish
        first). Their results still come through ``poll``. Unknown or already reported ids
        are ignored."""
        wanted = set(job_ids)
        for lane in self._lanes.values():
            queued = list(lane.pending)
            last = max((i for i, p in enumerate(queued) if p.job_id in wanted), default=-1)
            for pending in queued[: last + 1]:
                self._block_on(pending)

    def close(self) -> None:
        """Wait for every submitted copy, then release streams, threads and staging memory.
        Results not yet polled stay available to ``poll``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes.values():
            for pending in list(lane.pending):
                self._block_on(pending)
            if lane.staging is not None:
                lane.staging.release()
        if self._workers is not None:
            self._workers.close()

    # -- submission --------------------------------------------------------------------------
    def _submit(self, kind: TransferKind, job: TransferJob) -> None:
        check_submission(job, kind, closed=self._closed)
        runs = self.layout.plan(job, num_slots=self._num_slots, num_blocks=self._num_blocks)
        lane = self._lanes[kind]
        pending = _Pending(job.job_id)
        if self._workers is not None:
            self._enqueue_cpu(kind, pending, job, runs)
        else:
            self._enqueue_cuda(lane, pending, job, runs)
        lane.pending.append(pending)

    def _enqueue_cpu(
        self, kind: TransferKind, pending: _Pending, job: TransferJob, runs: tuple[ChunkRun, ...]
    ) -> None:
        assert self._direct is not None
        assert self._workers is not None
        try:
            tasks, nbytes = self._direct.plan(job, runs)
        except RuntimeError as exc:  # e.g. no memory for an index tensor
            pending.error = f"{type(exc).__name__}: {exc}"
            return
        # what the job writes, so that a later job writing it waits for this one
        dests = job.slots if kind is TransferKind.STORE else job.block_ids
        pending.work = self._workers.submit(kind, tasks, nbytes, dests)

    def _enqueue_cuda(
        self, lane: _Lane, pending: _Pending, job: TransferJob, runs: tuple[ChunkRun, ...]
    ) -> None:
        stream, staging, copier = lane.stream, lane.staging, self._staged
        assert stream is not None
        assert staging is not None
        assert copier is not None
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            try:
                start = _new_event()
                start.record(stream)
                pending.start = start
                pending.nbytes = copier.copy(
                    staging,
                    job,
                    runs,
                    store=lane.kind is TransferKind.STORE,
                    non_blocking=True,
                )
            except RuntimeError as exc:  # e.g. out of device memory for staging
                pending.error = f"{type(exc).__name__}: {exc}"
            finally:
                # also after a failure: the result waits for whatever was already queued
                end = _new_event()
                end.record(stream)
                pending.end = end

    # -- completion --------------------------------------------------------------------------
    def _finished(self, pending: _Pending) -> bool:
        if pending.work is not None:
            return pending.work.finished
        if pending.end is None:  # failed before it was queued
            return True
        try:
            return _event_done(pending.end)
        except RuntimeError as exc:  # an asynchronous CUDA error surfaced here
            pending.error = pending.error or f"{type(exc).__name__}: {exc}"
            return True

    def _block_on(self, pending: _Pending) -> None:
        if pending.work is not None:
            pending.work.done.wait()
            return
        if pending.end is None:
            return
        try:
            pending.end.synchronize()
        except RuntimeError as exc:
            pending.error = pending.error or f"{type(exc).__name__}: {exc}"

    def _result(self, kind: TransferKind, pending: _Pending) -> TransferResult:
        job_id = pending.job_id
        nbytes = pending.nbytes
        seconds: float | None = None
        error = pending.error
        if pending.work is not None:
            error = pending.work.error
            nbytes, seconds = pending.work.nbytes, pending.work.seconds
        elif error is None and pending.start is not None and pending.end is not None:
            seconds = pending.start.elapsed_time(pending.end) / 1000.0
        if error is not None:
            log.warning("transfer_failed", job_id=job_id, kind=kind.value, error=error)
            return TransferResult(job_id, False, error=error)
        return TransferResult(job_id, True, nbytes=nbytes, seconds=seconds)

    def __repr__(self) -> str:
        return (
            f"TorchBlockTransfer(device={self._device}, tensors={len(self.layout.page_bytes)}, "
            f"groups={self.layout.num_groups}, slot_bytes={self.layout.slot_bytes})"
        )


def _host_bytes(host: TensorHostBuffer) -> torch.Tensor:
    """The host buffer's tensor as uint8 ``[num_slots, slot_bytes]`` (int8 viewed, never
    copied), or a ``TransferError`` naming what does not fit."""
    tensor = host.tensor
    expected = [host.num_slots, host.slot_bytes]
    if (
        tensor.device.type != "cpu"
        or tensor.dtype not in {torch.uint8, torch.int8}
        or list(tensor.shape) != expected
    ):
        raise TransferError(
            f"host tensor must be a uint8 or int8 CPU tensor {expected}, got "
            f"{tensor.dtype} {list(tensor.shape)} on {tensor.device}",
            field="host",
        )
    rows, within = tensor.stride()
    if host.slot_bytes > 1 and within != 1:
        raise TransferError(
            f"host tensor rows must be contiguous (stride(1) == 1), got strides {[rows, within]}",
            field="host",
        )
    if host.num_slots > 1 and rows < host.slot_bytes:
        raise TransferError(
            f"host tensor rows are {rows} bytes apart (stride(0)), less than slot_bytes "
            f"{host.slot_bytes}: slots would overlap",
            field="host",
        )
    return tensor.view(torch.uint8)


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    # torch.cuda's Stream and Event constructors and Event.query are untyped
    stream: torch.cuda.Stream = cast(Any, torch.cuda.Stream)(device)
    return stream


def _new_event() -> torch.cuda.Event:
    event: torch.cuda.Event = cast(Any, torch.cuda.Event)(enable_timing=True)
    return event


def _event_done(event: torch.cuda.Event) -> bool:
    return bool(cast(Any, event).query())
