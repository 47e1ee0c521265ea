"""Two kvhex processes sharing the 3-node cluster (same prefix and namespace): the other
process (``instance.py``) reads back byte for byte the blocks this one stored, and this one,
with ``announce_peers``, announces the blocks the other stored, in full (their records), and
their removal by it, leaving its own blocks out of the view."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.testing import block_payload
from tests.adapters.storage.peer_kit import Events, parent_first_in_each, put, request, started
from tests.adapters.storage.valkey.instance import CAPACITY, NS, SLOT
from tests.adapters.storage.valkey.servers import Server, flush


@pytest.fixture
def url(valkey_cluster: list[Server]) -> Iterator[str]:
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in valkey_cluster)
    yield f"valkey://{seeds}/kv-{uuid.uuid4().hex[:8]}"
    flush([n.port for n in valkey_cluster])


def _other(action: str, url: str, chunks: int, base: int, *rest: int) -> None:
    """Run the other instance; fail with what it printed unless it succeeded."""
    args = [action, url, str(chunks), str(base), *map(str, rest)]
    done = subprocess.run(
        [sys.executable, "-m", "tests.adapters.storage.valkey.instance", *args],
        cwd=Path(__file__).parents[4],  # the repository: tests is a package there
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def _tier(url: str, announce_peers: bool = False, interval_s: float = 1.0) -> ValkeyTierStore:
    host = MemoryHostBuffer(8, SLOT)
    return started(
        ValkeyTierStore(
            host,
            url,
            capacity_bytes=CAPACITY,
            namespace=NS,
            announce_peers=announce_peers,
            peer_scan_interval_s=interval_s,
        )
    )


def test_another_process_reads_the_blocks_this_one_stored(url: str) -> None:
    store = _tier(url)
    try:
        ctx, keys = request("other", 6, base=3000)  # what the other process reads
        for slot, key in enumerate(keys):
            store._host.slot_view(slot)[:] = block_payload(key, SLOT)
        assert put(store, keys, ctx).success
        _other("get", url, 6, 3000)
    finally:
        store.close()


def test_the_peer_view_announces_another_process_blocks_and_their_removal(url: str) -> None:
    store = _tier(url, announce_peers=True, interval_s=0.05)
    try:
        on = Events(store)
        _other("put", url, 4, 5000)
        _, theirs = request("other", 4, base=5000)
        on.until(lambda: on.held(store.peer_identity) == set(theirs), "their blocks announced")
        stored = on.stores(store.peer_identity)
        assert parent_first_in_each(stored, theirs)
        assert all(e.records is not None and None not in e.records for e in stored)
        assert store.peer_blocks == 4
        # its own blocks stay out of the view: its own events announce them
        own_ctx, own = request("own", 2, base=7000)
        for slot, key in enumerate(own):
            store._host.slot_view(slot)[:] = block_payload(key, SLOT)
        assert put(store, own, own_ctx).success
        scans = store.peer_scans
        on.until(lambda: store.peer_scans >= scans + 2, "two more scans")
        assert on.held(store.identity) == set(own)
        assert on.held(store.peer_identity) == set(theirs)
        _other("delete", url, 4, 5000, 3)
        on.until(lambda: on.held(store.peer_identity) == {theirs[3]}, "three of theirs go")
    finally:
        store.close()
