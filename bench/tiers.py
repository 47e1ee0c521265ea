"""Tier throughput: GB/s through kvhex's storage tiers beside raw IO of the same bytes.

For each chunk size (``--chunk-kib``: 2 MiB and 256 KiB by default) and each tier,
``--total-mib`` (2 GiB by default) go host -> tier (put) and tier -> host (get) through the
tier's own jobs, in batches of ``--batch`` chunks per job on ``--io-threads`` IO threads, with
a baseline measured in the same run:

* local files (fsspec tier) and NIXL's POSIX backend (NIXL tier) vs raw ``os.pwrite`` /
  ``os.preadv`` of the same bytes into one preallocated file, one call per chunk on one
  thread;
* S3 (fsspec tier over s3fs) vs raw s3fs batched ``pipe`` / ``cat`` of the same bytes in
  batches of ``--batch``, as many batches in flight as the tier has IO threads, both against
  the same loopback S3 server (moto, in a process of its own as S3 is; its speed, not S3's,
  bounds both).

    python bench/tiers.py [--total-mib 2048] [--tiers files,nixl,s3] [--dir PATH]
    python bench/tiers.py --tiers files --chunk-kib 256 --queued   # the data path alone
    python bench/tiers.py --tiers files --python-io   # the file tier's Python data path
    python bench/tiers.py --tiers files,s3 --codec zstd,aes-gcm   # through a codec chain
    python bench/tiers.py --quick --json   # tiny sizes; rows as JSON (see _report.py)

By default the bench's thread plays the scheduler: it submits a pass's jobs as fast as it
can, then polls every 0.5 ms, on the same cores and under the same GIL as the tier's IO
threads. ``--queued`` measures the tier's own data path instead: every job of a pass (of each
wave of gets, which the host buffer's slots bound) is submitted while the IO threads are held
at their first slot view, and the time runs from their release until the last job is
collected, polling every 2 ms until as many jobs as IO threads are left, then every 0.1 ms.
The file tier runs its native data path where it was built (the report says which);
``--python-io`` runs its Python one. ``--codec`` (``kvhex.codecs`` names, comma-separated)
stores the kvhex tiers' blocks through that chain (docs/codecs.md; not NIXL, which takes no
codec), and fills the host slots with KV-like bytes (``kvhex.testing.kv_like``) instead of a
repeated pattern, which would compress to nothing: the raw side moves the same bytes
uncoded, so the ratio is what the chain costs or saves on that tier.

A plain script, never a timed test. One untimed round warms both sides up (page cache, the
tier's slab files, the server's connections); then raw and tier passes alternate, each
starting with no dirty page cache left by the other, each figure is the median of
``--repeats`` passes (9 by default), and the ratio is the median of the per-pass ratios, so
both sides see the same machine, with the 95% interval of that median
(``_report.median_interval``; from 6 passes on).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from _report import Report, add_chunk_sizes, add_repeats, parse, summarize
from _s3 import start_loopback_s3
from block_codecs import codec_chain
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.files.posix import PosixSlotMover
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.cli.bench import interval_text
from kvhex.domain import JobId, JobKind, TierJob, make_offload_key

MiB = 1 << 20
QUICK = {"total_mib": 8, "s3_total_mib": 2, "repeats": 1, "batch": 4}
"""Sizes of ``--quick`` (the smoke test's)."""
BASELINES = {
    "files": "raw os.pwrite/os.preadv, one file",
    "nixl": "raw os.pwrite/os.preadv, one file",
    "s3": "raw s3fs pipe/cat, same server",
}


def wait_all(store: FsspecTierStore, n_jobs: int, nap: float = 0.0005, last: int = 0) -> None:
    """Poll until ``n_jobs`` jobs reported, napping ``nap`` between empty polls, and 0.1 ms
    once at most ``last`` jobs are left."""
    done = 0
    while done < n_jobs:
        results = store.poll()
        for result in results:
            assert result.success, result.error
        done += len(results)
        if done < n_jobs and not results:
            time.sleep(nap if n_jobs - done > last else 0.0001)


class HeldHost:
    """The bench's host buffer with a gate: while it is held, a tier's IO threads wait at
    their first slot view, so the jobs submitted meanwhile queue up (``--queued``)."""

    def __init__(self, host: MemoryHostBuffer) -> None:
        self.host = host
        self.num_slots = host.num_slots
        self.slot_bytes = host.slot_bytes
        self._open = threading.Event()
        self._open.set()

    def slot_view(self, slot: int) -> memoryview:
        if not self._open.is_set():  # no lock taken once released
            self._open.wait()
        return self.host.slot_view(slot)

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()


class TierRun:
    """Puts then gets every chunk through one tier, ``batch`` chunks per job. Each put round
    writes new keys, made before any pass is timed (hashing them is the caller's work, as
    vLLM's block hashes are, and the raw baseline has none to make)."""

    def __init__(
        self,
        store: FsspecTierStore,
        host: MemoryHostBuffer | HeldHost,
        n_chunks: int,
        batch: int,
        rounds: int,
    ) -> None:
        self.store, self.host, self.n, self.batch = store, host, n_chunks, batch
        self.held = host if isinstance(host, HeldHost) else None
        self.next_id = 0
        self.round = 0
        self.keys = [
            [
                make_offload_key(hashlib.sha256(f"{r}:{i}".encode()).digest(), 0)
                for i in range(n_chunks)
            ]
            for r in range(rounds + 1)
        ]

    def _jobs(self, kind: JobKind) -> float | None:
        """Submit every chunk, ``batch`` per job. Gets keep at most ``num_slots`` chunks in
        flight, so no two running jobs fill the same slot (as the manager's reservations
        guarantee); puts only read their slots. With a held host (``--queued``), each wave's
        jobs are submitted while the IO threads are held, and the seconds from their release
        to the wave's end are returned, summed over the waves."""
        slots = self.host.num_slots
        submit = self.store.submit_put if kind is JobKind.PUT else self.store.submit_get
        waves: list[list[TierJob]] = [[]]
        in_flight = 0
        for start in range(0, self.n, self.batch):
            ids = range(start, min(start + self.batch, self.n))
            if kind is JobKind.GET and in_flight + len(ids) > slots:
                if self.held is None:
                    wait_all(self.store, len(waves[-1]))
                waves.append([])
                in_flight = 0
            keys = tuple(self.keys[self.round][start : start + len(ids)])
            job = TierJob(JobId(self.next_id), kind, keys, tuple(i % slots for i in ids))
            self.next_id += 1
            if self.held is None:
                submit(job)
            waves[-1].append(job)
            in_flight += len(ids)
        if self.held is None:
            wait_all(self.store, len(waves[-1]))
            return None
        seconds = 0.0
        for wave in waves:
            self.held.hold()
            for job in wave:
                submit(job)
            t0 = time.perf_counter()
            self.held.release()
            wait_all(self.store, len(wave), nap=0.002, last=self.store.io_threads)
            seconds += time.perf_counter() - t0
        return seconds

    def put(self) -> float | None:
        self.round += 1
        seconds = self._jobs(JobKind.PUT)
        self.store.take_events()
        return seconds

    def get(self) -> float | None:
        return self._jobs(JobKind.GET)


Pass = Callable[[], "float | None"]
"""One pass of a side; it returns the seconds it measured itself, or ``None`` (wall time)."""


def timed(fn: Pass, nbytes: int) -> float:
    """GB/s of one call, started with no dirty page cache left by the previous one (either
    side's writeback would otherwise throttle whichever runs next)."""
    os.sync()
    t0 = time.perf_counter()
    seconds = fn()
    return nbytes / (time.perf_counter() - t0 if seconds is None else seconds) / 1e9


def alternating(pairs: dict[str, tuple[Pass, Pass]], nbytes: int, repeats: int) -> dict[str, float]:
    """Median GB/s of raw and tier for each direction, and the median of the per-repeat
    ratios: raw and tier alternate, so both see the same machine (page cache, other load).
    One untimed round first: the first pass of either side pays one-time costs (page cache
    allocation, the tier's slab files, connections) that no later pass does."""
    for raw, tier in pairs.values():
        raw()
        tier()
    rates: dict[str, list[float]] = {}
    for _ in range(repeats):
        for direction, (raw, tier) in pairs.items():
            r, t = timed(raw, nbytes), timed(tier, nbytes)
            rates.setdefault(f"raw {direction}", []).append(r)
            rates.setdefault(f"tier {direction}", []).append(t)
            rates.setdefault(f"ratio {direction}", []).append(t / r)
    return summarize(rates)


def local_files(
    directory: str, chunk: int, args: argparse.Namespace, *, nixl: bool = False
) -> dict[str, float]:
    total, batch, repeats, threads = args.total_mib * MiB, args.batch, args.repeats, args.io_threads
    n = total // chunk
    host = filled_host(min(n, 256), chunk, args)
    # baseline: one preallocated file, positional IO of the same bytes
    path = os.path.join(directory, "raw.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, total)

    def raw_put() -> None:
        for i in range(n):
            os.pwrite(fd, host.slot_view(i % host.num_slots), i * chunk)

    def raw_get() -> None:
        for i in range(n):
            os.preadv(fd, [host.slot_view(i % host.num_slots)], i * chunk)

    root = os.path.join(directory, "tier")
    tier_host = HeldHost(host) if args.queued else host
    if nixl:
        from kvhex.adapters.storage.nixl import NixlTierStore

        store: FsspecTierStore = NixlTierStore(
            tier_host, root, capacity_bytes=total + total // 8, io_threads=threads
        )
    else:
        store = FsspecTierStore(
            tier_host,
            root,
            capacity_bytes=total + total // 8,
            name="files",
            io_threads=threads,
            native_io=False if args.python_io else None,
            codec=args.chain,
        )
    run = TierRun(store, tier_host, n, batch, repeats + 1)  # the untimed round and the timed ones
    try:
        return alternating({"put": (raw_put, run.put), "get": (raw_get, run.get)}, total, repeats)
    finally:
        store.close()
        os.close(fd)
        os.unlink(path)
        shutil.rmtree(root)


def filled_host(slots: int, chunk: int, args: argparse.Namespace) -> MemoryHostBuffer:
    """Host slots of a repeated random pattern, or with a codec chain KV-like bytes."""
    host = MemoryHostBuffer(slots, chunk)
    for s in range(slots):
        if args.chain is None:
            host.slot_view(s)[:] = os.urandom(16) * (chunk // 16)
        else:
            from kvhex.testing import kv_like  # only with --codec: it loads pytest

            host.slot_view(s)[:] = kv_like(chunk, s)
    return host


def s3(chunk: int, args: argparse.Namespace) -> dict[str, float]:
    import concurrent.futures as cf

    import s3fs

    total, batch, repeats, threads = (
        args.s3_total_mib * MiB,
        args.batch,
        args.repeats,
        args.io_threads,
    )
    server = start_loopback_s3()
    opts: dict[str, Any] = {
        "key": "k",
        "secret": "s",
        "endpoint_url": f"http://127.0.0.1:{server.port}",
        "use_listings_cache": False,
        "skip_instance_cache": True,
    }
    fs = s3fs.S3FileSystem(**opts)
    bucket = f"bench-{chunk}"
    fs.mkdir(bucket)
    n = total // chunk
    host = filled_host(min(n, 256), chunk, args)
    tier_host = HeldHost(host) if args.queued else host
    store = FsspecTierStore(
        tier_host,
        f"s3://{bucket}/kv",
        capacity_bytes=2 * total,
        name="s3",
        io_threads=threads,
        storage_options=opts,
        codec=args.chain,
    )
    pool = cf.ThreadPoolExecutor(store.io_threads)  # as many batches in flight as the tier
    starts = range(0, n, batch)

    def put_batch(start: int) -> None:  # overwrites the same objects: moto keeps every byte
        fs.pipe(
            {
                f"{bucket}/raw/{i}": bytes(host.slot_view(i % host.num_slots))
                for i in range(start, min(start + batch, n))
            }
        )

    def get_batch(start: int) -> None:
        paths = [f"{bucket}/raw/{i}" for i in range(start, min(start + batch, n))]
        got = fs.cat(paths)
        for i, path in enumerate(paths, start):
            host.slot_view(i % host.num_slots)[:] = got[path]

    def raw_put() -> None:
        list(pool.map(put_batch, starts))

    def raw_get() -> None:
        list(pool.map(get_batch, starts))

    run = TierRun(store, tier_host, n, batch, repeats + 1)  # the untimed round and the timed ones
    try:
        return alternating({"put": (raw_put, run.put), "get": (raw_get, run.get)}, total, repeats)
    finally:
        store.close()
        pool.shutdown()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument(
        "--s3-total-mib",
        type=int,
        default=512,
        help="MiB through the S3 tier (moto keeps them all in memory)",
    )
    parser.add_argument("--tiers", default="files,nixl,s3")
    parser.add_argument("--batch", type=int, default=16, help="chunks per job (per raw S3 batch)")
    parser.add_argument(
        "--io-threads",
        type=int,
        default=None,
        help="IO threads per tier (default: the tier's own; raw S3 has as many batches in flight)",
    )
    parser.add_argument(
        "--queued",
        action="store_true",
        help="time the tier's data path alone: each pass's jobs queued before its IO threads "
        "start, the bench's thread polling only every 2 ms meanwhile",
    )
    parser.add_argument(
        "--python-io",
        action="store_true",
        help="the file tier moves blocks in Python, not on its native data path",
    )
    parser.add_argument(
        "--dir", default=None, help="where the file tier writes (default: a temp dir)"
    )
    parser.add_argument(
        "--codec",
        default="",
        help="store through this codec chain (kvhex.codecs names, comma-separated); "
        "the slots then hold KV-like bytes",
    )
    add_chunk_sizes(parser)
    add_repeats(parser)
    args = parse(parser, QUICK)
    tiers = args.tiers.split(",")
    args.chain = codec_chain(parser, args.codec, "nixl" in tiers)
    smallest = min([args.total_mib] + ([args.s3_total_mib] if "s3" in tiers else []))
    if max(args.chunk_kib) > smallest * MiB:
        parser.error(f"--chunk-kib: a chunk larger than the {smallest} MiB a pass moves")
    report = Report("tiers", args)
    if "files" in tiers:
        mover = PosixSlotMover(native=False if args.python_io else None)
        checksum = mover.checksum_entry
        path = f"native data path, checksum {checksum}" if checksum else "Python data path"
        report.say(f"files: the {path}")
    if args.queued:
        report.say("each pass's jobs queued before the IO threads start (--queued)")
    if args.chain is not None:
        report.say(f"codec chain: {'+'.join(args.chain.names)}, slots of KV-like bytes")
    head = f"{'tier':<8}{'chunk':>8}{'put GB/s':>10}{'raw':>8}{'ratio':>7}{'95% CI':>12}"
    report.say(head + f"{'get GB/s':>10}{'raw':>8}{'ratio':>7}{'95% CI':>12}")
    for chunk in args.chunk_kib:
        label = f"{chunk // 1024} KiB"
        if "files" in tiers:
            directory = tempfile.mkdtemp(prefix="kvhex-bench-", dir=args.dir)
            try:
                r = local_files(directory, chunk, args)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            _emit(report, "files", label, r, args.queued)
        if "nixl" in tiers:
            directory = tempfile.mkdtemp(prefix="kvhex-bench-", dir=args.dir)
            try:
                r = local_files(directory, chunk, args, nixl=True)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            _emit(report, "nixl", label, r, args.queued)
        if "s3" in tiers:
            r = s3(chunk, args)
            _emit(report, "s3", label, r, args.queued)
    report.finish()


def _emit(report: Report, name: str, label: str, r: dict[str, float], queued: bool) -> None:
    report.say(_row(name, label, r))
    for direction in ("put", "get"):
        report.row(
            f"{name} {label} {direction}" + (" queued" if queued else ""),
            r[f"tier {direction}"],
            r[f"raw {direction}"],
            unit="GB/s",
            baseline_name=BASELINES[name],
            better="higher",
            ratio=r[f"ratio {direction}"],
            interval=(r[f"ratio {direction} low"], r[f"ratio {direction} high"]),
        )


def _row(name: str, label: str, r: dict[str, float]) -> str:
    return (
        f"{name:<8}{label:>8}{r['tier put']:>10.2f}{r['raw put']:>8.2f}{r['ratio put']:>7.2f}"
        f"{interval_text(r['ratio put low'], r['ratio put high']):>12}"
        f"{r['tier get']:>10.2f}{r['raw get']:>8.2f}{r['ratio get']:>7.2f}"
        f"{interval_text(r['ratio get low'], r['ratio get high']):>12}"
    )


if __name__ == "__main__":
    main()
