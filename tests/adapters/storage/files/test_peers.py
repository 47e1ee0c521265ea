"""Chunk records on local files: kept in every block's header by each writer (Python and
native data paths), announced in full by a restart, and by other instances sharing the root
through their peer view (``announce_peers``); damaged records are placeholders, never wrong
events; fsck passes blocks with records and names damaged ones."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage import tier as tier_module
from kvhex.adapters.storage.files.fsck import check_root
from kvhex.adapters.storage.format import HEADER, HEADER_AREA, KeptRecord, kept_record
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.domain import Stored
from kvhex.domain.provenance import MmFeature
from kvhex.ports.tier_store import ScheduledWork
from tests.adapters.storage.peer_kit import (
    Events,
    blocks,
    fill,
    get,
    parent_first_in_each,
    put,
    request,
)

SLOT = 4096
NS = {"model": "tiny-llama", "dtype": "float16"}


def tier(
    root: Path,
    name: str,
    *,
    announce_peers: bool = False,
    interval: float = 0.05,
    native_io: bool | None = None,
) -> FsspecTierStore:
    host = MemoryHostBuffer(8, SLOT)
    fill(host, range(8), 7)
    return FsspecTierStore(
        host,
        str(root),
        capacity_bytes=1 << 20,
        name=name,
        namespace=NS,
        native_io=native_io,
        announce_peers=announce_peers,
        peer_scan_interval_s=interval,
    )


def header(store: FsspecTierStore, key: bytes) -> bytes:
    path, offset = store.location(key)  # type: ignore[arg-type]
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(HEADER_AREA)


@pytest.mark.parametrize("native_io", [False, None], ids=["python", "native-if-built"])
def test_another_instance_announces_a_peers_blocks_in_full_then_their_removal(
    tmp_path: Path, native_io: bool | None
) -> None:
    a = tier(tmp_path, "a", native_io=native_io)
    b = tier(tmp_path, "b", announce_peers=True)
    ctx, keys = request("r", 4, mm_features=(MmFeature("img-1", 2, 9),), cache_salt="s")
    assert put(a, keys, ctx).success
    mine = a.take_events()
    on_b = Events(b)
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys), "b's view holds a's blocks")
    assert on_b.held(b.identity) == set()  # b holds none itself
    peer_stored = on_b.stores(b.peer_identity)
    assert all(e.ctx is None and e.records is not None and all(e.records) for e in peer_stored)
    assert parent_first_in_each(peer_stored, keys)
    want, _ = blocks(mine)
    got, placeholders = blocks(on_b.raw)
    assert got == want
    assert len(got) == 8
    assert placeholders == []
    assert b.peer_identity.ownership == "b@peers"
    assert b.peer_identity.medium == b.identity.medium
    assert b.peer_identity.locality == b.identity.locality
    # a's blocks load on b
    assert get(b, keys[:2], [4, 5]).success
    a.delete(keys[2:])
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys[:2]), "b sees two go")
    a.close()  # a's slabs stay; its blocks are still there to load
    b.close()


def test_a_restart_announces_adopted_blocks_in_full(tmp_path: Path) -> None:
    a = tier(tmp_path, "a")
    ctx, keys = request("r", 3, lora_id=3, lora_name="adapter")
    assert put(a, keys[:2], ctx).success
    assert put(a, keys[2:], None, [2]).success  # a job with no request: no record
    mine = a.take_events()
    a.close()
    again = tier(tmp_path, "a")
    (adopted,) = again.take_events()
    assert isinstance(adopted, Stored)
    assert adopted.ctx is None
    assert set(adopted.keys) == set(keys)
    assert adopted.records is not None
    by_key = dict(zip(adopted.keys, adopted.records, strict=True))
    assert by_key[keys[2]] is None  # announced as a placeholder, as before records
    want, _ = blocks(mine)
    got, placeholders = blocks([adopted])
    assert got == want
    assert len(got) == 4
    assert placeholders == [keys[2][:-4]]
    again.close()


def test_a_damaged_record_is_a_placeholder_and_the_block_still_loads(tmp_path: Path) -> None:
    a = tier(tmp_path, "a")
    ctx, keys = request("r", 2)
    assert put(a, keys, ctx).success
    first = header(a, keys[0])
    assert kept_record(first)[0] is KeptRecord.INTACT
    path, offset = a.location(keys[1])
    at = offset + HEADER.size + len(keys[1]) + 6 + 10  # a byte inside the record
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x20]))
    a.close()
    assert check_root(tmp_path).clean  # the block is intact: harmless
    (bad,) = check_root(tmp_path).namespaces[0].bad_records
    assert bad.key == keys[1].hex()
    again = tier(tmp_path, "a")
    (adopted,) = again.take_events()
    assert isinstance(adopted, Stored)
    assert adopted.records is not None
    records = dict(zip(adopted.keys, adopted.records, strict=True))
    kept = records[keys[0]]
    assert kept is not None
    assert records[keys[1]] is None
    got, placeholders = blocks([adopted])
    assert set(got) == set(kept.block_hashes)
    assert placeholders == [keys[1][:-4]]  # never a wrong full event
    assert get(again, keys, [4, 5]).success  # the payload's checksum does not cover it
    again.close()


def test_fsck_passes_blocks_with_records(tmp_path: Path) -> None:
    a = tier(tmp_path, "a")
    ctx, keys = request("r", 4)
    assert put(a, keys, ctx).success
    a.close()
    report = check_root(tmp_path)
    assert report.clean
    (ns,) = report.namespaces
    assert ns.blocks_ok == 4
    assert ns.bad_records == ()


def test_a_record_too_large_for_the_header_is_left_out(tmp_path: Path) -> None:
    a = tier(tmp_path, "a")
    # 8 multimodal features of long identifiers on every block: more than 4 KiB of keys
    features = tuple(MmFeature("x" * 300 + str(i), 0, 16) for i in range(16))
    ctx, keys = request("big", 2, mm_features=features)
    small, small_keys = request("small", 1, base=5000)
    assert put(a, keys, ctx).success
    assert put(a, small_keys, small, [2]).success
    assert kept_record(header(a, keys[0]))[0] is KeptRecord.NONE
    assert kept_record(header(a, small_keys[0]))[0] is KeptRecord.INTACT
    a.close()
    again = tier(tmp_path, "a")
    got, placeholders = blocks(again.take_events())
    assert set(placeholders) == {k[:-4] for k in keys}
    assert len(got) == 2  # the small request's two blocks
    assert get(again, keys, [4, 5]).success
    again.close()


def test_a_peers_block_found_corrupt_leaves_the_view(tmp_path: Path) -> None:
    a = tier(tmp_path, "a")
    b = tier(tmp_path, "b", announce_peers=True)
    ctx, keys = request("r", 2)
    assert put(a, keys, ctx).success
    on_b = Events(b)
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys), "b's view holds a's blocks")
    path, offset = a.location(keys[1])
    with open(path, "r+b") as f:  # a payload byte
        f.seek(offset + HEADER_AREA + 100)
        byte = f.read(1)[0]
        f.seek(offset + HEADER_AREA + 100)
        f.write(bytes([byte ^ 1]))
    result = get(b, keys, [4, 5])
    assert result.ok_keys == frozenset({keys[0]})
    on_b.take()
    assert on_b.held(b.peer_identity) == {keys[0]}  # left at once, announced
    # later scans keep it out while a's table still names it
    scans = b.peer_scans
    on_b.until(lambda: b.peer_scans >= scans + 2, "two more scans")
    assert on_b.held(b.peer_identity) == {keys[0]}
    a.delete(keys[1:])  # once a scan saw it gone, a new copy is announced again
    scans = b.peer_scans
    on_b.until(lambda: b.peer_scans >= scans + 2, "two more scans")
    assert put(a, keys[1:], ctx, [1]).success
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys), "the new copy is credited")
    a.close()
    b.close()


def test_nothing_is_announced_after_close(tmp_path: Path) -> None:
    a = tier(tmp_path, "a")
    b = tier(tmp_path, "b", announce_peers=True)
    b.poll()  # a scan starts
    b.close()
    ctx, keys = request("r", 2)
    assert put(a, keys, ctx).success
    for _ in range(5):
        b.poll()
    assert b.take_events() == []
    a.close()


def test_the_view_is_off_by_default(tmp_path: Path) -> None:
    a = tier(tmp_path, "a")
    b = tier(tmp_path, "b", interval=0.01)
    ctx, keys = request("r", 2)
    assert put(a, keys, ctx).success
    on_b = Events(b)
    assert get(b, keys, [4, 5]).success  # b loads a's blocks
    on_b.take()
    assert on_b.raw == []
    assert (b.peer_scans, b.peer_blocks) == (0, 0)
    a.close()
    b.close()


WRITER = """
import sys
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.fsspec import FsspecTierStore
from tests.adapters.storage.files.test_peers import NS, SLOT
from tests.adapters.storage.peer_kit import fill, put, request

