"""``kvhex.adapters.storage.files.fsck`` on real file tiers written by ``FsspecTierStore``:
clean roots, each kind of damage, harmless leftovers, bad roots, that it changes nothing, and
that its verdict matches what the tier itself serves."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.files._index import read_table, table_bytes
from kvhex.adapters.storage.files.fsck import Finding, FsckReport, NamespaceReport, check_root
from kvhex.adapters.storage.format import HEADER_AREA, LAYOUT_VERSION, namespace_digest
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.domain import JobKind
from tests.adapters.jobs import key, run
from tests.adapters.storage.files.test_file_tier import CRASHING_WRITER

SLOT = 4096
NS = {"model": "tiny-llama", "blocks_per_chunk": 1, "dtype": "float16"}


@pytest.fixture
def host() -> MemoryHostBuffer:
    host = MemoryHostBuffer(8, SLOT)
    for s in range(8):
        host.slot_view(s)[:] = bytes([s + 1]) * SLOT
    return host


class Written:
    """A closed tier under a root holding some chunks, and where each block was written."""

    def __init__(self, root: Path, host: MemoryHostBuffer, ids: list[int]) -> None:
        store = FsspecTierStore(host, str(root), capacity_bytes=1 << 20, namespace=NS)
        assert run(store, JobKind.PUT, ids).success
        self.root = Path(store.root)
        self.places = {k: store.location(key(k)) for k in ids}
        store.close()

    def where(self, k: int) -> tuple[Path, int]:
        """The slab file and byte offset of chunk ``k``'s block."""
        path, offset = self.places[k]
        return Path(path), offset


