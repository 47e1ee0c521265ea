"""bench/serve.py runs end to end on tiny sizes (a smoke test: nothing here is timed).

The bench starts vLLM's OpenAI server three times (without offloading, kvhex host memory,
kvhex host memory and a file tier) and drives each with its multi-turn chat load; this checks
that it reports a row per configuration and user count, with figures that can be figures, a
PNG plot, and equal greedy answers across the three.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.engine import ENGINE_SKIP

pytestmark = pytest.mark.skipif(ENGINE_SKIP is not None, reason=ENGINE_SKIP or "")

BENCH = Path(__file__).parent.parent.parent / "bench" / "serve.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_serving_bench_reports_every_configuration_and_user_count(tmp_path: Path) -> None:
    plot = tmp_path / "serve.png"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", "--plot", str(plot)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    document = json.loads(out.stdout)
    assert document["bench"] == "serve"
    rows = document["rows"]
    users = sorted({row["users"] for row in rows})
    assert len(users) == 2
    assert sorted((row["config"], row["users"]) for row in rows) == sorted(
        (config, u) for config in ("none", "host", "host+file") for u in users
    )
    for row in rows:
        for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "requests_per_s", "prompt_tokens"):
            assert row[key] > 0, (key, row)
        assert row["ttft_p99_s"] >= row["ttft_p50_s"]
        assert row["kvhex"] == row["ttft_p50_s"]
        assert row["ratio"] > 0
        assert row["answers_equal"] is True
        assert row["tokens_computed"] >= 0
    assert plot.read_bytes().startswith(PNG_SIGNATURE)
    assert "answers equal across configurations: yes" in out.stderr
