"""The SQLite tier against kvhex's shipped contract kit (every order of jobs on one key,
deletes, capacity, and writers killed with SIGKILL then reopened), then what is its own:
corruption, restart, capacity, and the file it keeps."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.domain import (
    JobId,
    JobKind,
    JobResult,
    OffloadKey,
    Removed,
    ReqContext,
    Stored,
    TierJob,
    make_offload_key,
)
from kvhex.errors import TierUnavailable
from kvhex.ports import HostBuffer, TierStore
from kvhex.testing import CrashContract, TierStoreContract
from kvhex_sqlite_tier import SqliteTierStore

SLOT = 4096


class TestSqliteTierContract(TierStoreContract, CrashContract):
    """Every check of the kit, each on a fresh database file (one process holds the file at
    a time, so the checks of two live instances on one storage do not apply)."""

    slot_bytes = SLOT

    @pytest.fixture(autouse=True)
    def _file(self, tmp_path: Path) -> None:
        self.path = tmp_path / "kv.sqlite"

    def make_store(self, host: HostBuffer) -> TierStore:
        return self.make_sized_store(host, 1024)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return SqliteTierStore(
            host, str(self.path), capacity_bytes=capacity_blocks * host.slot_bytes
        )


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


_ids = iter(range(1, 1 << 30))


def run(store: SqliteTierStore, kind: JobKind, ids: list[int], slots: list[int]) -> JobResult:
    """Submit one job and poll until its result arrives (failing after 10 s)."""
    job = TierJob(JobId(next(_ids)), kind, tuple(key(i) for i in ids), tuple(slots))
    {JobKind.PUT: store.submit_put, JobKind.GET: store.submit_get}[kind](job)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for result in store.poll():
            assert result.job_id == job.job_id
            return result
        time.sleep(0.001)
    raise AssertionError(f"job {job.job_id} never finished")


@pytest.fixture
def host() -> MemoryHostBuffer:
    host = MemoryHostBuffer(8, SLOT)
    for slot in range(8):
        host.slot_view(slot)[:] = bytes([slot + 1]) * SLOT
    return host


def test_restart_announces_the_blocks_once_without_a_request(
    host: MemoryHostBuffer, tmp_path: Path
) -> None:
    path = tmp_path / "cache" / "kv.sqlite"
    store = SqliteTierStore(host, str(path), capacity_bytes=1 << 20, name="db")
    ctx = ReqContext("req-1")
    job = TierJob(JobId(1), JobKind.PUT, (key(1), key(2)), (0, 1), ctx)
    store.submit_put(job)
    store.drain()
    assert store.poll()[0].success
    assert store.take_events() == [Stored((key(1), key(2)), store.identity, ctx)]
    store.close()
    assert oct(path.stat().st_mode & 0o777) == "0o600"

    again = SqliteTierStore(host, str(path), capacity_bytes=2 * SLOT, name="db")
    try:
        assert again.take_events() == [Stored((key(1), key(2)), again.identity, None)]
        assert again.take_events() == []
        assert run(again, JobKind.GET, [2, 1], [6, 7]).success
        assert bytes(host.slot_view(6)) == bytes([2]) * SLOT
        assert bytes(host.slot_view(7)) == bytes([1]) * SLOT
        assert run(again, JobKind.PUT, [3], [2]).success  # full: the found blocks count
        # kvhex's LRU: a job's first key (its oldest prefix chunk) ends most recent
        assert again.take_events() == [
            Removed((key(1),), again.identity),
            Stored((key(3),), again.identity, None),
        ]
    finally:
        again.close()


def test_a_corrupt_block_fails_its_load_is_deleted_and_its_removal_announced(
    host: MemoryHostBuffer, tmp_path: Path
) -> None:
    path = tmp_path / "kv.sqlite"
    store = SqliteTierStore(host, str(path), capacity_bytes=1 << 20)
    assert run(store, JobKind.PUT, [1, 2], [0, 1]).success
    store.close()
    with sqlite3.connect(path) as db:  # flip one byte of block 1 behind the tier's back
        (data,) = db.execute("SELECT data FROM blocks WHERE key = ?", (key(1),)).fetchone()
        flipped = data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]
        db.execute("UPDATE blocks SET data = ? WHERE key = ?", (flipped, key(1)))
    db.close()

    store = SqliteTierStore(host, str(path), capacity_bytes=1 << 20)
    try:
        store.take_events()
        host.slot_view(6)[:] = b"\xee" * SLOT
        result = run(store, JobKind.GET, [1, 2], [6, 7])
        assert not result.success
        assert result.ok_keys == frozenset({key(2)})
        assert bytes(host.slot_view(7)) == bytes([2]) * SLOT
        assert store.take_events() == [Removed((key(1),), store.identity)]
        assert not run(store, JobKind.GET, [1], [6]).success  # gone, not served again
        assert store.take_events() == []
    finally:
        store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM blocks").fetchone() == (1,)
    db.close()


def test_capacity_evicts_the_least_recently_used_before_announcing_the_new(
    host: MemoryHostBuffer, tmp_path: Path
) -> None:
    store = SqliteTierStore(host, str(tmp_path / "kv.sqlite"), capacity_bytes=3 * SLOT)
    try:
        assert run(store, JobKind.PUT, [1, 2, 3], [0, 1, 2]).success
        assert run(store, JobKind.GET, [1], [7]).success  # 1 is now the most recent
        store.take_events()
        assert run(store, JobKind.PUT, [4], [3]).success
        assert store.take_events() == [
            Removed((key(2),), store.identity),
            Stored((key(4),), store.identity, None),
        ]
        too_big = run(store, JobKind.PUT, [5, 6, 7, 8], [4, 5, 6, 7])
        assert not too_big.success
        assert store.take_events() == []  # a failure announces nothing
    finally:
        store.close()


def test_a_file_is_held_by_one_tier_and_kept_to_its_namespace(
    host: MemoryHostBuffer, tmp_path: Path
) -> None:
    path = str(tmp_path / "kv.sqlite")
    store = SqliteTierStore(host, path, capacity_bytes=1 << 20, namespace={"model": "a"})
    try:
        with pytest.raises(TierUnavailable, match="locked"):
            SqliteTierStore(host, path, capacity_bytes=1 << 20, namespace={"model": "a"})
    finally:
        store.close()
    with pytest.raises(TierUnavailable, match="another namespace"):
        SqliteTierStore(host, path, capacity_bytes=1 << 20, namespace={"model": "b"})
    SqliteTierStore(host, path, capacity_bytes=1 << 20, namespace={"model": "a"}).close()
