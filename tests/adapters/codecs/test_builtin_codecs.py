"""kvhex's built-in codecs against the shipped codec contract (``kvhex.testing``)."""

from __future__ import annotations

import pytest

from kvhex.adapters.codecs.aesgcm import KEY_ENV, AesGcmCodec
from kvhex.adapters.codecs.fp8 import Fp8Codec
from kvhex.adapters.codecs.lz4 import Lz4Codec
from kvhex.adapters.codecs.zstd import ZstdCodec
from kvhex.ports.codec import BlockCodec
from kvhex.testing import CodecContract

MASTER = "5f" * 32


class TestZstd(CodecContract):
    def make_codec(self) -> BlockCodec:
        return ZstdCodec()


class TestZstdUnshuffled(CodecContract):
    def make_codec(self) -> BlockCodec:
        return ZstdCodec(level=3, shuffle=0)


class TestLz4(CodecContract):
    def make_codec(self) -> BlockCodec:
        return Lz4Codec()


class TestLz4FourByteShuffle(CodecContract):
    element_bytes = 4

    def make_codec(self) -> BlockCodec:
        return Lz4Codec(acceleration=4, shuffle=4)


class TestFp8(CodecContract):
    lossy = True

    def make_codec(self) -> BlockCodec:
        return Fp8Codec(dtype="bfloat16")


class TestFp8Float32(CodecContract):
    lossy = True
    element_bytes = 4

    def make_codec(self) -> BlockCodec:
        return Fp8Codec(dtype="torch.float32", row=128)


class TestAesGcm(CodecContract):
    @pytest.fixture(autouse=True)
    def _master_key(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(KEY_ENV, MASTER)

    def make_codec(self) -> BlockCodec:
        return AesGcmCodec()
