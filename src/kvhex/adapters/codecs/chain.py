"""A tier's codec chain and the frame a coded block keeps.

A coded block's payload (what the block format of :mod:`kvhex.adapters.storage.format`
checksums and stores after its header area) is a frame::

    magic "KVHXCDC1" | chain id (u64) | original length (u64) | body length (u64)
    | checked length (u64) | XXH3-64 of the checked bytes (u64) | stages (u8)
    | per stage: its input length (u64), flags (u8: 1 = skipped, its input kept as is)
    | the body: the last stage's output

The **chain id** is the first 8 bytes of the SHA-256 of the chain's description (each
codec's :meth:`~kvhex.ports.codec.BlockCodec.describe`): a block of another chain is refused,
on top of the namespace digest that already keeps chains apart. The **checked bytes** are
what decoding must give back exactly: the host slot's bytes for a lossless chain, else what
the last lossy stage (quantization) produced. So a block is served only when its stored bytes
match the block checksum, every stage decodes, and the checked bytes match the frame's.

A lossless stage whose output is not smaller than its input is skipped (flagged), so
incompressible blocks cost a frame, never more: a lossless chain's blocks are at most a frame
larger than the slot. A lossy or keyed stage always runs.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

from kvhex.adapters.storage.format import checksum
from kvhex.domain.keys import OffloadKey
from kvhex.ports.codec import BlockCodec, CodecCorrupt, CodecRefused, RecordSealing

MAGIC = b"KVHXCDC1"
FRAME = struct.Struct(">8sQQQQQB")
"""magic, chain id, original length, body length, checked length, checked XXH3-64, stages"""
STAGE = struct.Struct(">QB")
"""a stage's input length, flags"""
SKIPPED = 1
MAX_STAGES = 8


