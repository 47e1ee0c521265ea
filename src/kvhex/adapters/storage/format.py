"""The block format every kvhex storage tier writes: local slabs, objects and NIXL.

A block is a 4 KiB header area and the host slot's bytes (the payload)::

    magic "KVHXBLK1" | payload length (u64) | XXH3-64 of the payload (u64) | key length (u16)
    | the offload key | chunk record length (u16) | CRC-32 of the chunk record (u32)
    | the chunk record | zero padding to 4096 bytes | payload

Every read verifies the header and the payload (:func:`verify`): a header naming another
key (a slot reused, a stale slot record) is a missing block, a mismatch of anything else or
a short read a corrupt one; neither is ever served. The **chunk record** (the stored chunk
described in full, :mod:`kvhex.adapters.storage.records`) is optional and checked on its
own, by its CRC-32 (the payload's checksum does not cover it, :func:`kept_record`): a block
without one (written before records were kept, by a job with no request, or whose record
did not fit) has zeros there, a length of 0. Readers that do not know records ignore the
padding, so records changed neither the layout version nor any namespace digest.

Blocks live under ``ROOT/<namespace digest>/``, where the digest names what makes blocks
compatible (:func:`namespace_digest`) and ``config.json`` records it
(:func:`namespace_config`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import xxhash

from kvhex.domain.keys import OffloadKey

LAYOUT_VERSION = 4
"""4: local slabs publish their blocks in a slot table at their head (3 kept a shared SQLite
index); 3: NIXL's object tier writes one object per block, in this format (2 wrote a payload
and a header object)."""
MAGIC = b"KVHXBLK1"
HEADER = struct.Struct(">8sQQH")  # magic, payload length, xxh3-64 of the payload, key length
HEADER_AREA = 4096
"""Bytes before the payload (header, key, zero padding): a page-aligned payload is written
4x faster through the page cache than one at an odd offset (docs/tiers.md), and suits
NIXL and direct IO."""
MAX_HEADER_KEY_BYTES = HEADER_AREA - HEADER.size
DIGEST_OFFSET = struct.calcsize(">8sQ")
"""Where a header holds the payload's checksum (big-endian): the native data path packs a
header with it zeroed and fills it in (:mod:`kvhex.adapters.storage.files._native`)."""
_HEADER_AREA = struct.Struct(f"{HEADER.format}{MAX_HEADER_KEY_BYTES}s")  # key zero-padded
_RECORD_HEAD = struct.Struct(">HI")  # record length, CRC-32 of the record
CONFIG = "config.json"
_GIL_FREE_BYTES = 1 << 16
"""From this size on, payloads are hashed by an ``xxh3_64`` object, whose constructor and
``update`` release the GIL (the one-shot functions hold it): other IO threads and the
scheduler run meanwhile."""


class Verdict(enum.Enum):
    """What a read found where a block should be."""

    OK = "ok"
    """The block, whole: header, key, length and checksum verified."""
    MISSING = "missing"
    """No block under that key there: nothing, an unmarked slot, or another key's block."""
    CORRUPT = "corrupt"
    """The key's block, damaged: cut short, a bad magic, length or checksum."""


class KeptRecord(enum.Enum):
    """What a block's header area holds after its key."""

    NONE = "none"
    """No record (zeros: an older block, a job without a request, a record too large)."""
    INTACT = "intact"
    """A record whose length fits and whose CRC-32 matches."""
    DAMAGED = "damaged"
    """A record length that does not fit the header area, or a CRC-32 mismatch."""


class Header(NamedTuple):
    """A parsed block header."""

    magic: bytes
    length: int
    digest: int
    key: bytes


def namespace_config(namespace: Mapping[str, Any]) -> bytes:
    """What ``config.json`` records for ``namespace``: its canonical JSON with the layout
    version."""
    return json.dumps({**namespace, "layout_version": LAYOUT_VERSION}, sort_keys=True).encode()


def namespace_digest(namespace: Mapping[str, Any]) -> str:
    """16 hex digits naming a namespace: blocks are shared only between identical ones."""
    return hashlib.sha256(namespace_config(namespace)).hexdigest()[:16]


def checksum(payload: memoryview | bytes) -> int:
    """XXH3-64 of ``payload``; large payloads are hashed without holding the GIL."""
    if len(payload) < _GIL_FREE_BYTES:
        return xxhash.xxh3_64_intdigest(payload)
    return xxhash.xxh3_64(payload).intdigest()  # hashed in the constructor, GIL released


