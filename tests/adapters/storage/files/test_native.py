"""The slab mover's native data path against its Python one: the same bytes on disk, the
same headers and verdicts read back, the same errors, and a clear refusal where it cannot
run. The file tier's whole contract runs on both paths (tests/contracts)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.files import _native as native
from kvhex.adapters.storage.files import posix
from kvhex.adapters.storage.files.posix import PosixSlotMover
from kvhex.adapters.storage.format import (
    HEADER_AREA,
    KeptRecord,
    Verdict,
    kept_record,
    record_room,
    verify,
)
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.domain.keys import OffloadKey
from tests.adapters.jobs import key

try:
    native.load()
    WHY_NOT = ""
except native.NativeUnavailable as exc:
    WHY_NOT = str(exc)
needs_native = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)

Block = tuple[int, int, OffloadKey, memoryview]


def test_the_native_path_is_there_when_the_run_requires_it() -> None:
    """``make test`` exports ``KVHEX_NATIVE=required``: a .venv built without the module (by
    ``make run`` where no C compiler was found) fails the suite instead of skipping half of
    what it tests."""
    if os.environ.get("KVHEX_NATIVE") != "required":
        pytest.skip("KVHEX_NATIVE is not 'required' (make test sets it): either path may run")
    assert not WHY_NOT, (
        f"KVHEX_NATIVE=required, but {WHY_NOT}. Remove .venv/.kvhex-installed and run make "
        "test again where a C compiler is found"
    )


def run_script(script: str, *args: str, **env: str) -> str:
    """What ``script`` printed, run by this interpreter from the repository's root."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=Path(__file__).parents[4],
        env={**os.environ, **env},
    )
    return done.stdout


@pytest.fixture
def reload_native() -> Iterator[None]:
    """A fresh load before and after the test (what it monkeypatches is not cached)."""
    native.forget()
    yield
    native.forget()


def layout(fd: int, sizes: list[int], gaps: list[bool], host: MemoryHostBuffer) -> list[Block]:
    """Blocks of ``sizes`` (payload bytes) one after another in ``fd``, a free slot before
    each block whose gap is set (ending a run)."""
    blocks: list[Block] = []
    offset = 0
    for i, (size, gap) in enumerate(zip(sizes, gaps, strict=True)):
        if gap:
            offset += HEADER_AREA + size
        blocks.append((fd, offset, key(i + 1), host.slot_view(i)[:size]))
        offset += HEADER_AREA + size
    return blocks


