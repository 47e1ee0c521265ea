"""The namespace's record on a real server: ``config.json`` is a key like any other, so a
server with an ``allkeys-*`` policy may evict it while blocks stay. The tier then records it
again and drops exactly the blocks a listing of the namespace lacks, and serves the others;
only a namespace emptied of every block (``FLUSHALL``, a server replaced empty) is a lost
store, whose blocks are all announced removed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.domain.keys import OffloadKey
from kvhex.testing import block_payload, tier_key
from tests.adapters.storage.peer_kit import Events, get, put, started
from tests.adapters.storage.valkey.servers import PASSWORD, Server, client

SLOT = 4096
BLOCKS = 8
NS = {"model": "tiny-llama", "dtype": "float16"}


@pytest.fixture
def store(valkey_standalone: Server) -> Iterator[ValkeyTierStore]:
    url = f"valkey://127.0.0.1:{valkey_standalone.port}/kv-{uuid.uuid4().hex[:8]}"
    tier = started(
        ValkeyTierStore(
            MemoryHostBuffer(BLOCKS, SLOT),
            url,
            capacity_bytes=64 * (SLOT + 4096),
            password=PASSWORD,
            namespace=NS,
        )
    )
    yield tier
    tier.close()


def _stored(store: ValkeyTierStore) -> tuple[Events, list[OffloadKey]]:
    keys = [tier_key(i) for i in range(BLOCKS)]
    for slot, key in enumerate(keys):
        store._host.slot_view(slot)[:] = block_payload(key, SLOT)
    assert put(store, keys, None).success
    events = Events(store)
    events.take()
    assert events.held(store.identity) == set(keys)
    return events, keys


def test_the_record_evicted_alone_is_written_again_and_only_lost_blocks_go(
    store: ValkeyTierStore, valkey_standalone: Server
) -> None:
    events, keys = _stored(store)
    io = store._io
    server = client(valkey_standalone.port, password=PASSWORD)
    server.delete(io._config_key, io.name(keys[3]))  # type: ignore[attr-defined]
    got = get(store, keys, list(range(BLOCKS)))
    assert not got.success
    assert got.ok_keys == frozenset(keys) - {keys[3]}
    events.until(lambda: keys[3] not in events.held(store.identity), "the lost block dropped")
    assert events.held(store.identity) == set(keys) - {keys[3]}  # and nothing else
    assert server.exists(io._config_key)  # type: ignore[attr-defined]
    rest = [k for k in keys if k != keys[3]]
    assert get(store, rest, list(range(len(rest)))).success
    for slot, key in enumerate(rest):
        assert bytes(store._host.slot_view(slot)) == block_payload(key, SLOT)


def test_a_namespace_emptied_is_a_lost_store(
    store: ValkeyTierStore, valkey_standalone: Server
) -> None:
    events, keys = _stored(store)
    io = store._io
    server = client(valkey_standalone.port, password=PASSWORD)
    names = [io._config_key, *(io.name(k) for k in keys)]  # type: ignore[attr-defined]
    server.delete(*names)  # as FLUSHALL would, the other tests' keys spared
    assert not get(store, keys[:2], [0, 1]).success
    events.until(lambda: not events.held(store.identity), "every block announced removed")
    assert store.keys() == []
    assert store.lost_blocks == BLOCKS
    assert put(store, keys[:2], None).success  # the namespace works again
    events.take()
    assert events.held(store.identity) == set(keys[:2])
