"""``fp8``: KV values quantized to float8 e4m3 with a float32 scale per row (lossy).

The slot's bytes are read as elements of the KV cache's dtype (``float16``, ``bfloat16`` or
``float32``) in rows of ``row`` consecutive elements (default 64: a head's vector of the
common head sizes 64, 128 and 256, or a whole divisor of it). Each row stores the largest
magnitude over 448 (e4m3's largest finite value) as its scale, then its elements divided by
it, rounded to e4m3 (round to nearest even). So 16-bit KV takes 0.53x its bytes (1 + 4/64
bytes per element), float32 0.27x.

Lossy: the chain keeps a checksum of the quantized bytes (what decoding must reproduce); the
accuracy on a real engine (greedy tokens equal to a run without offloading, the largest
logprob difference) is measured by ``bench/block_codecs.py --parts accuracy`` and stated
in docs/codecs.md. Never on unless a configuration names it. Needs torch (the ``torch`` extra).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvhex.domain.keys import OffloadKey
from kvhex.ports.codec import Buffer, CodecCorrupt

E4M3_MAX = 448.0
_DTYPES = {"float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4}
_CANONICAL = {"half": "float16", "float": "float32"}


class Fp8Codec:
    """See the module docstring.

    Args:
        dtype: the KV cache's element type (``torch.`` prefix allowed); kvhex's vLLM and
            CLI composition pass the namespace's.
        row: elements per scale (1 to 65536).

    Raises:
        ValueError: a dtype that is not a 16- or 32-bit float (an 8-bit cache is already as
            small), or a row out of range.
    """

    name = "fp8"
    lossy = True
    keyed = False

    def __init__(self, *, dtype: str, row: int = 64) -> None:
        if not isinstance(dtype, str):
            raise ValueError(f"dtype: a float type name, got {dtype!r}")
        plain = dtype.removeprefix("torch.")
        if plain not in _DTYPES:
            raise ValueError(f"dtype: fp8 quantizes float16, bfloat16 or float32 KV, not {dtype!r}")
        if isinstance(row, bool) or not isinstance(row, int) or not 1 <= row <= 65536:
            raise ValueError(f"row: 1 to 65536 elements per scale, got {row!r}")
        self.dtype = _CANONICAL.get(plain, plain)
        self.row = row
        self._width = _DTYPES[plain]
        self._element = getattr(torch, self.dtype)

    def describe(self) -> Mapping[str, Any]:
        return {"dtype": self.dtype, "row": self.row, "format": "e4m3fn", "scale": "float32"}

    def _shape(self, n: int) -> tuple[int, int, int]:
        """Elements, rows and tail bytes (past the last whole element) of ``n`` bytes."""
        elements = n // self._width
        return elements, -(-elements // self.row), n - elements * self._width

    def max_encoded_bytes(self, n: int) -> int:
        elements, rows, tail = self._shape(n)
        return 4 * rows + elements + tail

    def encode(self, data: memoryview, key: OffloadKey, tenant: str | None) -> Buffer:
        elements, rows, tail = self._shape(len(data))
        if not elements:
            return bytes(data)  # under one element: kept as is
        if data.readonly:
            data = memoryview(bytearray(data))
        values = torch.frombuffer(data, dtype=self._element, count=elements).float()
        padded = torch.zeros(rows * self.row, dtype=torch.float32)
        padded[:elements] = values
        grid = padded.view(rows, self.row)
        scale = grid.abs().amax(dim=1) / E4M3_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        quantized = (grid / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        out = bytearray(4 * rows + elements + tail)
        out[: 4 * rows] = scale.numpy().tobytes()
        out[4 * rows : 4 * rows + elements] = quantized.reshape(-1)[:elements].numpy().tobytes()
        if tail:
            out[-tail:] = data[len(data) - tail :]
        return out

    def decode(self, data: memoryview, size: int, key: OffloadKey, tenant: str | None) -> Buffer:
        elements, rows, tail = self._shape(size)
        if len(data) != 4 * rows + elements + tail:
            raise CodecCorrupt(f"fp8: {len(data)} bytes do not encode {size}")
        if not elements:
            return bytes(data)
        raw = bytearray(data)  # torch reads writable buffers only
        scale = torch.frombuffer(raw, dtype=torch.float32, count=rows)
        quantized = torch.zeros(rows * self.row, dtype=torch.uint8)
        quantized[:elements] = torch.frombuffer(
            raw, dtype=torch.uint8, count=elements, offset=4 * rows
        )
        grid = quantized.view(torch.float8_e4m3fn).float().view(rows, self.row) * scale[:, None]
        values = grid.reshape(-1)[:elements].to(self._element)
        out = bytearray(size)
        out[: elements * self._width] = values.view(torch.uint8).numpy().tobytes()
        if tail:
            out[-tail:] = raw[len(raw) - tail :]
        return out
