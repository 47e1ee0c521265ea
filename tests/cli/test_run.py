"""``kvhex run`` as a user runs it: a subprocess, its exit status, stdout and stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.adapters.conftest import CREDENTIALS

SMALL = ["--requests", "30", "--no-progress"]


def kvhex(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "kvhex", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def small_config(tmp_path: Path, extra: str = "") -> Path:
    config = tmp_path / "kvhex.toml"
    config.write_text(
        f"""
[primary]
capacity_bytes = 4194304

[[tiers]]
type = "fsspec"
name = "disk"
options = {{ url = "{tmp_path / "tier"}", capacity_bytes = 67108864 }}

[run]
requests = 40
layers = 2
page_bytes = 4096
device_blocks = 512
{extra}
"""
    )
    return config


def test_the_default_run_reports_hits_traffic_events_and_integrity() -> None:
    done = kvhex("run", *SMALL)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "kvhex run: 30 requests" in out
    assert "tiers: files (STORAGE)" in out
    for row in ("host", "device->host", "host->device", "files put", "BlockStored CPU"):
        assert row in out
    assert "integrity: intact" in out
    assert done.stderr == ""  # no progress line when stderr is not a terminal


def test_json_summary_with_a_config_file_and_tier_promotions(tmp_path: Path) -> None:
    done = kvhex("run", "--config", str(small_config(tmp_path)), "--json", "--no-progress")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["requests"] == 40
    assert summary["tiers"] == ["disk (STORAGE)"]
    hits = summary["hits"]
    assert hits["disk"]["chunks"] > 0  # the 4 MiB host tier overflowed: the disk served
    assert hits["host"]["chunks"] > 0
    assert summary["transfers"]["disk get"]["bytes"] > 0
    assert summary["events"]["BlockRemoved CPU"] > 0
    assert summary["events"]["BlockStored STORAGE"] > 0
    assert summary["placeholder_events"] == 0  # every store described in full
    assert summary["integrity"] == {
        "blocks_checked": summary["integrity"]["blocks_checked"],
        "blocks_bad": 0,
        "failed_transfers": 0,
        "verdict": "intact",
    }
    assert summary["integrity"]["blocks_checked"] > 0


def test_an_s3_tier_on_the_loopback_server(tmp_path: Path, s3_server: str, bucket: str) -> None:
    env = {
        "AWS_ACCESS_KEY_ID": CREDENTIALS["key"],
        "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret"],
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    done = kvhex(
        "run",
        "--config",
        str(small_config(tmp_path)),
        "--tier",
        f"s3://{bucket}/kv",
        "--s3-endpoint",
        s3_server,
        "--json",
        "--no-progress",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["tiers"] == ["s3 (STORAGE)"]
    assert summary["transfers"]["s3 put"]["bytes"] > 0
    assert summary["hits"]["s3"]["chunks"] > 0
    assert summary["integrity"]["verdict"] == "intact"
    assert CREDENTIALS["secret"] not in done.stdout + done.stderr


def test_events_to_jsonl_are_read_back(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    done = kvhex(
        "run",
        "--config",
        str(small_config(tmp_path)),
        "--events",
        str(events),
        "--json",
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    counted: dict[str, int] = {}
    for line in events.read_text().splitlines():
        batch = json.loads(line)
        for event in batch["events"]:
            name = f"{event['type']} {event.get('medium') or '-'}"
            counted[name] = counted.get(name, 0) + 1
    assert counted == summary["events"]
    assert oct(events.stat().st_mode & 0o777) == "0o600"


def test_a_workload_file(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    lines = [
        {"length": 700, "prefix_group": "sys", "prefix_length": 512, "cache_salt": "t1"},
        {"length": 900, "prefix_group": "sys", "prefix_length": 512, "lora": "a"},
        {"tokens": list(range(300)), "mm": [{"id": "img", "offset": 64, "length": 32}]},
        {"length": 700, "prefix_group": "sys", "prefix_length": 512, "cache_salt": "t1"},
    ]
    workload.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    done = kvhex(
        "run",
        "--config",
        str(small_config(tmp_path)),
        "--workload",
        str(workload),
        "--json",
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["requests"] == 4
    # the last line shares the first's 512-token prefix and tenant: 8 chunks of 64 tokens;
    # the second shares the tokens but not the LoRA, so none of its chunks match (38 chunks
    # are looked up: 10 + 14 + 4 + 10)
    assert summary["hits"] == {"host": {"chunks": 8, "rate": 8 / 38, "tokens": 512}}


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--requests", "0"], "--requests"),
        (["--tier-capacity", "lots"], "--tier-capacity"),
        (["--device", "gpu"], "--device"),
        (["--frobnicate"], "--frobnicate"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], named: str) -> None:
    done = kvhex("run", *args, timeout=60)
    assert done.returncode == 2
    assert named in done.stderr


def test_bad_config_files_name_the_file_and_key(tmp_path: Path) -> None:
    bad = small_config(tmp_path, "requestz = 3")
    done = kvhex("run", "--config", str(bad), timeout=60)
    assert done.returncode == 1
    assert str(bad) in done.stderr
    assert "$.run.requestz" in done.stderr
    assert "did you mean 'requests'" in done.stderr
    assert "Traceback" not in done.stderr
    missing = tmp_path / "nope.toml"
    done = kvhex("run", "--config", str(missing), timeout=60)
    assert done.returncode == 1
    assert str(missing) in done.stderr
    tier_option = tmp_path / "t.toml"
    tier_option.write_text(
        '[primary]\ncapacity_bytes = 4194304\n[[tiers]]\ntype = "fsspec"\n'
        'options = { url = "x", capacity = 5 }\n'
    )
    done = kvhex("run", "--config", str(tier_option), timeout=60)
    assert done.returncode == 1
    assert "$.tiers[0].options.capacity" in done.stderr
    assert "$.tiers[0].options.capacity_bytes" in done.stderr  # required, missing


def test_a_bad_workload_line_is_named(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"length": 100}\n{"length": -4, "colour": "red"}\n')
    done = kvhex(
        "run", "--config", str(small_config(tmp_path)), "--workload", str(workload), timeout=60
    )
    assert done.returncode == 1
    assert "line 2.length" in done.stderr
    assert "line 2.colour" in done.stderr
    assert str(workload) in done.stderr