host = MemoryHostBuffer(8, SLOT)
fill(host, range(8), 7)
store = FsspecTierStore(host, sys.argv[1], capacity_bytes=1 << 20, name="w", namespace=NS)
ctx, keys = request("r", 3)
assert put(store, keys, ctx).success
print("stored", flush=True)
sys.stdin.read()  # until the test closes our stdin
store.close()
"""


def test_another_process_s_blocks_then_its_dead_slabs(tmp_path: Path) -> None:
    """A writer process: b credits its blocks while it runs and their removal when a
    restart adopts them (and announces them in full as its own)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=Path(__file__).parents[4],
    ) as writer:
        assert writer.stdin is not None
        assert writer.stdout is not None
        try:
            assert writer.stdout.readline() == b"stored\n"
            _ctx, keys = request("r", 3)
            b = tier(tmp_path, "b", announce_peers=True)
            on_b = Events(b)
            on_b.until(lambda: on_b.held(b.peer_identity) == set(keys), "b credits the writer")
            got, _ = blocks(on_b.raw)
            assert len(got) == 6
        finally:
            writer.stdin.close()
            writer.wait(30)
    assert writer.returncode == 0
    c = tier(tmp_path, "c")  # adopts the writer's slabs (their lock is free)
    full, placeholders = blocks(c.take_events())
    assert full == got
    assert placeholders == []
    c.delete(keys[2:])  # c's now: b credits c, and sees it go
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys[:2]), "b sees c's removal")
    b.close()
    c.close()


