"""``bench/objects.py`` runs end to end on tiny inputs against vLLM's real object tier (a smoke
test: nothing here is timed; the figures of a ``--quick`` run mean nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (make test runs this in .venv-vllm)")
pytest.importorskip("nixl_cu12", reason="needs nixl==1.5.1 (pip install 'kvhex[nixl]')")
pytest.importorskip("s3fs", reason="needs s3fs (pip install 'kvhex[s3]')")
pytest.importorskip("moto.server", reason="needs moto[server] (pip install 'kvhex[test]')")

BENCH = Path(__file__).parent.parent.parent / "bench" / "objects.py"


def test_objects_bench_compares_both_kvhex_tiers_with_vllms_obj_tier() -> None:
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
        f"{tier} {chunk} {direction}"
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
    for tier in ("s3", "nixl"):
        for chunk in ("2048 KiB", "256 KiB"):
            assert any(
                line.split()[:3] == [tier, *chunk.split()] for line in done.stderr.splitlines()
            ), (tier, chunk)
