"""``kvhex run`` as a user runs it: a subprocess, its exit status, stdout and stderr."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.adapters.conftest import CREDENTIALS
from tests.cli.command import kvhex, small_config

SMALL = ["--requests", "30", "--no-progress"]


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
    assert done.returncode == 2
    assert str(bad) in done.stderr
    assert "$.run.requestz" in done.stderr
    assert "did you mean 'requests'" in done.stderr
    assert "Traceback" not in done.stderr
    missing = tmp_path / "nope.toml"
    done = kvhex("run", "--config", str(missing), timeout=60)
    assert done.returncode == 2
    assert str(missing) in done.stderr
    tier_option = tmp_path / "t.toml"
    tier_option.write_text(
        '[primary]\ncapacity_bytes = 4194304\n[[tiers]]\ntype = "fsspec"\n'
        'options = { url = "x", capacity = 5 }\n'
    )
    done = kvhex("run", "--config", str(tier_option), timeout=60)
    assert done.returncode == 2
    assert "$.tiers[0].options.capacity" in done.stderr
    assert "$.tiers[0].options.capacity_bytes" in done.stderr  # required, missing


def test_a_bad_workload_line_is_named(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"length": 100}\n{"length": -4, "colour": "red"}\n')
    done = kvhex(
        "run", "--config", str(small_config(tmp_path)), "--workload", str(workload), timeout=60
    )
    assert done.returncode == 2
    assert "line 2.length" in done.stderr
    assert "line 2.colour" in done.stderr
    assert str(workload) in done.stderr


def test_two_runs_on_one_tier_root_print_only_json_on_stdout(tmp_path: Path) -> None:
    config = small_config(tmp_path)
    first = kvhex("run", "--config", str(config), "--json", "--no-progress")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["transfers"]["disk put"]["bytes"] > 0
    assert first.stderr == ""  # warnings only, and there were none
    # the second finds the first's blocks (the tier logs its recovery): the log goes to
    # stderr, as JSON lines with --log-format json, and stdout is still one JSON document
    again = kvhex("run", "--config", str(config), "--json", "--no-progress", "-v")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["integrity"]["verdict"] == "intact"
    assert "tier_recovered" in again.stderr
    logged = kvhex(
        "--log-format", "json", "run", "--config", str(config), "--json", "--no-progress", "-v"
    )
    assert logged.returncode == 0, logged.stderr
    json.loads(logged.stdout)
    lines = [json.loads(line) for line in logged.stderr.splitlines()]
    recovered = [line for line in lines if line["event"] == "tier_recovered"]
    assert recovered
    assert recovered[0]["tier"] == "disk"
    assert recovered[0]["level"] == "info"


def peak_of(*args: str, timeout: float = 180) -> tuple[float, int, dict[str, Any]]:
    """Wall seconds, peak RSS in bytes and the JSON summary of ``kvhex ARGS`` run by a parent
    of its own (so the peak of its children is this run's alone)."""
    probe = (
        "import json, resource, subprocess, sys, time\n"
        "start = time.monotonic()\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "wall = time.monotonic() - start\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(json.dumps([wall, peak, done.returncode, done.stdout, done.stderr]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, sys.executable, "-m", "kvhex", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    wall, peak, status, out, err = json.loads(done.stdout)
    assert status == 0, err
    summary: dict[str, Any] = json.loads(out)
    return wall, peak, summary


def test_requests_are_made_as_the_run_takes_them_and_the_duration_stops_it() -> None:
    # --requests used to build every request first: 10**22 of them never started and grew
    # without bound, 100,000 took over a minute and 3 GB whatever --duration said
    wall, peak, summary = peak_of(
        "run", "--requests", "9" * 23, "--duration", "1", "--json", "--no-progress"
    )
    assert summary["requests"] >= 1
    assert 1 <= summary["seconds"] < 30
    assert peak < 1.5 * 2**30
    assert wall < 120
    _, alone_peak, alone = peak_of("run", "--duration", "1", "--json", "--no-progress")
    assert alone["requests"] >= 1  # --duration alone: as many as fit in the time
    assert alone["seconds"] >= 1
    assert alone_peak < 1.5 * 2**30


def test_nothing_loaded_back_is_unchecked_not_intact(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"length": 300}) + "\n")
    done = kvhex("run", "--config", str(small_config(tmp_path)), "--workload", str(workload))
    assert done.returncode == 0, done.stderr
    assert "integrity: unchecked (no block was loaded back, so none could be compared)" in (
        done.stdout
    )
    assert "intact" not in done.stdout


def test_a_disk_that_fills_mid_run_shows_the_failed_writes(tmp_path: Path) -> None:
    # a 10 MiB filesystem of its own (a user and mount namespace, no privileges needed)
    # under a tier whose slabs are 8 MiB: the first fits, the next ones do not
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to mount a small filesystem")
    mount = tmp_path / "small-disk"
    mount.mkdir()
    config = tmp_path / "kvhex.toml"
    config.write_text(
        small_config(tmp_path)
        .read_text()
        .replace(
            f'url = "{tmp_path / "tier"}", capacity_bytes = 67108864',
            f'url = "{mount / "tier"}", capacity_bytes = 67108864, io_threads = 8',
        )
    )
    script = (
        f"mount -t tmpfs -o size=10m tmpfs {mount} && exec {sys.executable} -m kvhex run "
        f"--config {config} --requests 80 --no-progress"
    )
    probe = subprocess.run(
        [unshare, "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mount}"],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr!r}")
    done = subprocess.run(
        [unshare, "-rm", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "FAILED tier jobs" in out
    failed = next(line for line in out.splitlines() if line.startswith("disk puts failed"))
    assert int(failed.split()[-1].replace(",", "")) > 0
    put = next(line for line in out.splitlines() if line.startswith("disk put "))
    assert int(put.split()[2].replace(",", "")) > 0  # what fitted was written
    assert "NOT OK:" in out
    assert "No space left on device" in done.stderr
    assert "Traceback" not in done.stderr


def test_sigterm_stops_a_run_as_ctrl_c_does_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A service manager stops ``kvhex run`` with SIGTERM: it ends within seconds with status
    143 (not killed by the signal) and its scratch directory removed (what SIGKILL leaves
    behind); its file tier is left usable: fsck finds it clean and another run works on it."""
    from kvhex.adapters.storage.files.fsck import check_root
    from tests.cli.command import Lines, spawn

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    config = small_config(tmp_path)
    events = tmp_path / "events.jsonl"
    child = spawn(
        "run",
        "--config",
        str(config),
        "--duration",
        "300",
        "--events",
        str(events),
        "--no-progress",
        env={"TMPDIR": str(scratch)},
    )
    out, err = Lines(child.stdout), Lines(child.stderr)
    try:
        while not events.exists() or len(events.read_text().splitlines()) < 3:
            assert child.poll() is None, err.text()
            time.sleep(0.05)
        assert list(scratch.iterdir()), "the run made no scratch directory under TMPDIR"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == 128 + signal.SIGTERM, err.text()
    finally:
        child.kill()
        child.wait(10)
        out.text()
        err.text()
    assert list(scratch.iterdir()) == []
    report = check_root(tmp_path / "tier")
    assert report.clean, report.as_dict()
    again = kvhex("run", "--config", str(config), *SMALL)
    assert again.returncode == 0, again.stderr
