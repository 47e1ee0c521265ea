"""The worked example transfer (examples/kvhex-counting-transfer), installed with pip as a user
would: its own suite passes, the registry finds and loads it under ``kvhex.transfers``, and
``kvhex run`` selects it by ``[run] transfer`` or ``--transfer`` and moves every byte of the
run through it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kvhex.plugins import TRANSFERS, Registry
from tests.plugins.conftest import EXAMPLES, imported_from, kvhex_run, run_own_suite

EXAMPLE = EXAMPLES / "kvhex-counting-transfer"

CONFIG = """
[primary]
capacity_bytes = 1048576

[run]
requests = 40
layers = 2
page_bytes = 4096
device_blocks = 512
"""


def test_the_examples_own_suite_passes_against_the_installed_distribution(
    counting_site: Path, tmp_path: Path
) -> None:
    suite = run_own_suite(EXAMPLE, counting_site, tmp_path / "junit.xml")
    own = (EXAMPLE / "tests" / "test_counting.py").read_text().count("\ndef test_")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == (str(own), "0", "0")
    where = imported_from(EXAMPLE, counting_site, "kvhex_counting_transfer")
    assert where.is_relative_to(counting_site)  # not the source tree


def test_the_registry_finds_and_loads_the_counting_transfer(with_counting: Path) -> None:
    registry = Registry.discover([TRANSFERS])
    assert registry.names(TRANSFERS) == ["counting", "memory", "torch"]
    spec = next(s for s in registry.specs(TRANSFERS) if s.name == "counting")
    assert (spec.distribution, spec.version) == ("kvhex-counting-transfer", "0.1.0")
    assert spec.value == "kvhex_counting_transfer:CountingBlockTransfer"
    factory = registry.load(TRANSFERS, "counting")
    assert factory.__module__ == "kvhex_counting_transfer.transfer"
    assert Path(sys.modules["kvhex_counting_transfer"].__file__ or "").is_relative_to(with_counting)
    lines = registry.load_all(TRANSFERS).lines()
    assert "kvhex.transfers counting: loaded from kvhex-counting-transfer 0.1.0" in lines


def _moved_through(summary: dict[str, Any], counts_file: Path) -> None:
    """The run is intact and every byte it moved either way went through the transfer."""
    assert summary["integrity"]["verdict"] == "intact"
    assert summary["integrity"]["blocks_checked"] > 0
    counts = json.loads(counts_file.read_text())
    traffic = summary["transfers"]
    assert counts["store"] == {
        "jobs": counts["store"]["jobs"],
        "failed": 0,
        "nbytes": traffic["device->host"]["bytes"],
    }
    assert counts["load"] == {
        "jobs": counts["load"]["jobs"],
        "failed": 0,
        "nbytes": traffic["host->device"]["bytes"],
    }
    assert counts["store"]["nbytes"] > 0
    assert counts["load"]["nbytes"] > 0  # host hits were loaded back through it


def test_kvhex_run_moves_its_bytes_through_the_transfer_named_in_run(
    counting_site: Path, tmp_path: Path
) -> None:
    counts = tmp_path / "counts.json"
    config = tmp_path / "kvhex.toml"
    config.write_text(
        CONFIG + f'transfer = "counting"\ntransfer_options = {{ report_path = "{counts}" }}\n'
    )
    done = kvhex_run(counting_site, config)
    assert done.returncode == 0, done.stderr
    _moved_through(json.loads(done.stdout), counts)


def test_the_transfer_flag_selects_it_and_an_unknown_name_lists_the_installed_ones(
    counting_site: Path, tmp_path: Path
) -> None:
    counts = tmp_path / "counts.json"
    config = tmp_path / "kvhex.toml"
    config.write_text(CONFIG + f'transfer_options = {{ report_path = "{counts}" }}\n')
    done = kvhex_run(counting_site, config, "--transfer", "counting")
    assert done.returncode == 0, done.stderr
    _moved_through(json.loads(done.stdout), counts)

    unknown = kvhex_run(counting_site, config, "--transfer", "countng")
    assert unknown.returncode == 2
    assert unknown.stdout == ""
    assert (
        "$.run.transfer (from --transfer countng): unknown transfer 'countng'; "
        "available: counting, memory, torch"
    ) in unknown.stderr
