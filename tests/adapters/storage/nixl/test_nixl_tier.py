"""The NIXL tier for real, CPU-only: the POSIX backend on local files and the OBJ backend on
the loopback S3 server, integrity and restart (the shipped contract kit runs on both in
tests/contracts)."""

from __future__ import annotations

import time
from pathlib import Path

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.format import HEADER_AREA
from kvhex.adapters.storage.nixl import NixlTierStore, obj_backend_threads
from kvhex.adapters.storage.objects.s3_direct import REQUESTS_IN_FLIGHT
from kvhex.domain import JobId, JobKind, Removed, Stored, TierJob
from tests.adapters.conftest import CREDENTIALS, Wire
from tests.adapters.jobs import key, run
from tests.adapters.storage.peer_kit import Events, blocks, fill, put, request, started

SLOT = 4096
NS = {"model": "tiny-llama"}


def test_posix_blocks_are_verified_and_survive_a_restart(tmp_path: Path) -> None:
    host = MemoryHostBuffer(4, SLOT)
    for s in range(2):
        host.slot_view(s)[:] = bytes([s + 1]) * SLOT
    store = NixlTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    assert run(store, JobKind.PUT, [1, 2], [0, 1]).success
    store.close()
    again = NixlTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    (inventory,) = again.take_events()
    assert isinstance(inventory, Stored)
    assert set(inventory.keys) == {key(1), key(2)}
    path, offset = again.location(key(2))
    with open(path, "r+b") as slab:  # flip a payload byte in its slot
        slab.seek(offset + HEADER_AREA + SLOT - 5)
        byte = slab.read(1)[0]
        slab.seek(offset + HEADER_AREA + SLOT - 5)
        slab.write(bytes([byte ^ 1]))
    result = run(again, JobKind.GET, [1, 2], [2, 3])
    assert result.ok_keys == frozenset({key(1)})
    assert bytes(host.slot_view(2)) == bytes([1]) * SLOT
    (removed,) = again.take_events()
    assert isinstance(removed, Removed)
    assert removed.keys == (key(2),)
    again.close()


def _all(store: NixlTierStore, kind: JobKind, jobs: list[list[tuple[int, int]]]) -> list[bool]:
    """Submit every job (chunk ids with their slots) at once, then wait for all results."""
    submitted = []
    for n, pairs in enumerate(jobs):
        job = TierJob(
            JobId(9000 + n), kind, tuple(key(i) for i, _ in pairs), tuple(s for _, s in pairs)
        )
        (store.submit_put if kind is JobKind.PUT else store.submit_get)(job)
        submitted.append(job.job_id)
    results: dict[int, bool] = {}
    deadline = time.monotonic() + 30
    while len(results) < len(jobs) and time.monotonic() < deadline:
        results.update((r.job_id, r.success) for r in store.poll())
        time.sleep(0.002)
    return [results.get(j, False) for j in submitted]


def test_posix_jobs_on_every_io_thread_at_once_move_exact_bytes(tmp_path: Path) -> None:
    """Each IO thread has its own NIXL agent: jobs in flight together, then a second
    instance reading the first one's slabs, all byte for byte."""
    host = MemoryHostBuffer(32, SLOT)
    for s in range(32):
        host.slot_view(s)[:] = bytes([s + 1]) * SLOT
    store = NixlTierStore(host, str(tmp_path), capacity_bytes=1 << 22, namespace=NS, io_threads=4)
    puts = [[(i, i) for i in range(j, j + 4)] for j in range(0, 32, 4)]
    assert _all(store, JobKind.PUT, puts) == [True] * 8
    for s in range(32):
        host.slot_view(s)[:] = bytes(SLOT)
    gets = [[(i, 31 - i) for i in range(j, j + 4)] for j in range(0, 32, 4)]
    assert _all(store, JobKind.GET, gets) == [True] * 8
    assert [bytes(host.slot_view(31 - i)) for i in range(32)] == [
        bytes([i + 1]) * SLOT for i in range(32)
    ]
    peer = NixlTierStore(host, str(tmp_path), capacity_bytes=1 << 22, namespace=NS, io_threads=2)
    for s in range(32):
        host.slot_view(s)[:] = bytes(SLOT)
    halves = [[(i, i) for i in range(16)], [(i, i) for i in range(16, 32)]]
    assert _all(peer, JobKind.GET, halves) == [True, True]
    assert [bytes(host.slot_view(i)) for i in range(32)] == [
        bytes([i + 1]) * SLOT for i in range(32)
    ]
    peer.close()
    store.close()


