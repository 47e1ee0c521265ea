"""``kvhex run --tier valkey://...`` on the real 3-node cluster, as a user runs it."""

from __future__ import annotations

import uuid

from tests.adapters.storage.valkey.servers import Server
from tests.cli.command import kvhex


def test_kvhex_run_offloads_to_a_valkey_cluster(valkey_cluster: list[Server]) -> None:
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in valkey_cluster)
    url = f"valkey://{seeds}/run-{uuid.uuid4().hex[:8]}"
    done = kvhex("run", "--tier", url, "--requests", "30", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "tiers: valkey (STORAGE)" in done.stdout
    assert "valkey put" in done.stdout
    assert "integrity: intact" in done.stdout
