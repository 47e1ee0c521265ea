"""The Valkey tier's own wire path (``_client.tune``) on blocks large enough to take it: a
``SET`` sends the host slot behind its header without a copy, a ``GET`` of a block is
received straight into one buffer. Byte-exact round trips on a real server and cluster, the
stored value exactly header area + payload, a damaged or cut value never served, a reply
cut off by the server (closed or stalled mid-block) failing the job, never filling a slot
with a partial block, and a server that stops reading a put failing it on the command
timeout (kept by the kernel on plain TCP: still reported as a timeout)."""

from __future__ import annotations

import itertools
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.format import HEADER_AREA
from kvhex.adapters.storage.valkey._client import DIRECT_BYTES
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.domain import JobId, JobKind, TierJob
from kvhex.testing import block_payload, tier_key
from tests.adapters.storage.peer_kit import get, put, run_job
from tests.adapters.storage.valkey.servers import PASSWORD, Server, client

SLOT = 4 * DIRECT_BYTES
"""Large enough for the direct receive path."""
N = 6
_ids = itertools.count(70_000)


@pytest.fixture(params=["standalone", "cluster"])
def pool(
    request: pytest.FixtureRequest, valkey_standalone: Server, valkey_cluster: list[Server]
) -> Iterator[tuple[ValkeyTierStore, Any, MemoryHostBuffer]]:
    """A tier with large slots on the standalone server or the cluster, and a plain
    valkey-py client of the same servers (to look at and damage the stored values)."""
    prefix = f"wire-{uuid.uuid4().hex[:8]}"
    host = MemoryHostBuffer(2 * N, SLOT)
    if request.param == "standalone":
        url = f"valkey://127.0.0.1:{valkey_standalone.port}/{prefix}"
        store = ValkeyTierStore(
            host, url, capacity_bytes=4 * N * (SLOT + HEADER_AREA), password=PASSWORD
        )
        plain = client(valkey_standalone.port, password=PASSWORD)
    else:
        from valkey.cluster import ClusterNode, ValkeyCluster

        url = f"valkey://127.0.0.1:{valkey_cluster[0].port}/{prefix}"
        store = ValkeyTierStore(host, url, capacity_bytes=4 * N * (SLOT + HEADER_AREA))
        plain = ValkeyCluster(startup_nodes=[ClusterNode("127.0.0.1", valkey_cluster[0].port)])
    yield store, plain, host
    store.close()
    plain.close()


def _fill(host: MemoryHostBuffer) -> list[Any]:
    keys = [tier_key(next(_ids)) for _ in range(N)]
    for slot, key in enumerate(keys):
        host.slot_view(slot)[:] = block_payload(key, SLOT)
    return keys


def test_large_blocks_are_stored_as_header_then_slot_and_read_back_byte_exact(
    pool: tuple[ValkeyTierStore, Any, MemoryHostBuffer],
) -> None:
    store, plain, host = pool
    keys = _fill(host)
    assert put(store, keys, None).success
    for key in keys:
        name, offset = store.location(key)
        assert offset == 0
        assert plain.strlen(name) == HEADER_AREA + SLOT
        assert plain.getrange(name, HEADER_AREA, -1) == block_payload(key, SLOT)
    dest = list(range(N, 2 * N))
    result = get(store, keys, dest)
    assert result.success, result.error
    for slot, key in zip(dest, keys, strict=True):
        assert host.slot_view(slot) == block_payload(key, SLOT)


