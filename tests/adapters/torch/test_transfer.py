"""TorchBlockTransfer on CPU tensors: round trips with equal bytes for many layouts, KV
allocations, host strides and jobs, ordering with many jobs in flight, failed copies, and
errors that name the job and field. (The CPU path copies with DirectCopier; the CUDA path's
StagedCopier also runs on CPU tensors in test_torch_copiers.py, on a GPU in
test_torch_cuda.py.)"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhex.adapters.torch import TorchBlockTransfer, TorchHostBuffer
from kvhex.domain import JobId, TransferJob, TransferKind, TransferResult
from kvhex.errors import TransferError
from kvhex.ports import BlockTransfer, HostBuffer
from tests.adapters.torch.torch_kv import ALLOCATIONS, HOSTS, StridedHost, check_round_trip
from tests.domain.transfers import Layout, jobs, layouts, placements

STORE, LOAD = TransferKind.STORE, TransferKind.LOAD


def _random_caches(spec: Layout, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (spec.tensor_blocks(t), page), dtype=torch.uint8, generator=gen)
        for t, page in enumerate(spec.page_bytes)
    ]


def _drain(transfer: TorchBlockTransfer, ids: list[int]) -> list[TransferResult]:
    transfer.wait([JobId(i) for i in ids])
    results = transfer.poll()
    assert sorted(r.job_id for r in results) == sorted(ids)
    return results


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    spec=layouts(),
    allocation=st.sampled_from(ALLOCATIONS),
    host=st.sampled_from(HOSTS),
    threads=st.sampled_from([1, 2, 3]),
)
def test_round_trip_device_host_device_keeps_every_byte(
    data: st.DataObject, spec: Layout, allocation: str, host: str, threads: int
) -> None:
    store = data.draw(jobs(spec, 40, STORE, job_id=1, loadable=True))
    count = len(spec.page_bytes)
    gaps = data.draw(st.lists(st.integers(0, 24), min_size=count, max_size=count))

    def copy(buffer: StridedHost, caches: list[torch.Tensor], job: TransferJob) -> int:
        transfer = TorchBlockTransfer(
            buffer,
            caches,
            tensor_groups=spec.tensor_groups,
            blocks_per_chunk=spec.blocks_per_chunk,
            copy_threads=threads,
        )
        (transfer.submit_store if job.kind is STORE else transfer.submit_load)(job)
        [result] = _drain(transfer, [job.job_id])
        assert result.success, result.error
        assert result.seconds is not None
        assert result.seconds >= 0
        transfer.close()
        return result.nbytes

    check_round_trip(spec, store, copy, allocation=allocation, gaps=gaps, host=host)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), spec=layouts(shared=True), allocation=st.sampled_from(ALLOCATIONS))
def test_tensors_shared_by_groups_round_trip(
    data: st.DataObject, spec: Layout, allocation: str
) -> None:
    store = data.draw(jobs(spec, 40, STORE, job_id=1, loadable=True))

    def copy(buffer: StridedHost, caches: list[torch.Tensor], job: TransferJob) -> int:
        transfer = TorchBlockTransfer(
            buffer, caches, tensor_groups=spec.tensor_groups, blocks_per_chunk=spec.blocks_per_chunk
        )
        (transfer.submit_store if job.kind is STORE else transfer.submit_load)(job)
        [result] = _drain(transfer, [job.job_id])
        assert result.success, result.error
        transfer.close()
        return result.nbytes

    gaps = [8] * len(spec.page_bytes)
    check_round_trip(spec, store, copy, allocation=allocation, gaps=gaps, host="rank")


def _single(
    host: TorchHostBuffer, caches: list[torch.Tensor], per_chunk: int = 2
) -> TorchBlockTransfer:
    return TorchBlockTransfer(
        host, caches, tensor_groups=[0] * len(caches), blocks_per_chunk=[per_chunk]
    )


@pytest.fixture
def host() -> Iterator[TorchHostBuffer]:
    with TorchHostBuffer(64, 2 * 2 * 48) as buffer:
        yield buffer


def _caches(num_blocks: int = 130) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (num_blocks, 48), dtype=torch.uint8) for _ in range(2)]


def test_is_a_block_transfer(host: TorchHostBuffer) -> None:
    transfer = _single(host, _caches())
    assert isinstance(transfer, BlockTransfer)
    assert isinstance(host, HostBuffer)
    assert "TorchBlockTransfer(device=cpu, tensors=2" in repr(transfer)
    transfer.close()


def test_many_jobs_in_flight_complete_once_in_submission_order_per_direction(
    host: TorchHostBuffer,
) -> None:
    caches = _caches()
    transfer = _single(host, caches)
    order: dict[TransferKind, list[int]] = {STORE: [], LOAD: []}
    for i in range(32):
        blocks = [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]
        transfer.submit_store(TransferJob(JobId(i), STORE, [2 * i, 2 * i + 1], blocks))
        order[STORE].append(i)
        if i % 4 == 3:  # loads of earlier, already-stored slots into other blocks
            j = 1000 + i
            transfer.wait([JobId(i - 3)])
            transfer.submit_load(TransferJob(JobId(j), LOAD, [2 * (i - 3)], [128, 129]))
            order[LOAD].append(j)
    transfer.wait([JobId(31)])  # waiting on the last does not reorder the others
    seen: list[TransferResult] = []
    for _ in range(1000):
        seen.extend(transfer.poll())
        if len(seen) == 40:
            break
        transfer.wait([JobId(order[LOAD][-1])])
    assert all(r.success for r in seen)
    for kind in (STORE, LOAD):
        assert [r.job_id for r in seen if r.job_id in order[kind]] == order[kind]
    assert transfer.poll() == []
    for i in range(32):  # every store landed
        assert torch.equal(host.tensor[2 * i, :96].view(2, 48), caches[0][4 * i : 4 * i + 2])
    assert torch.equal(caches[1][128:130], caches[1][28 * 4 : 28 * 4 + 2])  # the last load
    transfer.close()


def test_wait_ignores_unknown_and_reported_ids_and_close_keeps_results(
    host: TorchHostBuffer,
) -> None:
    transfer = _single(host, _caches())
    transfer.submit_store(TransferJob(JobId(1), STORE, [0], [0, 1]))
    transfer.wait([JobId(99)])
    transfer.submit_store(TransferJob(JobId(2), STORE, [1], [2, 3]))
    transfer.close()
    transfer.close()  # idempotent
    assert [r.job_id for r in transfer.poll()] == [1, 2]
    transfer.wait([JobId(1)])
    with pytest.raises(TransferError, match="transfer job 3: the transfer is closed"):
        transfer.submit_store(TransferJob(JobId(3), STORE, [2], [4, 5]))


def test_a_failing_task_fails_its_job_and_jobs_after_it_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the CPU path copies each piece (numpy's copyto, or memmove for a contiguous stretch)
    # on two copy threads
    page, num_blocks = 128 << 10, 16
    caches = [torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8) for _ in range(2)]
    calls = {"n": 0}
    lock = threading.Lock()
    real_copyto, real_move = np.copyto, ctypes.memmove

    def first_fails() -> bool:
        with lock:
            calls["n"] += 1
            return calls["n"] == 1

    def copyto(dst: Any, src: Any) -> None:
        if first_fails():
            raise RuntimeError("injected fault")
        real_copyto(dst, src)

    def move(dst: int, src: int, count: int) -> int:
        if first_fails():
            raise RuntimeError("injected fault")
        return int(real_move(dst, src, count))

    with TorchHostBuffer(2 * num_blocks, 2 * page) as host:
        transfer = TorchBlockTransfer(
            host, caches, tensor_groups=[0, 0], blocks_per_chunk=[1], copy_threads=2
        )
        blocks = list(range(num_blocks))[::-1]
        monkeypatch.setattr(np, "copyto", copyto)  # the copies of either kind
        monkeypatch.setattr(ctypes, "memmove", move)
        transfer.submit_store(TransferJob(JobId(1), STORE, list(range(16)), blocks))
        transfer.submit_store(TransferJob(JobId(2), STORE, list(range(16, 32)), blocks))
        # the same slots as job 1: runs after it, so its bytes are the ones left
        transfer.submit_store(TransferJob(JobId(3), STORE, list(range(16)), blocks[::-1]))
        failed, ok, again = _drain(transfer, [1, 2, 3])
        monkeypatch.undo()
        assert (failed.success, failed.nbytes) == (False, 0)
        assert failed.error == "RuntimeError: injected fault"
        assert (ok.success, ok.nbytes) == (True, 16 * 2 * page)
        assert again.success
        for slot, block in enumerate(blocks):
            assert torch.equal(host.tensor[16 + slot, :page], caches[0][block])
            assert torch.equal(host.tensor[slot, page:], caches[1][num_blocks - 1 - block])
        transfer.close()


def test_any_dtype_with_blocks_first_is_viewed_as_bytes(host: TorchHostBuffer) -> None:
    halves = torch.randn(16, 4, 6, dtype=torch.float16)  # 48 bytes per block
    strided = torch.randint(0, 256, (16, 2, 48), dtype=torch.uint8)[:, 1]  # rows 96 bytes apart
    transfer = _single(host, [halves, strided])
    transfer.submit_store(TransferJob(JobId(1), STORE, [5, 6], [3, 9, 1, 2]))
    _drain(transfer, [1])
    slot = host.tensor[5]
    assert torch.equal(slot[:48], halves[3].view(torch.uint8).flatten())
    assert torch.equal(slot[96:144], strided[3])
    host.tensor[6, 48:96].fill_(7)
    transfer.submit_load(TransferJob(JobId(2), LOAD, [6], [0, 11]))
    _drain(transfer, [2])
    assert halves[11].view(torch.uint8).flatten().tolist() == [7] * 48
    assert torch.equal(strided[0], host.tensor[6, 96:144])
    transfer.close()


def test_constructor_refuses_layouts_that_do_not_fit(host: TorchHostBuffer) -> None:
    def refuse(field: str, words: str, caches: list[torch.Tensor], **kwargs: object) -> None:
        args: dict[str, object] = {"tensor_groups": [0] * len(caches), "blocks_per_chunk": [2]}
        args.update(kwargs)
        with pytest.raises(TransferError, match=words) as info:
            TorchBlockTransfer(host, caches, **args)  # type: ignore[arg-type]
        assert info.value.field == field

    refuse("kv_caches", "no KV cache tensor", [])
    refuse(
        "host",
        "host buffer has slot_bytes 192, the KV layout needs 160",
        [torch.zeros(8, 48, dtype=torch.uint8), torch.zeros(8, 32, dtype=torch.uint8)],
    )
    refuse(
        "kv_caches",
        "tensors of group 0 differ in num_blocks: tensor 0: 8, tensor 1: 9",
        [torch.zeros(8, 48, dtype=torch.uint8), torch.zeros(9, 48, dtype=torch.uint8)],
    )
    refuse(
        "kv_caches",
        "tensor 1 .*a block's bytes are not contiguous",
        [torch.zeros(8, 48, dtype=torch.uint8), torch.zeros(48, 8, dtype=torch.uint8).t()],
    )
    refuse("kv_caches", "tensor 0 of shape \\[0, 48\\] has no blocks", [torch.zeros(0, 48)])
    refuse("kv_caches", "device meta is not supported", [torch.zeros(8, 48, device="meta")])
    refuse(
        "tensor_groups",
        "tensor 1: group 1 outside 0..0",
        _caches(),
        tensor_groups=[0, 1],
    )
    overlapping = torch.zeros(100, dtype=torch.uint8).as_strided((8, 48), (4, 1))
    refuse("kv_caches", "blocks overlap", [overlapping, overlapping])
    refuse("staging_bytes", "must be > 0", _caches(), staging_bytes=0)


def test_submissions_that_do_not_fit_name_the_job_and_field(host: TorchHostBuffer) -> None:
    transfer = _single(host, _caches(num_blocks=100))
    cases = [
        (TransferJob(JobId(1), STORE, [0], [0, 100]), "block_ids", "block 100 of group 0"),
        (TransferJob(JobId(2), STORE, [64], [0, 1]), "slots", "slot 64 outside 0..63"),
        (TransferJob(JobId(3), STORE, [0], [0, 1, 2]), "slots", "1 slots, but .* need 2"),
        (TransferJob(JobId(4), LOAD, [0], [0, 1]), "kind", "a load job submitted as a store"),
    ]
    for job, field, words in cases:
        with pytest.raises(TransferError, match=words) as info:
            transfer.submit_store(job)
        assert (info.value.job_id, info.value.field) == (job.job_id, field)
    with pytest.raises(TransferError, match="transfer job 5: kind: a store job submitted as a"):
        transfer.submit_load(TransferJob(JobId(5), STORE, [0], [0, 1]))
    assert transfer.poll() == []  # nothing was queued
    transfer.close()


class _Host:
    """A host buffer of 64 slots of 192 bytes over any tensor (the transfer reads .tensor)."""

    num_slots = 64
    slot_bytes = 192

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def slot_view(self, slot: int) -> memoryview:
        raise NotImplementedError


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (torch.zeros(32, 192, dtype=torch.uint8), r"uint8 or int8 CPU tensor \[64, 192\], got"),
        (torch.zeros(64, 192, dtype=torch.float32), r"got torch.float32 \[64, 192\] on cpu"),
        (
            torch.zeros(64, 384, dtype=torch.uint8)[:, ::2],
            r"rows must be contiguous \(stride\(1\) == 1\), got strides \[384, 2\]",
        ),
        (
            torch.zeros(64 * 100 + 92, dtype=torch.int8).as_strided((64, 192), (100, 1)),
            r"rows are 100 bytes apart \(stride\(0\)\), less than slot_bytes 192",
        ),
    ],
)
def test_host_tensor_must_be_the_slots(tensor: torch.Tensor, words: str) -> None:
    with pytest.raises(TransferError, match=words) as info:
        _single(_Host(tensor), _caches())  # type: ignore[arg-type]
    assert info.value.field == "host"


def test_a_strided_int8_host_view_is_written_in_place_padding_and_other_ranks_untouched() -> None:
    # vLLM's shared region: rows of 512 bytes, rank 1's cell of 192 bytes at 192
    rows = torch.randint(-128, 128, (64, 512), dtype=torch.int8)
    before = rows.clone()
    caches = _caches()
    transfer = _single(_Host(rows[:, 192:384]), caches)  # type: ignore[arg-type]
    transfer.submit_store(TransferJob(JobId(1), STORE, [7, 3], [5, 6, 1, 2]))
    _drain(transfer, [1])
    mine = rows[:, 192:384].view(torch.uint8)
    assert torch.equal(mine[7].view(2, 2, 48), torch.stack([caches[0][5:7], caches[1][5:7]]))
    assert torch.equal(mine[3].view(2, 2, 48), torch.stack([caches[0][1:3], caches[1][1:3]]))
    changed = (rows != before).any(dim=0).nonzero().flatten()
    assert int(changed.min()) >= 192
    assert int(changed.max()) < 384
    assert torch.equal(rows[[0, 1, 2, 4, 5, 6, 8]], before[[0, 1, 2, 4, 5, 6, 8]])
    transfer.close()


@pytest.mark.parametrize("staging_slots", [1, 2, 64])
def test_equal_layers_of_a_group_round_trip_together(staging_slots: int) -> None:
    # four equal layers in group 0, two in group 1 (one copy per group between the staging
    # rows and the dense blocks), jobs over several slots with a skip and a partial tail
    spec = Layout([16, 16, 16, 16, 8, 8], [0, 0, 0, 0, 1, 1], [3, 2], [40, 40])
    source = _random_caches(spec, seed=5)
    job = TransferJob(
        JobId(1),
        STORE,
        slots=[9, 2, 3, 7, 0, 5, 4],
        block_ids=[*range(10, 20), *range(30, 35)],
        group_sizes=[10, 5],
        block_indices=[4, 2],
    )
    with TorchHostBuffer(10, spec.slot_bytes) as host:
        transfer = TorchBlockTransfer(
            host,
            source,
            tensor_groups=spec.tensor_groups,
            blocks_per_chunk=spec.blocks_per_chunk,
            staging_bytes=staging_slots * spec.slot_bytes,
        )
        transfer.submit_store(job)
        _drain(transfer, [1])
        expected = torch.zeros(10 * spec.slot_bytes, dtype=torch.uint8)
        for w in placements(spec, job):
            expected[w.host : w.host + w.length] = source[w.tensor][w.block]
        assert torch.equal(host.tensor.view(-1), expected)
        target = [torch.zeros_like(t) for t in source]
        back = TorchBlockTransfer(
            host,
            target,
            tensor_groups=spec.tensor_groups,
            blocks_per_chunk=spec.blocks_per_chunk,
            staging_bytes=staging_slots * spec.slot_bytes,
        )
        back.submit_load(
            TransferJob(
                JobId(2),
                LOAD,
                job.slots,
                job.block_ids,
                group_sizes=job.group_sizes,
                block_indices=job.block_indices,
            )
        )
        _drain(back, [2])
        for t, (got, want) in enumerate(zip(target, source, strict=True)):
            ids = list(range(10, 20)) if spec.tensor_groups[t] == 0 else list(range(30, 35))
            assert torch.equal(got[ids], want[ids])
            assert int(got.sum()) == int(want[ids].sum(dtype=torch.int64))
        transfer.close()
        back.close()
