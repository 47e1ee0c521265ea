"""What the lossless codecs (``zstd``, ``lz4``) share: the byte shuffle, per-thread state.

The shuffle (``shuffle = 2`` for 16-bit floats) stores the bytes of every element's first
byte together, then every second byte: the high bytes of KV values (sign, exponent) repeat far
more than the low ones, so the compressor sees long runs. Whether it pays is measured on real
KV blocks by ``bench/block_codecs.py`` (docs/codecs.md has the figures).

Both libraries release the GIL while they compress and decompress, so a tier's IO threads
code blocks side by side; each thread keeps its own compressor objects (they are not safe
to share). Each codec's module imports its library when the registry loads it: a missing
one is a ``PluginError`` with its install hint (``pip install 'kvhex[zstd]'``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvhex.domain.keys import OffloadKey
from kvhex.ports.codec import Buffer, CodecCorrupt


def _check_shuffle(shuffle: object) -> int:
    if isinstance(shuffle, bool) or not isinstance(shuffle, int) or shuffle not in (0, 2, 4):
        raise ValueError(f"shuffle: 0 (off), 2 or 4 (bytes per element), got {shuffle!r}")
    return shuffle


def shuffled(data: memoryview, width: int) -> bytes:
    """``data``'s bytes grouped by their place in each ``width``-byte element (a tail shorter
    than an element is kept as is, at the end)."""
    whole = len(data) - len(data) % width
    lanes = np.frombuffer(data, dtype=np.uint8, count=whole).reshape(-1, width).T
    return lanes.tobytes() + bytes(data[whole:])


def unshuffled(data: Buffer, width: int) -> bytes:
    """The inverse of :func:`shuffled`."""
    view = memoryview(data)
    whole = len(view) - len(view) % width
    lanes = np.frombuffer(view, dtype=np.uint8, count=whole).reshape(width, -1)
    out = np.empty((whole // width, width), dtype=np.uint8)
    for lane in range(width):  # a column at a time: 6x a transposed copy's speed
        out[:, lane] = lanes[lane]
    return out.tobytes() + bytes(view[whole:])


class ShuffledLossless:
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
