"""kvhex's CPU offloading worker on vLLM's canonical KV caches, driven as vLLM's connector
worker drives it (submit_store / submit_load / get_finished / wait / shutdown).

The region is laid out as vLLM's shared offload region: rows ``row_stride`` apart (page
padded), one cell per worker rank; every byte the worker writes is checked against an
independent oracle, and every byte it must not write (padding, the other rank's cell, other
tensors' regions, skipped positions) against its sentinel.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM (make test runs this in .venv-vllm and .venv-vllm32)"
)

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvhex.adapters.torch import TensorHostBuffer, TorchBlockTransfer
from kvhex.errors import PluginError, TransferError
from kvhex.plugins import TRANSFERS, Registry
from kvhex.vllm.worker import KvhexCpuOffloadingWorker, tensor_groups_of

SENTINEL = -7


class Layout:
    """Synthetic canonical KV caches and a region with ``ranks`` cells per row."""

    def __init__(
        self,
        pages: list[int],
        group_tensors: list[list[int]],
        *,
        blocks_per_chunk: int,
        num_blocks: int = 24,
        num_chunks: int = 10,
        one_backing: bool = False,
        ranks: int = 1,
        rank: int = 0,
        pad: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(1)
        if one_backing:  # vLLM 0.32 on CPU: every layer inside one layer-major allocation
            assert len(set(pages)) == 1
            shape = (len(pages), num_blocks, pages[0])
            backing = torch.randint(-128, 127, shape, generator=gen).to(torch.int8)
            self.kv = [backing[t] for t in range(len(pages))]
        else:
            self.kv = [
                torch.randint(-128, 127, (num_blocks, p), generator=gen).to(torch.int8)
                for p in pages
            ]
        self.pages = pages
        self.group_tensors = group_tensors
        self.bpc = blocks_per_chunk
        self.cell = sum(p * blocks_per_chunk for p in pages)
        self.row = self.cell * ranks + pad
        self.region = torch.full((num_chunks * self.row,), SENTINEL, dtype=torch.int8)
        self.cells = self.region.as_strided(
            (num_chunks, self.cell), (self.row, 1), rank * self.cell
        )
        self.caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, p) for t, p in zip(self.kv, pages, strict=True)],
            group_data_refs=[
                [CanonicalKVCacheRef(t, pages[t]) for t in members] for members in group_tensors
            ],
        )
        offsets, at = [], 0
        for p in pages:
            offsets.append(at)
            at += p * blocks_per_chunk
        self.offsets = offsets

    def worker(self, **kwargs: Any) -> KvhexCpuOffloadingWorker:
        return KvhexCpuOffloadingWorker(
            self.caches, blocks_per_chunk=self.bpc, cells=self.cells, **kwargs
        )

    def expected_cells(
        self, jobs: list[tuple[list[int], list[list[int]], list[int]]]
    ) -> torch.Tensor:
        """The region after ``jobs`` (slots, per-group device blocks, per-group first block
        index) were stored, computed block by block."""
        region = torch.full_like(self.region, SENTINEL)
        cells = region.as_strided(
            self.cells.shape, self.cells.stride(), self.cells.storage_offset()
        )
        for slots, groups, indices in jobs:
            slot_iter = iter(slots)
            for g, (blocks, index) in enumerate(zip(groups, indices, strict=True)):
                if not blocks:
                    continue
                skip = index % self.bpc
                chunks = (skip + len(blocks) + self.bpc - 1) // self.bpc
                mine = [next(slot_iter) for _ in range(chunks)]
                for i, block in enumerate(blocks):
                    pos = skip + i
                    slot, j = mine[pos // self.bpc], pos % self.bpc
                    for t in self.group_tensors[g]:
                        at = self.offsets[t] + j * self.pages[t]
                        cells[slot, at : at + self.pages[t]] = self.kv[t][block]
        return region


def specs(
    slots: list[int], groups: list[list[int]], indices: list[int]
) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    device = GPULoadStoreSpec(
        [b for blocks in groups for b in blocks], [len(b) for b in groups], indices
    )
    return device, CPULoadStoreSpec(slots)


def finished(worker: KvhexCpuOffloadingWorker, job_ids: set[int]) -> list[Any]:
    worker.wait(job_ids)
    results = worker.get_finished()
    assert {r.job_id for r in results} == job_ids
    return results


LAYOUTS = {
    "one backing allocation, 4 layers": lambda **kw: Layout(
        [256] * 4, [[0, 1, 2, 3]], blocks_per_chunk=1, one_backing=True, **kw
    ),
    "separate tensors, 2 blocks per chunk": lambda **kw: Layout(
        [128, 128, 64], [[0, 1, 2]], blocks_per_chunk=2, **kw
    ),
    "two groups overlaid on shared tensors": lambda **kw: Layout(
        [128, 128], [[0, 1], [0, 1]], blocks_per_chunk=2, **kw
    ),
    "two groups, tensors of their own and one shared": lambda **kw: Layout(
        [64, 128, 64], [[0, 1], [1, 2]], blocks_per_chunk=1, one_backing=False, **kw
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize(("ranks", "rank", "pad"), [(1, 0, 0), (1, 0, 96), (2, 1, 32)])
def test_stores_write_exactly_vllms_layout_and_loads_bring_the_blocks_back(
    name: str, ranks: int, rank: int, pad: int
) -> None:
    layout = LAYOUTS[name](ranks=ranks, rank=rank, pad=pad)
    rng = random.Random(name)
    groups = len(layout.group_tensors)
    worker = layout.worker()
    if name.startswith("one backing"):  # the layers are copied as one strided span
        assert worker.transfer.spans == [[4]]
    jobs = []
    free_slots = list(range(10))
    rng.shuffle(free_slots)
    blocks = list(range(24))
    rng.shuffle(blocks)
    for job_id in (1, 2):
        per_group, indices, slots = [], [], []
        for _ in range(groups):
            index = rng.randrange(4)
            count = rng.randint(1, 3)
            per_group.append([blocks.pop() for _ in range(count)])
            indices.append(index)
            skip = index % layout.bpc
            slots += [
                free_slots.pop() for _ in range((skip + count + layout.bpc - 1) // layout.bpc)
            ]
        jobs.append((slots, per_group, indices))
        device, host = specs(slots, per_group, indices)
        assert worker.submit_store(job_id, device, host)
    results = finished(worker, {1, 2})
    assert [r.job_id for r in results] == [1, 2]  # submission order
    assert all(r.success for r in results)
    assert torch.equal(layout.region, layout.expected_cells(jobs))

    originals = [t.clone() for t in layout.kv]
    for tensor in layout.kv:
        tensor.zero_()
    for job_id, (slots, per_group, indices) in zip((3, 4), jobs, strict=True):
        device, host = specs(slots, per_group, indices)
        assert worker.submit_load(job_id, host, device)
    assert [r.job_id for r in finished(worker, {3, 4})] == [3, 4]
    for t, (tensor, original) in enumerate(zip(layout.kv, originals, strict=True)):
        for b in range(24):
            in_job_group = any(
                b in per_group[g] and t in layout.group_tensors[g]
                for _, per_group, _ in jobs
                for g in range(groups)
            )
            want = original[b] if in_job_group else torch.zeros_like(original[b])
            assert torch.equal(tensor[b], want), (t, b)
    worker.shutdown()


def test_results_come_stores_first_then_loads_each_in_submission_order() -> None:
    layout = Layout([512] * 2, [[0, 1]], blocks_per_chunk=1, one_backing=True)
    worker = layout.worker()
    for job_id, slot in ((10, 0), (11, 1), (12, 2)):
        worker.submit_store(job_id, *specs([slot], [[slot]], [0]))
    worker.wait({10, 11, 12})
    for job_id, slot in ((20, 0), (21, 1)):
        device, host = specs([slot], [[slot + 5]], [0])
        worker.submit_load(job_id, host, device)
    worker.wait({20, 21})
    assert [r.job_id for r in worker.get_finished()] == [10, 11, 12, 20, 21]
    assert worker.get_finished() == []
    worker.shutdown()


def test_sizes_and_times_are_reported_as_vllm_records_them() -> None:
    layout = Layout([512] * 2, [[0, 1]], blocks_per_chunk=1)
    worker = layout.worker()
    worker.submit_store(1, *specs([0, 1], [[3, 4]], [0]))
    (result,) = finished(worker, {1})
    assert result.transfer_size == 2 * 2 * 512
    assert result.transfer_time is not None
    assert result.transfer_time >= 0
    worker.shutdown()


def test_a_job_that_does_not_fit_is_a_typed_error_naming_the_job_and_field() -> None:
    layout = Layout([512] * 2, [[0, 1]], blocks_per_chunk=1)
    worker = layout.worker()
    with pytest.raises(TransferError) as err:
        worker.submit_store(5, *specs([0], [[99]], [0]))
    assert err.value.job_id == 5
    assert err.value.field == "block_ids"
    with pytest.raises(TransferError) as err:
        worker.submit_store(6, *specs([10], [[1]], [0]))
    assert err.value.field == "slots"
    worker.shutdown()


def test_a_tensor_no_group_references_is_refused() -> None:
    layout = Layout([512] * 2, [[0]], blocks_per_chunk=1)
    with pytest.raises(TransferError, match=r"tensor\(s\) \[1\] belong to no KV group"):
        tensor_groups_of(layout.caches)


def test_cells_that_the_tensors_do_not_fill_are_refused_naming_both_sizes() -> None:
    layout = Layout([512] * 2, [[0, 1]], blocks_per_chunk=1)
    wide = layout.region.as_strided((5, layout.cell + 64), (layout.cell + 64, 1))
    with pytest.raises(TransferError, match=f"{layout.cell + 64}.*{layout.cell}"):
        KvhexCpuOffloadingWorker(layout.caches, blocks_per_chunk=1, cells=wide)


def test_shutdown_waits_releases_once_and_refuses_later_jobs() -> None:
    layout = Layout([512] * 2, [[0, 1]], blocks_per_chunk=1)
    released: list[int] = []
    worker = layout.worker(release=lambda: released.append(1))
    worker.submit_store(1, *specs([0], [[1]], [0]))
    worker.shutdown()
    worker.shutdown()
    assert released == [1]
    assert torch.equal(layout.region, layout.expected_cells([([0], [[1]], [0])]))
    with pytest.raises(TransferError, match="shut down"):
        worker.submit_store(2, *specs([1], [[2]], [0]))


def test_the_transfer_bench_runs_through_the_vllm_worker() -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).parent.parent.parent / "bench" / "gpu_transfer.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--device", "cpu", "--vllm-worker", "--quick", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = json.loads(out.stdout)["rows"]
    assert rows
    assert all(row["ratio"] > 0 for row in rows)
    assert "through kvhex's vLLM CPU worker" in out.stderr


def test_a_load_has_landed_when_submit_returns_and_is_still_reported() -> None:
    layout = Layout([512] * 2, [[0, 1]], blocks_per_chunk=1, one_backing=True)
    worker = layout.worker()
    worker.submit_store(1, *specs([3], [[2]], [0]))
    worker.wait({1})
    originals = [t[2].clone() for t in layout.kv]
    for tensor in layout.kv:
        tensor[7].zero_()
    device, host = specs([3], [[7]], [0])
    worker.submit_load(2, host, device)  # no wait: the copy is done
    assert all(torch.equal(t[7], o) for t, o in zip(layout.kv, originals, strict=True))
    assert [r.job_id for r in worker.get_finished()] == [1, 2]
    worker.shutdown()


class Recording(TorchBlockTransfer):
    """The torch transfer, keeping what the worker built it with."""

    def __init__(
        self,
        host: TensorHostBuffer,
        kv_caches: list[torch.Tensor],
        *,
        tensor_groups: list[tuple[int, ...]],
        blocks_per_chunk: list[int],
        tag: str,
    ) -> None:
        super().__init__(
            host, kv_caches, tensor_groups=tensor_groups, blocks_per_chunk=blocks_per_chunk
        )
        self.built_with = (host.slot_bytes, len(kv_caches), tensor_groups, blocks_per_chunk, tag)


def test_the_transfer_is_the_registrys_entry_named_with_its_options() -> None:
    layout = LAYOUTS["two groups overlaid on shared tensors"]()
    registry = Registry.discover([TRANSFERS])
    registry.register(TRANSFERS, "recording", Recording)
    worker = layout.worker(transfer="recording", transfer_options={"tag": "t"}, registry=registry)
    assert isinstance(worker.transfer, Recording)
    assert worker.transfer.built_with == (layout.cell, 2, [(0, 1), (0, 1)], [2, 2], "t")
    job = ([0, 1], [[3, 4], [5]], [0, 0])
    worker.submit_store(1, *specs(*job))
    (result,) = finished(worker, {1})
    assert result.success
    assert torch.equal(layout.region, layout.expected_cells([job]))
    worker.shutdown()
    with pytest.raises(PluginError, match="unknown name; available: memory, recording, torch"):
        layout.worker(transfer="nope", registry=registry)