def record_room(key_bytes: int) -> int:
    """The longest record a block under a key of ``key_bytes`` bytes keeps in its header."""
    return MAX_HEADER_KEY_BYTES - key_bytes - _RECORD_HEAD.size


def pack_header(
    key: OffloadKey, payload: memoryview, digest: int | None = None, record: bytes = b""
) -> bytes:
    """The header area of a block holding ``payload`` under ``key``, with ``digest`` as the
    payload's checksum (by default computed here; the native data path passes 0 and fills it
    in at :data:`DIGEST_OFFSET`) and ``record`` (encoded, :mod:`.records`) after the key with
    its length and CRC-32; a record longer than :func:`record_room` is left out.

    Raises:
        ValueError: the key does not fit the header area.
    """
    length = len(key)
    if length > MAX_HEADER_KEY_BYTES:
        raise ValueError(f"a {length}-byte key does not fit a block's header area")
    if digest is None:
        digest = checksum(payload)
    if record and len(record) <= record_room(length):
        tail = key + _RECORD_HEAD.pack(len(record), zlib.crc32(record)) + record
        return _HEADER_AREA.pack(MAGIC, len(payload), digest, length, tail)
    return _HEADER_AREA.pack(MAGIC, len(payload), digest, length, key)


def kept_record(header: bytes) -> tuple[KeptRecord, bytes]:
    """The record a block's header area keeps after its key, and its bytes (``b""`` unless
    :attr:`KeptRecord.INTACT`). The header itself is not checked here (:func:`verify`)."""
    if len(header) < HEADER.size:
        return KeptRecord.NONE, b""
    at = HEADER.size + HEADER.unpack_from(header)[3]
    if at + _RECORD_HEAD.size > len(header):
        return KeptRecord.NONE, b""
    length, crc = _RECORD_HEAD.unpack_from(header, at)
    if not length:
        return KeptRecord.NONE, b""
    at += _RECORD_HEAD.size
    record = bytes(header[at : at + length])
    if at + length > min(len(header), HEADER_AREA) or zlib.crc32(record) != crc:
        return KeptRecord.DAMAGED, b""
    return KeptRecord.INTACT, record


def parse_header(data: bytes) -> Header | None:
    """The header at the start of ``data``, or ``None`` when ``data`` is too short to hold
    one (the key is cut at the bytes present)."""
    if len(data) < HEADER.size:
        return None
    magic, length, digest, key_len = HEADER.unpack_from(data)
    return Header(magic, length, digest, bytes(data[HEADER.size : HEADER.size + key_len]))


def holds_key(header: bytes, key: OffloadKey) -> bool:
    """True when ``header`` is a whole block header (magic included) naming ``key``; its
    payload is not checked."""
    parsed = parse_header(header)
    return (
        parsed is not None
        and len(header) >= HEADER_AREA
        and parsed.magic == MAGIC
        and parsed.key == key
    )


def verify(
    header: bytes | None,
    key: OffloadKey,
    payload: memoryview,
    digest: int | None = None,
    *,
    up_to: bool = False,
) -> Verdict:
    """What a read that returned ``header`` (``None``: no block there; ``b""``: cut short)
    and filled ``payload`` found under ``key``; ``digest`` is the payload's checksum when the
    reader took it (by default taken here). ``up_to``: ``payload`` may be longer than the
    block's (a coded tier's blocks vary in length, :mod:`kvhex.adapters.codecs`): the
    header's length, at most the view's, says how much of it the checksum covers."""
    if header is None:
        return Verdict.MISSING
    parsed = parse_header(header)
    if parsed is None:
        return Verdict.CORRUPT
    if parsed.magic == MAGIC and parsed.key != key:
        return Verdict.MISSING  # the slot holds another block: a stale place
    if parsed.magic == bytes(len(MAGIC)):
        return Verdict.MISSING  # an unmarked (freed) slot
    if up_to and parsed.length < len(payload):
        payload, digest = payload[: parsed.length], None  # a reader's digest covers the view
    return Verdict.OK if header_matches(header, key, payload, digest) else Verdict.CORRUPT


def header_matches(
    header: bytes, key: OffloadKey, payload: memoryview, digest: int | None = None
) -> bool:
    """True when ``header`` describes ``payload`` stored under ``key``, checksum included
    (``digest``: the payload's, when the caller has it)."""
    if len(header) != HEADER_AREA:
        return False
    magic, length, stored, key_len = HEADER.unpack_from(header)
    return (
        magic == MAGIC
        and length == len(payload)
        and key_len == len(key)
        and header[HEADER.size : HEADER.size + key_len] == key
        and (checksum(payload) if digest is None else digest) == stored
    )
