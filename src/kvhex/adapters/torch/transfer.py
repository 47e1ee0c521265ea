"""``TorchBlockTransfer``: device KV blocks <-> host slots with torch, on CUDA or on the CPU.

The copies themselves are :mod:`kvhex.adapters.torch.staging`'s (a staging area laid out like
the job's slots; a few device ops per tensor and one host copy per contiguous byte range).
This module runs them in order per direction and reports results:

* CUDA: one stream per direction. A job waits for the work queued on the current (compute)
  stream at submission, runs between two timing events, and completes in submission order
  because its stream runs in order; ``poll`` reports event-measured seconds.
* CPU: one worker thread per direction (torch releases the GIL while copying), which gives
  the same ordering; the same copy code runs there, so the whole stack is tested without a
  GPU.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol, cast

import structlog
import torch

from kvhex.adapters.torch.staging import StagedCopier, Staging, block_bytes
from kvhex.domain.jobs import JobId
from kvhex.domain.transfer import (
    ChunkRun,
    SlotLayout,
    TransferJob,
    TransferKind,
    TransferResult,
    check_submission,
)
from kvhex.errors import TransferError
from kvhex.ports.host_buffer import HostBuffer

__all__ = ["DEFAULT_STAGING_BYTES", "TensorHostBuffer", "TorchBlockTransfer"]

log = structlog.get_logger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20
"""Staging bytes per direction (two such areas per direction: the slot rows and the dense
block buffer). Jobs larger than this are copied in batches of whole slots."""


class TensorHostBuffer(HostBuffer, Protocol):
    """A ``HostBuffer`` whose bytes are also one uint8 CPU tensor ``[num_slots, slot_bytes]``
    (``kvhex.adapters.torch.TorchHostBuffer``)."""

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer, zero-copy."""
        ...


class _Pending:
    """A submitted job until its result is polled."""

    __slots__ = ("end", "error", "future", "job_id", "nbytes", "start")

    def __init__(self, job_id: JobId) -> None:
        self.job_id = job_id
        self.nbytes = 0
        self.start: torch.cuda.Event | None = None
        self.end: torch.cuda.Event | None = None
        self.future: Future[tuple[int, float]] | None = None
        self.error: str | None = None


class _Lane:
    """One direction: its stream or worker thread, its staging buffers, its jobs in order."""

    def __init__(self, kind: TransferKind, device: torch.device) -> None:
        self.kind = kind
        self.device = device
        self.pending: deque[_Pending] = deque()
        self.stream: torch.cuda.Stream | None = None
        self.executor: ThreadPoolExecutor | None = None
        if device.type == "cuda":
            self.stream = _new_stream(device)
        else:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvhex-{kind.value}")
        self.staging = Staging(device)


