"""Lossless codecs: zstd and lz4, each with an optional byte shuffle.

The shuffle (``shuffle = 2`` for 16-bit floats) stores the bytes of every element's first
byte together, then every second byte: the high bytes of KV values (sign, exponent) repeat far
more than the low ones, so the compressor sees long runs. Whether it pays is measured on real
KV blocks by ``bench/block_codecs.py`` (docs/codecs.md has the figures).

Both libraries release the GIL while they compress and decompress, so a tier's IO threads
code blocks side by side; each thread keeps its own compressor objects (they are not safe
to share).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvhex.domain.keys import OffloadKey
from kvhex.ports.codec import Buffer, CodecCorrupt


def _check_shuffle(shuffle: object) -> int:
    if isinstance(shuffle, bool) or not isinstance(shuffle, int) or shuffle not in (0, 2, 4):
        raise ValueError(f"shuffle: 0 (off), 2 or 4 (bytes per element), got {shuffle!r}")
    return shuffle


def shuffled(data: memoryview, width: int) -> bytes:
    """``data``'s bytes grouped by their place in each ``width``-byte element (a tail shorter
    than an element is kept as is, at the end)."""
    import numpy as np

    whole = len(data) - len(data) % width
    lanes = np.frombuffer(data, dtype=np.uint8, count=whole).reshape(-1, width).T
    return lanes.tobytes() + bytes(data[whole:])


def unshuffled(data: Buffer, width: int) -> bytes:
    """The inverse of :func:`shuffled`."""
    import numpy as np

    view = memoryview(data)
    whole = len(view) - len(view) % width
    lanes = np.frombuffer(view, dtype=np.uint8, count=whole).reshape(width, -1)
    out = np.empty((whole // width, width), dtype=np.uint8)
    for lane in range(width):  # a column at a time: 6x a transposed copy's speed
        out[:, lane] = lanes[lane]
    return out.tobytes() + bytes(view[whole:])


class _Lossless:
    """What zstd and lz4 share: the shuffle around the compressor, per-thread state."""

    name = ""
    lossy = False
    keyed = False

    def __init__(self, shuffle: int) -> None:
        self.shuffle = _check_shuffle(shuffle)
        self._local = threading.local()

    def describe(self) -> Mapping[str, Any]:
        return {"shuffle": self.shuffle}  # the level changes no decoder: not a namespace field

    def encode(self, data: memoryview, key: OffloadKey, tenant: str | None) -> Buffer:
        if self.shuffle:
            data = memoryview(shuffled(data, self.shuffle))
        return self._compress(data)

    def decode(self, data: memoryview, size: int, key: OffloadKey, tenant: str | None) -> Buffer:
        out = self._decompress(data, size)
        if len(out) != size:
            raise CodecCorrupt(f"{self.name} decoded {len(out)} bytes, not {size}")
        return unshuffled(out, self.shuffle) if self.shuffle else out

    def _compress(self, data: memoryview) -> Buffer:
        raise NotImplementedError

    def _decompress(self, data: memoryview, size: int) -> Buffer:
        raise NotImplementedError


class ZstdCodec(_Lossless):
    """zstd (the ``zstandard`` package) at ``level`` (1 to 22; 1 is the fastest), after a
    byte shuffle of ``shuffle`` bytes per element (0: none).

    Raises:
        ValueError: a level or shuffle out of range.
    """

    name = "zstd"

    def __init__(self, *, level: int = 1, shuffle: int = 2) -> None:
        import zstandard

        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(f"level: 1 to 22, got {level!r}")
        super().__init__(shuffle)
        self.level = level
        self._zstd = zstandard

    def max_encoded_bytes(self, n: int) -> int:
        return n + (n >> 7) + 1024  # above ZSTD_compressBound, with a frame header

    def _compress(self, data: memoryview) -> Buffer:
        local = self._local
        compressor = getattr(local, "c", None)
        if compressor is None:
            compressor = local.c = self._zstd.ZstdCompressor(level=self.level)
        out: bytes = compressor.compress(data)
        return out

    def _decompress(self, data: memoryview, size: int) -> Buffer:
        local = self._local
        decompressor = getattr(local, "d", None)
        if decompressor is None:
            decompressor = local.d = self._zstd.ZstdDecompressor()
        try:
            out: bytes = decompressor.decompress(data, max_output_size=size)
        except self._zstd.ZstdError as exc:
            raise CodecCorrupt(f"zstd: {exc}") from exc
        return out


class Lz4Codec(_Lossless):
    """LZ4 blocks (the ``lz4`` package), after a byte shuffle of ``shuffle`` bytes per
    element (0: none). ``acceleration`` above 1 trades ratio for speed.

    Raises:
        ValueError: an acceleration below 1 or a shuffle out of range.
    """

    name = "lz4"

    def __init__(self, *, acceleration: int = 1, shuffle: int = 2) -> None:
        import lz4.block

        if isinstance(acceleration, bool) or not isinstance(acceleration, int):
            raise ValueError(f"acceleration: an integer from 1, got {acceleration!r}")
        if acceleration < 1:
            raise ValueError(f"acceleration: an integer from 1, got {acceleration!r}")
        super().__init__(shuffle)
        self.acceleration = acceleration
        self._lz4 = lz4.block

    def max_encoded_bytes(self, n: int) -> int:
        return n + n // 255 + 16  # LZ4_compressBound

    def _compress(self, data: memoryview) -> Buffer:
        out: bytes = self._lz4.compress(
            data, mode="fast", acceleration=self.acceleration, store_size=False
        )
        return out

    def _decompress(self, data: memoryview, size: int) -> Buffer:
        try:
            out: bytes = self._lz4.decompress(data, uncompressed_size=size)
        except self._lz4.LZ4BlockError as exc:
            raise CodecCorrupt(f"lz4: {exc}") from exc
        return out
