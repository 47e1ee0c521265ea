"""The counting transfer moves real bytes both ways through kvhex's torch transfer, counts
each direction's jobs and bytes as their results are polled, and writes them when it closes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvhex.adapters.torch import TorchHostBuffer
from kvhex.domain import JobId, TransferJob, TransferKind
from kvhex.errors import TransferError
from kvhex.ports import BlockTransfer
from kvhex_counting_transfer import CountingBlockTransfer, Counts

PAGE, BLOCKS, PER_CHUNK, LAYERS = 256, 16, 2, 2


def build(
    host: TorchHostBuffer, report: Path | None = None
) -> tuple[CountingBlockTransfer, list[torch.Tensor]]:
    """The transfer over ``host`` and its device KV cache (a distinct byte pattern per layer)."""
    kv = [torch.zeros((BLOCKS, PAGE), dtype=torch.uint8) for _ in range(LAYERS)]
    for layer, cache in enumerate(kv):
        cache.copy_(torch.arange(BLOCKS * PAGE).reshape(BLOCKS, PAGE) * (layer + 3) % 251)
    transfer = CountingBlockTransfer(
        host,
        kv,
        tensor_groups=[0] * LAYERS,
        blocks_per_chunk=[PER_CHUNK],
        report_path=None if report is None else str(report),
        copy_threads=1,
    )
    return transfer, kv


def run(transfer: CountingBlockTransfer, job: TransferJob) -> None:
    (transfer.submit_store if job.kind is TransferKind.STORE else transfer.submit_load)(job)
    transfer.wait([job.job_id])
    (result,) = transfer.poll()
    assert result.job_id == job.job_id
    assert result.success, result


@pytest.fixture
def host() -> Iterator[TorchHostBuffer]:
    buffer = TorchHostBuffer(4, LAYERS * PAGE * PER_CHUNK, pin=False)
    yield buffer
    buffer.close()


def test_blocks_go_to_the_host_and_back_and_every_byte_is_counted(
    host: TorchHostBuffer, tmp_path: Path
) -> None:
    report = tmp_path / "counts.json"
    transfer, kv = build(host, report)
    assert isinstance(transfer, BlockTransfer)
    before = [cache[2:6].clone() for cache in kv]
    run(transfer, TransferJob(JobId(1), TransferKind.STORE, [0, 1], [2, 3, 4, 5]))
    for cache in kv:
        cache[8:12] = 0
    run(transfer, TransferJob(JobId(2), TransferKind.LOAD, [0, 1], [8, 9, 10, 11]))
    for cache, was in zip(kv, before, strict=True):
        assert torch.equal(cache[8:12], was)  # the host slots held exactly those blocks
    moved = 4 * PAGE * LAYERS
    assert transfer.counts == {
        TransferKind.STORE: Counts(jobs=1, nbytes=moved),
        TransferKind.LOAD: Counts(jobs=1, nbytes=moved),
    }
    transfer.close()
    transfer.close()
    assert json.loads(report.read_text()) == {
        "load": {"failed": 0, "jobs": 1, "nbytes": moved},
        "store": {"failed": 0, "jobs": 1, "nbytes": moved},
    }


def test_a_job_that_does_not_fit_is_refused_and_not_counted(host: TorchHostBuffer) -> None:
    transfer, _ = build(host)
    try:
        with pytest.raises(TransferError, match="slot"):
            transfer.submit_store(TransferJob(JobId(1), TransferKind.STORE, [9], [0, 1]))
        assert transfer.poll() == []
        assert transfer.counts[TransferKind.STORE] == Counts()
    finally:
        transfer.close()


def test_an_empty_report_path_is_refused_naming_it(host: TorchHostBuffer) -> None:
    with pytest.raises(ValueError, match="report_path"):
        build(host, Path(" "))
