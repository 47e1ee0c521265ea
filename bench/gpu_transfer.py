"""Device <-> host throughput of kvhex's TorchBlockTransfer beside a raw contiguous copy.

For each case of ``--cases`` (chunk KiB x blocks per chunk; by default 2 MiB chunks of one
block, 2 MiB chunks of 4 blocks and 256 KiB chunks of one block) of a ``--layers``-layer
layout (one KV tensor per layer, so a layer's page is ``chunk / (layers * blocks_per_chunk)``
bytes: 128 KiB, 32 KiB and 16 KiB with 16 layers), ``--total-mib`` of chunks go device ->
host (store) and host -> device (load) through ``TorchBlockTransfer`` in jobs of
``--chunks-per-job`` chunks, with shuffled host slots and shuffled device blocks (nothing
merges by luck). The KV tensors are what vLLM 0.32 on the CPU hands a worker: per-layer int8
``(num_blocks, page)`` views into one layer-major backing allocation (``--separate``: one
allocation per layer instead). The baseline, measured in the same run and alternated with
kvhex, copies the same number of bytes between one contiguous device tensor and one pinned
host tensor (plain host memory on the CPU). Prints medians of ``--repeats`` passes and the
median of the per-pass ratios (each pass against the raw pass right after it).

    python bench/gpu_transfer.py                      # CUDA when available, else the CPU
    python bench/gpu_transfer.py --device cpu --total-mib 256
    python bench/gpu_transfer.py --quick --json   # tiny sizes; rows as JSON (see _report.py)
    .venv-vllm32/bin/python bench/gpu_transfer.py --device cpu --vllm-worker
                           # through kvhex's vLLM CPU worker (vLLM's specs and results)

A plain script, never a timed test. Buffers are touched once before timing (page faults).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from _report import Report, parse
from kvhex.adapters.torch import TorchBlockTransfer, TorchHostBuffer
from kvhex.domain import JobId, TransferJob, TransferKind

KiB = 1 << 10
MiB = 1 << 20
QUICK = {"total_mib": 4, "layers": 4, "chunks_per_job": 4, "repeats": 1}
"""Sizes of ``--quick`` (the smoke test's)."""
CASES = "2048x1,2048x4,256x1"
"""Default ``--cases``: chunk KiB x device blocks per chunk."""
BASELINE = "raw contiguous copy"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    began = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - began


def _kv_caches(
    layers: int, num_blocks: int, page: int, device: torch.device, *, separate: bool
) -> list[torch.Tensor]:
    """Per-layer int8 ``(num_blocks, page)`` KV tensors: views into one layer-major backing
    allocation (vLLM 0.32 on the CPU), or one allocation each."""
    if separate:
        return [
            torch.full((num_blocks, page), layer % 127, dtype=torch.int8, device=device)
            for layer in range(layers)
        ]
    backing = torch.empty(layers * num_blocks * page, dtype=torch.int8, device=device)
    caches = [
        backing[layer * num_blocks * page : (layer + 1) * num_blocks * page].view(num_blocks, page)
        for layer in range(layers)
    ]
    for layer, cache in enumerate(caches):
        cache.fill_(layer % 127)
    return caches


class KvhexRun:
    """Stores then loads every chunk of the host buffer through one TorchBlockTransfer."""

    def __init__(
        self, args: argparse.Namespace, device: torch.device, chunk: int, per_chunk: int
    ) -> None:
        self.device = device
        self.per_chunk = per_chunk
        page = chunk // (args.layers * self.per_chunk)
        self.page = page
        self.slot_bytes = page * args.layers * self.per_chunk
        self.num_slots = max(1, args.total_mib * MiB // self.slot_bytes)
        num_blocks = self.num_slots * self.per_chunk
        self.caches = _kv_caches(args.layers, num_blocks, page, device, separate=args.separate)
        self.host = TorchHostBuffer(self.num_slots, self.slot_bytes)
        self.host.tensor.fill_(1)
        self.worker: Any = None
        if args.vllm_worker:  # the same copies through vLLM's worker API
            from vllm.v1.kv_offload import base as vbase

            from kvhex.vllm.worker import KvhexCpuOffloadingWorker

            canonical = vbase.CanonicalKVCaches(
                [vbase.CanonicalKVCacheTensor(c, page) for c in self.caches],
                [[vbase.CanonicalKVCacheRef(t, page) for t in range(args.layers)]],
            )
            self.worker = KvhexCpuOffloadingWorker(
                canonical, blocks_per_chunk=self.per_chunk, cells=self.host.tensor
            )
            self.transfer = self.worker.transfer
        else:
            self.transfer = TorchBlockTransfer(
                self.host,
                self.caches,
                tensor_groups=[0] * args.layers,
                blocks_per_chunk=[self.per_chunk],
            )
        rng = random.Random(7)
        slots = list(range(self.num_slots))
        blocks = list(range(num_blocks))
        rng.shuffle(slots)
        rng.shuffle(blocks)
        step = args.chunks_per_job
        self.plans = [
            (slots[i : i + step], blocks[i * self.per_chunk : (i + step) * self.per_chunk])
            for i in range(0, self.num_slots, step)
        ]
        self.next_id = 0
        self.nbytes = self.num_slots * self.slot_bytes

    def _run(self, kind: TransferKind) -> None:
        if self.worker is not None:
            self._run_worker(kind)
            return
        store = kind is TransferKind.STORE
        submit = self.transfer.submit_store if store else self.transfer.submit_load
        ids = []
        for slots, blocks in self.plans:
            job = TransferJob(JobId(self.next_id), kind, slots, blocks)
            self.next_id += 1
            submit(job)
            ids.append(job.job_id)
        self.transfer.wait(ids)
        results = self.transfer.poll()
        assert len(results) == len(ids)
        assert all(r.success for r in results), [r.error for r in results if not r.success]

    def _run_worker(self, kind: TransferKind) -> None:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        ids = set()
        for slots, blocks in self.plans:
            device = GPULoadStoreSpec(blocks, [len(blocks)], [0])
            if kind is TransferKind.STORE:
                self.worker.submit_store(self.next_id, device, CPULoadStoreSpec(slots))
            else:
                self.worker.submit_load(self.next_id, CPULoadStoreSpec(slots), device)
            ids.add(self.next_id)
            self.next_id += 1
        self.worker.wait(ids)
        results = self.worker.get_finished()
        assert len(results) == len(ids)
        assert all(r.success for r in results)

    def store(self) -> None:
        self._run(TransferKind.STORE)

    def load(self) -> None:
        self._run(TransferKind.LOAD)

    def check(self) -> None:
        """The first job's first chunk landed where the layout says (spot check)."""
        slots, blocks = self.plans[0]
        page = self.caches[0].shape[1]
        row = self.host.tensor[slots[0]]
        for layer in (0, len(self.caches) - 1):
            region = row[layer * self.per_chunk * page : (layer + 1) * self.per_chunk * page]
            want = self.caches[layer][blocks[: self.per_chunk]].flatten().cpu().view(torch.uint8)
            assert torch.equal(region, want), f"layer {layer} bytes differ"

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        else:
            self.transfer.close()
        self.host.close()


class RawRun:
    """The baseline: one contiguous copy of the same bytes each way."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device_bytes = torch.full((nbytes,), 3, dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        self.host_bytes = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host_bytes.fill_(1)

    def store(self) -> None:
        self.host_bytes.copy_(self.device_bytes, non_blocking=True)

    def load(self) -> None:
        self.device_bytes.copy_(self.host_bytes, non_blocking=True)


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _cases(text: str) -> list[tuple[int, int]]:
    """``"2048x1,256x1"`` -> [(chunk bytes, blocks per chunk), ...]."""
    cases = []
    for case in text.split(","):
        kib, _, blocks = case.partition("x")
        cases.append((int(kib) * KiB, int(blocks or 1)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--cases", default=CASES, help="chunk KiB x blocks per chunk, comma-separated"
    )
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument(
        "--separate", action="store_true", help="one allocation per layer's KV tensor"
    )
    parser.add_argument(
        "--vllm-worker",
        action="store_true",
        help="CPU only, needs vLLM: go through kvhex's vLLM CPU offloading worker "
        "(vLLM's OffloadingWorker API and specs) instead of TorchBlockTransfer directly",
    )
    parser.add_argument("--chunks-per-job", type=int, default=16)
    parser.add_argument("--total-mib", type=int, default=None, help="bytes per pass")
    parser.add_argument("--repeats", type=int, default=5)
    args = parse(parser, QUICK)
    report = Report("gpu_transfer", args)
    device = torch.device(args.device)
    if args.total_mib is None:
        args.total_mib = 2048 if device.type == "cuda" else 256
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    allocation = "one allocation per layer" if args.separate else "one layer-major backing"
    if args.vllm_worker:
        allocation += ", through kvhex's vLLM CPU worker"
    report.say(
        f"device {name}, {args.layers} layers ({allocation}), "
        f"{args.chunks_per_job} chunks per job, {args.total_mib} MiB per pass, "
        f"medians of {args.repeats}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    report.say(
        f"{'chunk':<8} {'direction':<9} {'pages':>14} {'kvhex GB/s':>10} {'raw GB/s':>9} "
        f"{'ratio':>6}"
    )
    for chunk, per_chunk in _cases(args.cases):
        run = KvhexRun(args, device, chunk, per_chunk)
        raw = RawRun(device, run.nbytes)
        times: dict[str, list[float]] = {k: [] for k in ("store", "load", "raw_s", "raw_l")}
        run.store()  # warm-up: staging buffers, CUDA context, page faults
        run.check()
        run.load()
        raw.store()
        raw.load()
        for _ in range(args.repeats):
            times["store"].append(_timed(run.store, device))
            times["raw_s"].append(_timed(raw.store, device))
            times["load"].append(_timed(run.load, device))
            times["raw_l"].append(_timed(raw.load, device))
        pages = f"{args.layers}x{_label(run.page)}x{per_chunk}"
        for direction, mine, base in (("store", "store", "raw_s"), ("load", "load", "raw_l")):
            ours = run.nbytes / statistics.median(times[mine]) / 1e9
            theirs = run.nbytes / statistics.median(times[base]) / 1e9
            # each pass against the raw pass right after it: a shared machine's bandwidth
            # drifts between passes, and the two of a pair see the same
            ratio = statistics.median(r / k for k, r in zip(times[mine], times[base], strict=True))
            report.say(
                f"{_label(run.slot_bytes):<8} {direction:<9} {pages:>14} {ours:>10.2f} "
                f"{theirs:>9.2f} {ratio:>6.2f}"
            )
            report.row(
                f"{_label(run.slot_bytes)} {pages} {direction} ({device.type})",
                ours,
                theirs,
                unit="GB/s",
                baseline_name=BASELINE,
                better="higher",
                ratio=ratio,
            )
        run.close()
    report.finish()


if __name__ == "__main__":
    main()
