"""The copy schemes under TorchBlockTransfer on CPU tensors, against the placement oracle:
DirectCopier (the CPU path) with every size threshold forced both ways, so that joined
pieces and jobs cut into tasks all run on small tensors; StagedCopier (the CUDA path, plain
torch) with staging areas of one slot and more; how tensors are grouped into spans; and the
copy threads sharing a job's tasks."""

from __future__ import annotations

import threading
import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhex.adapters.torch.direct import DirectCopier
from kvhex.adapters.torch.staging import StagedCopier, Staging, block_bytes
from kvhex.adapters.torch.workers import CopyWorkers
from kvhex.domain import JobId, SlotLayout, TransferJob, TransferKind
from tests.adapters.torch.torch_kv import (
    ALLOCATIONS,
    HOSTS,
    StridedHost,
    allocate,
    check_round_trip,
)
from tests.domain.transfers import Layout, jobs, layouts

STORE, LOAD = TransferKind.STORE, TransferKind.LOAD


def _layout(spec: Layout) -> SlotLayout:
    return SlotLayout(spec.page_bytes, spec.tensor_groups, spec.blocks_per_chunk)


def _blocks(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [block_bytes(i, c) for i, c in enumerate(caches)]


def _num_blocks(layout: SlotLayout, caches: list[torch.Tensor]) -> list[int]:
    return [caches[members[0]].shape[0] for members in layout.group_tensors]


TUNINGS = st.fixed_dictionaries(
    {
        "merge_cap": st.sampled_from([1, 100, 1 << 20]),
        "task_bytes": st.sampled_from([1, 64, 1 << 20]),
        "threads": st.sampled_from([1, 3]),
    }
)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    spec=layouts(),
    allocation=st.sampled_from(ALLOCATIONS),
    host=st.sampled_from(HOSTS),
    tuning=TUNINGS,
)
def test_direct_copies_place_every_byte_like_the_oracle(
    data: st.DataObject,
    spec: Layout,
    allocation: str,
    host: str,
    tuning: dict[str, int],
) -> None:
    layout = _layout(spec)
    store = data.draw(jobs(spec, 40, STORE, loadable=True, ordered=data.draw(st.booleans())))
    count = len(spec.page_bytes)
    gaps = data.draw(st.lists(st.sampled_from([0, 3, 8, 24]), min_size=count, max_size=count))

    def copy(buffer: StridedHost, caches: list[torch.Tensor], job: TransferJob) -> int:
        host_bytes = buffer.tensor.view(torch.uint8)
        knobs = {k: v for k, v in tuning.items() if k != "threads"}
        copier = DirectCopier(layout, _blocks(caches), host_bytes, **knobs)
        runs = layout.plan(job, num_slots=40, num_blocks=_num_blocks(layout, caches))
        tasks, nbytes = copier.plan(job, runs)
        workers = CopyWorkers(copier.run, threads=tuning["threads"], name="test-copy")
        try:
            done = workers.submit(job.kind, tasks, nbytes, job.slots)
            assert done.done.wait(60), "the copy threads did not finish the job"
        finally:
            workers.close()
        assert done.error is None
        return nbytes

    check_round_trip(spec, store, copy, allocation=allocation, gaps=gaps, host=host)


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    spec=layouts(),
    allocation=st.sampled_from(ALLOCATIONS),
    host=st.sampled_from(HOSTS),
    staging=st.sampled_from(["one-slot", "three-slots", "large"]),
)
def test_staged_copies_place_every_byte_like_the_oracle(
    data: st.DataObject, spec: Layout, allocation: str, host: str, staging: str
) -> None:
    layout = _layout(spec)
    store = data.draw(jobs(spec, 40, STORE, loadable=True, ordered=data.draw(st.booleans())))
    staging_bytes = {"one-slot": 1, "three-slots": 3 * spec.slot_bytes, "large": 1 << 24}[staging]
    gaps = [8] * len(spec.page_bytes)

    def copy(buffer: StridedHost, caches: list[torch.Tensor], job: TransferJob) -> int:
        copier = StagedCopier(
            layout, _blocks(caches), buffer.tensor.view(torch.uint8), staging_bytes=staging_bytes
        )
        runs = layout.plan(job, num_slots=40, num_blocks=_num_blocks(layout, caches))
        area = Staging(torch.device("cpu"))
        return copier.copy(area, job, runs, store=job.kind is STORE, non_blocking=False)

    check_round_trip(spec, store, copy, allocation=allocation, gaps=gaps, host=host)


def _spans(spec: Layout, allocation: str, gaps: list[int]) -> list[list[int]]:
    layout = _layout(spec)
    caches = allocate(spec, allocation, gaps, seed=1).tensors
    host = torch.zeros(4, layout.slot_bytes, dtype=torch.uint8)
    return DirectCopier(layout, _blocks(caches), host).span_sizes


def test_tensors_of_one_backing_at_a_uniform_distance_are_one_span() -> None:
    vllm = Layout([128] * 16, [0] * 16, [1], [12])  # 16 layers in one layer-major allocation
    assert _spans(vllm, "backing", []) == [[16]]
    assert _spans(vllm, "interleaved", [0] * 16) == [[16]]  # block-major: also uniform
    assert _spans(vllm, "separate", []) == [[1] * 16]
    gaps = [0, 0, 0, 8] + [0] * 12  # tensor 3 further away: distances no longer uniform
    assert _spans(vllm, "backing-gaps", gaps) == [[3, 13]]
    # two groups registered alternately: each group's tensors are uniformly apart on both
    # sides (every other tensor), so each group is one span; other page sizes cut spans
    mixed = Layout([64, 64, 64, 64, 32, 32], [0, 1, 0, 1, 0, 0], [2, 2], [10, 10])
    assert _spans(mixed, "backing", []) == [[2, 2], [2]]
    # a tensor shared by both groups joins each group's span
    shared = Layout([64, 64, 64], [0, (0, 1), 1], [1, 1], [10, 10])
    assert _spans(shared, "backing", []) == [[2], [2]]


def test_every_copy_thread_takes_tasks_and_torch_settings_stay_as_they_were() -> None:
    spec = Layout([4096] * 4, [0] * 4, [1], [64])
    layout = _layout(spec)
    caches = allocate(spec, "backing", [], seed=1).tensors
    host = torch.zeros(64, layout.slot_bytes, dtype=torch.uint8)
    copier = DirectCopier(layout, _blocks(caches), host, task_bytes=1)
    before = torch.get_num_threads()
    seen: set[str] = set()

    def run(task: tuple[object, ...], store: bool) -> None:
        seen.add(threading.current_thread().name)
        time.sleep(0.001)  # let the other thread take tasks too
        copier.run(task, store)

    blocks = list(range(31, -1, -1))  # nothing joins: 32 pieces, a task each
    job = TransferJob(JobId(1), STORE, list(range(32)), blocks)
    tasks, nbytes = copier.plan(job, layout.plan(job, num_slots=64, num_blocks=[64]))
    workers = CopyWorkers(run, threads=2, name="test-copy")
    assert workers.submit(STORE, tasks, nbytes, job.slots).done.wait(60)
    workers.close()
    assert sorted(seen) == ["test-copy-0", "test-copy-1"]
    assert torch.get_num_threads() == before
    for slot, block in enumerate(blocks):
        for t in range(4):
            want = caches[t][block].view(torch.uint8)
            assert torch.equal(host[slot, t * 4096 : (t + 1) * 4096], want)
