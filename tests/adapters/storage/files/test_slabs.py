"""The slab files of local tiers, below the tier store: how jobs are laid out over slab files
(striping, eviction room, runs of adjacent slots), what a failure gives back, what a crash at
each step leaves, and what a restart adopts. Real files and real slot tables throughout;
faults come through the public seams (a mover, the IO calls), never private methods."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import fcntl
import os
import platform
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest
import structlog.testing

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.files import _index as index
from kvhex.adapters.storage.files import slabs
from kvhex.adapters.storage.files._index import SLAB_DIR, read_table, table_bytes
from kvhex.adapters.storage.files.fsck import check_root
from kvhex.adapters.storage.files.posix import PosixSlotMover
from kvhex.adapters.storage.files.slabs import SlabIo
from kvhex.adapters.storage.format import (
    HEADER_AREA,
    MAGIC,
    Verdict,
    namespace_config,
    namespace_digest,
)
from kvhex.domain import OffloadKey
from tests.adapters.jobs import key

SLOT = 4096
BLOCK = HEADER_AREA + SLOT
NS = {"model": "t", "slot_bytes": SLOT}
CONFIG = namespace_config(NS)
NAME = namespace_digest(NS)  # the namespace directory's name, as fsck checks


@pytest.fixture
def host() -> MemoryHostBuffer:
    host = MemoryHostBuffer(32, SLOT)
    for s in range(host.num_slots):
        host.slot_view(s)[:] = bytes([s + 1]) * SLOT
    return host


def payload(i: int) -> bytes:
    """What chunk ``i`` holds (host slot ``i % 32``'s bytes)."""
    return bytes([i % 32 + 1]) * SLOT


def items(host: MemoryHostBuffer, ids: Sequence[int]) -> list[tuple[OffloadKey, memoryview]]:
    """Chunk ``i`` holds host slot ``i % 32``'s bytes."""
    return [(key(i), host.slot_view(i % host.num_slots)) for i in ids]


def open_io(
    root: Path, *, slots: int = 64, stripes: int = 1, mover: PosixSlotMover | None = None
) -> SlabIo:
    return SlabIo(str(root / NAME), BLOCK, slots, config=CONFIG, stripes=stripes, mover=mover)


def read_back(io: SlabIo, ids: Sequence[int]) -> list[bytes | Verdict]:
    """The verified payload of each chunk, or the verdict when it is not ``OK``."""
    views = [memoryview(bytearray(SLOT)) for _ in ids]
    verdicts = io.read_many([(key(i), v) for i, v in zip(ids, views, strict=True)])
    return [
        bytes(v) if verdict is Verdict.OK else verdict
        for v, verdict in zip(views, verdicts, strict=True)
    ]


def slab_files(root: Path) -> list[Path]:
    return sorted((root / NAME / SLAB_DIR).iterdir())


def recorded(root: Path) -> list[OffloadKey]:
    """The keys the slot tables under ``root`` name, a key once per record (what a restart
    adopts), sorted."""
    keys: list[OffloadKey] = []
    for path in (root / NAME / SLAB_DIR).glob("*.slab"):
        fd = os.open(path, os.O_RDONLY)
        try:
            keys += [k for _, k, _ in read_table(fd)[1]]
        finally:
            os.close(fd)
    return sorted(keys)


class Recording(PosixSlotMover):
    """A mover that records the files each job writes and runs a hook first."""

    def __init__(self, before: object = None) -> None:
        super().__init__()
        self.files: list[set[int]] = []
        self.before = before

    def write_slots(
        self,
        blocks: Sequence[tuple[int, int, OffloadKey, memoryview]],
        records: Mapping[OffloadKey, bytes] | None = None,
    ) -> list[str | None]:
        self.files.append({fd for fd, _, _, _ in blocks})
        if callable(self.before):
            self.before(blocks)
        return super().write_slots(blocks, records)


def test_capacity_is_spread_over_one_slab_file_per_stripe(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    io = open_io(tmp_path, slots=64, stripes=4)
    assert io.write_many(items(host, range(64))) == [None] * 64
    files = slab_files(tmp_path)
    assert len(files) == 4
    assert [f.stat().st_size for f in files] == [table_bytes(16) + 16 * BLOCK] * 4
    assert io.write_many(items(host, [64])) == ["OSError: every slot of this tier is taken"]
    io.close()


def test_concurrent_jobs_write_different_slab_files(tmp_path: Path, host: MemoryHostBuffer) -> None:
    """Writes into one file serialize on its inode lock: two jobs in flight at once never
    share a slab while another has room."""
    both_writing = threading.Barrier(2, timeout=10)
    mover = Recording(lambda _: both_writing.wait())  # each job is inside its write at once
    io = open_io(tmp_path, slots=64, stripes=2, mover=mover)
    with cf.ThreadPoolExecutor(2) as pool:
        a = pool.submit(io.write_many, items(host, range(8)))
        b = pool.submit(io.write_many, items(host, range(8, 16)))
        assert a.result() == [None] * 8
        assert b.result() == [None] * 8
    first, second = mover.files
    assert len(first) == len(second) == 1
    assert first.isdisjoint(second)
    assert read_back(io, range(16)) == [payload(i) for i in range(16)]
    io.close()


def test_a_put_writes_into_its_victims_slots_after_their_records_are_cleared(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    """The victims' records are cleared before their slots are overwritten (a crash in
    between leaves orphans, never a record naming another block), and a slot of room left
    over is unmarked before it is free again."""
    seen: list[set[OffloadKey]] = []
    mover = Recording(lambda _: seen.append(set(recorded(tmp_path)) & {key(2), key(3), key(4)}))
    io = open_io(tmp_path, slots=8, mover=mover)
    assert io.write_many(items(host, range(8))) == [None] * 8
    evicted = [io.location(key(i)) for i in (2, 3, 4)]
    seen.clear()
    assert io.write_many(items(host, [10, 11]), evict=[key(2), key(3), key(4)]) == [None, None]
    assert seen == [set()]  # no victim's record was left while the new blocks were written
    assert {io.location(key(10)), io.location(key(11))} == set(evicted[:2])
    path, offset = evicted[2]
    with open(path, "rb") as slab:
        slab.seek(offset)
        assert slab.read(len(MAGIC)) == bytes(len(MAGIC))
    assert read_back(io, [2, 3, 4]) == [Verdict.MISSING] * 3
    assert io.write_many(items(host, [12])) == [None]  # the unmarked slot is free
    assert io.location(key(12)) == evicted[2]
    live = {0, 1, 5, 6, 7, 10, 11, 12}
    got = read_back(io, range(13))
    assert got == [payload(i) if i in live else Verdict.MISSING for i in range(13)]
    io.close()


def test_blocks_in_and_out_of_runs_of_adjacent_slots_read_back_exactly(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    """Adjacent slots move in one vectored call; jobs whose slots are scattered (after
    removals) and reads that mix slabs and unknown keys come back block for block."""
    io = open_io(tmp_path, slots=24, stripes=2)
    assert io.write_many(items(host, range(12))) == [None] * 12
    io.remove_many([key(i) for i in (1, 4, 5, 9)])
    assert io.write_many(items(host, range(20, 30))) == [None] * 10
    live = {0, 2, 3, 6, 7, 8, 10, 11, *range(20, 30)}
    got = read_back(io, range(30))
    assert got == [payload(i) if i in live else Verdict.MISSING for i in range(30)]
    io.close()


def test_a_slab_cut_inside_a_run_fails_only_the_blocks_past_the_cut(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    io = open_io(tmp_path, slots=8)
    assert io.write_many(items(host, range(6))) == [None] * 6
    path, offset = io.location(key(3))
    os.truncate(path, offset + HEADER_AREA + SLOT // 2)  # block 3 torn, 4 and 5 gone
    assert read_back(io, range(6)) == [payload(i) for i in range(3)] + [Verdict.CORRUPT] * 3
    io.close()


@pytest.mark.parametrize("how", ["mapped", "pwrite", "map refused"])
def test_records_are_what_readers_see_and_close_lets_the_slab_go(
    tmp_path: Path, host: MemoryHostBuffer, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """However the table is written (through a memory map, with ``pwrite`` where maps are
    not used, or with ``pwrite`` after the map was refused), a reader's ``pread`` sees each
    record as soon as the job ends and each removal as soon as it returns; closing frees the
    slab's ``flock`` (which a map's descriptor shares) for the next instance, and a store
    into a closed map is refused, not lost."""
    monkeypatch.setattr(slabs, "maps_tables", lambda path: how != "pwrite")
    if how == "map refused":

        def refused(*args: object) -> None:
            raise OSError(errno.ENODEV, "No such device")

        monkeypatch.setattr(index.mmap, "mmap", refused)
    io = open_io(tmp_path)
    assert io.write_many(items(host, range(3))) == [None] * 3
    (table,) = io.slot_tables()
    assert table.mapped is (how == "mapped")
    assert recorded(tmp_path) == sorted(key(i) for i in range(3))
    io.remove_many([key(1)])
    assert recorded(tmp_path) == sorted([key(0), key(2)])
    (path,) = slab_files(tmp_path)
    io.close()
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a map holds it
    finally:
        os.close(fd)
    if how == "mapped":
        with pytest.raises(OSError, match="closed"):
            table.write([(0, b"")])
    monkeypatch.undo()
    again = open_io(tmp_path)
    assert read_back(again, [0, 2]) == [payload(0), payload(2)]
    again.close()


def test_tables_are_mapped_only_where_a_store_cannot_fail_or_be_seen_out_of_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store into a mapped page that needs a new block (copy-on-write filesystems) or a
    server (network ones) fails as SIGBUS, and a CPU that reorders stores could show a peer
    a new generation before its records: maps only on ext4, XFS and tmpfs, on x86."""
    if not Path("/dev/shm").is_dir() or platform.machine() != "x86_64":
        pytest.skip("needs tmpfs at /dev/shm on x86-64 (a Linux machine like CI's)")
    assert index.maps_tables("/dev/shm")
    assert not index.maps_tables("/proc")  # procfs
    assert not index.maps_tables("/sys")  # sysfs
    assert not index.maps_tables("/no/such/path")
    monkeypatch.setattr(index.platform, "machine", lambda: "aarch64")
    assert not index.maps_tables("/dev/shm")


def test_a_damaged_slot_count_is_an_unreadable_table_not_a_huge_read(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    """A table head naming more slots than the file holds (a damaged count) is refused as
    such before anything is read: the slab is left for fsck, the instance starts."""
    io = open_io(tmp_path)
    assert io.write_many(items(host, range(2))) == [None, None]
    io.close()
    (path,) = slab_files(tmp_path)
    with open(path, "r+b") as slab:
        slab.seek(8)
        slab.write((1 << 62).to_bytes(8, "big"))  # the head's slot count
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(index.TableError, match="shorter than the table of the"):
            read_table(fd)
    finally:
        os.close(fd)
    with structlog.testing.capture_logs() as said:
        again = open_io(tmp_path)
    assert [e["event"] for e in said] == ["tier_slab_unreadable"]
    assert again.exists_many([key(0), key(1)]) == set()
    again.close()


def test_a_slab_that_cannot_be_read_at_start_up_is_let_go(
    tmp_path: Path, host: MemoryHostBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error reading a dead instance's table fails the start with that error, and
    leaves no descriptor holding the slab's lock: the next start adopts it."""
    io = open_io(tmp_path)
    assert io.write_many(items(host, range(2))) == [None, None]
    io.close()

    def failing(fd: int) -> tuple[int, list[index.Record]]:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(slabs, "read_table", failing)
    with pytest.raises(OSError, match="Input/output error"):
        open_io(tmp_path)
    monkeypatch.undo()
    (path,) = slab_files(tmp_path)
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a descriptor leaked
    finally:
        os.close(fd)
    again = open_io(tmp_path)
    assert read_back(again, [0, 1]) == [payload(0), payload(1)]
    again.close()


def test_a_failed_record_write_fails_the_job_and_frees_its_slots(
    tmp_path: Path, host: MemoryHostBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot table refuses a record (its map is gone): the job fails with the reason, no
    record names its blocks, and its slots are free again."""
    io = open_io(tmp_path, slots=2)
    real = index.SlotTable.write
    broken = [True]

    def failing(table: index.SlotTable, entries: Iterable[tuple[int, bytes]]) -> None:
        entries = list(entries)
        if broken[0] and any(record for _, record in entries):  # clearing one still works
            raise OSError(5, "Input/output error")
        real(table, entries)

    monkeypatch.setattr(index.SlotTable, "write", failing)
    assert io.write_many(items(host, range(2))) == ["OSError: Input/output error"] * 2
    assert read_back(io, range(2)) == [Verdict.MISSING] * 2
    assert recorded(tmp_path) == []
    other = open_io(tmp_path)  # nothing was published for another instance either
    assert other.exists_many([key(0), key(1)]) == set()
    other.close()
    broken[0] = False
    assert io.write_many(items(host, range(2, 4))) == [None, None]  # both slots free again
    assert recorded(tmp_path) == sorted([key(2), key(3)])
    io.close()


def test_a_failed_flush_fails_the_job_and_frees_its_slots(
    tmp_path: Path, host: MemoryHostBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``fsync``, the blocks cannot be flushed (a disk error): the job fails with the
    reason, no record names its blocks, and its slot is free again."""
    io = SlabIo(str(tmp_path / NAME), BLOCK, 2, config=CONFIG, fsync=True)
    real = os.fdatasync
    broken = [False]

    def flush(fd: int) -> None:
        if broken[0]:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", flush)
    assert io.write_many(items(host, [0])) == [None]
    broken[0] = True
    assert io.write_many(items(host, [1])) == ["OSError: Input/output error"]
    assert recorded(tmp_path) == [key(0)]
    assert read_back(io, [0, 1]) == [payload(0), Verdict.MISSING]
    broken[0] = False
    assert io.write_many(items(host, [2])) == [None]  # the failed job's slot is free again
    assert recorded(tmp_path) == sorted([key(0), key(2)])
    assert read_back(io, [0, 2]) == [payload(0), payload(2)]
    io.close()


def test_a_write_path_that_raises_gives_its_slots_back(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    broken = [True]

    def fail(_: object) -> None:
        if broken[0]:
            raise RuntimeError("backend gone")

    io = open_io(tmp_path, slots=4, mover=Recording(fail))
    with pytest.raises(RuntimeError, match="backend gone"):
        io.write_many(items(host, range(4)))
    broken[0] = False
    assert io.write_many(items(host, range(4, 8))) == [None] * 4  # all four slots free again
    assert read_back(io, range(8)) == [Verdict.MISSING] * 4 + [payload(i) for i in range(4, 8)]
    io.close()


def test_a_key_in_two_dead_instances_slabs_is_adopted_once_and_removed_for_good(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    first, second = open_io(tmp_path, slots=4), open_io(tmp_path, slots=4)  # both alive
    assert first.write_many(items(host, [1, 2])) == [None, None]
    assert second.write_many(items(host, [1, 3])) == [None, None]  # its own copy of 1
    first.close()
    second.close()
    heir = open_io(tmp_path, slots=8)
    assert sorted(heir.inventory().blocks) == [key(1), key(2), key(3)]
    assert recorded(tmp_path) == sorted([key(1), key(2), key(3)])  # the older copy's is gone
    heir.remove_many([key(1)])
    assert read_back(heir, [1, 2, 3]) == [Verdict.MISSING, payload(2), payload(3)]
    heir.close()
    again = open_io(tmp_path, slots=8)
    assert sorted(again.inventory().blocks) == [key(2), key(3)]  # 1 does not come back
    again.close()
    assert check_root(tmp_path).clean


KILLED_BETWEEN_WRITE_AND_COMMIT = """
import os, signal, sys
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.files.posix import PosixSlotMover
from kvhex.adapters.storage.files.slabs import SlabIo
from tests.adapters.jobs import key
from tests.adapters.storage.files.test_slabs import BLOCK, CONFIG, SLOT

class DiesAfterWriting(PosixSlotMover):
    armed = False
    def write_slots(self, blocks, records=None):
        errors = super().write_slots(blocks, records)
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)  # the blocks are written, not published
        return errors

host = MemoryHostBuffer(8, SLOT)
for s in range(8):
    host.slot_view(s)[:] = bytes([s + 1]) * SLOT
mover = DiesAfterWriting()
io = SlabIo(sys.argv[1], BLOCK, 4, config=CONFIG, mover=mover)
assert io.write_many([(key(i), host.slot_view(i)) for i in range(4)]) == [None] * 4
mover.armed = True
io.write_many([(key(10), host.slot_view(4)), (key(11), host.slot_view(5))], evict=[key(0), key(1)])
"""


def test_a_writer_killed_between_its_slab_write_and_its_commit_leaves_only_servable_rows(
    tmp_path: Path,
) -> None:
    root = tmp_path / NAME
    done = subprocess.run(
        [sys.executable, "-c", KILLED_BETWEEN_WRITE_AND_COMMIT, str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    io = SlabIo(str(root), BLOCK, 4, config=CONFIG)
    # the victims' rows were gone before their slots were overwritten: nothing adopted names
    # a slot that holds another block, and the new blocks were never published
    assert sorted(io.inventory().blocks) == [key(2), key(3)]
    assert read_back(io, [0, 1, 2, 3, 10, 11]) == [
        Verdict.MISSING,
        Verdict.MISSING,
        bytes([3]) * SLOT,
        bytes([4]) * SLOT,
        Verdict.MISSING,
        Verdict.MISSING,
    ]
    io.close()
    report = check_root(tmp_path)
    assert report.clean, report.as_dict()
    assert {o.key for o in report.namespaces[0].orphans} == {key(10).hex(), key(11).hex()}


def test_another_instance_follows_the_tables_as_they_change(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    """Through the slot tables alone, a second live instance sees every block the first
    published before each lookup (across pages of the table and a slab created later),
    none it removed, and ignores a slab whose table head is damaged."""
    a = open_io(tmp_path, slots=96, stripes=2)  # 48 slots a slab: a table of 2 record pages
    b = open_io(tmp_path, slots=8)
    ids = list(range(40))
    assert a.write_many(items(host, ids)) == [None] * 40
    assert b.exists_many([key(i) for i in range(50)]) == {key(i) for i in ids}
    a.remove_many([key(i) for i in (0, 33, 39)])  # records on both pages
    assert a.write_many(items(host, range(100, 140))) == [None] * 40  # into a second slab
    live = {*ids, *range(100, 140)} - {0, 33, 39}
    assert b.exists_many([key(i) for i in range(150)]) == {key(i) for i in live}
    assert read_back(b, [1, 33, 120]) == [payload(1), Verdict.MISSING, payload(120)]
    assert len(slab_files(tmp_path)) == 2  # both a's: b has written nothing
    (tmp_path / NAME / SLAB_DIR / ("ef" * 16 + ".slab")).write_bytes(b"not a table" * 100)
    assert b.exists_many([key(1), key(2)]) == {key(1), key(2)}
    b.close()
    a.close()


def test_a_slab_that_turns_out_to_be_this_instances_own_is_no_peers(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    """A slab listed while this instance was creating it (named as its own only after the
    rename) is dropped from the peers at the next lookup, with every key it named."""
    a = open_io(tmp_path, slots=8)
    assert a.write_many(items(host, [1, 2])) == [None, None]
    own: set[str] = set()
    peers = index.PeerTables(str(tmp_path / NAME / SLAB_DIR), own)
    assert set(peers.find([key(1), key(3)])) == {key(1)}
    own.add(slab_files(tmp_path)[0].stem)
    assert peers.find([key(1), key(2)]) == {}
    peers.close()
    a.close()


def test_a_key_longer_than_a_record_holds_is_refused_alone(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    """A 200-byte key cannot be recorded: its block is not written (no slot taken), the
    reason names it, and the job's other blocks are stored."""
    io = open_io(tmp_path, slots=2)
    long = OffloadKey(b"\x07" * 200)
    view = host.slot_view(0)
    assert io.write_many([(long, view), *items(host, [1, 2])]) == [
        "a 200-byte key is longer than a slot record holds",
        None,
        None,
    ]
    assert recorded(tmp_path) == sorted([key(1), key(2)])
    assert io.exists_many([long]) == set()
    io.close()