class TorchBlockTransfer:
    """Copies KV blocks between device tensors and a host buffer's slots.

    Args:
        host: the host buffer whose slots jobs name; its ``tensor`` must be a uint8 CPU tensor
            ``[num_slots, slot_bytes]`` and ``slot_bytes`` must equal the layout's.
        kv_caches: the device KV cache, one tensor per layer (or per group), all on one
            device (CUDA or CPU). Each is ``(num_blocks, page_bytes)`` uint8/int8, or any
            dtype with ``num_blocks`` as its first dimension whose blocks are contiguous
            (viewed as bytes, never copied). Tensors of one group share ``num_blocks``.
        tensor_groups: the KV group of each tensor (its position in a job's group order).
        blocks_per_chunk: device blocks per host slot, per group.
        staging_bytes: device staging per direction (twice over: slot rows and dense blocks);
            larger jobs are copied in batches of whole slots.

    The slot layout is ``kvhex.domain.SlotLayout``: each tensor a region of
    ``blocks_per_chunk[group] * page_bytes`` bytes in registration order.

    Raises:
        TransferError: naming the argument: no tensors, tensors on different devices or an
            unsupported device, a tensor whose blocks are not contiguous bytes, tensors of one
            group with different ``num_blocks``, a host buffer whose ``slot_bytes`` does not
            match the layout (naming both numbers) or whose tensor has the wrong shape.
    """

    def __init__(
        self,
        host: TensorHostBuffer,
        kv_caches: Sequence[torch.Tensor],
        *,
        tensor_groups: Sequence[int],
        blocks_per_chunk: Sequence[int],
        staging_bytes: int = DEFAULT_STAGING_BYTES,
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
        host_tensor = host.tensor
        expected = (host.num_slots, host.slot_bytes)
        if (
            host_tensor.device.type != "cpu"
            or host_tensor.dtype != torch.uint8
            or tuple(host_tensor.shape) != expected
            or not host_tensor.is_contiguous()
        ):
            raise TransferError(
                f"host tensor must be a contiguous uint8 CPU tensor {list(expected)}, got "
                f"{host_tensor.dtype} {list(host_tensor.shape)} on {host_tensor.device}",
                field="host",
            )
        if staging_bytes <= 0:
            raise TransferError(f"must be > 0, got {staging_bytes}", field="staging_bytes")
        self._host = host
        self._num_slots = host.num_slots
        self._device = device
        self._cuda = device.type == "cuda"
        self.layout = layout
        self._num_blocks = tuple(num_blocks)
        self._copier = StagedCopier(layout, blocks, host_tensor, staging_bytes=staging_bytes)
        self._lanes = {kind: _Lane(kind, device) for kind in TransferKind}
        self._closed = False
        if self._cuda and not host_tensor.is_pinned():
            log.warning(
                "transfer_host_not_pinned",
                consequence="device copies block the submitting thread",
            )

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
        """Block until the named jobs finished; their results still come through ``poll``.
        Unknown or already reported ids are ignored."""
        wanted = set(job_ids)
        for lane in self._lanes.values():
            for pending in list(lane.pending):
                if pending.job_id in wanted:
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
            if lane.executor is not None:
                lane.executor.shutdown(wait=True)
            lane.staging.release()

    # -- submission --------------------------------------------------------------------------
    def _submit(self, kind: TransferKind, job: TransferJob) -> None:
        check_submission(job, kind, closed=self._closed)
        runs = self.layout.plan(job, num_slots=self._num_slots, num_blocks=self._num_blocks)
        lane = self._lanes[kind]
        pending = _Pending(job.job_id)
        if lane.executor is not None:
            pending.future = lane.executor.submit(self._run_timed, lane, job, runs)
        else:
            self._enqueue_cuda(lane, pending, job, runs)
        lane.pending.append(pending)

    def _enqueue_cuda(
        self, lane: _Lane, pending: _Pending, job: TransferJob, runs: tuple[ChunkRun, ...]
    ) -> None:
        stream = lane.stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            try:
                start = _new_event()
                start.record(stream)
                pending.start = start
                pending.nbytes = self._copier.copy(
                    lane.staging,
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

    def _run_timed(
        self, lane: _Lane, job: TransferJob, runs: tuple[ChunkRun, ...]
    ) -> tuple[int, float]:
        began = time.perf_counter()
        store = lane.kind is TransferKind.STORE
        nbytes = self._copier.copy(lane.staging, job, runs, store=store, non_blocking=False)
        return nbytes, time.perf_counter() - began

    # -- completion --------------------------------------------------------------------------
    def _finished(self, pending: _Pending) -> bool:
        if pending.future is not None:
            return pending.future.done()
        assert pending.end is not None
        try:
            return _event_done(pending.end)
        except RuntimeError as exc:  # an asynchronous CUDA error surfaced here
            pending.error = pending.error or f"{type(exc).__name__}: {exc}"
            return True

    def _block_on(self, pending: _Pending) -> None:
        if pending.future is not None:
            wait_futures([pending.future])
            return
        assert pending.end is not None
        try:
            pending.end.synchronize()
        except RuntimeError as exc:
            pending.error = pending.error or f"{type(exc).__name__}: {exc}"

    def _result(self, kind: TransferKind, pending: _Pending) -> TransferResult:
        job_id = pending.job_id
        nbytes = pending.nbytes
        seconds: float | None = None
        error = pending.error
        if pending.future is not None:
            exc = pending.future.exception()
            if exc is not None:
                error = f"{type(exc).__name__}: {exc}"
            else:
                nbytes, seconds = pending.future.result()
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


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    # torch.cuda's Stream and Event constructors and Event.query are untyped
    stream: torch.cuda.Stream = cast(Any, torch.cuda.Stream)(device)
    return stream


def _new_event() -> torch.cuda.Event:
    event: torch.cuda.Event = cast(Any, torch.cuda.Event)(enable_timing=True)
    return event


def _event_done(event: torch.cuda.Event) -> bool:
    return bool(cast(Any, event).query())
