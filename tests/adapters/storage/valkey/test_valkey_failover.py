"""A failover on a real replicated cluster (three primaries, a replica each): a primary is
killed, the cluster promotes its replica at another address, and the Valkey tier follows it.
Jobs fail while the slots have no primary, then serve every block again (the replica had
them), and with ``eviction = "server"`` the tier listens to the promoted replica's keyspace
notifications, so what that node drops is announced removed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.domain.keys import OffloadKey
from kvhex.testing import block_payload, tier_key
from tests.adapters.storage.peer_kit import Events, get, put, started
from tests.adapters.storage.valkey.servers import (
    SLOT_RANGES,
    Server,
    client,
    start_replicated_cluster,
)

SLOT = 16 << 10
BATCH = 16
BLOCKS = 48
NS = {"model": "tiny-llama", "dtype": "float16"}
FAILOVER_S = 60.0
"""How long the promotion and the first job served again may take."""


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Server], ...]]:
    primaries, replicas = start_replicated_cluster(Path(tmp_path_factory.mktemp("valkey-ha")))
    yield primaries, replicas
    for node in [*primaries, *replicas]:
        node.kill()


def _fill(host: MemoryHostBuffer, keys: list[OffloadKey]) -> None:
    for slot, key in enumerate(keys):
        host.slot_view(slot)[:] = block_payload(key, SLOT)


def _served(store: ValkeyTierStore, keys: list[OffloadKey]) -> bool:
    """Whether one get of ``keys`` succeeded, every byte right (zeroed slots first)."""
    host = store._host
    for slot in range(len(keys)):
        host.slot_view(slot)[:] = bytes(SLOT)
    if not get(store, keys, list(range(len(keys)))).success:
        return False
    for slot, key in enumerate(keys):
        assert bytes(host.slot_view(slot)) == block_payload(key, SLOT)
    return True


def test_a_failover_is_followed_by_the_jobs_and_by_the_drop_listener(
    replicated: tuple[list[Server], list[Server]],
) -> None:
    from valkey.crc import key_slot

    primaries, replicas = replicated
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in [*primaries, *replicas])
    url = f"valkey://{seeds}/kv-{uuid.uuid4().hex[:8]}"
    store = started(
        ValkeyTierStore(
            MemoryHostBuffer(BATCH, SLOT),
            url,
            eviction="server",
            namespace=NS,
            connect_timeout_s=1,
            command_timeout_s=2,
        )
    )
    victim, heir = primaries[0], replicas[0]
    try:
        assert store.notified_by == sorted(f"127.0.0.1:{p.port}" for p in primaries)
        events = Events(store)
        keys = [tier_key(i) for i in range(BLOCKS)]
        batches = [keys[i : i + BATCH] for i in range(0, BLOCKS, BATCH)]
        for batch in batches:
            _fill(store._host, batch)
            assert put(store, batch, None).success
        events.take()
        assert events.held(store.identity) == set(keys)
        for primary in primaries:  # every write reached the replicas
            assert client(primary.port).execute_command("WAIT", 1, 5000) == 1

        victim.kill()
        deadline = time.monotonic() + FAILOVER_S
        while client(heir.port).info("replication")["role"] != "master":
            assert time.monotonic() < deadline, "the replica was never promoted"
            time.sleep(0.1)
        # jobs touching the lost primary's slots fail until the client finds the heir
        while not all(_served(store, batch) for batch in batches):
            assert time.monotonic() < deadline, "the blocks were never served again"
            time.sleep(0.2)

        # the drop listener moved to the heir, which lists the namespace once subscribed
        # (the heir's listener starts before the dead node's ends: wait for both)
        heir_at, victim_at = f"127.0.0.1:{heir.port}", f"127.0.0.1:{victim.port}"
        events.until(
            lambda: heir_at in store.notified_by and victim_at not in store.notified_by,
            "the heir listened to, the dead primary no longer",
        )
        assert store.server_gaps >= 1
        assert events.held(store.identity) == set(keys)  # nothing was lost

        # a block on the heir's slots expires there: announced removed
        lo, hi = SLOT_RANGES[0]
        io = store._io
        gone = next(k for k in keys if lo <= key_slot(io.name(k)) <= hi)  # type: ignore[attr-defined]
        assert client(heir.port).pexpire(io.name(gone), 1)  # type: ignore[attr-defined]
        events.until(lambda: gone not in events.held(store.identity), "the expiry announced")
        assert gone not in store
        assert set(store.keys()) == set(keys) - {gone}
    finally:
        store.close()
        victim.start()  # back, as a replica of the heir
