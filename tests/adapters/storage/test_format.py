"""The block format every storage tier writes: checksums stay XXH3-64 whichever way they
are computed (blocks written before verify after), headers verify all they claim, and a
write cut short is finished."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from kvhex.adapters.storage.block_io import write_fully
from kvhex.adapters.storage.format import (
    HEADER,
    HEADER_AREA,
    MAGIC,
    MAX_HEADER_KEY_BYTES,
    Verdict,
    checksum,
    header_matches,
    pack_header,
    verify,
)
from kvhex.domain import OffloadKey
from tests.adapters.jobs import key


@pytest.mark.parametrize("size", [0, 4096, (1 << 16) - 1, 1 << 16, 256 << 10, 2 << 20])
def test_checksum_is_xxh3_64_at_every_size(size: int) -> None:
    payload = memoryview(os.urandom(size))
    assert checksum(payload) == xxhash.xxh3_64_intdigest(payload)


def test_a_header_verifies_its_key_length_and_payload() -> None:
    payload = memoryview(bytearray(os.urandom(256 << 10)))
    header = pack_header(key(1), payload)
    assert len(header) == HEADER_AREA
    assert header_matches(header, key(1), payload)
    assert not header_matches(header, key(2), payload)
    assert not header_matches(header, key(1), payload[:-1])
    assert not header_matches(header[:-1], key(1), payload)
    payload[12345] ^= 1
    assert not header_matches(header, key(1), payload)


def test_a_header_holds_magic_length_checksum_and_key_then_zeros() -> None:
    payload = memoryview(bytearray(os.urandom(5000)))
    header = pack_header(key(7), payload)
    magic, length, digest, key_length = HEADER.unpack_from(header)
    assert (magic, length, digest) == (MAGIC, 5000, xxhash.xxh3_64_intdigest(payload))
    assert header[HEADER.size : HEADER.size + key_length] == key(7)
    assert header[HEADER.size + key_length :] == bytes(HEADER_AREA - HEADER.size - key_length)
    longest = OffloadKey(b"k" * MAX_HEADER_KEY_BYTES)
    assert len(pack_header(longest, payload)) == HEADER_AREA
    with pytest.raises(ValueError, match="4071-byte key does not fit"):
        pack_header(OffloadKey(b"k" * (MAX_HEADER_KEY_BYTES + 1)), payload)


def test_a_read_is_missing_where_another_block_is_and_corrupt_where_its_own_is_damaged() -> None:
    payload = memoryview(bytearray(os.urandom(8192)))
    header = pack_header(key(1), payload)
    assert verify(header, key(1), payload) is Verdict.OK
    assert verify(None, key(1), payload) is Verdict.MISSING
    assert verify(pack_header(key(2), payload), key(1), payload) is Verdict.MISSING
    assert verify(bytes(8) + header[8:], key(1), payload) is Verdict.MISSING  # unmarked
    assert verify(b"", key(1), payload) is Verdict.CORRUPT  # cut short
    assert verify(b"XXXXXXXX" + header[8:], key(1), payload) is Verdict.CORRUPT
    payload[0] ^= 1
    assert verify(header, key(1), payload) is Verdict.CORRUPT


@pytest.mark.parametrize("told", [False, True])
def test_a_short_vectored_write_is_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, told: bool
) -> None:
    """``pwritev`` may write less than asked (a signal, a nearly full disk): the rest of the
    buffers still land, in order, at the right offsets."""
    parts = [os.urandom(4096), os.urandom(10_000), os.urandom(3)]
    real = os.pwritev

    def short(fd: int, buffers: list[bytes], offset: int) -> int:
        return real(fd, [bytes(buffers[0])[:1000]], offset)  # 1000 bytes, then stops

    monkeypatch.setattr(os, "pwritev", short)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        write_fully(fd, parts, 100, sum(map(len, parts)) if told else -1)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(100) + b"".join(parts)
