"""The codec contract: what a tier relies on from any ``BlockCodec`` (``kvhex.codecs``).

* ``encode`` returns at most ``max_encoded_bytes(n)`` bytes for ``n`` input bytes (sizes
  honest), for any content and size; ``decode`` of it returns exactly ``n`` bytes: the input
  itself for a lossless codec; for a lossy one, the same bytes on every decode.
* Input that is not an encoding (cut short, grown, another codec's, noise) is refused with
  ``CodecCorrupt`` or ``CodecRefused``, or decoded to exactly the asked size (the chain's
  checksum then refuses the block): never another exception, never another length.
* A keyed codec refuses (``CodecRefused``) a block asked for by another tenant or under
  another offload key, and any flipped byte.
* ``describe()`` is a JSON-able mapping, the same on every call; the codec works from several
  threads at once.
* Through a ``CodecChain``, alone and after a lossless codec, blocks round-trip.

Subclass and implement :meth:`CodecContract.make_codec`; set ``lossy`` where the codec is,
and size the data with ``block_bytes``, ``element_bytes``.
"""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import pytest

from kvhex.domain.keys import OffloadKey, make_offload_key
from kvhex.ports.codec import BlockCodec, CodecCorrupt, CodecRefused


def codec_key(i: int) -> OffloadKey:
    """A distinct, well-formed 36-byte offload key for ``i``."""
    return make_offload_key(i.to_bytes(32, "big"), 0)


def kv_like(nbytes: int, seed: int, element_bytes: int = 2) -> bytes:
    """Bytes shaped like 16-bit float KV values: small signed magnitudes whose high bytes
    repeat (what compressors and quantizers meet on real blocks), seeded."""
    rng = random.Random(seed)
    out = bytearray(nbytes)
    for i in range(0, nbytes - nbytes % element_bytes, element_bytes):
        # a float16 around +-[2^-4, 2^2): sign, a narrow exponent, random mantissa
        sign, exponent = rng.getrandbits(1) << 15, (11 + rng.getrandbits(2)) << 10
        out[i : i + 2] = (sign | exponent | rng.getrandbits(10)).to_bytes(2, "little")
    return bytes(out)