def test_a_block_the_peer_view_saw_is_never_answered_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The presence check runs once a second; a block the peer view already announced is
    probed (and loaded), not answered missing from a stale check."""
    monkeypatch.setattr(tier_module, "ALONE_CHECK_S", 3600.0)
    b = tier(tmp_path, "b", announce_peers=True)
    ctx, keys = request("r", 2)
    assert b.held_now(keys[0]) is False  # alone on the root
    a = tier(tmp_path, "a")
    assert put(a, keys, ctx).success
    on_b = Events(b)
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys), "b's view holds a's blocks")
    assert [b.held_now(k) for k in keys] == [None, None]  # probed, not missing
    _, others = request("other", 1, base=5000)
    assert b.held_now(others[0]) is False  # what no one holds: still answered at once
    assert get(b, keys, [4, 5]).success
    a.close()
    b.close()


def test_the_view_wants_a_poll_only_when_it_found_something(tmp_path: Path) -> None:
    """``ScheduledWork``: the view lists on its own thread; a listing that changes nothing
    asks for no poll (an idle engine is not woken for it), one that does is a time past until
    a poll applied it and the reads of what it found; a closed view wants none, and a tier
    without the view has no schedule at all."""
    a = tier(tmp_path, "a")
    b = tier(tmp_path, "b", announce_peers=True, interval=0.05)
    assert isinstance(b, ScheduledWork)
    assert a.next_poll_at() is None
    deadline = time.monotonic() + 10
    while b.peer_scans < 3:  # nothing on the root: scans go by with no poll of b
        assert b.next_poll_at() is None
        assert time.monotonic() < deadline, "no scan of the view's own"
        time.sleep(0.01)
    ctx, keys = request("r", 2)
    assert put(a, keys, ctx).success
    while b.next_poll_at() is None:  # the lister found a's blocks: b wants a poll now
        assert time.monotonic() < deadline, "the lister never found a's blocks"
        time.sleep(0.01)
    assert b.next_poll_at() == -math.inf
    on_b = Events(b)
    on_b.until(lambda: on_b.held(b.peer_identity) == set(keys), "a poll announces them")
    assert b.next_poll_at() is None  # applied, and read
    b.close()
    assert b.next_poll_at() is None
    a.close()
