"""Offload keys: one chunk of one KV-cache group, packed exactly like vLLM packs it.

An ``OffloadKey`` is ``block_hash || group_idx`` with the group index as 4-byte big-endian
unsigned, the same bytes vLLM's ``make_offload_key`` and the GPU prefix cache's
``BlockHashWithGroupId`` produce. Keys stay plain ``bytes`` on every hot path: no tuples, no
objects, so the index costs one dict entry per chunk and hashing is done once by CPython.
A chunk's key is the hash of the chunk's *last* hash-block (its tail hash).
"""

from __future__ import annotations

from typing import NewType

from kvhex.errors import InvalidKeyError

GROUP_IDX_BYTES = 4
_MAX_GROUP_IDX = (1 << (8 * GROUP_IDX_BYTES)) - 1

OffloadKey = NewType("OffloadKey", bytes)
"""``block_hash || group_idx.to_bytes(4, "big")``. Build it with :func:`make_offload_key`."""


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-cache group index into an offload key.

    Raises:
        InvalidKeyError: the hash is not non-empty bytes, or the group index does not fit in
            an unsigned 32-bit integer.
    """
    if not isinstance(block_hash, bytes) or not block_hash:
        raise InvalidKeyError(block_hash, "block hash must be non-empty bytes")
    if isinstance(group_idx, bool) or not isinstance(group_idx, int):
        raise InvalidKeyError(block_hash, f"group index must be an int, got {group_idx!r}")
    if not 0 <= group_idx <= _MAX_GROUP_IDX:
        raise InvalidKeyError(block_hash, f"group index {group_idx} outside 0..{_MAX_GROUP_IDX}")
    return OffloadKey(block_hash + group_idx.to_bytes(GROUP_IDX_BYTES, "big"))


def offload_key_hash(key: OffloadKey) -> bytes:
    """The block hash part of a key (every byte but the last four)."""
    return key[:-GROUP_IDX_BYTES]


def offload_key_group(key: OffloadKey) -> int:
    """The KV-cache group index of a key (the last four bytes, big-endian unsigned)."""
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


def unpack_offload_key(key: OffloadKey) -> tuple[bytes, int]:
    """``(block_hash, group_idx)``; the inverse of :func:`make_offload_key`."""
    return key[:-GROUP_IDX_BYTES], int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


def check_key(key: object, length: int | None) -> OffloadKey:
    """Return ``key`` if it is a well-formed key of ``length`` bytes (any length if ``None``).

    Raises:
        InvalidKeyError: naming the key and what is wrong with it.
    """
    if type(key) is not bytes:
        raise InvalidKeyError(key, f"expected bytes, got {type(key).__name__}")
    if length is None:
        if len(key) <= GROUP_IDX_BYTES:
            raise InvalidKeyError(key, f"shorter than {GROUP_IDX_BYTES + 1} bytes")
    elif len(key) != length:
        raise InvalidKeyError(key, f"expected {length} bytes, got {len(key)}")
    return OffloadKey(key)
