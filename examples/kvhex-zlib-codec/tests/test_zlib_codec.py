"""The zlib codec against kvhex's codec contract, and on a real file tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.domain import JobId, JobKind, TierJob
from kvhex.plugins import CODECS, Registry
from kvhex.ports import BlockCodec
from kvhex.testing import CodecContract, kv_like
from kvhex_zlib_codec import ZlibCodec


class TestZlibCodecContract(CodecContract):
    def make_codec(self) -> BlockCodec:
        return ZlibCodec()


class TestZlibCodecSmallest(CodecContract):
    def make_codec(self) -> BlockCodec:
        return ZlibCodec(level=9)


def test_a_level_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^level: 1 to 9"):
        ZlibCodec(level=0)


def test_the_entry_point_builds_a_file_tier_that_compresses(tmp_path: Path) -> None:
    from kvhex.bootstrap import build_tier

    registry = Registry.discover()
    assert "zlib" in registry.names(CODECS)
    host = MemoryHostBuffer(4, 1 << 15)
    host.slot_view(0)[:] = kv_like(1 << 15, 1)
    options = {"url": str(tmp_path), "capacity_bytes": 1 << 22, "codec": ["zlib"]}
    tier = build_tier("fsspec", host, registry, options, path="$.tiers[0]")
    key = b"\x01" * 32 + b"\x00" * 4
    tier.submit_put(TierJob(JobId(1), JobKind.PUT, (key,), (0,)))
    tier.drain()
    assert [r.success for r in tier.poll()] == [True]
    tier.submit_get(TierJob(JobId(2), JobKind.GET, (key,), (1,)))
    tier.drain()
    assert [r.success for r in tier.poll()] == [True]
    assert host.slot_view(1) == host.slot_view(0)
    tier.close()
