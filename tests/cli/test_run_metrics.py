"""``kvhex run --metrics-addr``: a real HTTP client scrapes ``/metrics`` while the run works and
after its last step, and the values agree with the run's own summary."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from tests.adapters.metrics.scrape import scrape, value
from tests.cli.command import Lines, small_config, spawn


def test_metrics_are_served_during_the_run_and_agree_with_its_summary(tmp_path: Path) -> None:
    config = small_config(tmp_path)
    child = spawn(
        "run",
        "--config",
        str(config),
        "--requests",
        "600",
        "--metrics-addr",
        "127.0.0.1:0",
        "--metrics-hold",
        "30",
        "--json",
        "--no-progress",
    )
    out, err = Lines(child.stdout), Lines(child.stderr)
    try:
        said = err.wait_for(lambda lines: any("metrics at http" in line for line in lines))
        url = re.search(r"metrics at (http://\S+)", "\n".join(said))
        assert url is not None
        # mid-run: lookups climb while requests are replayed
        first = scrape(url.group(1))
        deadline = time.monotonic() + 60
        while (looked := value(first, "kvhex_tier_lookups_total", tier="host", medium="CPU")) < 1:
            assert time.monotonic() < deadline, "no lookup counted"
            time.sleep(0.05)
            first = scrape(url.group(1))
        assert not out.lines, "the run was over before the first scrape"
        later = scrape(url.group(1))
        assert value(later, "kvhex_tier_lookups_total", tier="host", medium="CPU") >= looked
        # after the last step: the summary is printed and the server still answers
        lines = out.wait_for(lambda lines: lines[-1:] == ["}"], timeout=240)
        summary = json.loads("\n".join(lines))
        last = scrape(url.group(1))
    finally:
        child.terminate()  # as a service manager stops it: its scratch files go too
        try:
            child.wait(60)
        finally:
            child.kill()
            child.wait(10)
    assert summary["requests"] == 600
    for name, count in summary["events"].items():
        kind, medium = name.split(" ")
        assert value(last, "kvhex_events_published_total", type=kind, medium=medium) == count
    disk = {"tier": "disk", "medium": "STORAGE"}
    put, get = summary["transfers"]["disk put"], summary["transfers"]["disk get"]
    assert value(last, "kvhex_tier_bytes_total", **disk, direction="put") == put["bytes"] > 0
    assert value(last, "kvhex_tier_bytes_total", **disk, direction="get") == get["bytes"]
    promoted = value(last, "kvhex_tier_promoted_blocks_total", **disk, result="ok")
    assert promoted >= summary["hits"].get("disk", {"chunks": 0})["chunks"]
    stored = value(last, "kvhex_tier_blocks_put_total", tier="host", medium="CPU")
    assert stored == summary["chunks_stored"] + promoted  # device stores and promotions
    assert value(last, "kvhex_requests_active") == 0
    assert value(last, "kvhex_tier_jobs_in_flight", **disk) == 0
    decisions = summary["load_decisions"]
    for decision in ("load_all", "load_part", "recompute"):
        assert value(last, "kvhex_load_decisions_total", decision=decision) == decisions[decision]
