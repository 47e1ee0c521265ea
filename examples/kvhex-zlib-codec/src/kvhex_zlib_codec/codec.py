"""``ZlibCodec``: each block DEFLATE-compressed (raw deflate, no zlib header) at ``level``.

What a kvhex codec owes its tier (``kvhex.ports.BlockCodec``):

* ``name``, ``lossy`` and ``keyed``: this one is neither lossy nor keyed.
* ``describe()``: what changes the encoding, which joins the tier's namespace digest. The
  level does not (any level decodes with the same inflater), so it is left out: instances
  configured with other levels still share their blocks.
* ``max_encoded_bytes(n)``: the tier sizes its blocks by it, so it must hold for any input.
* ``encode`` / ``decode`` run on the tier's IO threads, several at once: each call makes its
  own compressor (no state shared between threads), and zlib releases the GIL while it
  works.
* ``decode`` refuses what is not an encoding with ``CodecCorrupt``: the tier then treats the
  block as corrupt and never serves it.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

from kvhex.domain import OffloadKey
from kvhex.ports import CodecCorrupt


class ZlibCodec:
    """DEFLATE at ``level`` (1 fastest, 9 smallest).

    Raises:
        ValueError: a level outside 1-9 (the message starts with the option's name, so kvhex
            reports it at ``codec[i].level``).
    """

    name = "zlib"
    lossy = False
    keyed = False

    def __init__(self, *, level: int = 1) -> None:
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 9:
            raise ValueError(f"level: 1 to 9, got {level!r}")
        self.level = level

    def describe(self) -> Mapping[str, Any]:
        return {"format": "raw-deflate"}

    def max_encoded_bytes(self, n: int) -> int:
        return n + n // 1000 + 64  # deflate's stored blocks: 5 bytes per 64 KiB, and a tail

    def encode(self, data: memoryview, key: OffloadKey, tenant: str | None) -> bytes:
        compressor = zlib.compressobj(self.level, zlib.DEFLATED, -15)
        return compressor.compress(data) + compressor.flush()

    def decode(self, data: memoryview, size: int, key: OffloadKey, tenant: str | None) -> bytes:
        inflater = zlib.decompressobj(-15)
        try:
            out = inflater.decompress(data, size)
        except zlib.error as exc:
            raise CodecCorrupt(f"zlib: {exc}") from None
        if len(out) != size or inflater.unconsumed_tail or not inflater.eof:
            raise CodecCorrupt(f"zlib: not an encoding of {size} bytes")
        return out
