"""``CountingBlockTransfer``: kvhex's torch transfer, counting the jobs and bytes it moves.

A worked example of a third-party ``kvhex.transfers`` plugin (kvhex's docs/plugins.md walks
through it). A transfer implements kvhex's ``BlockTransfer`` port: ``submit_store`` (device
-> host), ``submit_load`` (host -> device), ``poll``, ``wait`` and ``close``. This one leaves
the copies to ``kvhex.adapters.torch.TorchBlockTransfer`` and adds what a plugin would add
around them: it counts each direction's jobs, failures and bytes as their results are polled,
and writes the counts to a JSON file when it closes.

Its factory's signature is its configuration: ``kvhex run`` calls it with the host buffer,
the device KV tensors, ``tensor_groups`` and ``blocks_per_chunk``, and the keys of
``[run] transfer_options`` (``report_path``, ``copy_threads``) as keyword arguments.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from pathlib import Path

import attrs
import torch

from kvhex.adapters.torch import TensorHostBuffer, TorchBlockTransfer
from kvhex.domain import JobId, TransferJob, TransferKind, TransferResult

__all__ = ["CountingBlockTransfer", "Counts"]


@attrs.define
class Counts:
    """One direction's jobs reported so far: how many, how many failed, the bytes moved by
    the others."""

    jobs: int = 0
    failed: int = 0
    nbytes: int = 0

    def add(self, result: TransferResult) -> None:
        """Count one job's result."""
        self.jobs += 1
        if result.success:
            self.nbytes += result.nbytes
        else:
            self.failed += 1


class CountingBlockTransfer:
    """Copies with ``TorchBlockTransfer`` and counts each direction's results.

    Args:
        host: the host buffer whose slots jobs name (a ``TensorHostBuffer``).
        kv_caches: the device KV cache, one tensor per layer (or group).
        tensor_groups: per tensor, its KV group (or the groups sharing it).
        blocks_per_chunk: device blocks per host slot, per group.
        report_path: where :meth:`close` writes the counts as JSON (``None``: nowhere).
        copy_threads: the torch transfer's CPU copy threads (``None``: its default).

    Raises:
        TransferError: what ``TorchBlockTransfer`` raises for arguments that do not fit.
        ValueError: an empty ``report_path`` (kvhex names the option).
    """

    def __init__(
        self,
        host: TensorHostBuffer,
        kv_caches: Sequence[torch.Tensor],
        *,
        tensor_groups: Sequence[int | Sequence[int]],
        blocks_per_chunk: Sequence[int],
        report_path: str | None = None,
        copy_threads: int | None = None,
    ) -> None:
        if report_path is not None and not report_path.strip():
            raise ValueError("report_path must not be empty")
        self._inner = TorchBlockTransfer(
            host,
            kv_caches,
            tensor_groups=tensor_groups,
            blocks_per_chunk=blocks_per_chunk,
            copy_threads=copy_threads,
        )
        self._report = Path(report_path) if report_path is not None else None
        self._kinds: dict[JobId, TransferKind] = {}
        self.counts = {kind: Counts() for kind in TransferKind}
        self._closed = False

    def submit_store(self, job: TransferJob) -> None:
        """Copy device blocks into host slots (``TorchBlockTransfer.submit_store``)."""
        self._inner.submit_store(job)
        self._kinds[job.job_id] = TransferKind.STORE

    def submit_load(self, job: TransferJob) -> None:
        """Copy host slots into device blocks (``TorchBlockTransfer.submit_load``)."""
        self._inner.submit_load(job)
        self._kinds[job.job_id] = TransferKind.LOAD

    def poll(self) -> list[TransferResult]:
        """The finished jobs' results, each counted once as it is handed over."""
        results = self._inner.poll()
        for result in results:
            self.counts[self._kinds.pop(result.job_id)].add(result)
        return results

    def wait(self, job_ids: Collection[JobId]) -> None:
        """Block until the named jobs finished (their results still come through ``poll``)."""
        self._inner.wait(job_ids)

    def close(self) -> None:
        """Close the torch transfer, then write the counts to ``report_path`` (once; jobs
        whose results were never polled are not counted). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._inner.close()
        if self._report is not None:
            counts = {kind.value: attrs.asdict(c) for kind, c in self.counts.items()}
            tmp = self._report.with_name(f".{self._report.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(counts, indent=2, sort_keys=True) + "\n")
            tmp.replace(self._report)  # a reader never sees half a report
