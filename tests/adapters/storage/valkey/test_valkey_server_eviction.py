"""``eviction = "server"`` on real servers whose ``maxmemory-policy allkeys-lru`` evicts: a
standalone server started with a small ``--maxmemory``, and the 3-node cluster given one for
the test. The tier puts more than fits; its events, replayed (a key stored twice or removed
while not stored fails), end up equal to what the server holds, found by ``SCAN``. A node
restarted empty is heard of again, and what it lost is announced removed. A server that
refuses ``CONFIG`` is reported at ``eviction``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.domain.keys import OffloadKey
from kvhex.errors import TierUnavailable
from kvhex.testing import block_payload, tier_key
from tests.adapters.storage.peer_kit import Events, get, put, started
from tests.adapters.storage.valkey.servers import Server, client, free_port

SLOT = 16 << 10
BATCH = 16
NS = {"model": "tiny-llama", "dtype": "float16"}


@pytest.fixture(scope="module")
def lru_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = Path(tmp_path_factory.mktemp("valkey-lru"))
    args = ["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]
    server = Server(free_port(), root, args)
    server.start()
    yield server
    server.kill()


def _on_server(ports: Sequence[int], store: ValkeyTierStore) -> set[OffloadKey]:
    """The tier's blocks every node holds now."""
    io: Any = store._io
    found = set()
    for port in ports:
        for name in client(port).scan_iter(match=io.prefix + b"*", count=1000):
            key = io.key_of(name)
            if key is not None:
                found.add(key)
    return found


def _overfill(store: ValkeyTierStore, blocks: int, events: Events | None = None) -> Events:
    """Put ``blocks`` blocks (more than the server keeps), taking events as they come."""
    host = store._host
    events = Events(store) if events is None else events
    for start in range(0, blocks, BATCH):
        keys = [tier_key(i) for i in range(start, start + BATCH)]
        for slot, key in enumerate(keys):
            host.slot_view(slot)[:] = block_payload(key, SLOT)
        assert put(store, keys, None).success
        events.take()
    return events


def _converges(events: Events, store: ValkeyTierStore, ports: Sequence[int]) -> set[OffloadKey]:
    """Poll until the replayed events claim exactly what the server holds; that set."""
    try:
        events.until(lambda: events.held(store.identity) == _on_server(ports, store), "converged")
    except AssertionError:
        held, there = events.held(store.identity), _on_server(ports, store)
        raise AssertionError(
            f"claimed {len(held)}, held {len(there)}: {len(held - there)} claimed but gone, "
            f"{len(there - held)} held unclaimed; gaps {store.server_gaps}"
        ) from None
    return events.held(store.identity)


def _served(store: ValkeyTierStore, keys: list[OffloadKey], events: Events) -> None:
    """Get ``keys``: every block served holds its bytes, and one not served is one the
    server evicted since (writing ``config.json`` back, which an ``allkeys-lru`` server
    evicts first as the oldest key, evicts another block): dropped and announced removed.
    Most are served."""
    host = store._host
    missed: set[OffloadKey] = set()
    for start in range(0, len(keys), BATCH):
        batch = keys[start : start + BATCH]
        result = get(store, batch, list(range(len(batch))))
        ok = set(batch) if result.success else set(result.ok_keys or ())
        for slot, key in enumerate(batch):
            if key in ok:
                assert bytes(host.slot_view(slot)) == block_payload(key, SLOT)
        missed |= set(batch) - ok
    events.until(lambda: not missed & events.held(store.identity), "the missed ones dropped")
    assert not missed & set(store.keys())
    assert len(missed) <= len(keys) // 4, f"{len(missed)} of {len(keys)} blocks not served"


def test_a_standalone_server_evicts_and_the_events_follow(lru_server: Server) -> None:
    url = f"valkey://127.0.0.1:{lru_server.port}/kv-{uuid.uuid4().hex[:8]}"
    store = started(
        ValkeyTierStore(MemoryHostBuffer(BATCH, SLOT), url, eviction="server", namespace=NS)
    )
    try:
        events = _overfill(store, 480)  # ~9.6 MB of blocks into 4 MB
        held = _converges(events, store, [lru_server.port])
        assert store.server_gaps == 0  # every drop heard, none found by a listing
        assert 0 < len(held) < 480
        assert store.lost_blocks >= 480 - len(held)
        _served(store, sorted(held), events)

        lru_server.kill()  # restarted empty: its notifications resume, its losses found
        lru_server.start()
        events.until(lambda: store.server_gaps >= 1, "the lost node noticed")
        events.until(lambda: not events.held(store.identity), "the lost blocks announced")
        assert store.keys() == []
        _overfill(store, 320, events)
        assert _converges(events, store, [lru_server.port])
    finally:
        store.close()


def test_a_cluster_evicts_on_every_primary_and_the_events_follow(
    valkey_cluster: list[Server],
) -> None:
    ports = [n.port for n in valkey_cluster]
    for port in ports:
        client(port).config_set("maxmemory", "4mb")
        client(port).config_set("maxmemory-policy", "allkeys-lru")
    seeds = ",".join(f"127.0.0.1:{p}" for p in ports)
    url = f"valkey://{seeds}/kv-{uuid.uuid4().hex[:8]}"
    store = started(
        ValkeyTierStore(MemoryHostBuffer(BATCH, SLOT), url, eviction="server", namespace=NS)
    )
    try:
        events = _overfill(store, 960)  # ~19 MB into 3 x 4 MB
        held = _converges(events, store, ports)
        assert store.server_gaps == 0
        assert 0 < len(held) < 960
        _served(store, sorted(held)[:64], events)
    finally:
        store.close()
        for port in ports:
            client(port).config_set("maxmemory", "0")
            client(port).config_set("maxmemory-policy", "noeviction")
            client(port).flushall()


def test_a_server_that_refuses_config_is_reported_at_eviction(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = Path(tmp_path_factory.mktemp("valkey-noconfig"))
    server = Server(free_port(), root, ["--rename-command", "CONFIG", '""'])
    server.start()
    try:
        with pytest.raises(TierUnavailable) as info:
            ValkeyTierStore(
                MemoryHostBuffer(2, SLOT),
                f"valkey://127.0.0.1:{server.port}/kv",
                eviction="server",
                namespace=NS,
            )
        assert info.value.option == "eviction"
        assert "notify-keyspace-events" in str(info.value)
    finally:
        server.kill()


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"eviction": "server", "capacity_bytes": 1 << 30}, "capacity_bytes"),
        ({}, "capacity_bytes"),
        ({"eviction": "lfu", "capacity_bytes": 1 << 30}, "eviction"),
    ],
)
def test_who_evicts_is_checked_before_connecting(options: dict[str, Any], option: str) -> None:
    started_at = time.monotonic()
    with pytest.raises(TierUnavailable) as info:
        ValkeyTierStore(
            MemoryHostBuffer(2, SLOT), f"valkey://127.0.0.1:{free_port()}/kv", **options
        )
    assert info.value.option == option
    assert time.monotonic() - started_at < 1
