"""The worked example codec (examples/kvhex-zlib-codec), installed with pip as a user would:
its own suite (kvhex's codec contract) passes, the registry finds and loads it under
``kvhex.codecs``, and ``kvhex run`` stores and serves a file tier's blocks through it."""

from __future__ import annotations

import json
from pathlib import Path

from kvhex.plugins import CODECS, Registry
from tests.plugins.conftest import EXAMPLES, imported_from, run_own_suite, run_summary

EXAMPLE = EXAMPLES / "kvhex-zlib-codec"


def test_the_examples_own_suite_passes_against_the_installed_distribution(
    zlib_site: Path, tmp_path: Path
) -> None:
    suite = run_own_suite(EXAMPLE, zlib_site, tmp_path / "junit.xml")
    assert (suite.get("failures"), suite.get("errors")) == ("0", "0")
    assert int(suite.get("tests") or 0) > 10  # the contract's checks, twice, and its own
    where = imported_from(EXAMPLE, zlib_site, "kvhex_zlib_codec")
    assert where.is_relative_to(zlib_site)  # not the source tree


def test_the_registry_finds_and_loads_the_zlib_codec(with_zlib: Path) -> None:
    registry = Registry.discover([CODECS])
    assert registry.names(CODECS) == ["aes-gcm", "fp8", "lz4", "zlib", "zstd"]
    spec = next(s for s in registry.specs(CODECS) if s.name == "zlib")
    assert (spec.distribution, spec.version) == ("kvhex-zlib-codec", "0.1.0")
    lines = registry.load_all(CODECS).lines()
    assert "kvhex.codecs zlib: loaded from kvhex-zlib-codec 0.1.0" in lines


def test_kvhex_run_stores_and_serves_a_file_tier_through_the_codec(
    zlib_site: Path, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    config = tmp_path / "kvhex.toml"
    config.write_text(
        f"""
[primary]
capacity_bytes = 1048576

[[tiers]]
type = "fsspec"
options = {{ url = "{root}", capacity_bytes = 67108864, codec = [{{ name = "zlib", level = 6 }}] }}

[run]
requests = 120
layers = 2
page_bytes = 4096
device_blocks = 512
"""
    )
    summary = run_summary(zlib_site, config)
    assert summary["hits"]["fsspec"]["chunks"] > 0  # served from the coded tier
    assert summary["integrity"]["verdict"] == "intact"
    assert summary["integrity"]["blocks_checked"] > 0
    (namespace,) = [p for p in root.iterdir() if p.is_dir()]
    recorded = json.loads((namespace / "config.json").read_text())
    assert recorded["codec"] == [{"name": "zlib", "format": "raw-deflate"}]