def random_host(slots: int, slot_bytes: int, seed: int) -> MemoryHostBuffer:
    host = MemoryHostBuffer(slots, slot_bytes)
    for s in range(slots):
        host.slot_view(s)[:] = (seed * 131 + s).to_bytes(4, "little") * (slot_bytes // 4)
        host.slot_view(s)[: min(64, slot_bytes)] = os.urandom(min(64, slot_bytes))
    return host


@needs_native
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(
        st.sampled_from([0, 1, 240, 241, 4096, 70_000, 1 << 18]), min_size=1, max_size=12
    ),
    gaps=st.data(),
    run_limit=st.sampled_from([0, 1, 300_000, 2 << 20]),
)
def test_both_paths_write_the_same_bytes_and_read_them_back_alike(
    tmp_path: Path,
    sizes: list[int],
    gaps: st.DataObject,
    run_limit: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(posix, "_RUN_BYTES", run_limit or (1 << 40))
    gap = gaps.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    host = random_host(len(sizes), 1 << 18, len(sizes))
    # chunk records in every other header, of every length up to the longest that fits
    room = record_room(len(key(1)))
    records = {key(i + 1): bytes([i + 1]) * (1 + i * 397 % room) for i in range(0, len(sizes), 2)}
    files = {}
    for name, mover in (("py", PosixSlotMover(native=False)), ("c", PosixSlotMover(native=True))):
        path = tmp_path / f"{name}-{len(sizes)}-{run_limit}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written = mover.write_slots(layout(fd, sizes, gap, host), records)
            assert written == [None] * len(sizes)
            files[name] = path.read_bytes()
            for reader in (PosixSlotMover(native=False), PosixSlotMover(native=True)):
                views = [
                    memoryview(bytearray(len(p))) for _, _, _, p in layout(fd, sizes, gap, host)
                ]
                blocks = [
                    (fd, off, v)
                    for (_, off, _, _), v in zip(layout(fd, sizes, gap, host), views, strict=True)
                ]
                read = reader.read_slots(blocks)
                for (_, _, k, payload), view, (header, digest) in zip(
                    layout(fd, sizes, gap, host), views, read, strict=True
                ):
                    assert bytes(view) == bytes(payload)
                    assert digest in (None, xxhash.xxh3_64_intdigest(payload))
                    assert (digest is None) is (not reader.native)
                    assert verify(header, k, view, digest) is Verdict.OK
                    if k in records:
                        assert kept_record(header) == (KeptRecord.INTACT, records[k])
                    else:
                        assert kept_record(header) == (KeptRecord.NONE, b"")
        finally:
            os.close(fd)
    assert files["c"] == files["py"]


@needs_native
def test_a_block_cut_short_and_a_stale_one_read_alike_on_both_paths(tmp_path: Path) -> None:
    host = random_host(4, 1 << 16, 7)
    path = tmp_path / "slab"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        blocks = layout(fd, [1 << 16] * 4, [False] * 4, host)
        assert PosixSlotMover(native=True).write_slots(blocks) == [None] * 4
        os.truncate(path, 3 * (HEADER_AREA + (1 << 16)) + 100)  # the last block cut short
        flipped = bytearray(1)
        os.preadv(fd, [flipped], HEADER_AREA + 5)
        os.pwrite(fd, bytes([flipped[0] ^ 1]), HEADER_AREA + 5)  # the first payload damaged
        for mover in (PosixSlotMover(native=False), PosixSlotMover(native=True)):
            views = [memoryview(bytearray(1 << 16)) for _ in range(4)]
            read = mover.read_slots(
                [(fd, off, v) for (_, off, _, _), v in zip(blocks, views, strict=True)]
            )
            keys = [key(1), key(2), key(9), key(4)]  # the third slot holds another key's block
            verdicts = [verify(h, k, v, d) for (h, d), k, v in zip(read, keys, views, strict=True)]
            assert verdicts == [Verdict.CORRUPT, Verdict.OK, Verdict.MISSING, Verdict.CORRUPT]
            assert read[3] == (b"", None)
    finally:
        os.close(fd)


@needs_native
def test_a_failed_run_fails_its_blocks_only_with_the_python_paths_text(tmp_path: Path) -> None:
    host = random_host(4, 4096, 3)
    good = os.open(tmp_path / "good", os.O_RDWR | os.O_CREAT, 0o600)
    reader, writer = os.pipe()  # positional writes to a pipe fail: ESPIPE
    try:
        blocks = [*layout(good, [4096, 4096], [False, False], host)]
        blocks.append((writer, 0, key(3), host.slot_view(2)))
        blocks.append((good, 9 * 8192, key(4), host.slot_view(3)))
        results = {
            m.native: m.write_slots(blocks)
            for m in (PosixSlotMover(native=False), PosixSlotMover(native=True))
        }
        assert results[True] == results[False] == [None, None, "OSError: Illegal seek", None]
        closed = os.open(tmp_path / "closed", os.O_RDWR | os.O_CREAT, 0o600)
        os.close(closed)
        for mover in (PosixSlotMover(native=False), PosixSlotMover(native=True)):
            assert mover.write_slots([(closed, 0, key(1), host.slot_view(0))]) == [
                "OSError: Bad file descriptor"
            ]
            with pytest.raises(OSError, match="Bad file descriptor"):
                mover.read_slots([(closed, 0, memoryview(bytearray(4096)))])
    finally:
        for fd in (good, reader, writer):
            os.close(fd)


SHORT_WRITE = """
import os, resource, signal, sys
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.files import posix
from tests.adapters.jobs import key

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
payload, count, run_bytes, limit = (int(a) for a in sys.argv[3:7])
posix._RUN_BYTES = run_bytes
host = MemoryHostBuffer(count, max(payload, 1))
for s in range(count):
    host.slot_view(s)[:] = bytes([s % 251 + 1]) * max(payload, 1)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
size = 4096 + payload
blocks = [(fd, i * size, key(i + 1), host.slot_view(i)[:payload]) for i in range(count)]
errors = posix.PosixSlotMover(native=sys.argv[2] == "1").write_slots(blocks)
print(errors.count(None), sorted(set(errors) - {None}), os.fstat(fd).st_size)
"""

KIB = 1024


@needs_native
@pytest.mark.parametrize(
    "case",
    [
        # two blocks in one run, the file limit inside the second: the run fails whole
        (64 * KIB, 2, 2 << 20, 2 * 4096 + 64 * KIB + 1000, "0 ['OSError: File too large']"),
        # 256 KiB blocks: runs of seven (2 MiB), the limit inside the ninth block
        (256 * KIB, 12, 2 << 20, 8 * (4096 + 256 * KIB) + 5000, "7 ['OSError: File too large']"),
        # header-only blocks, no byte limit: runs of 512 blocks, the limit inside the 600th
        (0, 700, 1 << 40, 599 * 4096 + 100, "512 ['OSError: File too large']"),
    ],
)
def test_a_write_cut_short_by_the_file_size_limit_fails_its_run_alike(
    tmp_path: Path, case: tuple[int, int, int, int, str]
) -> None:
    payload, count, run_bytes, limit, expected = case
    outputs = []
    for flag in ("0", "1"):
        path = tmp_path / f"f{flag}"
        args = [str(path), flag, str(payload), str(count), str(run_bytes), str(limit)]
        outputs.append((run_script(SHORT_WRITE, *args).strip(), path.read_bytes()))
    assert outputs[0] == outputs[1]  # the same blocks failed, the same bytes on disk
    assert outputs[0][0] == f"{expected} {limit}"  # written up to the limit, then refused


@needs_native
def test_malformed_blocks_are_refused_before_any_write(tmp_path: Path) -> None:
    io = native.load()
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(TypeError, match=r"a block is \(fd, offset, header, payload\)"):
            io.write_blocks([(fd, 0, bytearray(HEADER_AREA))], 16, 0)  # type: ignore[list-item]
        with pytest.raises(ValueError, match="block 1: a 8-byte header buffer is shorter than 24"):
            io.write_blocks([(fd, 0, bytearray(64), b"x"), (fd, 100, bytearray(8), b"y")], 16, 0)
        with pytest.raises(ValueError, match="block 0: negative offset -1"):
            io.write_blocks([(fd, -1, bytearray(64), b"x")], 16, 0)
        with pytest.raises(TypeError, match=r"block 0: a block is .* not a list"):
            io.write_blocks([[fd, 0, bytearray(64), b"x"]], 16, 0)  # type: ignore[list-item]
        with pytest.raises(ValueError, match="digest_offset 9223372036854775804 is out of range"):
            io.write_blocks([(fd, 0, bytearray(64), b"x")], sys.maxsize - 3, 0)
        with pytest.raises(ValueError, match="block 0: offset 9223372036854775800 is past"):
            io.write_blocks([(fd, 9223372036854775800, bytearray(64), b"x")], 16, 0)
        with pytest.raises(BufferError):  # a read-only header cannot take its checksum
            io.write_blocks([(fd, 0, b"\0" * 64, b"x")], 16, 0)  # type: ignore[list-item]
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)


