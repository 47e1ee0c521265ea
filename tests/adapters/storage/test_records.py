"""The chunk record a block keeps in its header: every field round trips exactly, anything
the encoding cannot hold exactly (or that does not fit) gives no record, and a damaged
record, or one of another key, is never read back as a record."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhex.adapters.storage.format import (
    HEADER,
    HEADER_AREA,
    KeptRecord,
    Verdict,
    kept_record,
    pack_header,
    record_room,
    verify,
)
from kvhex.adapters.storage.peers import parent_first
from kvhex.adapters.storage.records import _encode, decode_record, encode_record, header_record
from kvhex.domain.keys import OffloadKey, make_offload_key
from kvhex.domain.locator import ChunkRecord, record_of
from kvhex.domain.provenance import MmFeature
from tests.adapters.storage.peer_kit import GROUP, request


def hashes(n: int, seed: int = 0, width: int = 32) -> list[bytes]:
    return [hashlib.sha256(f"{seed}:{i}".encode()).digest()[:width] for i in range(n)]


def record(**fields: Any) -> ChunkRecord:
    blocks = hashes(3)
    base = ChunkRecord(
        block_hashes=blocks,
        parent_block_hash=hashes(1, 9)[0],
        token_ids=list(range(100_000, 100_012)),
        block_size=4,
        extra_keys=None,
        group_idx=2,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
        lora_id=None,
        lora_name=None,
    )
    return base._replace(**fields)


def key_of(rec: ChunkRecord) -> OffloadKey:
    return make_offload_key(rec.block_hashes[-1], rec.group_idx)


EXTRA = [
    ("adapter", ("img-1", 0), ("img-2", -3), "salt"),
    None,
    ("adapter", b"\x00digest\xff", ((1, (2, None)), "x"), 2**63 - 1, -(2**63)),
]


@pytest.mark.parametrize(
    "rec",
    [
        record(),
        record(parent_block_hash=None),
        record(extra_keys=EXTRA, lora_id=7, lora_name="adapter"),
        record(extra_keys=[("adapter",)] * 3, lora_id=0, lora_name=""),  # one for every block
        record(kv_cache_spec_kind=None, kv_cache_spec_sliding_window=0),
        record(kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096),
        record(token_ids=[0] * 12),
        record(token_ids=[2**32 - 1] * 12),
        record(token_ids=list(range(12)), block_size=1, block_hashes=hashes(12)),
        record(block_hashes=hashes(3, width=8), parent_block_hash=hashes(1, 9, width=8)[0]),
        record(lora_name="adaptér-ü"),
    ],
)
def test_every_field_round_trips_exactly(rec: ChunkRecord) -> None:
    key = key_of(rec)
    data = encode_record(rec, key)
    assert data is not None
    back = decode_record(data, key)
    assert back == rec
    assert back is not None
    assert [type(t) for t in back.token_ids] == [int] * len(rec.token_ids)
    if rec.extra_keys is not None:
        assert back.extra_keys is not None
        assert [type(e) for e in back.extra_keys] == [type(e) for e in rec.extra_keys]


def test_a_request_s_records_round_trip_with_multimodal_salt_and_embedding_digests() -> None:
    ctx, keys = request(
        "r",
        3,
        mm_features=(MmFeature("img-a", 2, 9), MmFeature("img-b", 14, 3)),
        cache_salt="tenant",
        prompt_embeds_digest=lambda start, end: hashlib.sha256(f"{start}-{end}".encode()).digest(),
        lora_id=5,
        lora_name="adapter",
    )
    for key in keys:
        rec = record_of(ctx, key)
        assert rec is not None
        assert rec.extra_keys is not None
        data = encode_record(rec, key)
        assert data is not None
        assert decode_record(data, key) == rec
    first = record_of(ctx, keys[0])
    assert first is not None
    assert first.extra_keys is not None
    assert first.extra_keys[0] is not None
    assert "tenant" in first.extra_keys[0]
    assert first.group_idx == GROUP.group_idx


@pytest.mark.parametrize(
    "rec",
    [
        record(extra_keys=[(True,), None, None]),  # a bool would come back an int
        record(extra_keys=[(1.5,), None, None]),
        record(extra_keys=[(["a list"],), None, None]),
        record(extra_keys=[(2**63,), None, None]),
        record(extra_keys=[None, None]),  # not one per block
        record(extra_keys=["not a tuple", None, None]),
        record(extra_keys=[((((((((((1,),),),),),),),),),), None, None]),  # too deep
        record(token_ids=[-1] * 12),
        record(token_ids=[2**32] * 12),
        record(token_ids=list(range(11))),  # not block_size per block
        record(block_hashes=[]),
        record(block_hashes=[b"short", *hashes(2)]),
        record(parent_block_hash=b"short"),
        record(block_size=0, token_ids=[]),
        record(lora_id=True),
    ],
)
def test_what_the_encoding_cannot_hold_exactly_gives_no_record(rec: ChunkRecord) -> None:
    assert encode_record(rec, key_of(rec) if rec.block_hashes else OffloadKey(b"k" * 36)) is None


def test_a_record_longer_than_the_header_keeps_is_left_out() -> None:
    key = key_of(record())
    room = record_room(len(key))
    assert room == HEADER_AREA - HEADER.size - len(key) - 6
    name = "n" * (room - len(encode_record(record(lora_name=""), key) or b""))
    fits = record(lora_name=name)
    data = encode_record(fits, key)
    assert data is not None
    assert len(data) == room
    assert header_record(pack_header(key, memoryview(b"p")), key) is None  # none kept
    assert header_record(pack_header(key, memoryview(b"p"), None, data), key) == fits
    assert encode_record(record(lora_name=name + "n"), key) is None
    # pack_header leaves out what does not fit, never spilling into the payload
    header = pack_header(key, memoryview(b"p"), None, data + b"n")
    assert len(header) == HEADER_AREA
    assert kept_record(header) == (KeptRecord.NONE, b"")


def test_a_damaged_record_or_one_of_another_key_is_never_read_back() -> None:
    rec = record(extra_keys=EXTRA, lora_id=7, lora_name="adapter")
    key = key_of(rec)
    data = encode_record(rec, key)
    assert data is not None
    payload = memoryview(bytes(range(256)) * 4)
    header = pack_header(key, payload, None, data)
    assert header_record(header, key) == rec
    start = HEADER.size + len(key)
    for at in range(start, start + 6 + len(data)):  # the length, the CRC, every record byte
        for bit in (0x01, 0x80):
            damaged = bytearray(header)
            damaged[at] ^= bit
            assert header_record(bytes(damaged), key) is None, at
            assert verify(bytes(damaged), key, payload) is Verdict.OK  # the block is intact
    other = make_offload_key(rec.block_hashes[0], rec.group_idx)
    assert decode_record(data, other) is None  # not this key's chunk
    assert decode_record(data, make_offload_key(rec.block_hashes[-1], 9)) is None
    for cut in range(len(data)):
        assert decode_record(data[:cut], key) is None
    assert decode_record(data + b"\0", key) is None


def test_a_header_without_a_record_has_none() -> None:
    key = key_of(record())
    old = pack_header(key, memoryview(b"payload"))  # a block written before records
    assert kept_record(old) == (KeptRecord.NONE, b"")
    assert header_record(old, key) is None
    assert header_record(b"", key) is None


tags = st.recursive(
    st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.tuples(inner) | st.tuples(inner, inner),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.integers(1, 6),
    block_size=st.integers(1, 8),
    width=st.sampled_from([8, 16, 32]),
    top=st.sampled_from([255, 65_535, 2**24 - 1, 2**32 - 1]),
    data=st.data(),
)
def test_any_record_round_trips_or_gives_none(
    blocks: int, block_size: int, width: int, top: int, data: st.DataObject
) -> None:
    extra = data.draw(
        st.none() | st.lists(st.none() | st.tuples(tags), min_size=blocks, max_size=blocks)
    )
    rec = ChunkRecord(
        hashes(blocks, data.draw(st.integers(0, 99)), width),
        data.draw(st.none() | st.just(hashes(1, 7, width)[0])),
        data.draw(
            st.lists(
                st.integers(0, top), min_size=blocks * block_size, max_size=blocks * block_size
            )
        ),
        block_size,
        extra,
        data.draw(st.integers(0, 2**32 - 1)),
        data.draw(st.none() | st.text(max_size=30)),
        data.draw(st.none() | st.integers(0, 2**20)),
        data.draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        data.draw(st.none() | st.text(max_size=30)),
    )
    key = key_of(rec)
    encoded = encode_record(rec, key)
    if encoded is None:  # only what does not fit the header (every value here is exact)
        assert len(_encode(rec)) > record_room(len(key))
        return
    assert decode_record(encoded, key) == rec


def test_records_are_announced_parents_first() -> None:
    ctx, keys = request("r", 5)
    found = [(k, record_of(ctx, k)) for k in keys]
    shuffled = [found[3], found[0], found[4], found[2], found[1]]
    assert parent_first(shuffled) == found
    other, other_keys = request("o", 2, base=9000)
    mixed = [
        (other_keys[1], record_of(other, other_keys[1])),
        found[2],
        (keys[1], None),  # a placeholder, still a parent its child's record names
        (other_keys[0], record_of(other, other_keys[0])),
    ]
    ordered = [k for k, _ in parent_first(mixed)]
    assert ordered.index(other_keys[0]) < ordered.index(other_keys[1])
    assert ordered.index(keys[1]) < ordered.index(keys[2])
    assert sorted(ordered) == sorted(k for k, _ in mixed)
