"""The pair docs/cli.md documents, end to end with real sockets: ``kvhex run --events
tcp://127.0.0.1:P --events-replay tcp://127.0.0.1:R`` binds, ``kvhex events
tcp://127.0.0.1:P --replay tcp://127.0.0.1:R`` connects, and the watcher ends up with
every batch the run published (the same ledger as the JSONL file the run also wrote)."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections import Counter
from pathlib import Path

from tests.cli.command import Lines, kvhex, small_config, spawn


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports nothing listens on now."""
    probes = [socket.socket() for _ in range(n)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def test_kvhex_events_follows_kvhex_run_from_its_first_batch(tmp_path: Path) -> None:
    pub, router = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    # the watcher first: it connects and waits (a late watcher would get the same through
    # the replay socket, as long as the run is still up)
    watcher = spawn(
        "events", pub, "--replay", router, "--replay-timeout", "120", "--json", "--duration", "300"
    )
    out, err = Lines(watcher.stdout), Lines(watcher.stderr)
    try:
        jsonl = tmp_path / "events.jsonl"
        run = kvhex(
            "run",
            "--config",
            str(small_config(tmp_path)),
            "--events",
            pub,
            "--events-replay",
            router,
            "--events",
            str(jsonl),
            "--json",
            "--no-progress",
            timeout=240,
        )
        assert run.returncode == 0, run.stderr
        ran = json.loads(run.stdout)
        batches = [json.loads(line) for line in jsonl.read_text().splitlines()]
        published = sum(len(b["events"]) for b in batches)
        assert published == sum(ran["events"].values())
        out.wait_for(lambda lines: len(lines) >= published, timeout=120)
        watcher.send_signal(signal.SIGINT)  # Ctrl-C: the watcher stops and reports
        watcher.wait(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, out.text() + err.text()
    records = [json.loads(line) for line in out.text().splitlines()]
    events, summary = records[:-1], records[-1]
    assert len(events) == published
    assert sorted({e["seq"] for e in events}) == list(range(len(batches)))
    seen = Counter(f"{e['type']} {e.get('medium') or '-'}" for e in events)
    assert dict(seen) == ran["events"]
    assert summary["verdict"] == "consistent"
    assert summary["gaps"] == []
    assert summary["batches"] == len(batches)
    # the file the run wrote beside the stream: the same ledger, the same verdict
    read = kvhex("events", str(jsonl), "--json", "--quiet")
    assert read.returncode == 0, read.stderr
    (from_file,) = [json.loads(line) for line in read.stdout.splitlines()]
    for key in ("batches", "first_seq", "last_seq", "events", "blocks", "verdict", "gaps"):
        assert from_file[key] == summary[key], key


def test_a_watcher_that_joins_late_loses_nothing(tmp_path: Path) -> None:
    jsonl = tmp_path / "events.jsonl"
    run = spawn(
        "-v",
        "--log-format",
        "json",
        "run",
        "--config",
        str(small_config(tmp_path)),
        "--events",
        "tcp://127.0.0.1:*",
        "--events-replay",
        "tcp://127.0.0.1:*",
        "--events",
        str(jsonl),
        "--duration",
        "8",
        "--json",
        "--no-progress",
    )
    run_out, run_err = Lines(run.stdout), Lines(run.stderr)
    try:
        logged = run_err.wait_for(lambda lines: any("zmq_event_sink_started" in x for x in lines))
        started = json.loads(next(x for x in logged if "zmq_event_sink_started" in x))
        # wait until the run has published (and the live stream moved on without us)
        while not jsonl.exists() or len(jsonl.read_text().splitlines()) < 3:
            assert run.poll() is None, run_err.text()
            time.sleep(0.05)
        watcher = spawn(
            "events",
            started["endpoint"],
            "--replay",
            started["replay_endpoint"],
            "--json",
            "--duration",
            "300",
        )
        out, err = Lines(watcher.stdout), Lines(watcher.stderr)
        try:
            run.wait(timeout=240)
            assert run.returncode == 0, run_err.text()
            published = sum(
                len(json.loads(line)["events"]) for line in jsonl.read_text().splitlines()
            )
            out.wait_for(lambda lines: len(lines) >= published, timeout=120)
            watcher.send_signal(signal.SIGTERM)  # as a service manager stops it: as Ctrl-C
            watcher.wait(timeout=60)
        finally:
            watcher.kill()
    finally:
        run.kill()
    assert watcher.returncode == 0, out.text() + err.text()
    records = [json.loads(line) for line in out.text().splitlines()]
    events, summary = records[:-1], records[-1]
    assert events[0]["seq"] == 0
    assert events[0]["replayed"] is True  # sent before the watcher started
    assert any(not e["replayed"] for e in events)  # and then followed live
    assert summary["verdict"] == "consistent"
    assert summary["batches"] == len(jsonl.read_text().splitlines())
    ran = json.loads(run_out.text())
    seen = Counter(f"{e['type']} {e.get('medium') or '-'}" for e in events)
    assert dict(seen) == ran["events"]
