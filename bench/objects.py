"""Object-store throughput: kvhex's S3 tiers beside vLLM 0.33's own object tier, same server.

For each server (``--server``: SeaweedFS, a real S3 server in Go, and moto, a Python
imitation; both by default) and chunk size (``--chunk-kib``: 2 MiB and 256 KiB by default),
``--total-mib`` (512 MiB by default) go host -> store (put) and store -> host (get) through
three tiers talking to one loopback S3 server in a process of its own, as S3 is (its speed, not
S3's, bounds every side):

* the baseline, vLLM's ``ObjectStoreSecondaryTierManager`` (tier type ``obj``: NIXL's OBJ
  backend), built by vLLM's ``SecondaryTierFactory`` on a real host buffer of up to 256
  rows of one chunk each, driven through its public methods (``submit_store`` / ``submit_load``,
  ``get_finished_jobs``) as vLLM's tiering manager drives it;
* kvhex's ``fsspec`` tier on ``s3://`` (its own signed PUTs and GETs) and kvhex's
  ``nixl`` tier on ``s3://`` (NIXL's OBJ backend), built through kvhex's plugin registry,
  driven through ``submit_put`` / ``submit_get`` / ``poll``.

Every side gets the same chunks, ``--batch`` chunks per job, every job submitted at once (a
get keeps at most one host buffer's worth of chunks in flight, as the managers' reservations
guarantee), and is polled every millisecond. ``--io-threads`` (4 by default: vLLM's default
for its tier) is passed to all three: vLLM's tier hands it to its one NIXL agent's OBJ
backend as ``num_threads``; kvhex's tiers run that many IO threads (the nixl tier with one
NIXL agent each). The report names each side's concurrency, and under each chunk size the
cores the server process kept busy during each side's passes: near 1.0 for every side, the
one Python server (one GIL) sets the pace, and the ratios measure it more than the tiers.
``--server-latency-ms`` holds every request that long before the server serves it, as a store
off the machine answers after a round trip: throughput then follows the requests each side
keeps in flight.

    .venv-vllm/bin/python bench/objects.py [--total-mib 512] [--tiers s3,nixl] [--io-threads 4]
    .venv-vllm/bin/python bench/objects.py --quick --json   # tiny sizes; rows as JSON
    .venv-vllm/bin/python bench/objects.py --server-latency-ms 20  # a store 20 ms away

vLLM is imported from ``.venv-vllm`` (``make vllm-test`` builds it). Where vLLM is not
importable the script says so and measures kvhex's tiers alone (rows without a baseline).

NIXL: vLLM's tier imports ``nixl._api``. The ``nixl`` meta package picks ``nixl_cu13`` on a
CPU-only torch, whose OBJ plugin cannot load there, so before vLLM is imported this script
points ``nixl`` and its submodules (``sys.modules``) at ``nixl_cu12``, the build kvhex's nixl
tier imports directly: both sides then run the same NIXL library. A process that imported
``nixl`` already keeps it.

A plain script, never a timed test. One untimed round warms every side up (connections,
NIXL agents, the server's buckets); then the sides alternate, put then get, in an order that
rotates each pass; each figure is the median of ``--repeats`` passes and each ratio the median
of the per-pass ratios (kvhex / vLLM), so all sides see the same machine. Keys are new in
every pass (kvhex's tiers skip keys they hold; vLLM's tier would overwrite), and between
passes, untimed, the bench deletes the pass's block objects with s3fs so that the server
holds one pass at a time; kvhex's tiers get a capacity no pass evicts from.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import _vllm
from _report import Report, add_chunk_sizes, add_repeats, parse, summarize
from _s3 import LoopbackS3, start_loopback_s3, start_seaweedfs
from block_codecs import codec_chain
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.nixl import obj_backend_threads
from kvhex.adapters.storage.objects.s3_direct import REQUESTS_IN_FLIGHT
from kvhex.cli.bench import interval_text
from kvhex.domain import JobId, JobKind, TierJob, make_offload_key
from kvhex.plugins import TIERS, Registry

MiB = 1 << 20
QUICK = {"total_mib": 2, "repeats": 1, "batch": 4}
"""Sizes of ``--quick`` (the smoke test's)."""
POLL_S = 0.001
"""How long every side's driver sleeps between two polls that found nothing finished."""
MAX_SLOTS = 256
"""Rows of the host buffer: a get keeps at most this many chunks in flight."""
BUCKET = "bench"
BASELINE = "vLLM 0.33 obj tier (NIXL OBJ), same server"
ACCESS = {"key": "bench", "secret": "bench-secret"}
NAMES = {"s3": "kvhex s3 (fsspec tier)", "nixl": "kvhex nixl (nixl tier, OBJ)"}
SERVERS = {"seaweedfs": "SeaweedFS 4.48 (weed mini)", "moto": "moto"}
"""``--server`` choices, in the order ``both`` runs them."""
WHERE_VLLM = (
    "vllm: not importable here ({why}); the baseline, vLLM 0.33's obj tier, runs in "
    ".venv-vllm (make vllm-test builds it): .venv-vllm/bin/python bench/objects.py. "
    "Measuring kvhex's tiers alone (no ratios)."
)


def chunk_key(round_: int, i: int) -> bytes:
    """The block hash of chunk ``i`` in pass ``round_``: new keys every pass."""
    return hashlib.sha256(f"{round_}:{i}".encode()).digest()


def waves(n: int, batch: int, slots: int, kind: str) -> list[list[list[int]]]:
    """Chunk indices in jobs of ``batch``, grouped in waves submitted together: all of a put
    at once (puts only read their slots), a get's at most ``slots`` chunks at a time (no two
    running jobs fill the same slot)."""
    jobs = [list(range(s, min(s + batch, n))) for s in range(0, n, batch)]
    if kind == "put":
        return [jobs]
    out: list[list[list[int]]] = [[]]
    in_wave = 0
    for job in jobs:
        if out[-1] and in_wave + len(job) > slots:
            out.append([])
            in_wave = 0
        out[-1].append(job)
        in_wave += len(job)
    return out


class KvhexRun:
    """Puts then gets every chunk through one kvhex tier, ``batch`` chunks per job."""

    def __init__(self, store: Any, host: MemoryHostBuffer, n: int, batch: int) -> None:
        self.store, self.host, self.n, self.batch = store, host, n, batch
        self.next_id = 0
        self.round = 0

    def _wait(self, n_jobs: int) -> None:
        done = 0
        while done < n_jobs:
            results = self.store.poll()
            for result in results:
                if not result.success:
                    raise RuntimeError(f"kvhex job {result.job_id} failed: {result.error}")
            done += len(results)
            if not results:
                time.sleep(POLL_S)

    def _jobs(self, kind: JobKind) -> None:
        slots = self.host.num_slots
        submit = self.store.submit_put if kind is JobKind.PUT else self.store.submit_get
        for wave in waves(self.n, self.batch, slots, "put" if kind is JobKind.PUT else "get"):
            for ids in wave:
                keys = tuple(make_offload_key(chunk_key(self.round, i), 0) for i in ids)
                submit(TierJob(JobId(self.next_id), kind, keys, tuple(i % slots for i in ids)))
                self.next_id += 1
            self._wait(len(wave))

    def put(self) -> None:
        self.round += 1
        self._jobs(JobKind.PUT)
        self.store.take_events()

    def get(self) -> None:
        self._jobs(JobKind.GET)


class VllmRun:
    """Stores then loads every chunk through vLLM's obj tier, ``batch`` chunks per job, as its
    tiering manager does: submit, then ``get_finished_jobs`` until every job reported."""

    def __init__(self, tier: Any, rows: int, n: int, batch: int) -> None:
        import numpy as np
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.base import make_offload_key as vllm_key
        from vllm.v1.kv_offload.tiering.base import TransferJob

        self.np, self.key, self.job = np, vllm_key, TransferJob
        self.ctx = ReqContext(req_id="bench")
        self.tier, self.rows, self.n, self.batch = tier, rows, n, batch
        self.next_id = 0
        self.round = 0

    def _wait(self, n_jobs: int) -> None:
        done = 0
        while done < n_jobs:
            results = list(self.tier.get_finished_jobs())
            for result in results:
                if not result.success:
                    raise RuntimeError(f"vLLM obj tier job {result.job_id} failed")
            done += len(results)
            if not results:
                time.sleep(POLL_S)

    def _jobs(self, kind: str) -> None:
        np = self.np
        submit = self.tier.submit_store if kind == "put" else self.tier.submit_load
        for wave in waves(self.n, self.batch, self.rows, kind):
            for ids in wave:
                submit(
                    self.job(
                        job_id=self.next_id,
                        keys=[self.key(chunk_key(self.round, i), 0) for i in ids],
                        chunk_ids=np.array([i % self.rows for i in ids], dtype=np.int32),
                        is_promotion=kind == "get",
                        req_context=self.ctx,
                    )
                )
                self.next_id += 1
            self._wait(len(wave))

    def put(self) -> None:
        self.round += 1
        self._jobs("put")

    def get(self) -> None:
        self._jobs("get")


def alias_nixl_to_cu12() -> None:
    """Point ``nixl`` (what vLLM imports) at ``nixl_cu12`` (see the module docstring)."""
    if "nixl" in sys.modules:
        return
    package = importlib.import_module("nixl_cu12")
    sys.modules["nixl"] = package
    for sub in ("_bindings", "_utils", "logging", "_api"):
        module = importlib.import_module(f"nixl_cu12.{sub}")
        sys.modules[f"nixl.{sub}"] = module
        setattr(package, sub, module)
    # what vLLM sets before it imports NIXL itself (it warns when it finds NIXL imported)
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")


def vllm_missing() -> str | None:
    """Why vLLM's obj tier cannot be built here, or None (NIXL aliased first, see
    :func:`alias_nixl_to_cu12`)."""
    try:
        alias_nixl_to_cu12()
        importlib.import_module("vllm.v1.kv_offload.tiering.obj.manager")
        importlib.import_module("vllm.v1.kv_offload.tiering.spec")
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def vllm_tier(chunk: int, rows: Any, endpoint: str, io_threads: int) -> Any:
    """vLLM's obj tier over ``rows`` (a ``rows x chunk`` uint8 array), built as vLLM's
    ``TieringOffloadingSpec`` builds its secondary tiers: by ``SecondaryTierFactory`` from a
    tier config, with a one-group, one-worker offloading config whose block is one chunk."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = _vllm.offloading_config(
        block_bytes=chunk, cpu_bytes=rows.nbytes, engine_id="kvhex-bench"
    )
    entry = {
        "type": "obj",
        "prefix": "vllm",
        "io_threads": io_threads,
        "store_config": {
            "bucket": BUCKET,
            "endpoint_override": endpoint,
            "scheme": "http",
            "region": "us-east-1",
            "access_key": ACCESS["key"],
            "secret_key": ACCESS["secret"],
        },
    }
    spec = TieringOffloadingSpec(config)
    return SecondaryTierFactory.create_secondary_tier(entry, memoryview(rows), spec)


def kvhex_tier(
    name: str,
    host: MemoryHostBuffer,
    endpoint: str,
    capacity: int,
    io_threads: int,
    *,
    chain: Any = None,
) -> Any:
    """kvhex's ``fsspec`` (s3fs) or ``nixl`` (NIXL OBJ) tier, through the plugin registry;
    ``chain``: the S3 tier's codec chain (``--codec``)."""
    tier = Registry.discover([TIERS]).load(TIERS, "fsspec" if name == "s3" else "nixl")
    url = f"s3://{BUCKET}/kvhex-{name}"
    if name == "s3":
        options = {
            **ACCESS,
            "endpoint_url": endpoint,
            "use_listings_cache": False,
            "skip_instance_cache": True,
        }
        return tier(
            host,
            url,
            capacity_bytes=capacity,
            name="s3",
            io_threads=io_threads,
            storage_options=options,
            codec=chain,
        )
    return tier(
        host,
        url,
        capacity_bytes=capacity,
        name="nixl",
        io_threads=io_threads,
        endpoint_url=endpoint,
        access_key=ACCESS["key"],
        secret_key=ACCESS["secret"],
    )


def timed(fn: Callable[[], None], nbytes: int, server: LoopbackS3) -> tuple[float, float | None]:
    """GB/s of one call, started with no dirty page cache left by the previous one (moto
    spools large objects to temporary files), and the cores the server kept busy meanwhile
    (``None`` where that cannot be read)."""
    os.sync()
    before = server.cpu_seconds()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    after = server.cpu_seconds()
    cores = None if before is None or after is None else (after - before) / seconds
    return nbytes / seconds / 1e9, cores


def one_size(
    chunk: int, sides: list[str], args: argparse.Namespace, with_vllm: bool, kind: str
) -> dict[str, float]:
    """Median GB/s of every side and direction, and the median per-pass ratios to vLLM."""
    import s3fs

    total, batch, repeats, threads = args.total_mib * MiB, args.batch, args.repeats, args.io_threads
    n = max(1, total // chunk)
    nbytes = n * chunk
    rows = min(n, MAX_SLOTS)
    if kind == "seaweedfs":
        server = start_seaweedfs(ACCESS["key"], ACCESS["secret"])
    else:
        server = start_loopback_s3(args.server_latency_ms / 1000)
    endpoint = f"http://127.0.0.1:{server.port}"
    fs = s3fs.S3FileSystem(
        **ACCESS, endpoint_url=endpoint, use_listings_cache=False, skip_instance_cache=True
    )
    fs.mkdir(BUCKET)
    # a repeated pattern compresses to nothing: with a codec chain, KV-like bytes on every side
    if args.chain is None:
        pattern = os.urandom(16) * (chunk // 16)
    else:
        from kvhex.testing import kv_like  # only with --codec: it loads pytest

        pattern = kv_like(chunk, 0)
    runs: dict[str, Any] = {}
    closers: list[Callable[[], None]] = []
    try:
        if with_vllm:
            import numpy as np

            array = np.frombuffer(pattern * rows, dtype=np.uint8).reshape(rows, chunk).copy()
            tier = vllm_tier(chunk, array, endpoint, threads)
            closers.append(tier.shutdown)
            runs["vllm"] = VllmRun(tier, rows, n, batch)
        capacity = 4 * nbytes * (repeats + 2)  # never evicts: the bench deletes, not the tier
        for name in sides:
            host = MemoryHostBuffer(rows, chunk)
            for s in range(rows):
                host.slot_view(s)[:] = pattern
            store = kvhex_tier(name, host, endpoint, capacity, threads, chain=args.chain)
            closers.append(store.close)
            runs[name] = KvhexRun(store, host, n, batch)

        def clean() -> None:
            """Delete the pass's block objects (kvhex's namespace configs stay)."""
            found = [p for p in fs.find(BUCKET) if not p.endswith("/config.json")]
            if found:
                fs.rm(found)

        order = list(runs)
        for side in order:  # untimed warm-up round
            runs[side].put()
        for side in order:
            runs[side].get()
        clean()
        rates: dict[str, list[float]] = {}
        for r in range(repeats):
            turn = order[r % len(order) :] + order[: r % len(order)]
            for direction in ("put", "get"):
                got = {side: timed(getattr(runs[side], direction), nbytes, server) for side in turn}
                for side, (rate, cores) in got.items():
                    rates.setdefault(f"{side} {direction}", []).append(rate)
                    if cores is not None:
                        rates.setdefault(f"{side} server {direction}", []).append(cores)
                    if with_vllm and side != "vllm":
                        ratio = rate / got["vllm"][0]
                        rates.setdefault(f"{side} ratio {direction}", []).append(ratio)
            clean()
        return summarize(rates)
    finally:
        for close in reversed(closers):
            close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--total-mib",
        type=int,
        default=512,
        help="MiB each side puts and gets per pass and chunk size (moto holds one pass)",
    )
    parser.add_argument("--tiers", default="s3,nixl", help="kvhex tiers: s3, nixl or both")
    parser.add_argument(
        "--server",
        choices=[*SERVERS, "both"],
        default="both",
        help="the S3 server: seaweedfs (real), moto (an imitation) or both (default)",
    )
    parser.add_argument("--batch", type=int, default=16, help="chunks per job, every side")
    parser.add_argument(
        "--io-threads",
        type=int,
        default=4,
        help="every side's IO threads (vLLM's obj tier defaults to 4)",
    )
    parser.add_argument(
        "--server-latency-ms",
        type=_latency,
        default=0.0,
        help="hold every moto request this long before it is answered (default 0: loopback)",
    )
    parser.add_argument(
        "--codec",
        default="",
        help="the S3 tier stores through this codec chain (kvhex.codecs names, comma-separated)"
        "; every side then moves KV-like bytes",
    )
    add_chunk_sizes(parser)
    add_repeats(parser)
    args = parse(parser, QUICK)
    report = Report("objects", args)
    sides = [s for s in args.tiers.split(",") if s]
    args.chain = codec_chain(parser, args.codec, "nixl" in sides)
    unknown = set(sides) - set(NAMES)
    if unknown:
        parser.error(f"--tiers: unknown {', '.join(sorted(unknown))} (s3, nixl)")
    servers = list(SERVERS) if args.server == "both" else [args.server]
    if args.server_latency_ms and servers != ["moto"]:
        parser.error("--server-latency-ms: moto only (add --server moto)")
    missing = vllm_missing()
    with_vllm = missing is None
    t, b = args.io_threads, args.batch
    latency = args.server_latency_ms
    report.say(
        f"objects: {args.total_mib} MiB each way per pass, {b} chunks per job, "
        f"{args.repeats} passes, on loopback in a process of its own: "
        + ", then ".join(SERVERS[kind] for kind in servers)
        + (f", every request held {latency:g} ms before it is served" if latency else "")
    )
    if with_vllm:
        report.say(
            f"  vllm obj (baseline): one NIXL agent, OBJ backend num_threads={t}, "
            "one transfer per job, every job submitted at once"
        )
    else:
        report.say(WHERE_VLLM.format(why=missing))
    if "s3" in sides:
        report.say(
            f"  {NAMES['s3']}: {t} IO threads, a job at a time each; kvhex's own signed PUTs "
            f"and GETs (up to {min(t * b, REQUESTS_IN_FLIGHT)} in flight)"
        )
    if "nixl" in sides:
        report.say(
            f"  {NAMES['nixl']}: {t} IO threads, a job at a time each, one NIXL OBJ agent each "
            f"with {obj_backend_threads(t)} OBJ backend threads "
            f"(up to {t * min(b, obj_backend_threads(t))} requests in flight)"
        )
    head = f"{'tier':<6}{'chunk':>9}{'put GB/s':>10}{'vllm':>8}{'ratio':>7}{'95% CI':>12}"
    for kind in servers:
        report.say(f"server: {SERVERS[kind]}")
        report.say(head + f"{'get GB/s':>10}{'vllm':>8}{'ratio':>7}{'95% CI':>12}")
        for chunk in args.chunk_kib:
            _one_chunk(report, kind, chunk, sides, args, with_vllm=with_vllm)
    report.finish()


def _one_chunk(
    report: Report,
    kind: str,
    chunk: int,
    sides: list[str],
    args: argparse.Namespace,
    *,
    with_vllm: bool,
) -> None:
    """Measure one chunk size on one server and report its lines and rows."""
    label = f"{chunk // 1024} KiB"
    r = one_size(chunk, sides, args, with_vllm, kind)
    for side in sides:
        report.say(_line(side, label, r))
        for direction in ("put", "get"):
            report.row(
                f"{kind} {side} {label} {direction}",
                r[f"{side} {direction}"],
                r.get(f"vllm {direction}"),
                unit="GB/s",
                baseline_name=BASELINE,
                better="higher",
                ratio=r.get(f"{side} ratio {direction}"),
                interval=(
                    r.get(f"{side} ratio {direction} low"),
                    r.get(f"{side} ratio {direction} high"),
                ),
            )
    busy = _server_line(["vllm", *sides] if with_vllm else sides, r)
    if busy:
        report.say(busy)


def _latency(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None
    if not 0 <= value <= 10_000:
        raise argparse.ArgumentTypeError(f"{text!r}: from 0 to 10000 ms")
    return value


def _server_line(sides: list[str], r: dict[str, float]) -> str:
    """The cores the server kept busy during each side's passes (medians), or ``""``: near
    1.0 for every side, the one server process bounds them all alike."""
    parts = []
    for direction in ("put", "get"):
        busy = [
            f"{side} {r[f'{side} server {direction}']:.2f}"
            for side in sides
            if f"{side} server {direction}" in r
        ]
        if busy:
            parts.append(f"{direction} {', '.join(busy)}")
    return f"  server CPU, cores (median of passes): {'; '.join(parts)}" if parts else ""


def _line(side: str, label: str, r: dict[str, float]) -> str:
    def fmt(name: str, width: int, digits: int) -> str:
        value = r.get(name)
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

    def interval(name: str) -> str:
        return f"{interval_text(r.get(name + ' low'), r.get(name + ' high')):>12}"

    return f"{side:<6}{label:>9}" + "".join(
        fmt(f"{side} {d}", 10, 3)
        + fmt(f"vllm {d}", 8, 3)
        + fmt(f"{side} ratio {d}", 7, 2)
        + interval(f"{side} ratio {d}")
        for d in ("put", "get")
    )


if __name__ == "__main__":
    main()