class CodecChain:
    """The codecs of one tier, in encoding order (see the module docstring).

    Raises:
        ValueError: no codec, more than :data:`MAX_STAGES`, a codec named twice, or an
            object that is not a :class:`~kvhex.ports.codec.BlockCodec`.
    """

    def __init__(self, codecs: Sequence[BlockCodec]) -> None:
        if not codecs:
            raise ValueError("a codec chain needs at least one codec")
        if len(codecs) > MAX_STAGES:
            raise ValueError(f"a codec chain holds at most {MAX_STAGES} codecs")
        for codec in codecs:
            if not isinstance(codec, BlockCodec):
                raise ValueError(f"{type(codec).__name__} is not a BlockCodec")
        names = [c.name for c in codecs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"codec {twice[0]!r} is named twice in one chain")
        self.codecs = tuple(codecs)
        self.description: list[dict[str, Any]] = [{"name": c.name, **c.describe()} for c in codecs]
        canonical = json.dumps(self.description, sort_keys=True).encode()
        self.chain_id = int.from_bytes(hashlib.sha256(canonical).digest()[:8], "big")
        lossy = [i for i, c in enumerate(codecs) if c.lossy]
        self._checked_at = lossy[-1] + 1 if lossy else 0  # the stage whose input is checked
        self.lossy = bool(lossy)
        sealers = [c for c in codecs if isinstance(c, RecordSealing)]
        self.record_sealer: RecordSealing | None = sealers[0] if sealers else None
        """The codec sealing the chunk records blocks keep in their headers (``None``: kept
        in the clear)."""
        self._head = FRAME.size + STAGE.size * len(codecs)

    @property
    def names(self) -> list[str]:
        """The codecs' names, in encoding order."""
        return [c.name for c in self.codecs]

    def max_stored_bytes(self, n: int) -> int:
        """The longest frame a block of ``n`` bytes is stored as."""
        size = n
        for codec in self.codecs:
            bound = codec.max_encoded_bytes(size)
            size = bound if codec.lossy or codec.keyed else min(bound, size)
        return self._head + size

    def encode(self, data: memoryview, key: OffloadKey, tenant: str | None) -> bytearray:
        """The frame storing ``data`` (a host slot's bytes) under ``key`` for ``tenant``."""
        current: Any = data
        stages: list[tuple[int, int]] = []
        checked = -1
        checked_len = 0
        for i, codec in enumerate(self.codecs):
            if i == self._checked_at:
                checked, checked_len = checksum(current), len(current)
            out = codec.encode(current, key, tenant)
            if len(out) > codec.max_encoded_bytes(len(current)):
                raise ValueError(f"codec {codec.name!r} encoded more than its bound")
            if not (codec.lossy or codec.keyed) and len(out) >= len(current):
                stages.append((len(current), SKIPPED))
                continue
            stages.append((len(current), 0))
            current = out
        if checked < 0:  # the last stage is lossy: its output is the body, stored as checked
            checked, checked_len = checksum(current), len(current)
        body = len(current)
        frame = bytearray(self._head + body)
        FRAME.pack_into(
            frame, 0, MAGIC, self.chain_id, len(data), body, checked_len, checked, len(stages)
        )
        at = FRAME.size
        for size, flags in stages:
            STAGE.pack_into(frame, at, size, flags)
            at += STAGE.size
        frame[at:] = current
        return frame

    def decode(
        self, frame: memoryview, out: memoryview, key: OffloadKey, tenant: str | None
    ) -> None:
        """Decode ``frame`` (a block's payload, possibly followed by unused bytes) into
        ``out``, the host slot, for ``tenant`` loading ``key``. ``out`` holds undefined
        bytes when this raises.

        Raises:
            CodecRefused: a keyed codec cannot open the block for this tenant and key.
            CodecCorrupt: the frame is not this chain's, a stage fails, a length or the
                checked bytes do not match.
        """
        if len(frame) < self._head:
            raise CodecCorrupt("the frame is cut short")
        magic, chain, original, body, checked_len, checked, stages = FRAME.unpack_from(frame)
        if magic != MAGIC:
            raise CodecCorrupt("no codec frame")
        if chain != self.chain_id or stages != len(self.codecs):
            raise CodecCorrupt("the block was stored by another codec chain")
        if original != len(out):
            raise CodecCorrupt(f"the frame holds {original} bytes, the slot {len(out)}")
        if self._head + body > len(frame):
            raise CodecCorrupt("the frame's body is cut short")
        sizes = [STAGE.unpack_from(frame, FRAME.size + i * STAGE.size) for i in range(stages)]
        current: Any = frame[self._head : self._head + body]
        for i in range(stages - 1, -1, -1):
            if i == self._checked_at - 1:  # current: the last lossy stage's output
                self._check(current, checked_len, checked)
            size, flags = sizes[i]
            if flags & SKIPPED:
                continue
            codec = self.codecs[i]
            try:
                current = codec.decode(memoryview(current), size, key, tenant)
            except (CodecRefused, CodecCorrupt):
                raise
            except Exception as exc:  # a library's own error on bad input: never served
                raise CodecCorrupt(f"{codec.name}: {type(exc).__name__}: {exc}") from exc
            if len(current) != size:
                raise CodecCorrupt(f"{codec.name} decoded {len(current)} bytes, not {size}")
        if self._checked_at == 0:
            self._check(current, checked_len, checked)
        if len(current) != len(out):
            raise CodecCorrupt(f"the chain decoded {len(current)} bytes, not {len(out)}")
        out[:] = current

    @staticmethod
    def _check(current: Any, size: int, digest: int) -> None:
        if len(current) != size or checksum(memoryview(current)) != digest:
            raise CodecCorrupt("the decoded bytes do not match the frame's checksum")


def as_chain(codec: CodecChain | Sequence[BlockCodec] | None) -> CodecChain | None:
    """A tier's ``codec`` option as a chain: ``None`` or an empty list for none.

    Raises:
        ValueError: naming ``codec``: not codecs, or a chain :class:`CodecChain` refuses.
    """
    if codec is None or isinstance(codec, CodecChain):
        return codec
    if isinstance(codec, (str, bytes)) or not isinstance(codec, Sequence):  # type: ignore[unreachable]
        raise ValueError(
            f"codec: a list of codecs (built from names by kvhex's configuration), got "
            f"{type(codec).__name__}"
        )
    if not codec:
        return None
    try:
        return CodecChain(codec)
    except ValueError as exc:
        raise ValueError(f"codec: {exc}") from None
