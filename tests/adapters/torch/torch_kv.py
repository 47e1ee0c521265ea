"""KV caches and host buffers laid out the ways engines hand them to a transfer, and a round
trip (store into the host, load back into fresh tensors) checked byte for byte against the
placement oracle of tests/domain/transfers.py: every job byte lands where the oracle says,
and nothing else changes (skipped positions, other groups' regions, row padding, another
rank's bytes, gaps between tensors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kvhex.domain import JobId, TransferJob, TransferKind
from tests.domain.transfers import Layout, placements

ALLOCATIONS = ("separate", "backing", "backing-gaps", "interleaved")
"""``separate``: one allocation per tensor; ``backing``: one int8 allocation, tensor after
tensor (vLLM 0.32 on the CPU: layer-major); ``backing-gaps``: the same with gaps between
tensors (non-uniform distances); ``interleaved``: one allocation, block-major (tensor ``t`` is
a column range of every row)."""
HOSTS = ("plain", "padded", "rank")
"""``plain``: slots back to back; ``padded``: rows longer than a slot; ``rank``: our slot is
the second of three cells in each row (tensor parallelism)."""


class KvCache(NamedTuple):
    whole: list[torch.Tensor]  # every byte that exists (the backing, or each tensor)
    tensors: list[torch.Tensor]


def allocate(spec: Layout, allocation: str, gaps: list[int], seed: int | None) -> KvCache:
    """The spec's tensors, random (``seed``) or zero. ``gaps[t]`` bytes precede tensor ``t``
    in ``backing-gaps`` (and column ranges in ``interleaved``)."""
    gen = torch.Generator().manual_seed(seed or 0)

    def fill(*shape: int) -> torch.Tensor:
        if seed is None:
            return torch.zeros(shape, dtype=torch.int8)
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)

    pages = spec.page_bytes
    blocks = [spec.tensor_blocks(t) for t in range(len(pages))]
    if allocation == "separate":
        tensors = [fill(n, page) for n, page in zip(blocks, pages, strict=True)]
        return KvCache(tensors, tensors)
    spacing = gaps if allocation != "backing" else [0] * len(pages)
    if allocation == "interleaved":
        width = sum(spacing) + sum(pages)
        backing = fill(max(blocks) * width)
        rows = backing.view(max(blocks), width)
        tensors, at = [], 0
        for t, page in enumerate(pages):
            at += spacing[t]
            tensors.append(rows[: blocks[t], at : at + page])
            at += page
        return KvCache([backing], tensors)
    backing = fill(sum(spacing) + sum(n * p for n, p in zip(blocks, pages, strict=True)))
    tensors, at = [], 0
    for t, page in enumerate(pages):
        at += spacing[t]
        tensors.append(backing[at : at + blocks[t] * page].view(blocks[t], page))
        at += blocks[t] * page
    return KvCache([backing], tensors)


class StridedHost:
    """A ``TensorHostBuffer`` over a view of bigger rows, as vLLM's shared offload region
    gives a worker: int8 ``[num_slots, slot_bytes]``, rows ``row_stride`` apart, starting at
    ``offset`` in each row."""

    def __init__(self, num_slots: int, slot_bytes: int, row_stride: int, offset: int) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        gen = torch.Generator().manual_seed(11)
        self.rows = torch.randint(
            -128, 128, (num_slots, row_stride), dtype=torch.int8, generator=gen
        )
        self.tensor = self.rows[:, offset : offset + slot_bytes]

    def slot_view(self, slot: int) -> memoryview:
        raise NotImplementedError("TorchBlockTransfer reads .tensor only")


def host_of(kind: str, num_slots: int, slot_bytes: int) -> tuple[StridedHost, int, int]:
    """A host buffer, its row stride and each slot's offset inside its row."""
    stride, offset = {
        "plain": (slot_bytes, 0),
        "padded": (slot_bytes + 24, 0),
        "rank": (3 * slot_bytes, slot_bytes),
    }[kind]
    return StridedHost(num_slots, slot_bytes, stride, offset), stride, offset


Copy = Callable[[StridedHost, list[torch.Tensor], TransferJob], int]
"""Runs one job (store or load) between ``host`` and the KV tensors; returns its nbytes."""


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def check_round_trip(
    spec: Layout, store: TransferJob, copy: Copy, *, allocation: str, gaps: list[int], host: str
) -> None:
    """Store ``store`` from random tensors, check the whole host, load it back into zeroed
    tensors allocated alike, check every byte of them."""
    num_slots = 40
    buffer, stride, offset = host_of(host, num_slots, spec.slot_bytes)
    source = allocate(spec, allocation, gaps, seed=1)
    before = _bytes(buffer.rows).flatten().clone()
    writes = placements(spec, store, slot_stride=stride)
    assert copy(buffer, source.tensors, store) == sum(w.length for w in writes)
    expected = before.clone()
    for w in writes:
        at = offset + w.host
        expected[at : at + w.length] = _bytes(source.tensors[w.tensor][w.block])
    assert torch.equal(_bytes(buffer.rows).flatten(), expected)  # and nothing else changed

    target = allocate(spec, allocation, gaps, seed=None)
    load = TransferJob(
        JobId(store.job_id + 1),
        TransferKind.LOAD,
        store.slots,
        store.block_ids,
        group_sizes=store.group_sizes,
        block_indices=store.block_indices,
    )
    assert copy(buffer, target.tensors, load) == sum(w.length for w in writes)
    want = allocate(spec, allocation, gaps, seed=None)
    for w in writes:
        want.tensors[w.tensor][w.block] = source.tensors[w.tensor][w.block]
    for got, wanted in zip(target.whole, want.whole, strict=True):
        assert torch.equal(got, wanted)  # job blocks equal, every other byte still zero
