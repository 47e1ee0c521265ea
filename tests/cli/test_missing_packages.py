"""Every command meets a missing optional package with one line naming the kvhex extra to
install (exit 2, no traceback): the packages are hidden from a child process, as if never
installed (tests/packaging/test_install.py does it for real in a clean environment)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = (
    "import sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    sys.modules[name] = None  # import fails: ModuleNotFoundError, as if not installed\n"
    "from kvhex.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def kvhex_without(hidden: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, hidden, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("hidden", "args", "line"),
    [
        ("torch", ["run"], "kvhex run: needs torch, not installed: pip install 'kvhex[torch]'"),
        ("numpy", ["run"], "kvhex run: needs numpy, not installed: pip install 'kvhex[torch]'"),
        (  # the default file tier, through the registry: at its key, with its hint
            "xxhash",
            ["run", "--requests", "5"],
            "  $.tiers[0].type: kvhex.tiers entry point 'fsspec' from distribution 'kvhex': "
            "import failed: ModuleNotFoundError: import of xxhash halted; None in sys.modules "
            "(hint: pip install 'kvhex[files]')",
        ),
        (
            "zmq",
            ["events", "tcp://127.0.0.1:1", "--count", "1"],
            "kvhex events: needs zmq, not installed: pip install 'kvhex[zmq]'",
        ),
        (
            "msgspec",
            ["events", "events.jsonl"],
            "kvhex events: needs msgspec, not installed: pip install 'kvhex[zmq]'",
        ),
        (
            "xxhash",
            ["fsck", "."],
            "kvhex fsck: needs xxhash, not installed: pip install 'kvhex[files]'",
        ),
        (
            "prometheus_client",
            ["run", "--metrics-addr", "127.0.0.1:0"],
            "kvhex run: --metrics-addr 127.0.0.1:0: needs prometheus_client, not installed: "
            "pip install 'kvhex[metrics]'",
        ),
        (
            "s3fs",
            ["run", "--tier", "s3://bucket/kv", "--s3-endpoint", "http://127.0.0.1:1"],
            "  $.tiers[0].options.url (from --tier s3://bucket/kv): kvhex tier 'fsspec' cannot "
            "start: s3:// needs a package that is not installed (Install s3fs to access S3): "
            "pip install 'kvhex[s3]'",
        ),
    ],
    ids=[
        "run-torch",
        "run-numpy",
        "run-files",
        "events-zmq",
        "events-file",
        "fsck",
        "metrics",
        "run-s3",
    ],
)
def test_a_missing_package_is_one_line_naming_its_extra(
    hidden: str, args: list[str], line: str, tmp_path: Path
) -> None:
    (tmp_path / "events.jsonl").write_text("")
    done = kvhex_without(hidden, *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == line


def test_a_missing_module_that_is_no_optional_package_is_a_bug_shown_whole(
    tmp_path: Path,
) -> None:
    done = kvhex_without("kvhex.sim.driver", "run", cwd=tmp_path)
    assert done.returncode == 1
    assert "Traceback" in done.stderr
