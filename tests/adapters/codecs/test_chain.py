"""The codec chain's frame: what a coded block records, and every way a frame that is not
this chain's, or does not decode to what was stored, is refused."""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest

from kvhex.adapters.codecs.aesgcm import KEY_ENV, AesGcmCodec
from kvhex.adapters.codecs.chain import FRAME, MAX_STAGES, STAGE, CodecChain, as_chain
from kvhex.adapters.codecs.fp8 import Fp8Codec
from kvhex.adapters.codecs.lz4 import Lz4Codec
from kvhex.adapters.codecs.zstd import ZstdCodec
from kvhex.domain.keys import OffloadKey
from kvhex.ports.codec import CodecCorrupt, CodecRefused
from kvhex.testing import codec_key, kv_like

N = 1 << 14


KEY = codec_key(1)


def decode(chain: CodecChain, frame: Any, key: OffloadKey = KEY, tenant: Any = None) -> bytes:
    out = bytearray(N)
    chain.decode(memoryview(bytes(frame)), memoryview(out), key, tenant)
    return bytes(out)


def encode(chain: CodecChain, data: bytes, key: OffloadKey = KEY, tenant: Any = None) -> bytearray:
    return chain.encode(memoryview(bytearray(data)), key, tenant)


@pytest.fixture(autouse=True)
def master_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "11" * 32)


def test_a_frame_records_the_chain_the_lengths_and_each_stage() -> None:
    chain = CodecChain([ZstdCodec(), AesGcmCodec()])
    data = kv_like(N, 1)
    frame = encode(chain, data)
    magic, chain_id, original, body, checked, _, stages = FRAME.unpack_from(frame)
    assert (magic, chain_id, original, stages) == (b"KVHXCDC1", chain.chain_id, N, 2)
    assert checked == N  # lossless: the host's bytes are what decoding must give back
    assert len(frame) == FRAME.size + 2 * STAGE.size + body
    assert body < N  # compressed, then sealed (28 bytes more)
    assert decode(chain, frame) == data
    assert decode(chain, frame + bytes(100)) == data  # a slot's unused tail is ignored


def test_incompressible_blocks_cost_a_frame_never_more() -> None:
    chain = CodecChain([Lz4Codec(shuffle=0)])
    noise = random.Random(3).randbytes(N)
    frame = encode(chain, noise)
    assert len(frame) == FRAME.size + STAGE.size + N  # stored as is, flagged skipped
    assert STAGE.unpack_from(frame, FRAME.size) == (N, 1)
    assert chain.max_stored_bytes(N) == len(frame)
    assert decode(chain, frame) == noise


def test_a_quantizing_chain_checks_the_bytes_after_its_last_lossy_stage() -> None:
    chain = CodecChain([Fp8Codec(dtype="float16"), ZstdCodec(shuffle=0)])
    data = kv_like(N, 2)
    frame = encode(chain, data)
    *_, checked, _, _ = FRAME.unpack_from(frame)
    assert checked == Fp8Codec(dtype="float16").max_encoded_bytes(N)  # the fp8 bytes
    once = decode(chain, frame)
    assert once == decode(chain, frame) != data  # lossy, and the same every time
    assert chain.max_stored_bytes(N) < N * 0.6


class Liar:
    """A lossless codec whose decode gives back other bytes of the right length."""

    name = "liar"
    lossy = False
    keyed = False

    def describe(self) -> dict[str, Any]:
        return {}

    def max_encoded_bytes(self, n: int) -> int:
        return n

    def encode(self, data: memoryview, key: OffloadKey, tenant: str | None) -> bytes:
        return bytes(data[: len(data) // 2])  # smaller: the chain keeps it

    def decode(self, data: memoryview, size: int, key: OffloadKey, tenant: str | None) -> bytes:
        return bytes(size)


def test_bytes_a_stage_decodes_wrongly_are_refused_by_the_checksum() -> None:
    chain = CodecChain([Liar(), ZstdCodec()])
    frame = encode(chain, kv_like(N, 3))
    with pytest.raises(CodecCorrupt, match="checksum"):
        decode(chain, frame)


def test_frames_of_another_chain_or_cut_short_are_corrupt() -> None:
    ours, theirs = CodecChain([ZstdCodec()]), CodecChain([ZstdCodec(level=3, shuffle=0)])
    frame = encode(theirs, kv_like(N, 4))
    with pytest.raises(CodecCorrupt, match="another codec chain"):
        decode(ours, frame)
    good = encode(ours, kv_like(N, 4))
    for bad, why in (
        (good[:10], "cut short"),
        (good[: len(good) - 1], "cut short"),
        (b"X" + good[1:], "no codec frame"),
    ):
        with pytest.raises(CodecCorrupt, match=why):
            decode(ours, bad)
    wrong_size = bytearray(good)
    struct.pack_into(">Q", wrong_size, 16, N + 1)  # the original length
    with pytest.raises(CodecCorrupt, match="bytes, the slot"):
        decode(ours, wrong_size)
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF  # a library error or a wrong decode: corrupt either way
    with pytest.raises(CodecCorrupt):
        decode(ours, flipped)


def test_a_block_sealed_for_one_tenant_is_refused_to_another() -> None:
    chain = CodecChain([ZstdCodec(), AesGcmCodec()])
    data = kv_like(N, 5)
    frame = encode(chain, data, tenant="alice")
    assert decode(chain, frame, tenant="alice") == data
    for key, tenant in ((codec_key(1), "bob"), (codec_key(1), None), (codec_key(2), "alice")):
        with pytest.raises(CodecRefused):
            decode(chain, frame, key, tenant)


def test_the_chain_id_follows_what_changes_the_encoding_never_a_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = CodecChain([ZstdCodec(), AesGcmCodec()])
    assert a.chain_id == CodecChain([ZstdCodec(level=9), AesGcmCodec()]).chain_id  # levels
    assert a.chain_id != CodecChain([ZstdCodec(shuffle=0), AesGcmCodec()]).chain_id
    assert a.chain_id != CodecChain([AesGcmCodec(), ZstdCodec()]).chain_id
    assert "11" * 32 not in repr(a.description)
    monkeypatch.setenv(KEY_ENV, "22" * 32)
    assert a.chain_id != CodecChain([ZstdCodec(), AesGcmCodec()]).chain_id  # the key id


def test_a_chain_refuses_what_is_no_chain() -> None:
    with pytest.raises(ValueError, match="at least one"):
        CodecChain([])
    with pytest.raises(ValueError, match="named twice"):
        CodecChain([ZstdCodec(), ZstdCodec(level=3)])
    with pytest.raises(ValueError, match="at most"):
        CodecChain([Liar()] * (MAX_STAGES + 1))
    with pytest.raises(ValueError, match="not a BlockCodec"):
        CodecChain([object()])  # type: ignore[list-item]
    assert as_chain(None) is None
    assert as_chain([]) is None
    with pytest.raises(ValueError, match="codec: a list of codecs"):
        as_chain("zstd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="codec: codec 'zstd' is named twice"):
        as_chain([ZstdCodec(), ZstdCodec()])
