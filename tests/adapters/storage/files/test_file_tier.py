"""The fsspec tier on real local files (the shipped contract kit runs on it in tests/contracts):
layout and permissions,
integrity, capacity, restart, crash leftovers, sharing, and bad roots."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage import tier as tier_module
from kvhex.adapters.storage.files._index import read_table, table_bytes
from kvhex.adapters.storage.format import HEADER_AREA, namespace_digest
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.domain import JobId, JobKind, Removed, Stored, TierJob
from kvhex.errors import TierUnavailable
from kvhex.ports import Indexed
from tests.adapters.jobs import key, run

SLOT = 4096
NS = {"model": "tiny-llama", "blocks_per_chunk": 1, "dtype": "float16"}


def slab_slots(path: Path | str) -> int:
    """How many slots a slab file's table says it has."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_table(fd)[0]
    finally:
        os.close(fd)


def fill(host: MemoryHostBuffer, slots: range, seed: int) -> None:
    for s in slots:
        host.slot_view(s)[:] = bytes([(seed + s) % 256]) * SLOT


@pytest.fixture
def host() -> MemoryHostBuffer:
    return MemoryHostBuffer(8, SLOT)


def corrupt(store: FsspecTierStore, k: int, *, at: int, truncate: bool = False) -> None:
    """Flip the byte ``at`` bytes into block ``k``'s payload, or cut the file there."""
    path, offset = store.location(key(k))
    with open(path, "r+b") as f:
        if truncate:
            f.truncate(offset + HEADER_AREA + at)
            return
        f.seek(offset + HEADER_AREA + at)
        byte = f.read(1)
        f.seek(offset + HEADER_AREA + at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_layout_namespace_permissions_and_config(tmp_path: Path, host: MemoryHostBuffer) -> None:
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    fill(host, range(2), 1)
    assert run(store, JobKind.PUT, [7, 8]).success
    digest = namespace_digest({**NS, "slot_bytes": SLOT})
    ns = tmp_path / digest
    path, offset = store.location(key(7))
    slab = Path(path)
    assert slab.parent == ns / "slabs"
    assert slab.suffix == ".slab"
    assert len(slab.stem) == 32
    assert int(slab.stem, 16) >= 0  # hex only
    assert offset == table_bytes(slab_slots(slab))  # after the table
    assert offset % 4096 == 0
    assert store.location(key(8)) == (path, offset + HEADER_AREA + SLOT)
    assert (
        slab.read_bytes()[offset + HEADER_AREA : offset + HEADER_AREA + SLOT] == bytes([1]) * SLOT
    )
    assert sorted(os.listdir(ns)) == ["config.json", "slabs"]
    for made in (slab, ns / "config.json"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o600, made
    for directory in (ns, ns / "slabs"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    other = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace={"model": "x"})
    assert other.root != store.root  # incompatible blocks never meet
    store.close()
    other.close()


def test_slabs_hold_no_more_than_the_capacity(tmp_path: Path, host: MemoryHostBuffer) -> None:
    block = HEADER_AREA + SLOT
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=5 * block + 100, namespace=NS)
    fill(host, range(8), 0)
    for start in range(0, 16, 4):
        assert run(store, JobKind.PUT, list(range(start, start + 4)), list(range(4))).success
    slabs = list((Path(store.root) / "slabs").iterdir())
    slots = [slab_slots(slab) for slab in slabs]
    assert sum(slots) == 5
    assert sum(slab.stat().st_size for slab in slabs) == sum(
        table_bytes(n) + n * block for n in slots
    )
    assert len(store.keys()) == 5
    store.close()


def test_corrupt_and_truncated_blocks_are_never_served(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    fill(host, range(2), 3)
    assert run(store, JobKind.PUT, [1, 2]).success
    store.take_events()
    corrupt(store, 1, at=SLOT - 1)
    corrupt(store, 2, at=SLOT - 10, truncate=True)
    result = run(store, JobKind.GET, [1, 2], [5, 6])
    assert not result.success
    assert result.ok_keys == frozenset()
    assert key(1) not in store  # gone from the index at once; the blocks go on an IO thread
    store.drain()
    for k in (1, 2):
        with pytest.raises(KeyError):
            store.location(key(k))
    (removed,) = store.take_events()
    assert isinstance(removed, Removed)
    assert set(removed.keys) == {key(1), key(2)}
    assert store.corrupt_blocks == 2
    assert run(store, JobKind.PROBE, [1, 2]).found == frozenset()
    fill(host, range(2), 60)
    assert run(store, JobKind.PUT, [1], [0]).success  # the freed slot takes a new block
    assert run(store, JobKind.GET, [1], [7]).success
    assert bytes(host.slot_view(7)) == bytes([60]) * SLOT
    store.close()


def test_capacity_evicts_least_recent_and_announces_first(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    block = HEADER_AREA + SLOT
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=3 * block, namespace=NS)
    fill(host, range(3), 0)
    assert run(store, JobKind.PUT, [1, 2, 3]).success
    store.take_events()
    where = store.location(key(1))
    assert run(store, JobKind.PUT, [4, 5]).success
    events = store.take_events()
    assert [type(e) for e in events] == [Removed, Stored]
    assert events[0].keys == (key(1), key(2))
    with pytest.raises(KeyError):
        store.location(key(1))
    assert where in {store.location(key(4)), store.location(key(5))}  # its slot reused
    assert store.keys() == [key(3), key(4), key(5)]
    store.close()


def test_its_own_index_answers_lookups_at_once_and_truly(
    tmp_path: Path, host: MemoryHostBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file tier owns its root: ``held_now`` answers from the index, never ahead of a put,
    and after a restart for the blocks it adopted."""
    store = FsspecTierStore(
        host, str(tmp_path), capacity_bytes=2 * (HEADER_AREA + SLOT), namespace=NS
    )
    assert isinstance(store, Indexed)
    assert store.held_now(key(1)) is False
    fill(host, range(3), 0)
    job = TierJob(JobId(900), JobKind.PUT, (key(1),), (0,))
    store.submit_put(job)
    assert store.held_now(key(1)) is False  # being written: a get might not find it
    store.drain()
    assert [r.job_id for r in store.poll()] == [JobId(900)]
    assert store.held_now(key(1)) is True
    assert run(store, JobKind.PUT, [2, 3], [1, 2]).success  # evicts 1
    assert (store.held_now(key(1)), store.held_now(key(3))) == (False, True)
    store.close()
    again = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    assert [again.held_now(key(i)) for i in (1, 2, 3)] == [False, True, True]
    # another instance starts on the same root: what this index lacks may be there
    monkeypatch.setattr(tier_module, "ALONE_CHECK_S", 0.0)
    other = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    assert other.held_now(key(9)) is None  # it sees the first one's slab at start-up
    assert run(other, JobKind.PUT, [9], [0]).success
    deadline = time.monotonic() + 10
    while again.held_now(key(1)) is not None:
        assert time.monotonic() < deadline, "the other instance's slab was never seen"
        again.poll()
        time.sleep(0.01)
    assert again.held_now(key(2)) is True
    assert run(again, JobKind.PROBE, [9]).found == frozenset({key(9)})  # a probe finds it
    other.close()
    again.close()


def test_restart_adopts_the_blocks_and_announces_them_once(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    first = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    fill(host, range(3), 9)
    assert run(first, JobKind.PUT, [1, 2, 3]).success
    first.close()
    ns = tmp_path / namespace_digest({**NS, "slot_bytes": SLOT})
    (ns / "notes.txt").write_text("x")
    (ns / "slabs" / "not-a-slab.bin").write_text("x")
    second = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    (inventory,) = second.take_events()
    assert isinstance(inventory, Stored)
    assert set(inventory.keys) == {key(1), key(2), key(3)}
    assert inventory.ctx is None
    assert second.foreign_files == 2
    fill(host, range(8), 77)
    assert run(second, JobKind.GET, [2], [7]).success
    assert bytes(host.slot_view(7)) == bytes([(9 + 1) % 256]) * SLOT
    assert run(second, JobKind.PUT, [4], [0]).success  # into the adopted slab
    assert len(list((ns / "slabs").glob("*.slab"))) == 1
    second.close()


def test_a_torn_record_names_nothing_and_a_slab_without_a_table_is_left_alone(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    """What a power loss can leave: a record whose bytes fail its CRC names no block (the
    slot is free again), and a slab whose table head is damaged is neither adopted nor
    removed (fsck reports it)."""
    first = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    fill(host, range(3), 20)
    assert run(first, JobKind.PUT, [1, 2, 3]).success
    path, offset = first.location(key(2))
    slot = (offset - table_bytes(slab_slots(path))) // (HEADER_AREA + SLOT)
    first.close()
    with open(path, "r+b") as slab:  # a byte of key 2's record flipped
        slab.seek(4096 + slot * 128 + 20)
        byte = slab.read(1)
        slab.seek(-1, os.SEEK_CUR)
        slab.write(bytes([byte[0] ^ 0xFF]))
    again = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    (inventory,) = again.take_events()
    assert set(inventory.keys) == {key(1), key(3)}
    assert run(again, JobKind.GET, [1, 3], [6, 7]).success
    assert bytes(host.slot_view(7)) == bytes([22]) * SLOT
    again.close()
    with open(path, "r+b") as slab:
        slab.write(b"NOTATABL")
    third = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    assert third.take_events() == []
    assert run(third, JobKind.PUT, [4], [0]).success  # into a slab of its own
    assert third.location(key(4))[0] != path
    third.close()
    assert Path(path).exists()


def test_restart_into_a_smaller_capacity_evicts_the_oldest(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    block = HEADER_AREA + SLOT
    first = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    fill(host, range(3), 1)
    for k in (1, 2, 3):
        assert run(first, JobKind.PUT, [k], [k - 1]).success
        time.sleep(0.01)
    first.close()
    second = FsspecTierStore(host, str(tmp_path), capacity_bytes=2 * block, namespace=NS)
    (inventory,) = second.take_events()
    assert inventory.keys == (key(2), key(3))
    assert run(second, JobKind.PROBE, [1]).found == frozenset()
    second.close()


CRASHING_WRITER = """
import os, sys
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.domain import JobId, JobKind, TierJob, make_offload_key

root, slot = sys.argv[1], int(sys.argv[2])
host = MemoryHostBuffer(4, slot)
store = FsspecTierStore(host, root, capacity_bytes=64 * (slot + 4096), namespace={"m": 1})
i = 0
while True:  # until killed, in the middle of whatever it is doing
    keys = tuple(make_offload_key(n.to_bytes(32, "big"), 0) for n in range(i, i + 4))
    for s, n in enumerate(range(i, i + 4)):
        host.slot_view(s)[:] = n.to_bytes(8, "big") * (slot // 8)
    store.submit_put(TierJob(JobId(i), JobKind.PUT, keys, (0, 1, 2, 3)))
    store.drain()
    store.poll()
    if i == 40:
        print("ready", flush=True)
    i += 4
"""


def test_a_process_killed_mid_write_leaves_no_torn_block_readable(tmp_path: Path) -> None:
    slot = 1 << 16
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WRITER, str(tmp_path), str(slot)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    host = MemoryHostBuffer(1, slot)
    again = FsspecTierStore(
        host, str(tmp_path), capacity_bytes=64 * (slot + 4096), namespace={"m": 1}
    )
    (inventory,) = again.take_events()
    assert len(inventory.keys) >= 40
    served = 0
    for k in inventory.keys:
        n = int.from_bytes(bytes(k)[:32], "big")
        result = run(again, JobKind.GET, [n], [0])
        if result.success:  # every block served holds exactly what was stored under it
            assert bytes(host.slot_view(0)) == n.to_bytes(8, "big") * (slot // 8)
            served += 1
    assert served >= len(inventory.keys) - 4  # at most the job the kill interrupted
    again.close()


def test_a_crash_while_creating_a_slab_leaves_nothing(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    store.close()
    half = Path(store.root) / "slabs" / ("ab" * 16 + ".new")  # a dead instance's, unlocked
    half.write_bytes(b"\0" * 100)
    again = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    assert not half.exists()
    assert again.take_events() == []
    assert again.foreign_files == 0
    again.close()


def test_live_instances_never_take_each_others_slabs(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    a = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS, name="a")
    fill(host, range(2), 1)
    assert run(a, JobKind.PUT, [1, 2]).success
    b = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS, name="b")
    assert b.take_events() == []  # a is alive: its blocks stay a's
    assert run(b, JobKind.PUT, [3], [0]).success
    assert b.location(key(3))[0] != a.location(key(1))[0]  # a slab of b's own
    a.close()
    c = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS, name="c")
    (inventory,) = c.take_events()  # a died: c adopts its slab, not b's
    assert set(inventory.keys) == {key(1), key(2)}
    b.close()
    c.close()


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
    assert b.take_events() == []  # a's block, a's events
    a.delete([key(11)])
    time.sleep(0.05)
    a.poll()
    assert run(b, JobKind.PROBE, [11]).found == frozenset()
    assert not run(b, JobKind.GET, [11], [4]).success  # a removed it
    assert b.take_events() == []
    corrupt_target = 12
    fill(host, range(1), 5)
    assert run(a, JobKind.PUT, [corrupt_target]).success
    corrupt(a, corrupt_target, at=0)
    assert not run(b, JobKind.GET, [corrupt_target], [4]).success  # never served
    assert key(corrupt_target) in a  # not b's to drop
    a.close()
    b.close()


def test_an_unwritable_root_fails_at_start_up(tmp_path: Path, host: MemoryHostBuffer) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a directory")
    with pytest.raises(TierUnavailable, match="cannot use root") as info:
        FsspecTierStore(host, str(blocked / "sub"), capacity_bytes=1 << 20, name="disk")
    assert info.value.tier == "disk"


def test_a_full_disk_fails_the_put_and_announces_nothing(
    tmp_path: Path, host: MemoryHostBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the Python data path: its block writes are the os.pwritev a test can make fail
    store = FsspecTierStore(
        host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS, native_io=False
    )

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    fill(host, range(1), 5)
    result = run(store, JobKind.PUT, [1])
    assert not result.success
    assert "No space left" in (result.error or "")
    assert list((Path(store.root) / "slabs").iterdir()) == []  # no half-made slab
    monkeypatch.undo()
    assert run(store, JobKind.PUT, [2]).success

    def failing(fd: int, data: object, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", failing)
    result = run(store, JobKind.PUT, [3])
    monkeypatch.undo()
    assert not result.success
    assert [type(e) for e in store.take_events()] == [Stored]  # block 2's only
    assert store.keys() == [key(2)]
    assert store.used_bytes == HEADER_AREA + SLOT
    with pytest.raises(KeyError):
        store.location(key(3))
    assert run(store, JobKind.PUT, [3]).success  # the slot was given back
    store.close()


def test_io_threads_default_to_the_cores_on_local_files_and_are_checked(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    assert store.io_threads == min(4, os.cpu_count() or 1)
    store.close()
    chosen = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, io_threads=3)
    assert chosen.io_threads == 3
    chosen.close()
    with pytest.raises(ValueError, match="io_threads must be >= 1, got 0"):
        FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, io_threads=0)


class GatedHost:
    """A host buffer whose slot views wait at a gate: the tier's IO threads stop at their
    first block while jobs queue behind them."""

    def __init__(self, host: MemoryHostBuffer) -> None:
        self.host = host
        self.num_slots = host.num_slots
        self.slot_bytes = host.slot_bytes
        self.gate = threading.Event()
        self.reached = threading.Event()

    def slot_view(self, slot: int) -> memoryview:
        self.reached.set()
        self.gate.wait()
        return self.host.slot_view(slot)


def test_closing_fails_the_queued_jobs_and_finishes_the_running_one(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    gated = GatedHost(host)
    store = FsspecTierStore(gated, str(tmp_path), capacity_bytes=1 << 20, io_threads=1)
    fill(host, range(4), 3)
    jobs = [
        TierJob(JobId(901), JobKind.PUT, (key(1), key(2)), (0, 1)),
        TierJob(JobId(902), JobKind.PUT, (key(3), key(4)), (2, 3)),
        TierJob(JobId(903), JobKind.GET, (key(1),), (0,)),
    ]
    store.submit_put(jobs[0])
    assert gated.reached.wait(5)  # the one IO thread holds the first put
    store.submit_put(jobs[1])
    store.submit_get(jobs[2])
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # the running put finishes first
    gated.gate.set()
    closer.join(5)
    assert not closer.is_alive()
    results = {r.job_id: r for r in store.poll()}
    assert results[JobId(901)].success
    for queued in (JobId(902), JobId(903)):
        assert not results[queued].success
        assert "closed" in (results[queued].error or "")
    assert store.keys() == [key(1), key(2)]
    assert store.used_bytes == 2 * (HEADER_AREA + SLOT)  # the failed put's room is released
    stored = [k for e in store.take_events() if isinstance(e, Stored) for k in e.keys]
    assert stored == [key(1), key(2)]
    with pytest.raises(TierUnavailable, match="closed"):
        store.submit_put(TierJob(JobId(904), JobKind.PUT, (key(5),), (0,)))