class CodecContract:
    """Mix into a ``Test*`` class and implement :meth:`make_codec`."""

    lossy = False
    """The codec under test is lossy (its decode is checked for stability, not equality)."""
    block_bytes = 1 << 16
    """The size of the blocks checked (plus a few odd sizes)."""
    element_bytes = 2

    def make_codec(self) -> BlockCodec:
        """Build the codec under test."""
        raise NotImplementedError("implement make_codec() in your test class")

    # -- helpers -------------------------------------------------------------------------
    def sizes(self) -> list[int]:
        """Sizes checked: the block, small whole elements, and odd lengths."""
        return [self.block_bytes, 64 * self.element_bytes, self.element_bytes, 3, 1]

    def samples(self, nbytes: int) -> list[bytes]:
        """KV-like bytes, noise and zeros of ``nbytes``."""
        rng = random.Random(nbytes)
        return [kv_like(nbytes, nbytes), rng.randbytes(nbytes), bytes(nbytes)]

    def round_trip(
        self, codec: BlockCodec, data: bytes, key: OffloadKey, tenant: str | None
    ) -> bytes:
        encoded = codec.encode(memoryview(bytearray(data)), key, tenant)
        assert len(encoded) <= codec.max_encoded_bytes(len(data)), (
            f"{len(encoded)} bytes encoded, above max_encoded_bytes({len(data)}) = "
            f"{codec.max_encoded_bytes(len(data))}"
        )
        decoded = bytes(codec.decode(memoryview(bytes(encoded)), len(data), key, tenant))
        assert len(decoded) == len(data)
        return decoded

    # -- checks --------------------------------------------------------------------------
    def test_satisfies_protocol(self) -> None:
        codec = self.make_codec()
        assert isinstance(codec, BlockCodec)
        assert isinstance(codec.name, str)
        assert codec.name
        assert codec.lossy is self.lossy

    def test_describe_is_json_and_stable(self) -> None:
        codec = self.make_codec()
        first = json.dumps(dict(codec.describe()), sort_keys=True)
        assert first == json.dumps(dict(codec.describe()), sort_keys=True)
        assert json.dumps(dict(self.make_codec().describe()), sort_keys=True) == first

    def test_round_trip_every_size_and_content(self) -> None:
        codec = self.make_codec()
        for n in self.sizes():
            for i, data in enumerate(self.samples(n)):
                decoded = self.round_trip(codec, data, codec_key(i), "tenant-a")
                if self.lossy:
                    assert decoded == self.round_trip(codec, data, codec_key(i), "tenant-a")
                else:
                    assert decoded == data, f"{n} bytes, sample {i}: not the bytes encoded"

    def test_input_that_is_no_encoding_is_refused_or_sized(self) -> None:
        codec = self.make_codec()
        data = kv_like(self.block_bytes, 1)
        encoded = bytes(codec.encode(memoryview(bytearray(data)), codec_key(1), None))
        rng = random.Random(7)
        bad = [
            encoded[: len(encoded) // 2],
            encoded[:1],
            b"",
            encoded + b"\0" * 16,
            rng.randbytes(len(encoded)),
            bytes(len(encoded)),
        ]
        for i, junk in enumerate(bad):
            try:
                out = codec.decode(memoryview(junk), len(data), codec_key(1), None)
            except (CodecCorrupt, CodecRefused):
                continue
            assert len(out) == len(data), f"junk {i} decoded to {len(out)} bytes"

    def test_a_keyed_codec_refuses_another_tenant_key_or_byte(self) -> None:
        codec = self.make_codec()
        if not codec.keyed:
            pytest.skip(f"{codec.name} is not keyed: every tenant reads its blocks")
        data = kv_like(self.block_bytes, 2)
        encoded = bytes(codec.encode(memoryview(bytearray(data)), codec_key(2), "tenant-a"))
        others = [(codec_key(2), "tenant-b"), (codec_key(2), None), (codec_key(3), "tenant-a")]
        for key, tenant in others:
            with pytest.raises(CodecRefused):
                codec.decode(memoryview(encoded), len(data), key, tenant)
        flipped = bytearray(encoded)
        flipped[len(flipped) // 2] ^= 1
        with pytest.raises((CodecRefused, CodecCorrupt)):
            codec.decode(memoryview(bytes(flipped)), len(data), codec_key(2), "tenant-a")

    def test_threads_code_side_by_side(self) -> None:
        codec = self.make_codec()
        blocks = [kv_like(self.block_bytes, seed) for seed in range(8)]
        want = [self.round_trip(codec, b, codec_key(i), "t") for i, b in enumerate(blocks)]
        errors: list[BaseException] = []

        def work(offset: int) -> None:
            try:
                for _ in range(4):
                    for i in range(len(blocks)):
                        j = (i + offset) % len(blocks)
                        got = self.round_trip(codec, blocks[j], codec_key(j), "t")
                        assert got == want[j]
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]

    def test_blocks_round_trip_through_a_chain(self) -> None:
        from kvhex.adapters.codecs.chain import CodecChain

        codec = self.make_codec()
        for chain in (CodecChain([codec]), CodecChain([_Identity(), codec])):
            data = kv_like(self.block_bytes, 3)
            frame = chain.encode(memoryview(bytearray(data)), codec_key(4), "t")
            assert len(frame) <= chain.max_stored_bytes(len(data))
            out = bytearray(len(data))
            chain.decode(memoryview(bytes(frame)), memoryview(out), codec_key(4), "t")
            if not self.lossy:
                assert bytes(out) == data


class _Identity:
    """A lossless codec that changes nothing (the chain then skips it)."""

    name = "identity"
    lossy = False
    keyed = False

    def describe(self) -> dict[str, Any]:
        return {}

    def max_encoded_bytes(self, n: int) -> int:
        return n

    def encode(self, data: memoryview, key: OffloadKey, tenant: str | None) -> bytes:
        return bytes(data)

    def decode(self, data: memoryview, size: int, key: OffloadKey, tenant: str | None) -> bytes:
        return bytes(data)
