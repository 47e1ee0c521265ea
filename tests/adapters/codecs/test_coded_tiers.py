"""Coded blocks on real storage: the file tier (both data paths), S3 on the session's
SeaweedFS and a real Valkey server, each with a codec chain. Frames round-trip, another
chain never sees them, a tenant's sealed blocks are misses for another tenant and stay, a
frame whose stored bytes or decoding fail is never served, and ``kvhex fsck`` checks coded
roots."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvhex.adapters.codecs.aesgcm import KEY_ENV, AesGcmCodec
from kvhex.adapters.codecs.chain import CodecChain
from kvhex.adapters.codecs.fp8 import Fp8Codec
from kvhex.adapters.codecs.lz4 import Lz4Codec
from kvhex.adapters.codecs.zstd import ZstdCodec
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.files.fsck import check_root
from kvhex.adapters.storage.format import (
    HEADER_AREA,
    KeptRecord,
    checksum,
    kept_record,
    parse_header,
)
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.adapters.storage.records import chunk_records, decode_record, encode_record
from kvhex.adapters.storage.tier import BlockTierStore
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.domain import JobId, JobKind, TierJob
from kvhex.domain.events import Removed
from kvhex.ports import TenantRefusals
from kvhex.testing import kv_like
from tests.adapters.conftest import s3_options
from tests.adapters.storage.peer_kit import Events, blocks, put, request, run_job
from tests.adapters.storage.valkey.servers import PASSWORD, Server, flush

SLOT = 1 << 15
NS = {"model": "tiny-llama", "blocks_per_chunk": 1, "kv_cache_dtype": "float16"}
MASTER = "3c" * 32

Opener = Callable[[MemoryHostBuffer, list[Any]], BlockTierStore]


@pytest.fixture(autouse=True)
def master_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, MASTER)


def host_with_kv() -> MemoryHostBuffer:
    host = MemoryHostBuffer(16, SLOT)
    for s in range(8):
        host.slot_view(s)[:] = kv_like(SLOT, s)
    return host


def get_for(store: BlockTierStore, keys: list[Any], slots: list[int], ctx: Any) -> Any:
    job = TierJob(JobId(uuid.uuid4().int % 1_000_000), JobKind.GET, tuple(keys), tuple(slots), ctx)
    return run_job(store, job)


@pytest.fixture(params=["files-native", "files-python", "s3", "valkey"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    kind = request.param
    if kind.startswith("files"):
        native = None if kind == "files-native" else False

        def files(host: MemoryHostBuffer, codec: list[Any]) -> BlockTierStore:
            return FsspecTierStore(
                host,
                str(tmp_path),
                capacity_bytes=1 << 24,
                namespace=NS,
                native_io=native,
                codec=codec,
            )

        yield files
    elif kind == "s3":
        endpoint = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("bucket")

        def s3(host: MemoryHostBuffer, codec: list[Any]) -> BlockTierStore:
            return FsspecTierStore(
                host,
                f"s3://{bucket}/kv",
                capacity_bytes=1 << 24,
                namespace=NS,
                storage_options=s3_options(endpoint),
                codec=codec,
            )

        yield s3
    else:
        server: Server = request.getfixturevalue("valkey_standalone")
        url = f"valkey://127.0.0.1:{server.port}/kv-{uuid.uuid4().hex[:8]}"

        def valkey(host: MemoryHostBuffer, codec: list[Any]) -> BlockTierStore:
            return ValkeyTierStore(
                host, url, capacity_bytes=1 << 24, namespace=NS, password=PASSWORD, codec=codec
            )

        yield valkey
        flush([server.port], password=PASSWORD)


def settled(store: BlockTierStore) -> BlockTierStore:
    store.drain()
    store.poll()
    return store


def test_frames_round_trip_and_another_chain_never_sees_them(opener: Opener) -> None:
    host = host_with_kv()
    ctx, keys = request("r", 4, cache_salt="tenant-a")
    store = opener(host, [ZstdCodec(), AesGcmCodec()])
    assert put(store, keys, ctx).success
    result = get_for(store, keys, [8, 9, 10, 11], ctx)
    assert result.success, result
    assert [bytes(host.slot_view(8 + i)) for i in range(4)] == [kv_like(SLOT, i) for i in range(4)]
    store.close()
    other = settled(opener(host, [Lz4Codec(), AesGcmCodec()]))  # another namespace digest
    assert other.keys() == []
    assert not get_for(other, keys[:1], [12], ctx).success
    other.close()
    again = settled(opener(host, [ZstdCodec(), AesGcmCodec()]))
    assert set(again.keys()) == set(keys)  # adopted after a restart
    host.slot_view(12)[:] = bytes(SLOT)
    assert get_for(again, keys[:1], [12], ctx).success
    assert bytes(host.slot_view(12)) == kv_like(SLOT, 0)
    again.close()


def test_a_tenants_sealed_block_is_a_miss_for_another_and_stays(opener: Opener) -> None:
    host = host_with_kv()
    alice, keys = request("alice", 2, cache_salt="alice")
    store = opener(host, [AesGcmCodec()])
    events = Events(store)
    assert put(store, keys, alice).success
    events.take()
    mallory, _ = request("mallory", 2, cache_salt="mallory")
    host.slot_view(8)[:] = bytes(SLOT)
    refused = get_for(store, keys, [8, 9], mallory)
    assert not refused.success
    assert not refused.ok_keys
    assert "refused" in (refused.error or "")
    assert bytes(host.slot_view(8)) != kv_like(SLOT, 0)  # nothing of it reached the slot
    assert isinstance(store, TenantRefusals)
    assert store.refused_blocks == 2  # what TierStats and kvhex_tier_refused_blocks_total read
    events.take()
    assert not any(isinstance(e, Removed) for e in events.raw)  # never dropped for her
    assert set(store.keys()) == set(keys)
    assert get_for(store, keys, [8, 9], alice).success  # still the owner's
    assert bytes(host.slot_view(8)) == kv_like(SLOT, 0)
    store.close()


def test_a_lossy_chain_holds_more_blocks_in_the_same_bytes(tmp_path: Path) -> None:
    host = host_with_kv()
    raw = FsspecTierStore(host, str(tmp_path / "raw"), capacity_bytes=1 << 20, namespace=NS)
    fp8 = FsspecTierStore(
        host,
        str(tmp_path / "fp8"),
        capacity_bytes=1 << 20,
        namespace=NS,
        codec=[Fp8Codec(dtype="float16"), ZstdCodec(shuffle=0)],
    )
    per_raw = HEADER_AREA + SLOT
    per_fp8 = HEADER_AREA + fp8.namespace["stored_bytes"]
    assert per_fp8 <= HEADER_AREA + 0.65 * SLOT  # 0.53x and a frame, in whole pages
    assert (1 << 20) // per_fp8 >= 1.4 * ((1 << 20) // per_raw)
    ctx, keys = request("r", 2)
    assert put(fp8, keys, ctx).success
    assert get_for(fp8, keys, [8, 9], ctx).success
    loaded = struct.unpack(f"<{SLOT // 2}e", host.slot_view(8))
    original = struct.unpack(f"<{SLOT // 2}e", kv_like(SLOT, 0))
    worst = max(abs(a - b) / max(abs(b), 1e-3) for a, b in zip(loaded, original, strict=True))
    assert worst < 0.07  # e4m3: 3 mantissa bits, a row's scale
    raw.close()
    fp8.close()


def frame_of(store: FsspecTierStore, key: Any) -> tuple[str, int, bytes]:
    path, offset = store.location(key)
    with open(path, "rb") as f:
        f.seek(offset)
        header = f.read(HEADER_AREA)
        parsed = parse_header(header)
        assert parsed is not None
        return path, offset, f.read(parsed.length)


@pytest.mark.parametrize("native_io", [None, False], ids=["native-if-built", "python"])
def test_a_frame_never_serves_bad_bytes(tmp_path: Path, native_io: bool | None) -> None:
    """A flipped stored byte fails the block's checksum; a frame whose block checksum was
    made to match (a writer bug, a tampering) fails its decoding or its checked bytes:
    corrupt either way, dropped, never loaded. fsck passes the good frames and names the
    bad one."""
    host = host_with_kv()
    store = FsspecTierStore(
        host,
        str(tmp_path),
        capacity_bytes=1 << 24,
        namespace=NS,
        native_io=native_io,
        codec=[ZstdCodec()],
    )
    ctx, keys = request("r", 3)
    assert put(store, keys, ctx).success
    report = check_root(tmp_path)
    assert report.clean
    assert sum(ns.blocks_ok for ns in report.namespaces) == 3
    path, offset, frame = frame_of(store, keys[0])
    assert len(frame) < SLOT  # compressed
    with open(path, "r+b") as f:  # a byte of the body: the block checksum fails
        f.seek(offset + HEADER_AREA + len(frame) - 3)
        f.write(bytes([frame[-3] ^ 1]))
    path, offset, frame = frame_of(store, keys[1])
    forged = bytearray(frame)
    forged[-3] ^= 1
    header = bytearray(parse_header_area(path, offset))
    header[16:24] = checksum(bytes(forged)).to_bytes(8, "big")  # a matching block checksum
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(header) + bytes(forged))
    events = Events(store)
    result = get_for(store, keys, [8, 9, 10], ctx)
    assert result.ok_keys == frozenset({keys[2]})
    assert store.corrupt_blocks == 2
    events.take()
    gone = {k for e in events.raw if isinstance(e, Removed) for k in e.keys}
    assert gone == {keys[0], keys[1]}
    store.close()


def parse_header_area(path: str, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(HEADER_AREA)


def test_fsck_sizes_coded_slots_from_the_namespace(tmp_path: Path) -> None:
    host = host_with_kv()
    chain = CodecChain([Fp8Codec(dtype="float16")])
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 22, namespace=NS, codec=chain)
    ctx, keys = request("r", 4)
    assert put(store, keys, ctx).success
    store.close()
    (ns,) = check_root(tmp_path).namespaces
    assert ns.config is not None
    assert ns.config["codec"][0]["name"] == "fp8"
    assert (ns.blocks_ok, ns.problems, ns.findings) == (4, (), ())


def test_sealed_records_keep_no_prompt_in_the_clear_yet_announce_in_full(
    tmp_path: Path,
) -> None:
    """With aes-gcm in the chain, the record in each header (the request's token ids) is
    sealed: the header holds none of it in the clear, yet a restart and another instance's
    peer view (same master key) announce the blocks in full, as without a codec."""
    host = host_with_kv()
    tokens = list(range(7000, 7000 + 4 * 8))
    ctx, keys = request("r", 4, base=7000, cache_salt="tenant-a", lora_id=3, lora_name="x")

    def tier(name: str, peers: bool = False) -> FsspecTierStore:
        return FsspecTierStore(
            host,
            str(tmp_path),
            capacity_bytes=1 << 24,
            name=name,
            namespace=NS,
            codec=[ZstdCodec(), AesGcmCodec()],
            announce_peers=peers,
            peer_scan_interval_s=0.05,
        )

    a = tier("a")
    assert put(a, keys, ctx).success
    mine, _ = blocks(a.take_events())
    assert len(mine) == 8
    header = parse_header_area(*a.location(keys[0]))
    state, kept = kept_record(header)
    assert state is KeptRecord.INTACT
    assert decode_record(kept, keys[0]) is None  # sealed: no parse
    clear = encode_record(describe_key(ctx, keys[0]), keys[0])
    assert clear is not None
    assert clear not in header
    assert struct.pack(">I", tokens[0]) not in header  # no token id, in any byte order
    assert struct.pack("<I", tokens[0]) not in header
    b = tier("b", peers=True)
    on_b = Events(b)
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys), "b's view holds a's blocks")
    seen, placeholders = blocks(on_b.raw)
    assert (seen, placeholders) == (mine, [])  # the peer view opened every record
    a.close()
    b.close()
    again = tier("a")
    adopted, placeholders = blocks(again.take_events())
    assert (adopted, placeholders) == (mine, [])  # so did the restart
    again.close()
    report = check_root(tmp_path)
    assert report.clean
    assert [ns.bad_records for ns in report.namespaces] == [()]


def describe_key(ctx: Any, key: Any) -> Any:
    records = chunk_records(ctx, [key])
    assert records is not None
    return records[key]
