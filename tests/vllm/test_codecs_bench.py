"""bench/block_codecs.py's engine parts run end to end on tiny sizes (a smoke test: nothing
here is timed): real KV blocks from vLLM's CPU engine, the fp8 codec's accuracy against an engine
without offloading, and the time to first token of a prefix loaded through each chain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.engine import ENGINE_SKIP

pytestmark = pytest.mark.skipif(ENGINE_SKIP is not None, reason=ENGINE_SKIP or "")

BENCH = Path(__file__).parent.parent.parent / "bench" / "block_codecs.py"


def test_the_codecs_bench_measures_real_blocks_accuracy_and_ttft(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", "--parts", "codecs,accuracy,ttft"],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "chunks of real KV" in done.stderr
    rows = {row["case"]: row for row in json.loads(done.stdout)["rows"]}
    assert 0.5 < rows["stored/raw (fp8)"]["kvhex"] < 0.6
    # the control: loads through an uncoded file tier change no answer (their logprobs may
    # move in bf16's last bits: a prefill over loaded KV sums in another order)
    assert rows["none greedy tokens equal"]["kvhex"] == 1.0
    assert 0 <= rows["fp8 greedy tokens equal"]["kvhex"] <= 1
    assert rows["fp8 largest logprob difference"]["kvhex"] >= 0
    for chain in ("none", "zstd", "lz4", "fp8", "fp8+zstd", "aes-gcm"):
        assert rows[f"ttft from files ({chain})"]["kvhex"] > 0, chain