def slot_of(path: Path, offset: int) -> int:
    """The slot of the block whose header is at ``offset`` of slab ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        slots, _ = read_table(fd)
    finally:
        os.close(fd)
    return (offset - table_bytes(slots)) // (HEADER_AREA + SLOT)


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def only(report: FsckReport) -> NamespaceReport:
    (ns,) = report.namespaces
    return ns


def tree(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``root``: content digest, mtime and mode."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        out[str(path.relative_to(root))] = (digest, st.st_mtime_ns, st.st_mode)
    return out


def test_a_clean_tier_is_clean_and_counted(tmp_path: Path, host: MemoryHostBuffer) -> None:
    tier = Written(tmp_path, host, [1, 2, 3])
    report = check_root(tmp_path)
    ns = only(report)
    assert report.clean
    assert ns.clean
    assert ns.name == namespace_digest({**NS, "slot_bytes": SLOT})
    assert (ns.blocks_ok, ns.blocks_corrupt, ns.blocks_missing) == (3, 0, 0)
    assert ns.block_bytes == 3 * SLOT
    assert ns.slabs == 1
    assert ns.slab_bytes == tier.where(1)[0].stat().st_size
    assert (ns.findings, ns.orphans, ns.foreign, ns.problems) == ((), (), (), ())
    assert ns.config is not None
    assert ns.config["model"] == "tiny-llama"
    data = json.loads(json.dumps(report.as_dict()))
    assert data["clean"] is True
    assert data["namespaces"][0]["blocks_ok"] == 3


def test_it_reads_without_changing_a_byte_even_beside_a_live_instance(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    Written(tmp_path, host, [1, 2])
    before = tree(tmp_path)
    assert check_root(tmp_path).clean
    assert tree(tmp_path) == before  # no -wal/-shm created, nothing touched
    live = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=NS)
    try:
        assert run(live, JobKind.PUT, [3], [2]).success  # in a slab the live one holds locked
        during = tree(tmp_path)
        ns = only(check_root(tmp_path))
        assert (ns.blocks_ok, ns.clean) == (3, True)
        assert tree(tmp_path) == during
        assert run(live, JobKind.GET, [3], [5]).success  # its slab locks were never taken
    finally:
        live.close()


def test_a_flipped_payload_byte_is_corrupt_and_named(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    tier = Written(tmp_path, host, [1, 2, 3])
    path, offset = tier.where(2)
    flip(path, offset + HEADER_AREA + 100)
    report = check_root(tmp_path)
    ns = only(report)
    assert not report.clean
    assert (ns.blocks_ok, ns.blocks_corrupt, ns.blocks_missing) == (2, 1, 0)
    (finding,) = ns.findings
    assert finding.key == key(2).hex()
    assert finding.finding is Finding.CORRUPT
    assert "checksum" in finding.reason
    assert finding.slot == slot_of(path, offset)


def test_damaged_headers_are_told_apart(tmp_path: Path, host: MemoryHostBuffer) -> None:
    tier = Written(tmp_path, host, [1, 2, 3, 4])
    path, off1 = tier.where(1)
    patch(path, off1, b"XXXXXXXX")  # garbage magic
    _, off2 = tier.where(2)
    patch(path, off2, bytes(8))  # unmarked, as a removal leaves it
    _, off3 = tier.where(3)
    _, off4 = tier.where(4)
    with open(path, "rb") as f:  # block 4's header copied over block 3's: a reused slot
        f.seek(off4)
        header = f.read(HEADER_AREA)
    patch(path, off3, header)
    ns = only(check_root(tmp_path))
    found = {f.key: (f.finding, f.reason) for f in ns.findings}
    assert found[key(1).hex()][0] is Finding.CORRUPT
    assert "magic" in found[key(1).hex()][1]
    assert found[key(2).hex()][0] is Finding.MISSING
    assert "unmarked" in found[key(2).hex()][1]
    assert found[key(3).hex()][0] is Finding.MISSING
    assert key(4).hex() in found[key(3).hex()][1]
    assert (ns.blocks_ok, ns.blocks_corrupt, ns.blocks_missing) == (1, 1, 2)


def test_records_past_the_end_of_a_truncated_slab_are_missing(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    tier = Written(tmp_path, host, [1, 2, 3])
    path, off3 = tier.where(3)
    os.truncate(path, off3 + 100)  # cuts block 3 and every later slot
    ns = only(check_root(tmp_path))
    assert [(f.key, f.finding) for f in ns.findings] == [(key(3).hex(), Finding.MISSING)]
    assert "past the end" in ns.findings[0].reason
    assert any("not its table and" in p for p in ns.problems)
    path.unlink()  # its table goes with it: nothing names its blocks any more
    ns = only(check_root(tmp_path))
    assert (ns.blocks_ok, ns.findings, ns.slabs, ns.clean) == (0, (), 0, True)


def test_orphans_unfinished_slabs_and_foreign_files_are_reported_but_harmless(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    tier = Written(tmp_path, host, [1, 2])
    ns_dir = tier.root
    path, offset = tier.where(2)
    patch(path, 4096 + slot_of(path, offset) * 128, bytes(128))  # as a crash before its record
    (ns_dir / "slabs" / ("cd" * 16 + ".new")).write_bytes(b"\0" * 10)
    (ns_dir / "slabs" / "README").write_text("hi")
    (ns_dir / "notes.txt").write_text("hi")
    (tmp_path / "stray.bin").write_bytes(b"x")
    (tmp_path / "other").mkdir()
    report = check_root(tmp_path)
    ns = only(report)
    assert report.clean
    assert ns.blocks_ok == 1
    assert [(o.key, o.slot) for o in ns.orphans] == [(key(2).hex(), 1)]
    assert ns.unfinished_slabs == ("cd" * 16 + ".new",)
    assert ns.foreign == ("notes.txt", "slabs/README")
    assert report.foreign == ("other/", "stray.bin")


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda d: (d / "config.json").unlink(), "config.json missing"),
        (lambda d: (d / "config.json").write_text("{nope"), "config.json unreadable"),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps({**NS, "slot_bytes": SLOT, "layout_version": 1})
            ),
            "layout version 1",
        ),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps(
                    {**NS, "model": "other", "slot_bytes": SLOT, "layout_version": LAYOUT_VERSION}
                )
            ),
            "describes namespace",
        ),
        (lambda d: patch(next((d / "slabs").iterdir()), 0, b"GARBAGE!"), "no slot table"),
        (lambda d: os.truncate(next((d / "slabs").iterdir()), 10), "shorter than a slot table"),
    ],
)
def test_namespace_problems_make_it_unclean(
    tmp_path: Path, host: MemoryHostBuffer, damage: Callable[[Path], object], problem: str
) -> None:
    tier = Written(tmp_path, host, [1])
    damage(tier.root)
    report = check_root(tmp_path)
    assert not report.clean
    assert any(problem in p for p in only(report).problems), only(report).problems


def test_a_namespace_directory_can_be_checked_as_the_root(
    tmp_path: Path, host: MemoryHostBuffer
) -> None:
    tier = Written(tmp_path, host, [1, 2])
    report = check_root(tier.root)
    assert only(report).blocks_ok == 2
    assert report.foreign == ()


def test_a_missing_or_non_directory_root_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        check_root(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        check_root(tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_root(empty) == FsckReport(str(empty), (), ())


def test_its_verdict_matches_what_the_tier_serves_after_a_crash(tmp_path: Path) -> None:
    slot = 1 << 16
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WRITER, str(tmp_path), str(slot)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    report = check_root(tmp_path)
    ns = only(report)
    assert ns.blocks_ok >= 40
    # damage one intact block: fsck and the tier must both refuse it from now on
    crashed = {f.key for f in ns.findings}  # at most the job the kill interrupted
    assert len(crashed) <= 4
    ns_dir = Path(ns.path)
    rows = []
    for path in (ns_dir / "slabs").glob("*.slab"):
        fd = os.open(path, os.O_RDONLY)
        slots, records = read_table(fd)
        os.close(fd)
        rows += [(k, path, table_bytes(slots) + n * (HEADER_AREA + slot)) for n, k, _ in records]
    k, path, offset = next(row for row in rows if row[0].hex() not in crashed)
    offset += HEADER_AREA + 7
    flip(path, offset)
    ns = only(check_root(tmp_path))
    bad = {f.key for f in ns.findings}
    assert bad == crashed | {bytes(k).hex()}
    host = MemoryHostBuffer(1, slot)
    tier = FsspecTierStore(
        host, str(tmp_path), capacity_bytes=64 * (slot + 4096), namespace={"m": 1}
    )
    try:
        (inventory,) = tier.take_events()
        for held in inventory.keys:
            n = int.from_bytes(bytes(held)[:32], "big")
            served = run(tier, JobKind.GET, [n], [0]).success
            assert served == (held.hex() not in bad), held.hex()
    finally:
        tier.close()
