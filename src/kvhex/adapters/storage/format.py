"""The block format every kvhex storage tier writes: local slabs, objects and NIXL.

A block is a 4 KiB header area and the host slot's bytes (the payload)::

    magic "KVHXBLK1" | payload length (u64) | XXH3-64 of the payload (u64) | key length (u16)
    | the offload key | zero padding to 4096 bytes | payload

Every read verifies all of it (:func:`header_matches`): a mismatch or a short read is a failed
load, never served. Blocks live under ``ROOT/<namespace digest>/``, where the digest names
what makes blocks compatible (:func:`namespace_digest`) and ``config.json`` records it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from kvhex.domain.keys import OffloadKey

__all__ = [
    "CONFIG",
    "HEADER",
    "HEADER_AREA",
    "LAYOUT_VERSION",
    "MAGIC",
    "Located",
    "checksum",
    "header_matches",
    "namespace_digest",
    "oserror",
    "pack_header",
    "safe_error",
    "write_fully",
]

LAYOUT_VERSION = 2
MAGIC = b"KVHXBLK1"
HEADER = struct.Struct(">8sQQH")  # magic, payload length, xxh3-64 of the payload, key length
HEADER_AREA = 4096
"""Bytes before the payload (header, key, zero padding): a page-aligned payload is written
4x faster through the page cache than one at an odd offset (docs/tiers.md), and suits
NIXL and direct IO."""
CONFIG = "config.json"
_GIL_FREE_BYTES = 1 << 16
"""From this size on, payloads are hashed by xxhash's streaming API, which releases the GIL
(the one-shot functions hold it): other IO threads and the scheduler run meanwhile."""

Located = tuple[str, int]
"""Where a block lives: a file or object, and the byte offset of its header."""


def namespace_digest(namespace: Mapping[str, Any]) -> str:
    """16 hex digits naming a namespace: blocks are shared only between identical ones."""
    canonical = json.dumps({**namespace, "layout_version": LAYOUT_VERSION}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def checksum(payload: memoryview | bytes) -> int:
    """XXH3-64 of ``payload``; large payloads are hashed without holding the GIL."""
    if len(payload) < _GIL_FREE_BYTES:
        return xxhash.xxh3_64_intdigest(payload)
    hasher = xxhash.xxh3_64()
    hasher.update(payload)
    return hasher.intdigest()


def pack_header(key: OffloadKey, payload: memoryview) -> bytes:
    """The header area of a block holding ``payload`` under ``key``."""
    header = HEADER.pack(MAGIC, len(payload), checksum(payload), len(key))
    return (header + key).ljust(HEADER_AREA, b"\0")


def header_matches(header: bytes, key: OffloadKey, payload: memoryview) -> bool:
    """True when ``header`` describes ``payload`` stored under ``key``, checksum included."""
    if len(header) != HEADER_AREA:
        return False
    magic, length, digest, key_len = HEADER.unpack_from(header)
    return (
        magic == MAGIC
        and length == len(payload)
        and key_len == len(key)
        and header[HEADER.size : HEADER.size + key_len] == key
        and checksum(payload) == digest
    )


def write_fully(fd: int, parts: Sequence[bytes | memoryview], offset: int) -> None:
    """Write ``parts`` back to back at ``offset``: one ``pwritev``, finished piece by piece
    after a short write.

    Raises:
        OSError: the write failed (a full disk, an IO error).
    """
    done = os.pwritev(fd, parts, offset)
    for part in parts:
        view = memoryview(part).cast("B")
        if done >= len(view):
            done -= len(view)
            offset += len(view)
            continue
        view, offset, done = view[done:], offset + done, 0
        while view:
            written = os.pwrite(fd, view, offset)
            offset += written
            view = view[written:]


def oserror(exc: OSError) -> str:
    """The text of a failed job for ``exc``: its type and reason, no path."""
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def safe_error(exc: BaseException) -> str:
    """An error text without credentials (fsspec/botocore messages can echo options)."""
    text = str(exc)
    for marker in ("key=", "secret=", "token=", "aws_secret_access_key", "aws_access_key_id"):
        if marker in text:
            return type(exc).__name__
    return text[:300]
