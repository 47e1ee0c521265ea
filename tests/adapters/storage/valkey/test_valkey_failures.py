"""The Valkey tier's failures on real servers: every start-up failure reported by kvhex's
configuration at the key to fix, no credential in any message; a cluster node killed while
the tier runs (jobs fail cleanly, nothing wrong is served, the tier works again once the node
is back)."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.format import HEADER_AREA
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.domain import JobId, JobKind, TierJob
from kvhex.domain.jobs import JobResult
from kvhex.testing import block_payload, tier_key
from tests.adapters.storage.peer_kit import run_job
from tests.adapters.storage.valkey.servers import (
    PASSWORD,
    SLOT_RANGES,
    Server,
    free_port,
    start_up_issue,
    wait_cluster_ok,
)

SLOT = 4096
_ids = itertools.count(90_000)


def _fails(options: dict[str, Any]) -> tuple[str, str]:
    return start_up_issue(options, "wrong-one")


def _url(server: Server) -> str:
    return f"valkey://127.0.0.1:{server.port}/kv-{uuid.uuid4().hex[:8]}"


def test_a_wrong_password_is_reported_at_password(valkey_standalone: Server) -> None:
    path, problem = _fails({"url": _url(valkey_standalone), "password": "wrong-one"})
    assert path == "$.tiers[0].options.password"
    assert "refused the credentials" in problem


def test_no_password_where_one_is_required_is_reported_at_password(
    valkey_standalone: Server,
) -> None:
    path, _ = _fails({"url": _url(valkey_standalone)})
    assert path == "$.tiers[0].options.password"


def test_a_node_down_is_reported_at_url() -> None:
    path, problem = _fails({"url": f"valkey://127.0.0.1:{free_port()}/kv", "connect_timeout_s": 1})
    assert path == "$.tiers[0].options.url"
    assert "no node of 127.0.0.1" in problem


def test_a_cluster_asked_of_a_standalone_server_is_reported_at_cluster(
    valkey_standalone: Server,
) -> None:
    path, _ = _fails({"url": _url(valkey_standalone), "password": PASSWORD, "cluster": True})
    assert path == "$.tiers[0].options.cluster"


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:1/kv", "valkey://127.0.0.1:6379", "valkey://h:notaport/kv",
     "valkey://user:wrong-one@127.0.0.1:6379/kv", "valkey://127.0.0.1:6379/{tag}"],
)  # fmt: skip
def test_a_malformed_url_is_reported_at_url(url: str) -> None:
    path, _ = _fails({"url": url})
    assert path == "$.tiers[0].options.url"


def _job(kind: JobKind, keys: list[Any], slots: list[int]) -> TierJob:
    return TierJob(JobId(next(_ids)), kind, tuple(keys), tuple(slots))


def _served_right(host: MemoryHostBuffer, result: JobResult, keys: list[Any]) -> None:
    """Every key the get reports read holds its own payload."""
    ok = set(keys) if result.success else set(result.ok_keys or ())
    for slot, key in enumerate(keys):
        if key in ok:
            assert bytes(host.slot_view(slot)) == block_payload(key, SLOT)


def test_a_node_killed_mid_run_fails_jobs_cleanly_and_the_tier_recovers(
    valkey_cluster: list[Server],
) -> None:
    blocks = 48
    host = MemoryHostBuffer(blocks, SLOT)
    keys = [tier_key(i) for i in range(blocks)]
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in valkey_cluster)
    store = ValkeyTierStore(
        host,
        f"valkey://{seeds}/kv-{uuid.uuid4().hex[:8]}",
        capacity_bytes=4 * blocks * (SLOT + HEADER_AREA),
        connect_timeout_s=1,
        command_timeout_s=2,
    )
    # a node that does not hold config.json: losing that is losing the namespace (another
    # test), not blocks
    from valkey.crc import key_slot

    config_slot = key_slot(store._io._config_key)  # type: ignore[attr-defined]
    victim = next(
        n for n, (lo, hi) in zip(valkey_cluster, SLOT_RANGES, strict=True)
        if not lo <= config_slot <= hi
    )  # fmt: skip
    for slot, key in enumerate(keys):
        host.slot_view(slot)[:] = block_payload(key, SLOT)
    stored = run_job(store, _job(JobKind.PUT, keys, list(range(blocks))))
    assert stored.success, stored.error
    try:
        victim.kill()
        for slot in range(blocks):
            host.slot_view(slot)[:] = bytes(SLOT)
        got = run_job(store, _job(JobKind.GET, keys, list(range(blocks))))
        assert not got.success
        assert got.error
        _served_right(host, got, keys)
        more = [tier_key(1000 + i) for i in range(16)]  # some on the dead node's slots
        put = run_job(store, _job(JobKind.PUT, more, list(range(16))))
        assert not put.success
        assert put.error
        assert "wrong-one" not in (put.error or "")
    finally:
        victim.start()  # its nodes.conf keeps its slots: it rejoins, empty
        wait_cluster_ok(valkey_cluster)
    try:
        deadline = time.monotonic() + 20
        while True:  # the client finds the node again (reconnects after the failure)
            host.slot_view(0)[:] = block_payload(tier_key(2000), SLOT)
            if run_job(store, _job(JobKind.PUT, [tier_key(2000)], [0])).success:
                break
            assert time.monotonic() < deadline, "the tier did not recover"
            time.sleep(0.2)
        host.slot_view(0)[:] = bytes(SLOT)
        again = run_job(store, _job(JobKind.GET, keys, list(range(blocks))))
        _served_right(host, again, keys)  # the blocks the restarted node lost are missing
        assert again.ok_keys or again.success
        back = run_job(store, _job(JobKind.GET, [tier_key(2000)], [0]))
        assert back.success
        assert bytes(host.slot_view(0)) == block_payload(tier_key(2000), SLOT)
    finally:
        store.close()
