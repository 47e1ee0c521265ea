"""The codec contract catches codecs that break it: each broken codec below fails the check
that is there for its fault, for that reason."""

from __future__ import annotations

from typing import Any

import pytest

from kvhex.adapters.codecs.zstd import ZstdCodec
from kvhex.domain.keys import OffloadKey
from kvhex.ports.codec import BlockCodec
from kvhex.testing import CodecContract


class Boastful(ZstdCodec):
    """Encodes beyond the bound it states."""

    def max_encoded_bytes(self, n: int) -> int:
        return n // 4


class Flipping(ZstdCodec):
    """Lossless in name, yet gives back one byte changed."""

    def decode(self, data: memoryview, size: int, key: OffloadKey, tenant: str | None) -> Any:
        out = bytearray(super().decode(data, size, key, tenant))
        out[0] ^= 1
        return out


class Careless(ZstdCodec):
    """Says it is keyed, yet any tenant opens its blocks."""

    keyed = True


class Crashing(ZstdCodec):
    """Lets a library error out on bad input instead of refusing it."""

    def decode(self, data: memoryview, size: int, key: OffloadKey, tenant: str | None) -> Any:
        if len(data) < 8:
            raise IndexError("short")
        return super().decode(data, size, key, tenant)


def run(codec: type[ZstdCodec], check: str) -> None:
    class Suite(CodecContract):
        block_bytes = 1 << 12

        def make_codec(self) -> BlockCodec:
            return codec()

    getattr(Suite(), check)()


@pytest.mark.parametrize(
    ("codec", "check", "reason"),
    [
        (Boastful, "test_round_trip_every_size_and_content", "above max_encoded_bytes"),
        (Flipping, "test_round_trip_every_size_and_content", "not the bytes encoded"),
        (Careless, "test_a_keyed_codec_refuses_another_tenant_key_or_byte", "DID NOT RAISE"),
        (Crashing, "test_input_that_is_no_encoding_is_refused_or_sized", "short"),
    ],
    ids=["sizes", "lossless", "keyed", "junk"],
)
def test_the_contract_fails_a_codec_for_its_fault(
    codec: type[ZstdCodec], check: str, reason: str
) -> None:
    with pytest.raises((AssertionError, pytest.fail.Exception, IndexError), match=reason):
        run(codec, check)


def test_the_contract_passes_the_codec_they_break() -> None:
    for check in (
        "test_round_trip_every_size_and_content",
        "test_input_that_is_no_encoding_is_refused_or_sized",
    ):
        run(ZstdCodec, check)
