"""``MemoryBlockTransfer``: device <-> host copies between ``bytearray`` "device" caches and
host slots, with the same ``SlotLayout`` as the torch transfer, so the whole stack runs
without torch."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Sequence

from kvhex.domain.jobs import JobId
from kvhex.domain.slot_layout import ChunkRun, SlotLayout
from kvhex.domain.transfer import TransferJob, TransferKind, TransferResult, check_submission
from kvhex.errors import TransferError
from kvhex.ports.host_buffer import HostBuffer


class MemoryBlockTransfer:
    """A ``BlockTransfer`` whose "device" KV caches are ``bytearray``s (pure Python).

    Args:
        host: the buffer whose slots jobs name; ``slot_bytes`` must equal the layout's.
        kv_caches: one ``bytearray`` per registered tensor, ``num_blocks * page_bytes`` long.
        page_bytes: bytes per block, per tensor.
        tensor_groups: the KV group of each tensor, or the groups sharing it.
        blocks_per_chunk: blocks per host slot, per group.

    The slot layout is ``SlotLayout``'s, as for the torch transfer. Submitted jobs are copied
    by the next ``poll`` (or ``wait``), in submission order per direction;
    ``fail_next_stores`` / ``fail_next_loads`` make the next jobs fail without copying.

    Raises:
        TransferError: naming the argument, for caches that do not fit the layout or a host
            buffer whose ``slot_bytes`` differs (naming both numbers).
    """

    def __init__(
        self,
        host: HostBuffer,
        kv_caches: Sequence[bytearray],
        *,
        page_bytes: Sequence[int],
        tensor_groups: Sequence[int | Sequence[int]],
        blocks_per_chunk: Sequence[int],
    ) -> None:
        layout = SlotLayout(page_bytes, tensor_groups, blocks_per_chunk)
        if len(kv_caches) != len(layout.page_bytes):
            raise TransferError(
                f"{len(kv_caches)} caches for {len(layout.page_bytes)} page sizes",
                field="kv_caches",
            )
        num_blocks: list[int] = []
        for group, members in enumerate(layout.group_tensors):
            counts = set()
            for t in members:
                blocks, rest = divmod(len(kv_caches[t]), layout.page_bytes[t])
                if rest or not blocks:
                    raise TransferError(
                        f"cache {t} has {len(kv_caches[t])} bytes, not a positive multiple of "
                        f"its page of {layout.page_bytes[t]}",
                        field="kv_caches",
                    )
                counts.add(blocks)
            if len(counts) > 1:
                raise TransferError(
                    f"caches of group {group} differ in num_blocks: {sorted(counts)}",
                    field="kv_caches",
                )
            num_blocks.append(counts.pop())
        if host.slot_bytes != layout.slot_bytes:
            raise TransferError(
                f"host buffer has slot_bytes {host.slot_bytes}, the KV layout needs "
                f"{layout.slot_bytes}",
                field="host",
            )
        self.layout = layout
        self._host = host
        self._caches = [memoryview(c) for c in kv_caches]
        self._num_blocks = tuple(num_blocks)
        self._queues: dict[TransferKind, deque[tuple[TransferJob, tuple[ChunkRun, ...]]]] = {
            kind: deque() for kind in TransferKind
        }
        self._done: list[TransferResult] = []
        self._fail = dict.fromkeys(TransferKind, 0)
        self._closed = False

    def fail_next_stores(self, n: int = 1) -> None:
        """The next ``n`` store jobs fail and copy nothing."""
        self._fail[TransferKind.STORE] += n

    def fail_next_loads(self, n: int = 1) -> None:
        """The next ``n`` load jobs fail and copy nothing."""
        self._fail[TransferKind.LOAD] += n

    def submit_store(self, job: TransferJob) -> None:
        """Queue a device -> host copy. ``TransferError`` for a job that does not fit."""
        self._submit(TransferKind.STORE, job)

    def submit_load(self, job: TransferJob) -> None:
        """Queue a host -> device copy. ``TransferError`` for a job that does not fit."""
        self._submit(TransferKind.LOAD, job)

    def _submit(self, kind: TransferKind, job: TransferJob) -> None:
        check_submission(job, kind, closed=self._closed)
        runs = self.layout.plan(job, num_slots=self._host.num_slots, num_blocks=self._num_blocks)
        self._queues[kind].append((job, runs))

    def poll(self) -> list[TransferResult]:
        """Copy every queued job (stores, then loads) and report them with earlier ones."""
        self._run_all()
        results, self._done = self._done, []
        return results

    def wait(self, job_ids: Collection[JobId]) -> None:
        """Copy every queued job now; results wait for ``poll``."""
        self._run_all()

    def close(self) -> None:
        """Copy what is queued, then refuse new jobs. Idempotent."""
        self._run_all()
        self._closed = True

    def _run_all(self) -> None:
        for kind, queue in self._queues.items():
            while queue:
                job, runs = queue.popleft()
                if self._fail[kind]:
                    self._fail[kind] -= 1
                    error = f"injected {kind.value} failure"
                    self._done.append(TransferResult(job.job_id, False, error=error))
                    continue
                began = time.perf_counter()
                nbytes = self._copy(kind, job, runs)
                seconds = time.perf_counter() - began
                self._done.append(TransferResult(job.job_id, True, nbytes, seconds))

    def _copy(self, kind: TransferKind, job: TransferJob, runs: tuple[ChunkRun, ...]) -> int:
        layout = self.layout
        nbytes = 0
        for run in runs:
            per_chunk = layout.blocks_per_chunk[run.group]
            tensors = layout.group_tensors[run.group]
            for k in range(run.num_blocks):
                chunk, position = divmod(run.skip + k, per_chunk)
                view = self._host.slot_view(job.slots[run.slot_pos + chunk])
                block = job.block_ids[run.block_pos + k]
                for t in tensors:
                    page = layout.page_bytes[t]
                    at = layout.region_offsets[t] + position * page
                    device = self._caches[t][block * page : (block + 1) * page]
                    if kind is TransferKind.STORE:
                        view[at : at + page] = device
                    else:
                        device[:] = view[at : at + page]
                    nbytes += page
        return nbytes
