"""``kvhex run``'s blocks are only ever shared where they are compatible: each ``[run]`` field
that changes a block's bytes or its key gives a fresh namespace, and a tier opened with it
finds none of the old blocks; fields that change neither keep the namespace, so runs share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.format import namespace_digest
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.cli._stack import Stack, run_namespace
from kvhex.config import load_config
from kvhex.config.model import RunConfig
from kvhex.domain import JobKind
from tests.adapters.jobs import run


def _run(**fields: Any) -> RunConfig:
    return load_config({"primary": {"capacity_bytes": 1 << 20}, "run": fields}).run


CHANGES_BLOCKS = {
    # field: (namespace key that records it, the change)
    "seed (the KV bytes)": ("seed", {"seed": 7}),
    "layers": ("groups", {"layers": 4}),
    "page bytes": ("page_bytes", {"page_bytes": 4096}),
    "layers and page bytes at equal chunk bytes": (
        "page_bytes",
        {"layers": 4, "page_bytes": 16384},
    ),
    "tokens per block (and per hash)": ("tokens_per_hash", {"tokens_per_block": 32}),
    "blocks per chunk": ("blocks_per_chunk", {"blocks_per_chunk": 2}),
}

CHANGES_NEITHER = {
    "requests": {"requests": 7},
    "device blocks": {"device_blocks": 64},
    "device": {"device": "cpu"},
    "transfer": {"transfer": "counting", "transfer_options": {"copy_threads": 2}},
}


@pytest.mark.parametrize(("key", "change"), CHANGES_BLOCKS.values(), ids=list(CHANGES_BLOCKS))
def test_a_field_that_changes_blocks_gives_a_fresh_namespace(
    key: str, change: dict[str, Any], tmp_path: Path
) -> None:
    old, new = run_namespace(_run()), run_namespace(_run(**change))
    assert old[key] != new[key]
    assert namespace_digest(old) != namespace_digest(new)
    host = MemoryHostBuffer(4, 4096)
    host.slot_view(0)[:] = b"\x05" * 4096
    first = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=old)
    second = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=new)
    try:
        assert run(first, JobKind.PUT, [1, 2]).success
        assert run(second, JobKind.PROBE, [1, 2]).found == frozenset()
        assert not run(second, JobKind.GET, [1], [3]).success
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("change", CHANGES_NEITHER.values(), ids=list(CHANGES_NEITHER))
def test_a_field_that_changes_neither_keeps_the_namespace(change: dict[str, Any]) -> None:
    assert run_namespace(_run(**change)) == run_namespace(_run())


def test_the_run_records_its_namespace_in_its_tier(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    config = load_config(
        {
            "primary": {"capacity_bytes": 1 << 20},
            "tiers": [{"type": "fsspec", "options": {"url": str(root), "capacity_bytes": 1 << 22}}],
            "run": {"layers": 2, "page_bytes": 4096, "device_blocks": 16, "device": "cpu"},
        }
    )
    with Stack(config):
        (recorded,) = (json.loads(p.read_text()) for p in root.glob("*/config.json"))
    expected = run_namespace(config.run)
    assert {k: v for k, v in recorded.items() if k not in ("slot_bytes", "layout_version")} == (
        expected
    )
    assert recorded["slot_bytes"] == expected["kv_bytes_per_chunk"]


def _kvhex_run(tmp_path: Path, workload: Path, seed: int) -> dict[str, Any]:
    config = tmp_path / "kvhex.toml"
    config.write_text(
        f"""
[primary]
capacity_bytes = 1048576

[[tiers]]
type = "fsspec"
name = "disk"
options = {{ url = "{tmp_path / "tier"}", capacity_bytes = 16777216 }}

[run]
layers = 2
page_bytes = 4096
device_blocks = 64
device = "cpu"
"""
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvhex",
            "run",
            "--config",
            str(config),
            "--workload",
            str(workload),
            "--seed",
            str(seed),
            "--json",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def test_runs_share_a_root_only_with_the_same_seed(tmp_path: Path) -> None:
    # the same tokens give the same keys under any seed, but the seed makes the bytes: a run
    # with another seed must not load the blocks a first run left on disk
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"tokens": list(range(1000, 1512))}) + "\n")
    first = _kvhex_run(tmp_path, workload, seed=1)
    assert first["transfers"]["disk put"]["bytes"] > 0
    other = _kvhex_run(tmp_path, workload, seed=2)
    assert "disk" not in other["hits"]
    assert other["integrity"]["blocks_bad"] == 0
    assert other["integrity"]["verdict"] == "unchecked"  # nothing was loaded back