def test_obj_blocks_go_without_a_transport_checksum(wire_s3_server: Wire) -> None:
    """NIXL's S3 client is asked for a checksum only where an operation requires one (by
    default it streams every PUT as aws-chunked with a CRC64 trailer and asks every GET for
    the object's checksum): every block carries its own, verified on every read."""
    wire = wire_s3_server
    host = MemoryHostBuffer(1, SLOT)
    block = bytes(range(256)) * (SLOT // 256)
    host.slot_view(0)[:] = block
    store = NixlTierStore(
        host,
        f"s3://{wire.bucket}/kv",
        capacity_bytes=1 << 20,
        namespace=NS,
        endpoint_url=wire.endpoint,
        access_key=CREDENTIALS["key"],
        secret_key=CREDENTIALS["secret"],
        locality=None,
    )
    try:
        assert run(store, JobKind.PUT, [0]).success
        host.slot_view(0)[:] = bytes(SLOT)
        assert run(store, JobKind.GET, [0]).success
    finally:
        store.close()
    assert bytes(host.slot_view(0)) == block
    assert wire.block_requests("PUT")
    assert wire.block_requests("GET")
    assert wire.checksums() == []


def test_obj_jobs_move_their_blocks_side_by_side(wire_s3_server: Wire) -> None:
    """Each IO thread's agent keeps its share of ``REQUESTS_IN_FLIGHT`` requests going (NIXL's
    default is half the cores: one at a time on a 2-core machine): a job of 16 blocks, on one
    of two IO threads, has all 16 at the server at once, both ways (the server holds each
    block request until 16 are there, or 3 s), and its blocks come back whole."""
    wire = wire_s3_server
    assert REQUESTS_IN_FLIGHT == 32
    assert [obj_backend_threads(n) for n in (1, 3, 4, 8, 32, 33, 100)] == [32, 10, 8, 4, 1, 1, 1]
    blocks = obj_backend_threads(2)
    host = MemoryHostBuffer(2 * blocks, SLOT)
    for s in range(blocks):
        host.slot_view(s)[:] = bytes([s + 1]) * SLOT
    store = NixlTierStore(
        host,
        f"s3://{wire.bucket}/kv",
        capacity_bytes=1 << 20,
        namespace=NS,
        io_threads=2,
        endpoint_url=wire.endpoint,
        access_key=CREDENTIALS["key"],
        secret_key=CREDENTIALS["secret"],
        locality=None,
    )
    wire.gather.update(PUT=blocks, GET=blocks)
    try:
        assert run(store, JobKind.PUT, list(range(blocks))).success
        result = run(store, JobKind.GET, list(range(blocks)), list(range(blocks, 2 * blocks)))
    finally:
        store.close()
    assert result.success
    assert result.ok_keys is None  # every block read whole
    assert [bytes(host.slot_view(blocks + s)) for s in range(blocks)] == [
        bytes([s + 1]) * SLOT for s in range(blocks)
    ]
    assert wire.peak == {"PUT": 16, "GET": 16}


def test_posix_blocks_keep_records_a_restart_and_a_peer_announce_in_full(tmp_path: Path) -> None:
    """NIXL's POSIX mover stages each header with its chunk record: a restart announces the
    adopted blocks in full, as a peer with ``announce_peers`` announced them before."""
    host = MemoryHostBuffer(8, SLOT)
    fill(host, range(8), 5)
    store = NixlTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    peer = NixlTierStore(
        host,
        str(tmp_path),
        capacity_bytes=1 << 20,
        namespace=NS,
        name="peer",
        announce_peers=True,
        peer_scan_interval_s=0.05,
    )
    ctx, keys = request("r", 3, cache_salt="s")
    assert put(store, keys, ctx).success
    want, _ = blocks(store.take_events())
    on_peer = Events(peer)
    on_peer.until(lambda: on_peer.held(peer.peer_identity) == set(keys), "the peer credits them")
    assert blocks(on_peer.raw) == (want, [])
    peer.close()
    store.close()
    again = NixlTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    assert blocks(again.take_events()) == (want, [])
    again.close()


def test_obj_blocks_keep_records_the_fsspec_tier_reads(s3_server: str, bucket: str) -> None:
    """NIXL's OBJ mover writes the fsspec tier's objects, records included: an fsspec tier
    listing the bucket announces NIXL's blocks in full."""
    from kvhex.adapters.storage.fsspec import FsspecTierStore
    from tests.adapters.conftest import s3_options

    host = MemoryHostBuffer(8, SLOT)
    fill(host, range(8), 5)
    store = NixlTierStore(
        host,
        f"s3://{bucket}/kv",
        capacity_bytes=1 << 20,
        namespace=NS,
        endpoint_url=s3_server,
        access_key=CREDENTIALS["key"],
        secret_key=CREDENTIALS["secret"],
        locality=None,
    )
    ctx, keys = request("r", 3, lora_id=2, lora_name="adapter")
    try:
        assert put(store, keys, ctx).success
        want, _ = blocks(store.take_events())
    finally:
        store.close()
    reader = FsspecTierStore(
        host,
        f"s3://{bucket}/kv",
        capacity_bytes=1 << 20,
        namespace=NS,
        storage_options=s3_options(s3_server),
        locality=None,
    )
    assert blocks(started(reader).take_events()) == (want, [])
    reader.close()
