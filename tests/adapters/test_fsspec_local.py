"""The fsspec tier on real local files: the TierStore contract, layout and permissions,
integrity, capacity, restart, crash leftovers, sharing, and bad roots."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from kvhex.adapters.fsspec import HEADER_AREA, FsspecTierStore, namespace_digest
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.domain import JobKind, Removed, Stored
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.testing import TierStoreContract
from tests.adapters.jobs import key, run

SLOT = 4096
NS = {"model": "tiny-llama", "blocks_per_chunk": 1, "dtype": "float16"}


class TestLocalFilesContract(TierStoreContract):
    slot_bytes = SLOT

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def make_store(self, host: HostBuffer) -> TierStore:
        return FsspecTierStore(host, str(self.root), capacity_bytes=1 << 24, namespace=NS)


def fill(host: MemoryHostBuffer, slots: range, seed: int) -> None:
    for s in slots:
        host.slot_view(s)[:] = bytes([(seed + s) % 256]) * SLOT


@pytest.fixture
def host() -> MemoryHostBuffer:
    return MemoryHostBuffer(8, SLOT)


def test_layout_namespace_permissions_and_config(tmp_path: Path, host: MemoryHostBuffer) -> None:
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    fill(host, range(1), 1)
    assert run(store, JobKind.PUT, [7]).success
    digest = namespace_digest({**NS, "slot_bytes": SLOT})
    path = Path(store.path_of(key(7)))
    assert path.parent.parent == tmp_path / digest
    assert path.parent.name == key(7).hex()[:2]
    assert path.name == key(7).hex() + ".blk"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert (tmp_path / digest / "config.json").exists()
    other = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace={"model": "x"})
    assert other.root != store.root  # incompatible blocks never meet
    store.close()
    other.close()


def test_corrupt_and_truncated_blocks_are_never_served(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    fill(host, range(2), 3)
    assert run(store, JobKind.PUT, [1, 2]).success
    store.take_events()
    flipped = Path(store.path_of(key(1)))
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated = Path(store.path_of(key(2)))
    truncated.write_bytes(truncated.read_bytes()[:-10])
    result = run(store, JobKind.GET, [1, 2], [5, 6])
    assert not result.success
    assert result.ok_keys == frozenset()
    assert not flipped.exists()
    assert not truncated.exists()
    (removed,) = store.take_events()
    assert isinstance(removed, Removed)
    assert set(removed.keys) == {key(1), key(2)}
    assert store.corrupt_blocks == 2
    assert run(store, JobKind.PROBE, [1, 2]).found == frozenset()


def test_capacity_evicts_least_recent_and_announces_first(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    block = HEADER_AREA + SLOT
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=3 * block, namespace=NS)
    fill(host, range(3), 0)
    assert run(store, JobKind.PUT, [1, 2, 3]).success
    store.take_events()
    assert run(store, JobKind.PUT, [4, 5]).success
    events = store.take_events()
    assert [type(e) for e in events] == [Removed, Stored]
    assert events[0].keys == (key(1), key(2))
    assert not Path(store.path_of(key(1))).exists()
    assert store.keys() == [key(3), key(4), key(5)]


def test_restart_sees_blocks_and_announces_them_once(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    first = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    fill(host, range(3), 9)
    assert run(first, JobKind.PUT, [1, 2, 3]).success
    first.close()
    (tmp_path / namespace_digest({**NS, "slot_bytes": SLOT}) / "ab").mkdir(
        mode=0o700, exist_ok=True
    )
    (tmp_path / namespace_digest({**NS, "slot_bytes": SLOT}) / "ab" / "notes.txt").write_text("x")
    second = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    (inventory,) = second.take_events()
    assert isinstance(inventory, Stored)
    assert set(inventory.keys) == {key(1), key(2), key(3)}
    assert inventory.ctx is None
    assert second.foreign_files == 1
    fill(host, range(8), 77)
    assert run(second, JobKind.GET, [2], [7]).success
    assert bytes(host.slot_view(7)) == bytes([(9 + 1) % 256]) * SLOT
    second.close()


def test_a_crash_mid_write_leaves_nothing_readable(tmp_path: Path, host: MemoryHostBuffer) -> None:
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    store.close()
    dead = Path(store.root) / "work" / "deadbeef"  # a crashed instance's work directory
    dead.mkdir(parents=True)
    (dead / ".lock").write_bytes(b"")
    (dead / "half-written").write_bytes(b"KVHXBLK1" + b"\0" * 10)
    again = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    assert not dead.exists()
    assert again.take_events() == []
    again.close()


def test_live_instances_keep_their_work_and_reuse_retired_files(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    block = HEADER_AREA + SLOT
    a = FsspecTierStore(host, str(tmp_path), capacity_bytes=2 * block, namespace=NS, name="a")
    b = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS, name="b")
    work = Path(a.root) / "work"
    assert len(list(work.iterdir())) == 2  # b did not remove a's work directory
    fill(host, range(2), 1)
    assert run(a, JobKind.PUT, [1, 2]).success
    inode = Path(a.path_of(key(1))).stat().st_ino
    fill(host, range(1), 9)
    assert run(a, JobKind.PUT, [3], [0]).success  # evicts 1: its file is reused for 3
    assert not Path(a.path_of(key(1))).exists()
    assert Path(a.path_of(key(3))).stat().st_ino == inode
    assert run(a, JobKind.GET, [3], [5]).success
    assert bytes(host.slot_view(5)) == bytes([9]) * SLOT
    a.close()
    b.close()


def test_two_processes_sharing_a_root_see_each_others_blocks(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    a = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS, name="a")
    b = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS, name="b")
    fill(host, range(1), 42)
    assert run(a, JobKind.PUT, [11]).success
    assert run(b, JobKind.PROBE, [11, 12]).found == frozenset({key(11)})
    assert run(b, JobKind.GET, [11], [3]).success
    assert bytes(host.slot_view(3)) == bytes([42]) * SLOT
    c = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS, name="c")
    assert [e.keys for e in c.take_events()] == [(key(11),)]  # its start-up inventory
    a.delete([key(11)])
    time.sleep(0.05)
    a.poll()
    assert not run(c, JobKind.GET, [11], [4]).success  # a removed it under c's feet
    (removed,) = c.take_events()
    assert isinstance(removed, Removed)
    assert removed.keys == (key(11),)  # c no longer claims it
    assert key(11) not in c
    a.close()
    b.close()
    c.close()


def test_an_unwritable_root_fails_at_start_up(tmp_path: Path, host: MemoryHostBuffer) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a directory")
    with pytest.raises(TierUnavailable, match="cannot use root") as info:
        FsspecTierStore(host, str(blocked / "sub"), capacity_bytes=1 << 20, name="disk")
    assert info.value.tier == "disk"


def test_a_full_disk_fails_the_put_and_announces_nothing(
    tmp_path: Path, host: MemoryHostBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    real_write = os.pwrite

    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    fill(host, range(1), 5)
    result = run(store, JobKind.PUT, [1])
    monkeypatch.setattr(os, "pwrite", real_write)
    assert not result.success
    assert "No space left" in (result.error or "")
    assert store.take_events() == []
    assert store.keys() == []
    (work,) = (Path(store.root) / "work").iterdir()
    assert [p.name for p in work.iterdir()] == [".lock"]  # no half-written file left
    assert store.used_bytes == 0
    store.close()
