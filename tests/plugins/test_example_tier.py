"""The worked example tier (examples/kvhex-sqlite-tier), installed with pip as a user would:
its own test suite passes, the registry finds and builds it, and ``kvhex run`` serves
promotions from it, also after a restart on the same file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.bootstrap import build_tier
from kvhex.domain import Locality, Medium, TierIdentity
from kvhex.errors import ConfigError
from kvhex.plugins import TIERS, Registry
from kvhex.ports import TierStore
from kvhex.testing import CrashContract, TierStoreContract
from tests.plugins.conftest import EXAMPLES, imported_from, run_own_suite, run_summary

EXAMPLE = EXAMPLES / "kvhex-sqlite-tier"


def test_the_examples_own_suite_passes_against_the_installed_distribution(
    sqlite_site: Path, tmp_path: Path
) -> None:
    suite = run_own_suite(EXAMPLE, sqlite_site, tmp_path / "junit.xml")
    cases = suite.findall("testcase")
    contract = [c for c in cases if c.get("classname", "").endswith("TestSqliteTierContract")]
    kit = (TierStoreContract, CrashContract)  # the example is persistent: it runs both
    checks = sorted({name for c in kit for name in dir(c) if name.startswith("test_")})
    own = (EXAMPLE / "tests" / "test_contract.py").read_text().count("\ndef test_")
    assert sorted(c.get("name") for c in contract) == sorted(checks)
    assert len(cases) == len(checks) + own
    assert (suite.get("failures"), suite.get("errors")) == ("0", "0")
    skipped = sorted(c.get("name") for c in cases if c.find("skipped") is not None)
    # the example opts out of the one check of two live instances on one database file
    assert skipped == ["test_restart_after_two_instances_stored_the_same_keys"]
    where = imported_from(EXAMPLE, sqlite_site, "kvhex_sqlite_tier")
    assert where.is_relative_to(sqlite_site)  # not the source tree


def test_the_registry_finds_loads_and_builds_the_sqlite_tier(
    with_sqlite: Path, tmp_path: Path
) -> None:
    registry = Registry.discover()
    spec = next(s for s in registry.specs(TIERS) if s.name == "sqlite")
    assert (spec.distribution, spec.version) == ("kvhex-sqlite-tier", "0.1.0")
    assert spec.value == "kvhex_sqlite_tier:SqliteTierStore"
    factory = registry.load(TIERS, "sqlite")
    assert factory.__module__ == "kvhex_sqlite_tier.store"
    assert Path(sys.modules["kvhex_sqlite_tier"].__file__ or "").is_relative_to(with_sqlite)
    lines = registry.load_all(TIERS).lines()
    assert "kvhex.tiers sqlite: loaded from kvhex-sqlite-tier 0.1.0" in lines

    host = MemoryHostBuffer(4, 4096)
    path = tmp_path / "kv.sqlite"
    options = {"path": str(path), "capacity_bytes": 1 << 20, "locality": "REMOTE"}
    tier = build_tier("sqlite", host, registry, options, path="$.tiers[0]")
    try:
        assert isinstance(tier, TierStore)
        assert tier.identity == TierIdentity(Medium.STORAGE, Locality.REMOTE, "sqlite")
        assert oct(path.stat().st_mode & 0o777) == "0o600"
    finally:
        tier.close()
    with pytest.raises(ConfigError) as info:
        build_tier("sqlite", host, registry, {"path": "x", "capacity": 5}, path="$.tiers[0]")
    assert set(info.value.paths) == {"$.tiers[0].capacity", "$.tiers[0].capacity_bytes"}
    # a file it cannot open: the tier blames its own option, reported at that option's key
    unusable = {"path": "/proc/kvhex-no-such/kv.sqlite", "capacity_bytes": 1 << 20}
    with pytest.raises(ConfigError) as info:
        build_tier("sqlite", host, registry, unusable, path="$.tiers[0]")
    assert info.value.paths == ("$.tiers[0].path",)
    assert "cannot open /proc/kvhex-no-such/kv.sqlite" in str(info.value)


def test_kvhex_run_serves_promotions_from_the_sqlite_tier_and_again_after_a_restart(
    sqlite_site: Path, tmp_path: Path
) -> None:
    db = tmp_path / "cache" / "kv.sqlite"
    config = tmp_path / "kvhex.toml"
    config.write_text(
        f"""
[primary]
capacity_bytes = 4194304

[[tiers]]
type = "sqlite"
options = {{ path = "{db}", capacity_bytes = 67108864 }}

[run]
requests = 120
layers = 2
page_bytes = 4096
device_blocks = 512
"""
    )
    first = run_summary(sqlite_site, config)
    assert first["tiers"] == ["sqlite (STORAGE)"]
    assert first["hits"]["sqlite"]["chunks"] > 0  # the 4 MiB host tier overflowed
    assert first["transfers"]["sqlite get"]["bytes"] > 0
    assert first["events"]["BlockStored STORAGE"] > 0
    assert first["placeholder_events"] == 0  # every block stored with its request's context
    assert first["integrity"]["verdict"] == "intact"
    assert first["integrity"]["blocks_checked"] > 0
    assert oct(db.stat().st_mode & 0o777) == "0o600"

    again = run_summary(sqlite_site, config)  # same workload, empty host tier, the same file
    assert again["hits"]["sqlite"]["chunks"] > first["hits"]["sqlite"]["chunks"]
    assert again["placeholder_events"] > 0  # the blocks found at start-up, without requests
    assert again["integrity"]["verdict"] == "intact"
