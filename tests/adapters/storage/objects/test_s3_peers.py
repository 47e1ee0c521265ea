"""Chunk records on an object store (the loopback S3 server): a restart's listing announces
every block in full from its object's header (one ranged GET each, concurrently), and an
instance with ``announce_peers`` announces the blocks other instances put in the bucket, in
full, and their removal, leaving out its own."""

from __future__ import annotations

from typing import Any

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.format import HEADER, HEADER_AREA, KeptRecord, kept_record
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.domain import Stored
from kvhex.domain.locator import record_of
from kvhex.domain.provenance import MmFeature
from tests.adapters.conftest import Wire, s3_options
from tests.adapters.storage.peer_kit import (
    Events,
    blocks,
    fill,
    get,
    parent_first_in_each,
    put,
    request,
    started,
)

SLOT = 2048
NS = {"model": "tiny-llama", "dtype": "float16"}


def tier(endpoint: str, bucket: str, name: str, **kw: Any) -> FsspecTierStore:
    host = MemoryHostBuffer(8, SLOT)
    fill(host, range(8), 3)
    return FsspecTierStore(
        host,
        f"s3://{bucket}/kv",
        capacity_bytes=1 << 24,
        name=name,
        namespace=NS,
        storage_options=s3_options(endpoint),
        locality=None,
        **kw,
    )


def fs(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**s3_options(endpoint))


def test_another_instance_announces_objects_in_full_then_their_removal(
    s3_server: str, bucket: str
) -> None:
    a = tier(s3_server, bucket, "a")
    b = tier(s3_server, bucket, "b", announce_peers=True, peer_scan_interval_s=0.05)
    ctx, keys = request("r", 4, mm_features=(MmFeature("img", 3, 6),), lora_id=1, lora_name="l")
    assert put(a, keys, ctx).success
    mine = a.take_events()
    on_b = Events(b)
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys), "b's view holds a's objects")
    assert parent_first_in_each(on_b.stores(b.peer_identity), keys)
    want, _ = blocks(mine)
    got, placeholders = blocks(on_b.raw)
    assert got == want
    assert len(got) == 8
    assert placeholders == []
    assert b.peer_blocks == 4
    # b's own blocks stay out of its view: its own events announce them
    own_ctx, own = request("own", 2, base=7000)
    assert put(b, own, own_ctx, [4, 5]).success
    scans = b.peer_scans
    on_b.until(lambda: b.peer_scans >= scans + 2, "two more scans")
    assert on_b.held(b.identity) == set(own)
    assert on_b.held(b.peer_identity) == set(keys)
    a.delete(keys[:3])
    on_b.until(lambda: on_b.held(b.peer_identity) == {keys[3]}, "b sees three go")
    a.close()
    b.close()


def test_a_restart_lists_and_announces_every_object_in_full(s3_server: str, bucket: str) -> None:
    a = tier(s3_server, bucket, "a")
    ctx, keys = request("r", 6, cache_salt="salt")
    assert put(a, keys[:3], ctx).success
    assert put(a, keys[3:], ctx, [3, 4, 5]).success
    mine = a.take_events()
    damaged = a.location(keys[5])[0]  # its record: one byte flipped
    data = bytearray(fs(s3_server).cat_file(damaged))
    data[HEADER.size + len(keys[5]) + 6 + 3] ^= 0x04
    fs(s3_server).pipe_file(damaged, bytes(data))
    a.close()
    again = tier(s3_server, bucket, "a")
    assert again.take_events() == []  # announced once their records are read
    (adopted,) = started(again).take_events()
    assert isinstance(adopted, Stored)
    assert set(adopted.keys) == set(keys)
    got, placeholders = blocks([adopted])
    want, _ = blocks(mine)
    assert placeholders == [keys[5][:-4]]  # never a wrong event
    lost = record_of(ctx, keys[5])
    assert lost is not None
    assert got == {h: b for h, b in want.items() if h not in lost.block_hashes}
    assert len(got) == 10
    assert get(again, keys[5:], [6]).success  # the payload still verifies
    again.close()


def test_an_emptied_bucket_leaves_the_view(s3_server: str, bucket: str) -> None:
    a = tier(s3_server, bucket, "a")
    b = tier(s3_server, bucket, "b", announce_peers=True, peer_scan_interval_s=0.05)
    ctx, keys = request("r", 2)
    assert put(a, keys, ctx).success
    on_b = Events(b)
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys), "b's view holds a's objects")
    store = fs(s3_server)
    store.rm([a.location(k)[0] for k in keys])
    on_b.until(lambda: on_b.held(b.peer_identity) == set(), "b sees them go")
    a.close()
    b.close()


def test_objects_keep_their_records_where_the_header_has_room(s3_server: str, bucket: str) -> None:
    a = tier(s3_server, bucket, "a")
    ctx, keys = request("r", 1)
    assert put(a, keys, ctx).success
    header = fs(s3_server).cat_file(a.location(keys[0])[0])[:HEADER_AREA]
    assert kept_record(header)[0] is KeptRecord.INTACT
    a.close()


def test_an_adopted_block_removed_before_it_is_announced_is_never_announced(
    s3_server: str, bucket: str
) -> None:
    """The records of a listing are read after start-up: meanwhile the tier serves the
    adopted blocks, and what it removes of them is announced neither stored nor removed."""
    a = tier(s3_server, bucket, "a")
    ctx, keys = request("r", 3)
    assert put(a, keys, ctx).success
    a.close()
    again = tier(s3_server, bucket, "a")
    again.delete(keys[1:2])  # before any poll: its adoption cannot be announced yet
    assert again.take_events() == []  # the removal of a block never announced
    assert get(again, keys[:1], [5]).success  # served, announced or not
    events = again.take_events() + started(again).take_events()
    (adopted,) = events
    assert isinstance(adopted, Stored)
    assert set(adopted.keys) == {keys[0], keys[2]}
    assert adopted.records is not None
    assert all(adopted.records)
    again.close()


def test_records_are_read_by_one_ranged_get_of_the_header_per_object(
    wire_s3_server: Wire,
) -> None:
    """A restart reads each adopted object's record with a GET of its first 4 KiB, asking
    the server for no checksum (the record has its own CRC-32), and nothing more."""
    wire = wire_s3_server
    a = tier(wire.endpoint, wire.bucket, "a")
    ctx, keys = request("r", 3)
    assert put(a, keys, ctx).success
    a.close()
    before = len(wire.block_requests("GET"))
    again = started(tier(wire.endpoint, wire.bucket, "a"))
    (adopted,) = again.take_events()
    assert isinstance(adopted, Stored)
    assert adopted.records is not None
    assert all(adopted.records)
    again.close()
    reads = wire.block_requests("GET")[before:]
    assert len(reads) == 3
    assert {h.get("range") for h in reads} == {f"bytes=0-{HEADER_AREA - 1}"}
    assert wire.checksums() == []
