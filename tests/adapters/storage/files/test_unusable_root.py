"""A local root the file tier cannot use is refused at the key that names it, with the
system's reason: from vLLM's ``root_dir`` (whose default capacity, the root's free space, is
not judged before the root exists), from kvhex's own TOML ``url`` and from Python; a root on
a full filesystem says there is no space for the default capacity."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage import namespace
from kvhex.adapters.storage.format import HEADER_AREA
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.bootstrap import build_engine as build_kvhex
from kvhex.config import load_config
from kvhex.errors import ConfigError, TierUnavailable
from kvhex.plugins import Registry
from kvhex.vllm.compose import RegionHostBuffer
from kvhex.vllm.compose import build_engine as build_vllm
from kvhex.vllm.settings import parse_settings

SLOT = 4096


def _reason(path: str) -> str:
    """What the system says when ``path`` is created here (the test's own attempt)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.rmdir(path)
    pytest.skip(f"{path} can be created here")


@pytest.fixture(params=["procfs", "sysfs", "file"])
def unusable(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A root that cannot be created: under procfs (no such directory can be made), under
    sysfs (not permitted), below a file."""
    if request.param == "file":
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        return str(blocker / "kv")
    return {"procfs": "/proc/kvhex-nope", "sysfs": "/sys/kvhex-nope"}[request.param]


def _vllm_fails(root_dir: str) -> ConfigError:
    settings = parse_settings(
        {"cpu_bytes_to_use": 2 * SLOT, "secondary_tiers": [{"type": "fs", "root_dir": root_dir}]}
    )
    host = RegionHostBuffer(memoryview(bytearray(2 * SLOT)), 2, SLOT)
    with pytest.raises(ConfigError) as info:
        build_vllm(settings, host, registry=Registry.discover(), namespace={}, record_events=True)
    return info.value


def test_vllm_s_root_dir_that_cannot_be_created_is_named_with_the_reason(unusable: str) -> None:
    ((path, problem),) = _vllm_fails(unusable).issues
    assert path == "$.secondary_tiers[0].root_dir"
    assert problem.startswith(f"kvhex tier 'fsspec' cannot start: cannot use root {unusable!r}")
    assert f"cannot create '{unusable}" in problem
    assert problem.endswith(_reason(unusable))
    assert "capacity" not in problem


def test_kvhex_s_toml_url_that_cannot_be_created_is_named_with_the_reason(
    unusable: str, tmp_path: Path
) -> None:
    toml = tmp_path / "kvhex.toml"
    toml.write_text(
        f'[primary]\ncapacity_bytes = {4 * SLOT}\n\n[[tiers]]\ntype = "fsspec"\n'
        f"options = {{ url = {json.dumps(unusable)}, capacity_bytes = {1 << 24} }}\n"
    )
    with pytest.raises(ConfigError) as info:
        build_kvhex(
            load_config(toml),
            MemoryHostBuffer(4, SLOT),
            Registry.discover(),
            namespace={"model": "m"},
            source=str(toml),
        )
    ((path, problem),) = info.value.issues
    assert path == "$.tiers[0].options.url"
    assert f"cannot create '{unusable}" in problem
    assert problem.endswith(_reason(unusable))


def test_the_tier_blames_its_url_with_the_reason(unusable: str) -> None:
    with pytest.raises(TierUnavailable) as info:
        FsspecTierStore(MemoryHostBuffer(2, SLOT), unusable, capacity_bytes=None, name="disk")
    assert (info.value.tier, info.value.option) == ("disk", "url")
    assert str(info.value).endswith(_reason(unusable))


def test_a_full_filesystem_has_no_space_for_vllm_s_default_capacity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = HEADER_AREA + SLOT
    monkeypatch.setattr(namespace, "free_bytes", lambda root: block - 1)
    ((path, problem),) = _vllm_fails(str(tmp_path / "kv")).issues
    assert path == "$.secondary_tiers[0].root_dir"
    assert "no space left on the filesystem of root" in problem
    assert f"{block - 1} bytes free hold no block of {block} bytes" in problem
    assert "capacity_bytes" in problem  # what else would do


def test_the_default_capacity_is_the_free_space_of_the_root_once_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def free(root: str) -> int:
        asked.append(root)
        assert os.path.isdir(root)
        return 3 * (HEADER_AREA + SLOT)

    monkeypatch.setattr(namespace, "free_bytes", free)
    root = tmp_path / "not" / "yet"
    tier = FsspecTierStore(MemoryHostBuffer(2, SLOT), str(root), capacity_bytes=None)
    assert tier.capacity_bytes == 3 * (HEADER_AREA + SLOT)
    assert asked == [str(root)]
    tier.close()


def test_an_object_store_takes_no_default_capacity() -> None:
    pytest.importorskip("s3fs")
    with pytest.raises(ValueError, match="only local roots default to their free space"):
        FsspecTierStore(MemoryHostBuffer(2, SLOT), "s3://bucket/kv", capacity_bytes=None)
