"""``lz4``: LZ4 blocks (the ``lz4`` package, ``kvhex[lz4]``), lossless, after a byte shuffle
(:mod:`kvhex.adapters.codecs.lossless`)."""

from __future__ import annotations

import lz4.block

from kvhex.adapters.codecs.lossless import ShuffledLossless
from kvhex.ports.codec import Buffer, CodecCorrupt


class Lz4Codec(ShuffledLossless):
    """LZ4 blocks (the ``lz4`` package), after a byte shuffle of ``shuffle`` bytes per
    element (0: none). ``acceleration`` above 1 trades ratio for speed.

    Raises:
        ValueError: an acceleration below 1 or a shuffle out of range.
    """

    name = "lz4"

    def __init__(self, *, acceleration: int = 1, shuffle: int = 2) -> None:
        if isinstance(acceleration, bool) or not isinstance(acceleration, int):
            raise ValueError(f"acceleration: an integer from 1, got {acceleration!r}")
        if acceleration < 1:
            raise ValueError(f"acceleration: an integer from 1, got {acceleration!r}")
        super().__init__(shuffle)
        self.acceleration = acceleration

    def max_encoded_bytes(self, n: int) -> int:
        return n + n // 255 + 16  # LZ4_compressBound

    def _compress(self, data: memoryview) -> Buffer:
        out: bytes = lz4.block.compress(
            data, mode="fast", acceleration=self.acceleration, store_size=False
        )
        return out

    def _decompress(self, data: memoryview, size: int) -> Buffer:
        try:
            out: bytes = lz4.block.decompress(data, uncompressed_size=size)
        except lz4.block.LZ4BlockError as exc:
            raise CodecCorrupt(f"lz4: {exc}") from exc
        return out
