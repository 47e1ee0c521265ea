"""The benchmarks run end to end on tiny inputs (a smoke test: nothing here is timed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "bench"


def test_primary_tier_bench_runs_and_reports_every_operation() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "primary_tier.py"),
            "--ops",
            "3000",
            "--slots",
            "200",
            "--prefixes",
            "100",
            "--index-chunks",
            "2000",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    for op in ("lookup", "touch", "prepare_load", "complete_load", "prepare_store"):
        assert f"\n{op} " in out
    assert "index memory at 2000 resident chunks: kvhex" in out
    assert ("vllm: not installed" in out) or ("kvhex/vllm" in out)


def test_tiering_bench_runs_and_reports_both_columns() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "tiering.py"),
            "--ops",
            "4000",
            "--slots",
            "200",
            "--prefixes",
            "100",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    for op in ("lookup", "store lifecycle", "load lifecycle", "step end"):
        assert f"\n{op} " in out
    assert "excl. tier adapters" in out
    assert "mem0:" in out


def test_events_bench_runs_and_reports_cost_and_memory() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "events.py"),
            "--chunks",
            "640",
            "--resident",
            "800",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "translate + encode" in out
    assert "warm caches" in out
    assert "snapshot design" in out


def test_tiers_bench_runs_every_tier_with_its_baseline() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "tiers.py"),
            "--total-mib",
            "8",
            "--s3-total-mib",
            "2",
            "--repeats",
            "1",
            "--batch",
            "4",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    for tier in ("files", "nixl", "s3"):
        assert f"\n{tier} " in out or out.startswith(tier), tier
    assert out.count("KiB") == 6


def test_gpu_transfer_bench_runs_on_cpu_tensors_with_its_baseline() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_transfer.py"),
            "--device",
            "cpu",
            "--total-mib",
            "4",
            "--layers",
            "4",
            "--chunks-per-job",
            "4",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out.startswith("device cpu, 4 layers")
    for chunk in ("2 MiB", "256 KiB"):
        for direction in ("store", "load"):
            assert f"\n{chunk:<8} {direction:<9} " in out, (chunk, direction)
    assert "kvhex GB/s" in out
