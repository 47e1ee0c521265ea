"""The codec port: what a storage tier does to a block's bytes between host memory and its
medium (compress, quantize, encrypt).

A tier's codecs run in a chain (``codec = ["fp8", "zstd"]``): on a put each one encodes what
the one before it produced, starting from the host slot's bytes; on a get they decode in
reverse, the last one back into bytes of the slot's length. The chain, its frame (what a
coded block records of the chain, the original length and a checksum of what decoding must
reproduce) and the tier around it live in :mod:`kvhex.adapters.codecs`; a codec only turns
bytes into bytes. Codecs are found through the ``kvhex.codecs`` entry-point group, built-ins
exactly like a third party's; ``kvhex.testing.codec_contract`` is the contract every one
passes.

Threads: ``encode`` and ``decode`` run on the tier's IO threads, several at once, never on
the scheduler thread; a codec keeps no per-call state (or guards it). Buffers: ``data`` is
valid for the call only; a codec never keeps it and returns a buffer of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from kvhex.domain.keys import OffloadKey

Buffer = bytes | bytearray | memoryview
"""What a codec returns: bytes it owns (a view of its own buffer is fine)."""


class CodecRefused(Exception):
    """A keyed codec cannot open a block with the key of the request asking for it (another
    tenant's block, or one sealed with another master key). The block is a miss for this
    request and stays where it is: one tenant's lookup never deletes another's block."""


class CodecCorrupt(Exception):
    """The encoded bytes are not a valid encoding (cut short, a bad length, a mismatch):
    the block is corrupt and never served."""


@runtime_checkable
class RecordSealing(Protocol):
    """A keyed codec that also seals the chunk record a block keeps in its header (the
    request's token ids and provenance, read back by restarts and other instances' peer
    views): a tier whose chain holds one keeps no record in the clear. Records are sealed
    for the fleet (every instance holding the master key opens them), not per tenant: they
    are read with no request at hand."""

    def seal_record(self, data: bytes, key: OffloadKey) -> bytes:
        """``data`` (an encoded record of ``key``'s block) sealed."""
        ...

    def open_record(self, data: bytes, key: OffloadKey) -> bytes | None:
        """What :meth:`seal_record` sealed for ``key``, or ``None`` when ``data`` does not
        open (another key, another master key, damaged)."""
        ...


@runtime_checkable
class BlockCodec(Protocol):
    """One stage of a tier's codec chain.

    ``name`` is the codec's entry-point name; ``lossy`` is True when decoding does not give
    back the exact bytes encoded (quantization): a chain checks the bytes after its last
    lossy stage, and a lossy codec is only ever used where a configuration asks for it.
    ``keyed`` is True when decoding needs the tenant's key (encryption): a block such a
    codec refuses for one request is a miss, not a corrupt block.
    """

    @property
    def name(self) -> str: ...

    @property
    def lossy(self) -> bool: ...

    @property
    def keyed(self) -> bool: ...

    def describe(self) -> Mapping[str, Any]:
        """What makes this codec's blocks readable by another instance (its name and the
        parameters that change the encoding, a key's public fingerprint): it joins the
        tier's namespace digest, so blocks stored with another chain are never served as this
        one's. Never a secret. Called once, at start-up."""
        ...

    def max_encoded_bytes(self, n: int) -> int:
        """The most bytes :meth:`encode` returns for ``n`` input bytes (a tier sizes its
        blocks by it)."""
        ...

    def encode(self, data: memoryview, key: OffloadKey, tenant: str | None) -> Buffer:
        """``data`` encoded, at most :meth:`max_encoded_bytes` long. ``key`` is the block's
        offload key and ``tenant`` the storing request's cache salt (``None``: no salt);
        keyed codecs bind the encoding to both."""
        ...

    def decode(self, data: memoryview, size: int, key: OffloadKey, tenant: str | None) -> Buffer:
        """The ``size`` bytes ``data`` encodes, for the request of ``tenant`` loading
        ``key``.

        Raises:
            CodecRefused: a keyed codec cannot open it for this tenant and key.
            CodecCorrupt: ``data`` is not a valid encoding of ``size`` bytes.
        """
        ...
