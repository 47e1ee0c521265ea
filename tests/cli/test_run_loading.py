"""``kvhex run`` takes ``[loading]``: with a prefill speed set, its plans load or recompute as
the costs say, and the summary counts them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.command import kvhex, small_config


def _run(tmp_path: Path, loading: str) -> dict[str, int]:
    config = small_config(tmp_path)
    config.write_text(config.read_text() + f"\n[loading]\n{loading}\n")
    done = kvhex("run", "--config", str(config), "--requests", "80", "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["integrity"]["verdict"] == "intact"
    decisions: dict[str, int] = summary["load_decisions"]
    return decisions


@pytest.mark.parametrize(
    ("loading", "loads"),
    [
        ("prefill_tokens_per_s = 1e12", False),  # recomputing is free: never worth a load
        ("prefill_tokens_per_s = 1", True),  # a token a second: every load wins
    ],
)
def test_plans_follow_the_configured_prefill_speed(
    tmp_path: Path, loading: str, loads: bool
) -> None:
    d = _run(tmp_path, loading)
    plans = d["load_all"] + d["load_part"] + d["recompute"]
    assert plans > 2
    if loads:
        assert d["load_all"] == plans
        assert d["chunks_recomputed"] == 0
    else:
        # the first plan loads (the tier was never measured), as do the explorations
        assert d["recompute"] >= plans - 1 - d["explore"]
        assert d["chunks_recomputed"] > d["chunks_loaded"]


def test_mode_off_makes_no_plan(tmp_path: Path) -> None:
    d = _run(tmp_path, 'mode = "off"')
    assert d["load_all"] + d["load_part"] + d["recompute"] == 0
