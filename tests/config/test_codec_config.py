"""A tier's ``codec`` chain in configuration (TOML ``options.codec``): names and tables built
through the ``kvhex.codecs`` entry points when the tier is planned, every problem at the key
that would fix it, nothing built when one is wrong, and the master key never in a message."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from kvhex.adapters.codecs.aesgcm import KEY_ENV
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.bootstrap import build_engine
from kvhex.config import load_config
from kvhex.config.loader import loads_toml
from kvhex.errors import ConfigError
from kvhex.plugins import Registry

SLOT = 4096
MASTER = "9a" * 32


def engine(tiers: list[dict[str, Any]]) -> Any:
    config = load_config({"primary": {"capacity_bytes": 4 * SLOT}, "tiers": tiers})
    return build_engine(
        config,
        MemoryHostBuffer(4, SLOT),
        Registry.discover(),
        namespace={"model": "m", "kv_cache_dtype": "bfloat16"},
        source="kvhex.toml",
    )


def files_tier(url: str, codec: Any) -> dict[str, Any]:
    """A file tier entry with a ``codec`` chain."""
    return {"type": "fsspec", "options": {"url": url, "capacity_bytes": 1 << 22, "codec": codec}}


def fails(tiers: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    with pytest.raises(ConfigError) as info:
        engine(tiers)
    return info.value.issues


def test_a_chain_from_toml_builds_its_codecs_with_the_kv_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, MASTER)
    config = loads_toml(
        f"""
        [primary]
        capacity_bytes = {4 * SLOT}
        [[tiers]]
        type = "fsspec"
        [tiers.options]
        url = "{tmp_path}"
        capacity_bytes = {1 << 22}
        codec = ["fp8", {{name = "zstd", level = 3, shuffle = 0}}, "aes-gcm"]
        """
    )
    built, (tier,) = build_engine(
        config,
        MemoryHostBuffer(4, SLOT),
        Registry.discover(),
        namespace={"model": "m", "kv_cache_dtype": "bfloat16"},
    )
    assert isinstance(tier, FsspecTierStore)
    assert tier.codec is not None
    assert tier.codec.names == ["fp8", "zstd", "aes-gcm"]
    described = tier.namespace["codec"]
    assert described[0]["dtype"] == "bfloat16"  # the KV cache's, from the namespace
    assert described[1] == {"name": "zstd", "shuffle": 0}
    assert MASTER not in repr(described)
    built.shutdown()


def test_every_codec_problem_is_named_at_its_key_and_nothing_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    first, second = tmp_path / "a", tmp_path / "b"
    issues = fails(
        [
            files_tier(str(first), ["nope", "aes-gcm"]),
            {
                "type": "fsspec",
                "name": "b",
                "options": {
                    "url": str(second),
                    "capacity_bytes": 1 << 22,
                    "codec": [{"name": "zstd", "level": 99}, {"level": 1}, "lz4", "lz4"],
                },
            },
            {
                "type": "memory",
                "name": "m",
                "options": {"capacity_bytes": 1 << 20, "codec": ["zstd"]},
            },
        ]
    )
    by_path = dict(issues)
    assert by_path["$.tiers[0].options.codec[0]"].startswith("unknown codec 'nope'; available:")
    assert by_path["$.tiers[0].options.codec[1].key_env"].startswith(
        "no master key: set the environment variable KVHEX_CODEC_KEY"
    )
    assert by_path["$.tiers[1].options.codec[0].level"] == "1 to 22, got 99"
    assert by_path["$.tiers[1].options.codec[1]"].startswith("expected a codec name or a table")
    assert by_path["$.tiers[2].options.codec"].startswith("unknown option")
    assert not first.exists()
    assert not second.exists()


def test_a_wrong_master_key_is_named_and_never_echoed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "not-a-key-" + "x" * 30)
    ((path, problem),) = fails([files_tier(str(tmp_path / "kv"), ["aes-gcm"])])
    assert path == "$.tiers[0].options.codec[0].key_env"
    assert "does not hold a 32-byte key" in problem
    assert "not-a-key" not in problem
    key_file = tmp_path / "master.key"
    key_file.write_bytes(bytes(16))
    ((path, problem),) = fails(
        [files_tier(str(tmp_path / "kv"), [{"name": "aes-gcm", "key_file": str(key_file)}])]
    )
    assert path == "$.tiers[0].options.codec[0].key_file"
    assert not (tmp_path / "kv").exists()


def test_a_codec_whose_package_is_missing_names_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if never installed
    monkeypatch.delitem(sys.modules, "kvhex.adapters.codecs.zstd", raising=False)
    ((path, problem),) = fails([files_tier(str(tmp_path / "kv"), ["zstd"])])
    assert path == "$.tiers[0].options.codec[0]"
    assert "pip install 'kvhex[zstd]'" in problem
    assert not (tmp_path / "kv").exists()
