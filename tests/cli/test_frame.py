"""What every subcommand shares: ``--version``, logging to stderr at the chosen level and
format (before or after the subcommand), and stdout left to what the command prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvhex as package
from kvhex.cli import build_parser
from tests.cli.command import kvhex


def test_version() -> None:
    done = kvhex("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"kvhex {package.__version__}"


@pytest.mark.parametrize(
    "args",
    [
        ["-v", "fsck", "ROOT"],
        ["fsck", "ROOT", "-v"],
        ["--log-format", "json", "fsck", "ROOT", "-vv"],
        ["fsck", "--log-format", "json", "ROOT"],
    ],
)
def test_logging_flags_go_before_or_after_the_subcommand(args: list[str]) -> None:
    parsed = build_parser().parse_args(args)
    assert parsed.verbose == args.count("-v") + 2 * args.count("-vv")
    assert parsed.log_format == ("json" if "json" in args else "text")


def test_warnings_by_default_info_with_v_as_json_on_request(tmp_path: Path) -> None:
    # a command's own error is one line on stderr; the ZMQ sink's start-up is logged at
    # info: shown with -v only, as a JSON object with --log-format json, never on stdout
    events = tmp_path / "e.jsonl"
    events.write_text("")
    quiet = kvhex("events", str(events))
    assert quiet.returncode == 3
    assert quiet.stderr.splitlines() == [f"kvhex events: FILE {events} holds no batch"]
    loud = kvhex(
        "-v",
        "--log-format",
        "json",
        "run",
        "--requests",
        "2",
        "--json",
        "--events",
        "tcp://127.0.0.1:*",
    )
    assert loud.returncode == 0, loud.stderr
    json.loads(loud.stdout)
    logged = [json.loads(line) for line in loud.stderr.splitlines()]
    started = [line for line in logged if line["event"] == "zmq_event_sink_started"]
    assert started[0]["level"] == "info"
    assert started[0]["mode"] == "bind"
    assert started[0]["endpoint"].startswith("tcp://127.0.0.1:")
    assert not started[0]["endpoint"].endswith(":*")  # the port it got
    plain = kvhex("run", "--requests", "2", "--json", "--events", "tcp://127.0.0.1:*")
    assert plain.returncode == 0
    assert plain.stderr == ""
