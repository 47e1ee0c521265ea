"""``KvhexCpuOffloadingWorker``: vLLM's ``OffloadingWorker`` for vLLM's CPU platform.

vLLM's own worker refuses the CPU platform (it needs CUDA streams, pinned DMA and its
``swap_blocks`` ops, none of which the CPU build has). This one runs a kvhex ``BlockTransfer``
taken from the ``kvhex.transfers`` registry (``torch`` by default,
``kvhex.adapters.torch.TorchBlockTransfer``) between the CPU KV-cache tensors vLLM registers
and this worker's cell of vLLM's shared offload region, the same ``/dev/shm`` mapping the
scheduler side's host tier (``RegionHostBuffer``) reads, in the layout vLLM's worker writes:

* every chunk row of the region holds one cell per worker rank (``cpu_page_size`` bytes each,
  rank ``r`` at offset ``r * cpu_page_size``; rank 0 only under the replicated layout), rows
  ``kv_bytes_per_chunk`` apart (page aligned);
* a cell holds every canonical KV tensor's region in registration order, each
  ``blocks_per_chunk * page_size_bytes`` long; a chunk of KV group ``g`` fills the regions of
  the tensors ``g`` references (several groups may share a tensor) and leaves the others.

So the bytes vLLM's CPU build stores are exactly where kvhex's tiers expect them, and a chunk a
file tier wrote is loaded back into any engine with the same layout.

The transfer is called as ``kvhex run`` calls it, with torch tensors: vLLM hands the worker
its KV cache as tensors and the region as a tensor view, so a transfer that takes tensors
fits (``factory(host, kv_caches, tensor_groups=..., blocks_per_chunk=..., **options)``, with
a ``TensorHostBuffer`` over the cells and, for hybrid models, several groups per tensor);
kvhex's ``memory`` transfer, which copies ``bytearray`` caches, does not.

Stores run in the background on the transfer's copy threads. Loads are waited for by default
(``wait_loads``): ``submit_load`` returns once the copy is done. On the CPU the copy and the
model share the cores, and the request that needs the blocks waits for them anyway; a load
left in the background has to win the GIL from vLLM's engine loop, which steps without pause
while a request waits for its blocks, for every copy it makes. Measured on 2 cores, 64 MiB
loaded from host memory: 0.17-0.45 s in the background, 6-8 ms waited (time to first token
of a 4096-token prefix 0.20-0.49 s against 0.03-0.04 s; 0.6-0.7 s recomputed).

Jobs mirror vLLM's specs one to one: ``GPULoadStoreSpec`` block ids, group sizes and block
indices (the first ``block_indices[g] % blocks_per_chunk`` positions of
a group's first chunk are skipped) and ``CPULoadStoreSpec`` chunk ids. Results come back per
direction in submission order, stores before loads, as vLLM's worker reports them. A job that
does not fit the layout raises ``TransferError`` naming the job and the field (vLLM would only
assert).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
import torch
from vllm.v1.kv_offload import base as vbase

from kvhex.domain.jobs import JobId
from kvhex.domain.transfer import TransferJob, TransferKind
from kvhex.errors import PluginError, TransferError
from kvhex.plugins import TRANSFERS, Registry
from kvhex.ports.transfer import BlockTransfer

log = structlog.get_logger(__name__)


class CellHostBuffer:
    """One worker's cells of the shared region: ``[num_chunks, cell_bytes]`` uint8, rows
    ``row_stride`` apart (a strided view, never a copy): a ``TensorHostBuffer`` for the
    worker's transfer."""

    __slots__ = ("_tensor", "num_slots", "slot_bytes")

    def __init__(self, cells: torch.Tensor) -> None:
        if cells.dim() != 2 or cells.stride(1) != 1 or cells.device.type != "cpu":
            raise TransferError(
                f"the region view must be a 2-D CPU tensor with contiguous rows, got shape "
                f"{list(cells.shape)} strides {list(cells.stride())} on {cells.device}",
                field="host",
            )
        self._tensor = cells.view(torch.uint8)
        self.num_slots = int(cells.shape[0])
        self.slot_bytes = int(cells.shape[1])

    @property
    def tensor(self) -> torch.Tensor:
        """The cells, zero-copy."""
        return self._tensor

    def slot_view(self, slot: int) -> memoryview:
        """One cell's bytes."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")
        return self._tensor[slot].numpy().data


def tensor_groups_of(kv_caches: vbase.CanonicalKVCaches) -> list[tuple[int, ...]]:
    """The KV groups that reference each canonical tensor (several for vLLM's hybrid models,
    whose groups overlay the same tensors).

    Raises:
        TransferError: a tensor no group references (its region would be laid out in the
            cell but never written).
    """
    groups: list[list[int]] = [[] for _ in kv_caches.tensors]
    for g, refs in enumerate(kv_caches.group_data_refs):
        for ref in refs:
            if g not in groups[ref.tensor_idx]:
                groups[ref.tensor_idx].append(g)
    orphans = [t for t, members in enumerate(groups) if not members]
    if orphans:
        raise TransferError(
            f"canonical KV tensor(s) {orphans} belong to no KV group", field="kv_caches"
        )
    return [tuple(members) for members in groups]


class KvhexCpuOffloadingWorker(vbase.OffloadingWorker):
    """vLLM's worker contract over a kvhex ``BlockTransfer`` on the CPU (module docstring).

    Args:
        kv_caches: vLLM's canonical KV caches (per-tensor ``(num_blocks, page)`` int8 views
            and the tensors of each KV group).
        blocks_per_chunk: device blocks per offloaded chunk (vLLM's, the same for every group).
        cells: this worker's cells of the shared region, ``[num_chunks, cpu_page_size]``.
        release: called once at shutdown, after the last copy finished (unmaps the region).
        wait_loads: ``submit_load`` waits for its copy (module docstring).
        transfer: the ``kvhex.transfers`` entry point doing the copies.
        transfer_options: keyword arguments of its factory besides what the worker passes
            (the cells, the tensors, ``tensor_groups``, ``blocks_per_chunk``).
        registry: where ``transfer`` is found (default: the installed entry points).

    Raises:
        TransferError: the tensors do not fill a cell exactly (naming both sizes), or any
            layout error the transfer names.
        PluginError: ``transfer`` is not installed (the message lists the installed ones),
            cannot be imported (with its install hint), or builds no ``BlockTransfer``.
    """

    def __init__(
        self,
        kv_caches: vbase.CanonicalKVCaches,
        *,
        blocks_per_chunk: int,
        cells: torch.Tensor,
        release: Callable[[], None] | None = None,
        wait_loads: bool = True,
        transfer: str = "torch",
        transfer_options: Mapping[str, Any] | None = None,
        registry: Registry | None = None,
    ) -> None:
        tensors = [t.tensor for t in kv_caches.tensors]
        groups = tensor_groups_of(kv_caches)
        host = CellHostBuffer(cells)
        plugins = Registry.discover([TRANSFERS]) if registry is None else registry
        built = plugins.load(TRANSFERS, transfer)(
            host,
            tensors,
            tensor_groups=groups,
            blocks_per_chunk=[blocks_per_chunk] * len(kv_caches.group_data_refs),
            **(transfer_options or {}),
        )
        if not isinstance(built, BlockTransfer):
            raise PluginError(
                f"built a {type(built).__name__}, not a BlockTransfer",
                group=TRANSFERS,
                name=transfer,
            )
        self._transfer: BlockTransfer | None = built
        self._release = release
        self._wait_loads = wait_loads
        log.info(
            "kvhex_cpu_offloading_worker_ready",
            transfer=transfer,
            tensors=len(tensors),
            groups=len(kv_caches.group_data_refs),
            chunks=host.num_slots,
            chunk_bytes=host.slot_bytes,
        )

    @property
    def transfer(self) -> BlockTransfer:
        """The kvhex transfer doing the copies.

        Raises:
            TransferError: after ``shutdown``.
        """
        if self._transfer is None:
            raise TransferError("the worker was shut down")
        return self._transfer

    def submit_store(
        self, job_id: int, src_spec: vbase.GPULoadStoreSpec, dst_spec: vbase.LoadStoreSpec
    ) -> bool:
        """Copy the device blocks of ``src_spec`` into the chunks of ``dst_spec`` (in the
        background). Raises ``TransferError`` for a job that does not fit the layout."""
        self.transfer.submit_store(_job(job_id, TransferKind.STORE, src_spec, dst_spec))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: vbase.LoadStoreSpec,
        dst_spec: vbase.GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Copy the chunks of ``src_spec`` into the device blocks of ``dst_spec``, waiting
        for the copy unless the worker was built with ``wait_loads=False`` (every load is then
        what vLLM 0.33 calls expedited); the result still comes from ``get_finished``."""
        self.transfer.submit_load(_job(job_id, TransferKind.LOAD, dst_spec, src_spec))
        if self._wait_loads:
            self.transfer.wait([JobId(job_id)])
        return True

    def get_finished(self) -> list[vbase.TransferResult]:
        """Jobs finished since the last call: stores, then loads, each in submission order."""
        return [
            vbase.TransferResult(
                job_id=int(r.job_id),
                success=r.success,
                transfer_size=r.nbytes if r.success else None,
                transfer_time=r.seconds,
            )
            for r in self.transfer.poll()
        ]

    def wait(self, job_ids: set[int]) -> None:
        """Block until these jobs finished (their results still come from ``get_finished``)."""
        self.transfer.wait([JobId(j) for j in job_ids])

    def shutdown(self) -> None:
        """Wait for every copy, stop the threads, then release the region (once no view of
        it is left, so vLLM can unmap it). Idempotent."""
        transfer, self._transfer = self._transfer, None
        if transfer is None:
            return
        transfer.close()
        del transfer
        release, self._release = self._release, None
        if release is not None:
            release()


def _ints(values: Any) -> Sequence[int]:
    out: list[int] = values.tolist() if hasattr(values, "tolist") else list(values)
    return out


def _job(job_id: int, kind: TransferKind, device: vbase.GPULoadStoreSpec, host: Any) -> TransferJob:
    return TransferJob(
        JobId(job_id),
        kind,
        _ints(host.block_ids),
        _ints(device.block_ids),
        group_sizes=_ints(device.group_sizes),
        block_indices=_ints(device.block_indices),
    )
