"""TorchBlockTransfer on a CUDA device: pinned and shared host buffers, equal bytes both ways,
ordering against the compute stream, completion order, event timing.

Skipped where there is no CUDA device (run ``pytest -m cuda`` on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvhex.adapters.torch import TorchBlockTransfer, TorchHostBuffer
from kvhex.domain import JobId, TransferJob, TransferKind, TransferResult

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine"
    ),
]

STORE, LOAD = TransferKind.STORE, TransferKind.LOAD
PAGES = [4096, 4096, 2048]
GROUPS = [0, 0, 1]
PER_CHUNK = [4, 2]
SLOT_BYTES = 4 * 4096 * 2 + 2 * 2048
NUM_BLOCKS = 64


def _caches() -> list[torch.Tensor]:
    return [
        torch.randint(0, 256, (NUM_BLOCKS, page), dtype=torch.uint8, device="cuda")
        for page in PAGES
    ]


def _transfer(host: TorchHostBuffer, caches: list[torch.Tensor]) -> TorchBlockTransfer:
    return TorchBlockTransfer(host, caches, tensor_groups=GROUPS, blocks_per_chunk=PER_CHUNK)


def _job(job_id: int, kind: TransferKind, slots: list[int], first_block: int) -> TransferJob:
    # group 0: skip 1, 6 blocks -> 2 slots; group 1: 3 blocks -> 2 slots
    blocks = list(range(first_block, first_block + 9))
    return TransferJob(JobId(job_id), kind, slots, blocks, group_sizes=[6, 3], block_indices=[5, 0])


def _done(transfer: TorchBlockTransfer, ids: list[int]) -> list[TransferResult]:
    transfer.wait([JobId(i) for i in ids])
    results = transfer.poll()
    assert [r.job_id for r in results] == ids
    assert all(r.success for r in results), [r.error for r in results]
    return results


def _expect_host(host: TorchHostBuffer, caches: list[torch.Tensor], job: TransferJob) -> None:
    cpu = [c.cpu() for c in caches]
    slots = job.slots
    # group 0, tensors 0 and 1 (regions at 0 and 16384), positions 1..3 of slot 0, 0..2 of 1
    for k, block in enumerate(job.block_ids[:6]):
        chunk, j = divmod(1 + k, 4)
        for t, offset in ((0, 0), (1, 16384)):
            row = host.tensor[slots[chunk], offset + j * 4096 : offset + (j + 1) * 4096]
            assert torch.equal(row, cpu[t][block])
    for k, block in enumerate(job.block_ids[6:]):
        chunk, j = divmod(k, 2)
        row = host.tensor[slots[2 + chunk], 32768 + j * 2048 : 32768 + (j + 1) * 2048]
        assert torch.equal(row, cpu[2][block])


def test_pinned_round_trip_keeps_every_byte_and_is_event_timed() -> None:
    with TorchHostBuffer(16, SLOT_BYTES) as host:
        assert host.pinned
        assert host.tensor.is_pinned()
        caches = _caches()
        transfer = _transfer(host, caches)
        store = _job(1, STORE, [3, 9, 4, 0], first_block=10)
        transfer.submit_store(store)
        [result] = _done(transfer, [1])
        assert result.nbytes == 6 * 2 * 4096 + 3 * 2048
        assert result.seconds is not None
        assert result.seconds > 0
        _expect_host(host, caches, store)
        target = [torch.zeros_like(c) for c in caches]
        back = _transfer(host, target)
        back.submit_load(_job(2, LOAD, [3, 9, 4, 0], first_block=10))
        _done(back, [2])
        for got, want in zip(target, caches, strict=True):
            assert torch.equal(got[10:19], want[10:19])
            assert int(got[:10].sum()) == 0
            assert int(got[19:].sum()) == 0
        transfer.close()
        back.close()


def test_a_store_waits_for_the_compute_stream_and_a_load_is_ordered_after_it() -> None:
    with TorchHostBuffer(16, SLOT_BYTES) as host:
        caches = _caches()
        transfer = _transfer(host, caches)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # keep the compute stream busy for a while
        for c in caches:
            c.fill_(7)  # the model's writes, queued behind the sleep
        transfer.submit_store(_job(1, STORE, [0, 1, 2, 3], first_block=0))
        _done(transfer, [1])
        assert int((host.tensor[0, 4096:16384] != 7).sum()) == 0
        host.tensor[4:8].fill_(9)
        torch.cuda._sleep(200_000_000)
        for c in caches:
            c.fill_(1)  # queued before the load: the load's 9s must win
        transfer.submit_load(_job(2, LOAD, [4, 5, 6, 7], first_block=20))
        _done(transfer, [2])
        torch.cuda.synchronize()
        # group 0 (tensors 0, 1) loaded blocks 20..25, group 1 (tensor 2) blocks 26..28
        for t, (lo, hi) in enumerate([(20, 26), (20, 26), (26, 29)]):
            assert int((caches[t][lo:hi] != 9).sum()) == 0
            assert int((caches[t][:lo] != 1).sum()) == 0
            assert int((caches[t][hi:] != 1).sum()) == 0
        transfer.close()


def test_many_jobs_complete_in_submission_order_per_direction() -> None:
    with TorchHostBuffer(128, SLOT_BYTES) as host:
        caches = _caches()
        transfer = _transfer(host, caches)
        stores = []
        for i in range(24):
            transfer.submit_store(_job(i, STORE, [4 * i + k for k in range(4)], first_block=i))
            stores.append(i)
        loads = []
        for i in range(100, 108):
            transfer.submit_load(_job(i, LOAD, [4 * (i - 100) + k for k in range(4)], 40))
            loads.append(i)
        seen: list[TransferResult] = []
        transfer.wait([JobId(stores[-1]), JobId(loads[-1])])
        seen.extend(transfer.poll())
        assert [r.job_id for r in seen if r.job_id < 100] == stores
        assert [r.job_id for r in seen if r.job_id >= 100] == loads
        assert all(r.success for r in seen)
        transfer.close()


def test_a_shared_buffer_is_pinned_and_round_trips(tmp_path: Path) -> None:
    path = str(tmp_path / "shared")
    with TorchHostBuffer(8, SLOT_BYTES, shm_name=path) as host:
        assert host.pinned
        guest = TorchHostBuffer(8, SLOT_BYTES, shm_name=path, create=False)
        caches = _caches()
        transfer = _transfer(guest, caches)
        store = _job(1, STORE, [7, 1, 2, 5], first_block=30)
        transfer.submit_store(store)
        _done(transfer, [1])
        _expect_host(host, caches, store)  # read through the creator's mapping
        transfer.close()
        guest.close()


def test_large_jobs_are_staged_in_batches() -> None:
    with TorchHostBuffer(64, SLOT_BYTES) as host:
        caches = _caches()
        transfer = TorchBlockTransfer(
            host,
            caches,
            tensor_groups=GROUPS,
            blocks_per_chunk=PER_CHUNK,
            staging_bytes=SLOT_BYTES,  # one slot per batch
        )
        store = _job(1, STORE, [60, 2, 33, 8], first_block=50)
        transfer.submit_store(store)
        _done(transfer, [1])
        _expect_host(host, caches, store)
        transfer.close()
