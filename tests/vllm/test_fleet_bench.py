"""bench/fleet.py runs end to end on tiny sizes (a smoke test: nothing here is timed).

Two arms on fresh server pairs: vllm-router ``kv_aware`` and Dynamo's selection service,
both in front of two vLLM servers running kvhex on a shared file root; this checks that each
reports its figures, that the router credited requests (its histories were announced), that
kvhex served some of the servers' prompt tokens, and that the answers are equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dynamo import BUILD as DYNAMO_BUILD
from tests.dynamo import PYTHON_VARIABLE as DYNAMO_VARIABLE
from tests.routers import ROUTER_BUILD, ROUTER_VARIABLE, python_or_skip
from tests.vllm.engine import ENGINE_SKIP

pytestmark = pytest.mark.skipif(ENGINE_SKIP is not None, reason=ENGINE_SKIP or "")

BENCH = Path(__file__).parent.parent.parent / "bench" / "fleet.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_fleet_bench_reports_each_arm_with_its_routers_credit(tmp_path: Path) -> None:
    python_or_skip(ROUTER_VARIABLE, "vllm-router", ROUTER_BUILD, ".venv-router")
    python_or_skip(DYNAMO_VARIABLE, "Dynamo's runtime", DYNAMO_BUILD, ".venv-dynamo")
    plot = tmp_path / "fleet.png"
    command = [sys.executable, str(BENCH), "--quick", "--json", "--plot", str(plot)]
    command += ["--arms", "kv+kvhex,dynamo+kvhex"]
    out = subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=900, cwd=tmp_path,
        env=os.environ,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    document = json.loads(out.stdout)
    assert document["bench"] == "fleet"
    rows = {row["arm"]: row for row in document["rows"]}
    assert sorted(rows) == ["dynamo+kvhex", "kv+kvhex"]
    for row in rows.values():
        for key in ("ttft_p50_s", "ttft_p99_s", "requests_per_s"):
            assert row[key] > 0, (key, row)
        assert row["answers_equal"] is True
        assert row["credited_share"] > 0, row  # later turns found their history
        servers = row["servers"]
        assert len(servers) == 2
        assert sum(s["prompt"] for s in servers) > 0
        assert sum(s["device"] + s["host"] + s["disk"] for s in servers) > 0
    assert plot.read_bytes().startswith(PNG_SIGNATURE)
    assert "kv+kvhex" in out.stderr
