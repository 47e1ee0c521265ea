"""MemoryBlockTransfer: the pure-Python transfer places bytes exactly as the oracle says (the
same layout as the torch transfer), keeps order and faults deterministically."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhex.adapters.memory import MemoryBlockTransfer, MemoryHostBuffer
from kvhex.domain import JobId, TransferJob, TransferKind
from kvhex.errors import TransferError
from kvhex.ports import BlockTransfer
from tests.domain.transfers import Layout, jobs, layouts, placements

STORE, LOAD = TransferKind.STORE, TransferKind.LOAD


def _caches(spec: Layout, seed: int) -> list[bytearray]:
    rng = random.Random(seed)
    return [
        bytearray(rng.randbytes(spec.tensor_blocks(t) * page))
        for t, page in enumerate(spec.page_bytes)
    ]


def _transfer(host: MemoryHostBuffer, caches: list[bytearray], spec: Layout) -> MemoryBlockTransfer:
    return MemoryBlockTransfer(
        host,
        caches,
        page_bytes=spec.page_bytes,
        tensor_groups=spec.tensor_groups,
        blocks_per_chunk=spec.blocks_per_chunk,
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data(), spec=layouts())
def test_round_trip_places_every_byte_like_the_oracle(data: st.DataObject, spec: Layout) -> None:
    host = MemoryHostBuffer(40, spec.slot_bytes)
    before = random.Random(2).randbytes(40 * spec.slot_bytes)
    size = spec.slot_bytes
    for slot in range(40):
        host.slot_view(slot)[:] = before[slot * size : (slot + 1) * size]
    source = _caches(spec, seed=1)
    transfer = _transfer(host, source, spec)
    assert isinstance(transfer, BlockTransfer)
    job = data.draw(jobs(spec, 40, STORE, loadable=True))
    transfer.submit_store(job)
    [result] = transfer.poll()
    writes = placements(spec, job)
    assert (result.success, result.nbytes) == (True, sum(w.length for w in writes))
    expected = bytearray(before)
    for w in writes:
        page = w.length
        expected[w.host : w.host + page] = source[w.tensor][w.block * page : (w.block + 1) * page]
    assert b"".join(bytes(host.slot_view(slot)) for slot in range(40)) == bytes(expected)
    target = [bytearray(len(c)) for c in source]
    back = _transfer(host, target, spec)
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
    assert [r.success for r in back.poll()] == [True]
    want = [bytearray(len(c)) for c in source]
    for w in writes:
        at = slice(w.block * w.length, (w.block + 1) * w.length)
        want[w.tensor][at] = source[w.tensor][at]
    assert target == want


def test_faults_order_and_errors() -> None:
    spec = Layout([8], [0], [2], [10])
    host = MemoryHostBuffer(4, spec.slot_bytes)
    transfer = _transfer(host, _caches(spec, 3), spec)
    transfer.fail_next_stores()
    transfer.submit_store(TransferJob(JobId(1), STORE, [0], [0, 1]))
    transfer.submit_store(TransferJob(JobId(2), STORE, [1], [2, 3]))
    transfer.fail_next_loads()
    transfer.submit_load(TransferJob(JobId(3), LOAD, [1], [4, 5]))
    transfer.wait([JobId(3)])
    results = transfer.poll()
    assert [(r.job_id, r.success) for r in results] == [(1, False), (2, True), (3, False)]
    assert results[0].error == "injected store failure"
    assert bytes(host.slot_view(0)) == bytes(16)  # the failed store copied nothing
    with pytest.raises(TransferError, match=r"transfer job 4: slots: slot 4 outside 0\.\.3"):
        transfer.submit_store(TransferJob(JobId(4), STORE, [4], [0, 1]))
    transfer.close()
    with pytest.raises(TransferError, match="closed"):
        transfer.submit_store(TransferJob(JobId(5), STORE, [0], [0, 1]))
    with pytest.raises(
        TransferError, match="host buffer has slot_bytes 16, the KV layout needs 24"
    ):
        MemoryBlockTransfer(
            host, [bytearray(96)], page_bytes=[12], tensor_groups=[0], blocks_per_chunk=[2]
        )
    with pytest.raises(TransferError, match="not a positive multiple of its page of 8"):
        MemoryBlockTransfer(
            host, [bytearray(81)], page_bytes=[8], tensor_groups=[0], blocks_per_chunk=[2]
        )
