"""``BlockTransfer``: copies between the engine's device KV cache and host slots.

Called from one thread (the engine's worker thread). Submissions never block on the copy;
results come back through ``poll`` exactly once per job, in submission order per direction
(a store that finished is not reported before an earlier store). Built with the
``HostBuffer`` whose slots the jobs name and the device KV caches it copies to and from.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, runtime_checkable

from kvhex.domain.jobs import JobId
from kvhex.domain.transfer import TransferJob, TransferResult


@runtime_checkable
class BlockTransfer(Protocol):
    """Device <-> host block copies."""

    def submit_store(self, job: TransferJob) -> None:
        """Copy ``job.block_ids`` from the device into ``job.slots``, asynchronously.

        On a GPU the copy waits for the work already queued on the compute stream (the model's
        writes to those blocks), but not for work queued later: the blocks must not be
        overwritten until the job's result was polled (vLLM fences block reuse by job id).
        Raises ``TransferError`` (naming the job and the field) for a job that does not fit the
        registered layout (a block id or slot out of range, a slot count that does not match
        the blocks); never for a copy failure, which is a failed ``TransferResult``.
        """
        ...

    def submit_load(self, job: TransferJob) -> None:
        """Copy ``job.slots`` into the device blocks ``job.block_ids``, asynchronously.

        The slots must stay unchanged until the job's result was polled. Errors as for
        ``submit_store``.
        """
        ...

    def poll(self) -> list[TransferResult]:
        """Results of jobs finished since the last call, each exactly once. Never blocks."""
        ...

    def wait(self, job_ids: Collection[JobId]) -> None:
        """Block until the named jobs finished (their results still come through ``poll``).
        Unknown or already reported ids are ignored."""
        ...

    def close(self) -> None:
        """Wait for running copies, then release streams and buffers. Idempotent."""
        ...
