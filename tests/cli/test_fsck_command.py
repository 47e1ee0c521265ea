"""``kvhex fsck ROOT`` as a user runs it, on roots written by ``FsspecTierStore``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.format import HEADER_AREA
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.domain import JobKind
from tests.adapters.jobs import key, run
from tests.cli.command import kvhex

SLOT = 4096


def tier(root: Path) -> dict[int, tuple[str, int]]:
    """Write chunks 1-3 under ``root``; where each block went."""
    host = MemoryHostBuffer(4, SLOT)
    for s in range(4):
        host.slot_view(s)[:] = bytes([s + 7]) * SLOT
    store = FsspecTierStore(host, str(root), capacity_bytes=1 << 20, namespace={"model": "m"})
    assert run(store, JobKind.PUT, [1, 2, 3]).success
    places = {k: store.location(key(k)) for k in (1, 2, 3)}
    store.close()
    return places


def test_a_clean_root_exits_0(tmp_path: Path) -> None:
    tier(tmp_path)
    done = kvhex("fsck", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 ok, 0 corrupt, 0 missing" in done.stdout
    assert done.stdout.splitlines()[-1] == "clean"


def test_a_flipped_payload_byte_exits_1_naming_the_block(tmp_path: Path) -> None:
    places = tier(tmp_path)
    path, offset = places[2]
    with open(path, "r+b") as f:
        f.seek(offset + HEADER_AREA + SLOT - 1)
        f.write(b"\0")  # the payload byte was 8
    (tmp_path / "stray.txt").write_text("not kvhex's")
    done = kvhex("fsck", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"CORRUPT {key(2).hex()}: payload checksum mismatch" in done.stdout
    assert "foreign stray.txt" in done.stdout
    assert "2 ok, 1 corrupt, 0 missing" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("NOT CLEAN: 1 corrupt")

    as_json = kvhex("fsck", str(tmp_path), "--json")
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert report["clean"] is False
    assert report["foreign"] == ["stray.txt"]
    (ns,) = report["namespaces"]
    assert [(f["key"], f["finding"]) for f in ns["findings"]] == [(key(2).hex(), "corrupt")]


def test_a_foreign_file_alone_is_reported_but_clean(tmp_path: Path) -> None:
    tier(tmp_path)
    (tmp_path / "stray.txt").write_text("x")
    done = kvhex("fsck", str(tmp_path))
    assert done.returncode == 0
    assert "foreign stray.txt" in done.stdout


@pytest.mark.parametrize("name", ["absent", "a-file"])
def test_a_root_that_is_not_a_directory_exits_2_naming_it(tmp_path: Path, name: str) -> None:
    (tmp_path / "a-file").write_text("x")
    root = tmp_path / name
    done = kvhex("fsck", str(root))
    assert done.returncode == 2
    assert str(root) in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("args", "named"), [(["fsck"], "ROOT"), (["fsck", ".", "--x"], "--x")])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], named: str) -> None:
    done = kvhex(*args)
    assert done.returncode == 2
    assert named in done.stderr


def test_a_root_holding_no_kvhex_tier_exits_3_saying_so(tmp_path: Path) -> None:
    done = kvhex("fsck", str(tmp_path))
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"ROOT {tmp_path} holds no kvhex tier (it is empty)" in done.stderr
    assert "clean" not in done.stdout
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "photos").mkdir()
    done = kvhex("fsck", str(tmp_path), "--json")
    assert done.returncode == 3
    assert "(2 entries, none a kvhex namespace)" in done.stderr
    report = json.loads(done.stdout)  # --json still prints what it found
    assert report["namespaces"] == []
    assert sorted(report["foreign"]) == ["notes.txt", "photos/"]


def test_a_damaged_chunk_record_is_reported_harmless(tmp_path: Path) -> None:
    from kvhex.adapters.storage.format import HEADER
    from tests.adapters.storage.peer_kit import put, request

    host = MemoryHostBuffer(4, SLOT)
    store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace={"m": 1})
    ctx, keys = request("r", 2)
    assert put(store, keys, ctx).success  # blocks stored by a request keep its record
    path, offset = store.location(keys[1])
    store.close()
    at = offset + HEADER.size + len(keys[1]) + 16  # a byte inside the record
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x20]))
    done = kvhex("fsck", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"bad record {keys[1].hex()}" in done.stdout
    assert "announced as a placeholder, harmless" in done.stdout
    assert done.stdout.splitlines()[-1] == "clean"
