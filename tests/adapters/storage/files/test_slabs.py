"""The slab files of local tiers, below the tier store: how jobs are laid out over slab files
(striping, eviction room, runs of adjacent slots) and what a failure gives back. Real files
and a real SQLite index throughout."""

from __future__ import annotations

import concurrent.futures as cf
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.files.slabs import SLAB_DIR, SlabIo
from kvhex.adapters.storage.format import HEADER_AREA, MAGIC, header_matches
from kvhex.domain import OffloadKey
from tests.adapters.jobs import key

SLOT = 4096
BLOCK = HEADER_AREA + SLOT


@pytest.fixture
def host() -> MemoryHostBuffer:
    host = MemoryHostBuffer(32, SLOT)
    for s in range(host.num_slots):
        host.slot_view(s)[:] = bytes([s + 1]) * SLOT
    return host


def payload(i: int) -> bytes:
    """What chunk ``i`` holds (host slot ``i % 32``'s bytes)."""
    return bytes([i % 32 + 1]) * SLOT


def items(host: MemoryHostBuffer, ids: range) -> list[tuple[OffloadKey, memoryview]]:
    """Chunk ``i`` holds host slot ``i % 32``'s bytes."""
    return [(key(i), host.slot_view(i % host.num_slots)) for i in ids]


def open_io(root: Path, *, slots: int = 64, stripes: int = 1, cls: type[SlabIo] = SlabIo) -> Any:
    io = cls(str(root / "ns"), BLOCK, slots, fsync=False, stripes=stripes)
    io.prepare()
    return io


def read_back(io: SlabIo, ids: range) -> list[bytes | None]:
    """What ``read_many`` returns for chunks ``ids``: the verified payload, ``b""`` when
    short or failing its check, ``None`` when unknown."""
    views = [memoryview(bytearray(SLOT)) for _ in ids]
    headers = io.read_many([(key(i), v) for i, v in zip(ids, views, strict=True)])
    out: list[bytes | None] = []
    for i, view, header in zip(ids, views, headers, strict=True):
        if header is None or header == b"":
            out.append(header)
        else:
            out.append(bytes(view) if header_matches(header, key(i), view) else b"")
    return out


def slab_files(root: Path) -> list[Path]:
    return sorted((root / "ns" / SLAB_DIR).iterdir())


def test_capacity_is_spread_over_one_slab_file_per_stripe(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    io = open_io(tmp_path, slots=64, stripes=4)
    assert io.write_many(items(host, range(64))) == [None] * 64
    files = slab_files(tmp_path)
    assert len(files) == 4
    assert sum(f.stat().st_size for f in files) == 64 * BLOCK
    assert io.write_many(items(host, range(64, 65))) == [
        "OSError: every slot of this tier is taken"
    ]
    io.close()


def test_concurrent_jobs_write_different_slab_files(tmp_path: Path, host: MemoryHostBuffer) -> None:
    """Writes into one file serialize on its inode lock: two jobs in flight at once never
    share a slab while another has room."""
    both_writing = threading.Barrier(2, timeout=10)
    files: list[set[int]] = []

    class Recording(SlabIo):
        def _write_blocks(self, blocks: list[tuple[int, int, OffloadKey, memoryview]]) -> Any:
            files.append({fd for fd, _, _, _ in blocks})
            both_writing.wait()  # each job is inside its write while the other is
            return super()._write_blocks(blocks)

    io = open_io(tmp_path, slots=64, stripes=2, cls=Recording)
    with cf.ThreadPoolExecutor(2) as pool:
        a = pool.submit(io.write_many, items(host, range(8)))
        b = pool.submit(io.write_many, items(host, range(8, 16)))
        assert a.result() == [None] * 8
        assert b.result() == [None] * 8
    first, second = files
    assert len(first) == len(second) == 1
    assert first.isdisjoint(second)
    assert read_back(io, range(16)) == [payload(i) for i in range(16)]
    io.close()


def test_a_put_writes_into_the_room_its_evictions_freed(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    io = open_io(tmp_path, slots=8)
    assert io.write_many(items(host, range(8))) == [None] * 8
    evicted = [io.location(key(i)) for i in (2, 3, 4)]
    room = io.remove_many([key(2), key(3), key(4)], defer=True)
    assert len(room) == 3
    # the tier is full: the new blocks can only go where the evicted ones were, and the one
    # slot of room left over is unmarked before it is free again
    assert io.write_many(items(host, range(10, 12)), room) == [None, None]
    placed = {io.location(key(10)), io.location(key(11))}
    assert placed == set(evicted[:2])
    path, offset = evicted[2]
    with open(path, "rb") as slab:
        slab.seek(offset)
        assert slab.read(len(MAGIC)) == bytes(len(MAGIC))
    assert read_back(io, range(2, 5)) == [None, None, None]  # gone from the index too
    assert io.write_many(items(host, range(12, 13))) == [None]  # the unmarked slot is free
    assert io.location(key(12)) == evicted[2]
    live = {0, 1, 5, 6, 7, 10, 11, 12}
    assert read_back(io, range(13)) == [payload(i) if i in live else None for i in range(13)]
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
    ids = range(30)
    got = read_back(io, ids)
    live = {0, 2, 3, 6, 7, 8, 10, 11, *range(20, 30)}
    assert got == [payload(i) if i in live else None for i in ids]
    io.close()


def test_a_slab_cut_inside_a_run_fails_only_the_blocks_past_the_cut(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    io = open_io(tmp_path, slots=8)
    assert io.write_many(items(host, range(6))) == [None] * 6
    path, offset = io.location(key(3))
    os.truncate(path, offset + HEADER_AREA + SLOT // 2)  # block 3 torn, 4 and 5 gone
    assert read_back(io, range(6)) == [payload(i) for i in range(3)] + [b""] * 3
    io.close()


def test_a_failed_index_commit_fails_the_job_and_frees_its_slots(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    class Failing(SlabIo):
        fail = True

        def _transaction(
            self, deletes: list[tuple[Any, ...]], inserts: list[tuple[Any, ...]]
        ) -> None:
            if self.fail:
                raise sqlite3.OperationalError("disk I/O error")
            super()._transaction(deletes, inserts)

    io = open_io(tmp_path, slots=2, cls=Failing)
    assert io.write_many(items(host, range(2))) == ["index: disk I/O error"] * 2
    assert read_back(io, range(2)) == [None, None]
    other = open_io(tmp_path)  # nothing was published for another instance either
    assert other.exists_many([key(0), key(1)]) == set()
    other.close()
    io.fail = False
    assert io.write_many(items(host, range(2, 4))) == [None, None]  # both slots free again
    io.close()


def test_a_write_path_that_raises_gives_its_slots_back(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    class Broken(SlabIo):
        broken = True

        def _write_blocks(self, blocks: list[tuple[int, int, OffloadKey, memoryview]]) -> Any:
            if self.broken:
                raise RuntimeError("backend gone")
            return super()._write_blocks(blocks)

    io = open_io(tmp_path, slots=4, cls=Broken)
    with pytest.raises(RuntimeError, match="backend gone"):
        io.write_many(items(host, range(4)))
    io.broken = False
    assert io.write_many(items(host, range(4, 8))) == [None] * 4  # all four slots free again
    assert read_back(io, range(8)) == [None] * 4 + [payload(i) for i in range(4, 8)]
    io.close()