@needs_native
@pytest.mark.usefixtures("reload_native")
def test_the_checksum_is_xxhash_s_entry_that_picks_the_cpu_s_vector_unit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extension's plain XXH3_64bits is built for the baseline CPU (SSE2): bound is the
    entry that dispatches at run time, as xxhash's own functions are, and the plain one only
    where the first is missing."""
    library = ctypes.CDLL(xxhash._xxhash.__file__)
    if not hasattr(library, "XXH3_64bits_dispatch"):
        pytest.skip("this xxhash build has no dispatch entry (it dispatches on x86 only)")
    assert native.checksum_entry() == "XXH3_64bits_dispatch"
    native.forget()
    monkeypatch.setattr(native, "_SYMBOLS", ("XXH3_no_such_entry", "XXH3_64bits"))
    assert native.checksum_entry() == "XXH3_64bits"
    data = os.urandom(300_000)
    assert native.load().checksum(data) == xxhash.xxh3_64_intdigest(data)
    native.forget()
    monkeypatch.setattr(native, "_SYMBOLS", ("XXH3_no_such_entry",))
    with pytest.raises(native.NativeUnavailable, match="exports no XXH3_no_such_entry"):
        native.checksum_entry()


@pytest.mark.usefixtures("reload_native")
def test_a_checksum_that_disagrees_with_xxhash_leaves_the_python_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    library = ctypes.CDLL(xxhash._xxhash.__file__)
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda data: 0)
    with pytest.raises(native.NativeUnavailable, match="disagrees with xxhash at 0 bytes"):
        native.load()
    posix._WARNED.clear()
    with structlog.testing.capture_logs() as said:
        assert not PosixSlotMover().native  # the default falls back, and says so
        assert not PosixSlotMover().native
    assert said == [  # once
        {
            "event": "native_io_unavailable",
            "log_level": "warning",
            "reason": "the native data path is unavailable: "
            + "; ".join(
                f"the xxhash package's {symbol} disagrees with xxhash at 0 bytes"
                if hasattr(library, symbol)
                else f"the library exports no {symbol}"
                for symbol in native._SYMBOLS
            ),
            "running": "the Python data path",
        }
    ]
    with pytest.raises(native.NativeUnavailable):
        PosixSlotMover(native=True)
    host = MemoryHostBuffer(2, 4096)
    with pytest.raises(ValueError, match="native_io=True: the native data path is unavailable"):
        FsspecTierStore(host, str(tmp_path / "t"), capacity_bytes=1 << 20, native_io=True)
    assert not (tmp_path / "t").exists()  # nothing half-started
    store = FsspecTierStore(host, str(tmp_path / "t"), capacity_bytes=1 << 20)
    assert not store.native_io
    store.close()


@needs_native
@pytest.mark.usefixtures("reload_native")
def test_a_stale_build_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhex.adapters.storage.files import _slotio

    monkeypatch.setattr(_slotio, "API_VERSION", 0)
    expected = f"version 0, this code expects {native._API_VERSION}: reinstall"
    with pytest.raises(native.NativeUnavailable, match=expected):
        native.load()


def test_an_object_store_has_no_native_path() -> None:
    host = MemoryHostBuffer(2, 4096)
    with pytest.raises(ValueError, match="native_io=True: only local roots"):
        FsspecTierStore(host, "s3://bucket/kv", capacity_bytes=1 << 20, native_io=True)


@needs_native
def test_the_file_tier_takes_the_native_path_by_default(tmp_path: Path) -> None:
    host = MemoryHostBuffer(2, 4096)
    for native_io, expected in ((None, True), (True, True), (False, False)):
        store = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, native_io=native_io)
        try:
            assert store.native_io is expected
        finally:
            store.close()


BUILD = textwrap.dedent(
    """
    import glob, subprocess, sys, zipfile
    out = sys.argv[1]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-v", "-w", out],
        capture_output=True, text=True,
    )
    print("rc", done.returncode)
    said = [line for line in (done.stdout + done.stderr).splitlines() if "kvhex:" in line]
    print("said", " ".join(said))
    for wheel in glob.glob(out + "/*.whl"):
        names = zipfile.ZipFile(wheel).namelist()
        print("wheel", wheel.rsplit("/", 1)[1], any(n.endswith(".so") for n in names))
    """
)


def build_wheel(tmp_path: Path, **env: str) -> str:
    return run_script(BUILD, str(tmp_path), **env)


@pytest.mark.slow
def test_the_build_compiles_the_native_path_or_says_why(tmp_path: Path) -> None:
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    built = build_wheel(tmp_path / "auto", KVHEX_NATIVE="auto")
    assert "rc 0" in built
    assert "-cp3" in built, built  # a platform wheel, with the module in it
    assert built.rstrip().endswith("True"), built
    off = build_wheel(tmp_path / "off", KVHEX_NATIVE="off")
    assert "py3-none-any.whl False" in off, off
    no_cc = build_wheel(tmp_path / "nocc", KVHEX_NATIVE="auto", CC="false")
    assert "py3-none-any.whl False" in no_cc, no_cc
    assert "the native module _slotio was not built" in no_cc
    assert "the native module _hostslots was not built" in no_cc
    required = build_wheel(tmp_path / "req", KVHEX_NATIVE="required", CC="false")
    assert "rc 1" in required
    assert "the native module _slotio was not built" in required
    assert not list(Path(native.__file__).parent.glob("_slotio*.so"))  # no stale build left
    assert "True" in build_wheel(tmp_path / "again", KVHEX_NATIVE="auto")  # built in place again
    loads = "from kvhex.adapters.storage.files import _native; print(_native.load().API_VERSION)"
    assert run_script(loads).strip() == str(native._API_VERSION)
