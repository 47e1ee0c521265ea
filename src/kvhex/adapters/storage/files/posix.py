"""``PosixSlotMover``: blocks into and out of slab slots with positional vectored IO, the
default :class:`~kvhex.adapters.storage.block_io.SlotMover` of
:class:`~kvhex.adapters.storage.files.slabs.SlabIo` (NIXL's POSIX backend is the other one,
:class:`~kvhex.adapters.storage.nixl.NixlSlotMover`).

Threads: every method may run on any IO thread, several at once; a mover holds nothing but
the native module it runs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType

import structlog

from kvhex.adapters.storage.block_io import Records, oserror, write_fully
from kvhex.adapters.storage.files import _native
from kvhex.adapters.storage.format import DIGEST_OFFSET, HEADER_AREA, pack_header
from kvhex.domain.keys import OffloadKey

log = structlog.get_logger(__name__)

_RUN_BLOCKS = 512
"""Blocks per vectored syscall: two buffers each, within Linux's ``IOV_MAX`` of 1024 (the
native path, ``_slotio.c``, splits runs at the same count; tested on both)."""
_RUN_BYTES = 2 << 20
"""Bytes per vectored write or read (at least one block). A write's checksum pass leaves
each block in the CPU cache for the kernel's copy right after, and a writer holds the file's
inode lock for one such write at a time (docs/performance.md: 2 MiB puts went from 0.93x to
1.1x raw); a read's blocks are checksummed while the copy just left them there (256 KiB gets
1.07x, 2 MiB gets 1.16x, against one read per run of adjacent slots)."""


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def _python_path_runs(reason: str) -> None:
    """Warn, once per process and reason, that file tiers run the Python data path: slower
    at small chunks (docs/performance.md), so an operator should know, and why."""
    with _WARNED_LOCK:
        if reason in _WARNED:
            return
        _WARNED.add(reason)
    log.warning("native_io_unavailable", reason=reason, running="the Python data path")


class PosixSlotMover:
    """Blocks in and out of slab slots with positional vectored IO: one ``pwritev`` (header
    and payload of every block back to back) or ``preadv`` per run of adjacent slots of one
    file, up to 2 MiB (and 512 blocks; one block at least). The checksums of a run are
    computed just before its write, or right after its read: each payload is then in the CPU
    cache.

    Two paths do this, byte for byte alike: the native one
    (:mod:`~kvhex.adapters.storage.files._native`), which does a
    whole call with the GIL released once, and Python's, which releases it per checksum and
    per run.

    Args:
        native: ``True`` requires the native path, ``False`` takes Python's, ``None`` (the
            default) the native one where it was built.

    Raises:
        NativeUnavailable: ``native=True`` where the native path cannot run (the message
            says why).
    """

    def __init__(self, native: bool | None = None) -> None:
        self._native: ModuleType | None = None
        if native is not False:
            try:
                self._native = _native.load()
            except _native.NativeUnavailable as exc:
                if native:
                    raise
                _python_path_runs(str(exc))

    @property
    def native(self) -> bool:
        """Whether the native path moves this mover's blocks."""
        return self._native is not None

    @property
    def checksum_entry(self) -> str | None:
        """The xxhash extension's function the native path checksums with (``None`` on
        Python's path)."""
        return None if self._native is None else _native.checksum_entry()

    def write_slots(
        self,
        blocks: Sequence[tuple[int, int, OffloadKey, memoryview]],
        records: Records | None = None,
    ) -> list[str | None]:
        """Write each (fd, offset, key, payload), its header keeping the key's chunk record
        from ``records``; a run cut short fails all its blocks."""
        if self._native is not None:
            return self._write_native(self._native, blocks, records)
        errors: list[str | None] = [None] * len(blocks)
        for run in _runs([(fd, off, len(p)) for fd, off, _, p in blocks], _RUN_BYTES):
            parts: list[bytes | memoryview] = []
            nbytes = 0
            for i in run:
                _, _, key, payload = blocks[i]
                record = records.get(key, b"") if records else b""
                parts += (pack_header(key, payload, None, record), payload)
                nbytes += HEADER_AREA + len(payload)
            fd, offset, _, _ = blocks[run[0]]
            try:
                write_fully(fd, parts, offset, nbytes)
            except OSError as exc:
                for i in run:
                    errors[i] = oserror(exc)
        return errors

    @staticmethod
    def _write_native(
        io: ModuleType,
        blocks: Sequence[tuple[int, int, OffloadKey, memoryview]],
        records: Records | None,
    ) -> list[str | None]:
        # the headers, chunk records included, are packed here; the native call fills in
        # each payload's checksum at DIGEST_OFFSET
        if records:
            get = records.get
            headers = [bytearray(pack_header(k, p, 0, get(k, b""))) for _, _, k, p in blocks]
        else:
            headers = [bytearray(pack_header(k, p, 0)) for _, _, k, p in blocks]
        codes = io.write_blocks(
            [(fd, off, h, p) for (fd, off, _, p), h in zip(blocks, headers, strict=True)],
            DIGEST_OFFSET,
            _RUN_BYTES,
        )
        return [oserror(OSError(code, os.strerror(code))) if code else None for code in codes]

    def read_slots(
        self, blocks: Sequence[tuple[int, int, memoryview]]
    ) -> list[tuple[bytes, int | None]]:
        """The header area of each block (``b""`` when the slot is cut short), its payload
        read into the view, and on the native path the payload's checksum."""
        headers = [bytearray(HEADER_AREA) for _ in blocks]
        if self._native is not None:
            digests = self._native.read_blocks(
                [(fd, off, h, view) for (fd, off, view), h in zip(blocks, headers, strict=True)],
                _RUN_BYTES,
            )
            return [
                (b"", None) if d is None else (bytes(h), d)
                for h, d in zip(headers, digests, strict=True)
            ]
        out: list[tuple[bytes, int | None]] = [(b"", None)] * len(blocks)
        for run in _runs([(fd, off, len(v)) for fd, off, v in blocks], _RUN_BYTES):
            parts = [part for i in run for part in (headers[i], blocks[i][2])]
            fd, offset, _ = blocks[run[0]]
            got = os.preadv(fd, parts, offset)
            for i in run:
                size = HEADER_AREA + len(blocks[i][2])
                if got >= size:
                    out[i] = (bytes(headers[i]), None)
                got -= size
        return out

    def close(self) -> None:
        """Nothing held."""


def _runs(
    places: Sequence[tuple[int, int, int]], max_bytes: int | None = None
) -> Iterator[list[int]]:
    """Indices of ``places`` (fd, offset, payload length) in runs of adjacent blocks of one
    file, each at most ``_RUN_BLOCKS`` long and, given ``max_bytes``, at most that many bytes
    (or one block)."""
    run: list[int] = []
    end = (-1, -1)
    size = 0
    for i, (fd, offset, length) in enumerate(places):
        block = HEADER_AREA + length
        if run and (
            len(run) == _RUN_BLOCKS
            or (fd, offset) != end
            or (max_bytes is not None and size + block > max_bytes)
        ):
            yield run
            run, size = [], 0
        run.append(i)
        size += block
        end = (fd, offset + block)
    if run:
        yield run