@pytest.mark.parametrize("damage", ["flipped", "cut"])
def test_a_damaged_large_block_is_never_served_and_is_dropped(
    pool: tuple[ValkeyTierStore, Any, MemoryHostBuffer], damage: str
) -> None:
    store, plain, host = pool
    keys = _fill(host)
    assert put(store, keys, None).success
    name, _ = store.location(keys[2])
    if damage == "flipped":
        byte = plain.getrange(name, HEADER_AREA + SLOT // 2, HEADER_AREA + SLOT // 2)
        plain.setrange(name, HEADER_AREA + SLOT // 2, bytes([byte[0] ^ 0xFF]))
    else:
        plain.set(name, plain.getrange(name, 0, HEADER_AREA + SLOT // 2))
    result = get(store, keys, list(range(N, 2 * N)))
    assert not result.success
    assert result.ok_keys == frozenset(keys) - {keys[2]}
    assert keys[2] not in store


_BLOCK_BULK = re.compile(rb"\$\d{6,}\r\n")
"""The length line of a block-sized bulk string."""


class _CuttingServer:
    """Just enough of a Valkey server on loopback for the tier to start (``INFO``, ``SET``,
    ``SCAN``: an empty standalone server), which answers every ``GET`` with the start of a
    block's bulk reply and then closes the connection (``closes``) or stalls (``stalls``),
    or stops reading at the first block a ``SET`` sends (``stops_reading``)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        buffered = b""
        with conn:
            while not self.stop.is_set():
                data = conn.recv(65536)
                if not data:
                    return
                buffered += data
                if self.mode == "stops_reading" and _BLOCK_BULK.search(buffered):
                    self.stop.wait(5)  # the client's sends fill the socket buffers
                    return
                while (command := _command(buffered)) is not None:
                    args, buffered = command
                    if not self._answer(conn, args[0].upper()):
                        return

    def _answer(self, conn: socket.socket, name: bytes) -> bool:
        if name == b"INFO":
            text = b"cluster_enabled:0\r\n"
            conn.sendall(b"$%d\r\n%s\r\n" % (len(text), text))
        elif name == b"SCAN":
            conn.sendall(b"*2\r\n$1\r\n0\r\n*0\r\n")
        elif name == b"GET":
            conn.sendall(b"$%d\r\n" % (HEADER_AREA + SLOT) + bytes(HEADER_AREA + SLOT // 3))
            if self.mode == "closes":
                return False
            self.stop.wait(5)  # stalls past the tier's command timeout
            return False
        else:
            conn.sendall(b"+OK\r\n")
        return True

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.listener.close()


def _command(data: bytes) -> tuple[list[bytes], bytes] | None:
    """The first whole RESP command in ``data`` and what follows it, or ``None``."""
    lines = data.split(b"\r\n")
    if len(lines) < 2 or not lines[0].startswith(b"*"):
        return None
    count = int(lines[0][1:])
    args, at = [], 1
    for _ in range(count):
        if at + 1 >= len(lines):
            return None
        args.append(lines[at + 1])
        at += 2
    if at >= len(lines):
        return None
    return args, b"\r\n".join(lines[at:])


@pytest.mark.parametrize("mode", ["closes", "stalls"])
def test_a_block_reply_cut_off_by_the_server_fails_the_get(mode: str) -> None:
    server = _CuttingServer(mode)
    host = MemoryHostBuffer(1, SLOT)
    host.slot_view(0)[:] = b"\x5a" * SLOT
    try:
        store = ValkeyTierStore(
            host,
            f"valkey://127.0.0.1:{server.port}/cut",
            capacity_bytes=4 * (SLOT + HEADER_AREA),
            command_timeout_s=0.5,
        )
        try:
            started = time.monotonic()
            job = TierJob(JobId(next(_ids)), JobKind.GET, (tier_key(1),), (0,))
            result = run_job(store, job)
            assert time.monotonic() - started < 5
        finally:
            store.close()
    finally:
        server.close()
    assert not result.success
    assert not result.ok_keys  # the whole job failed
    assert "valkey 127.0.0.1" in (result.error or "")
    if mode == "stalls":
        assert "Timeout" in (result.error or "")
    assert host.slot_view(0) == b"\x5a" * SLOT  # nothing of the partial block landed


def test_a_put_the_server_stops_reading_fails_on_the_command_timeout() -> None:
    server = _CuttingServer("stops_reading")
    blocks = 64  # 16 MiB: more than loopback's socket buffers take
    host = MemoryHostBuffer(blocks, SLOT)
    keys = [tier_key(next(_ids)) for _ in range(blocks)]
    try:
        store = ValkeyTierStore(
            host,
            f"valkey://127.0.0.1:{server.port}/stopped",
            capacity_bytes=2 * blocks * (SLOT + HEADER_AREA),
            command_timeout_s=0.5,
        )
        try:
            started = time.monotonic()
            result = put(store, keys, None)
            assert time.monotonic() - started < 5
            assert not any(key in store for key in keys)
        finally:
            store.close()
    finally:
        server.close()
    assert not result.success
    assert "Timeout" in (result.error or ""), result.error
