"""docs/metrics.md lists exactly the metrics kvhex exports, and the Grafana dashboard queries
only those (and every one of them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvhex.adapters.metrics.prometheus import METRICS

ROOT = Path(__file__).parent.parent.parent.parent
DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "examples" / "grafana" / "kvhex-dashboard.json"
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def test_the_doc_lists_every_exported_metric_and_nothing_else() -> None:
    documented = set(re.findall(r"^\| `(kvhex_[a-z_]+)` \|", DOC.read_text(), re.MULTILINE))
    listed = {name + ("_total" if kind == "counter" else "") for name, kind, _, _ in METRICS}
    assert documented == listed


def test_the_dashboard_queries_exported_metrics_and_covers_them_all() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"\bkvhex_[a-z_]+", expr)}
    possible = {name + s for name, kind, _, _ in METRICS for s in _SUFFIXES[kind]}
    assert queried <= possible, f"not exported: {sorted(queried - possible)}"
    for name, kind, _, _ in METRICS:
        assert any(name + s in queried for s in _SUFFIXES[kind]), f"{name} is on no panel"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
