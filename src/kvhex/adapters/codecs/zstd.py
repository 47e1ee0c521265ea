"""``zstd``: zstd (the ``zstandard`` package, ``kvhex[zstd]``), lossless, after a byte
shuffle (:mod:`kvhex.adapters.codecs.lossless`)."""

from __future__ import annotations

import zstandard

from kvhex.adapters.codecs.lossless import ShuffledLossless
from kvhex.ports.codec import Buffer, CodecCorrupt


class ZstdCodec(ShuffledLossless):
    """zstd (the ``zstandard`` package) at ``level`` (1 to 22; 1 is the fastest), after a
    byte shuffle of ``shuffle`` bytes per element (0: none).

    Raises:
        ValueError: a level or shuffle out of range.
    """

    name = "zstd"

    def __init__(self, *, level: int = 1, shuffle: int = 2) -> None:
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(f"level: 1 to 22, got {level!r}")
        super().__init__(shuffle)
        self.level = level

    def max_encoded_bytes(self, n: int) -> int:
        return n + (n >> 7) + 1024  # above ZSTD_compressBound, with a frame header

    def _compress(self, data: memoryview) -> Buffer:
        local = self._local
        compressor = getattr(local, "c", None)
        if compressor is None:
            compressor = local.c = zstandard.ZstdCompressor(level=self.level)
        out: bytes = compressor.compress(data)
        return out

    def _decompress(self, data: memoryview, size: int) -> Buffer:
        local = self._local
        decompressor = getattr(local, "d", None)
        if decompressor is None:
            decompressor = local.d = zstandard.ZstdDecompressor()
        try:
            out: bytes = decompressor.decompress(data, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise CodecCorrupt(f"zstd: {exc}") from exc
        return out
