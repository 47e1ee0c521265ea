from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhex.domain.keys import (
    check_key,
    make_offload_key,
    offload_key_group,
    offload_key_hash,
    unpack_offload_key,
)
from kvhex.errors import InvalidKeyError


def test_packing_is_hash_then_four_byte_big_endian_group() -> None:
    key = make_offload_key(b"\xab" * 32, 0x01020304)
    assert key == b"\xab" * 32 + b"\x01\x02\x03\x04"
    assert len(key) == 36


def test_packing_matches_vllm_formula() -> None:
    # vLLM: block_hash + group_idx.to_bytes(4, "big", signed=False)
    block_hash = bytes(range(32))
    for group in (0, 1, 7, 255, 256, 2**32 - 1):
        expected = block_hash + group.to_bytes(4, "big", signed=False)
        assert make_offload_key(block_hash, group) == expected


@given(st.binary(min_size=1, max_size=64), st.integers(0, 2**32 - 1))
def test_unpack_inverts_pack(block_hash: bytes, group: int) -> None:
    key = make_offload_key(block_hash, group)
    assert unpack_offload_key(key) == (block_hash, group)
    assert offload_key_hash(key) == block_hash
    assert offload_key_group(key) == group


@pytest.mark.parametrize(
    ("block_hash", "group", "why"),
    [
        (b"", 0, "non-empty bytes"),
        ("abc", 0, "non-empty bytes"),
        (b"h", -1, "outside"),
        (b"h", 2**32, "outside"),
        (b"h", True, "must be an int"),
        (b"h", 1.0, "must be an int"),
    ],
)
def test_bad_parts_are_rejected(block_hash: object, group: object, why: str) -> None:
    with pytest.raises(InvalidKeyError, match=why):
        make_offload_key(block_hash, group)  # type: ignore[arg-type]


def test_check_key_enforces_type_and_length() -> None:
    good = make_offload_key(b"x" * 32, 1)
    assert check_key(good, 36) == good
    assert check_key(good, None) == good
    with pytest.raises(InvalidKeyError, match="expected 36 bytes, got 35"):
        check_key(good[:-1], 36)
    with pytest.raises(InvalidKeyError, match="expected bytes, got str"):
        check_key("abc", 36)
    with pytest.raises(InvalidKeyError, match="expected bytes, got bytearray"):
        check_key(bytearray(good), 36)
    with pytest.raises(InvalidKeyError, match="shorter than 5"):
        check_key(b"\0\0\0\0", None)
    assert isinstance(InvalidKeyError(b"", "x"), ValueError)
