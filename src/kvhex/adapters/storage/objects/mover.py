"""``FsspecObjectMover``: blocks into and out of objects through fsspec, the default mover of
:class:`~kvhex.adapters.storage.objects.io.ObjectIo`.

A job's objects go out as one concurrent s3fs ``pipe``; they come back, on an S3-compatible
endpoint, by the tier's own signed GETs straight into the host slots
(:mod:`kvhex.adapters.storage.objects.s3_direct`), and otherwise as one s3fs ``cat``.

Threads: every method may run on any IO thread; ``_reads_lock`` guards the choice of reads.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from typing import Any

import structlog

from kvhex.adapters.storage.block_io import Records, StoreLost
from kvhex.adapters.storage.format import HEADER_AREA, pack_header
from kvhex.adapters.storage.objects._errors import store_error
from kvhex.adapters.storage.objects.s3_direct import FALLBACK, REFUSED, DirectReader
from kvhex.domain.keys import OffloadKey

log = structlog.get_logger(__name__)

REFUSED_JOBS = 3
"""Get jobs in a row whose every own GET the server refused (a 4xx answer), while s3fs was
served the same objects, before the fsspec tier reads through s3fs only."""


class _Reads(enum.Enum):
    """How :class:`FsspecObjectMover` reads blocks."""

    UNKNOWN = "unknown"
    """Not decided yet: the first get decides, once the namespace's client exists."""
    DIRECT = "direct"
    """The tier's own signed GETs straight into the slots, s3fs for what they leave."""
    S3FS = "s3fs"
    """s3fs only: an endpoint whose requests are not plain to build, or a server that
    refused the own GETs ``REFUSED_JOBS`` jobs in a row."""


class FsspecObjectMover:
    """Blocks as objects through fsspec: a job's objects go out as one concurrent ``pipe``
    (a block's object built with one copy of the payload). They come back, on an
    S3-compatible endpoint, by signed GETs straight into the host slots
    (:class:`~kvhex.adapters.storage.objects.s3_direct.DirectReader`), and otherwise, or whatever
    those leave, as one ``cat`` copied into the slots."""

    def __init__(self, fs: Any, url: str) -> None:
        self.fs = fs
        self.url = url
        # s3fs asks for an object's size (a HEAD) before every GET unless told to read each
        # object in one request: a block is one object, read whole
        self._cat_options = {"max_concurrency": 1} if hasattr(fs, "max_concurrency") else {}
        self._reads = _Reads.UNKNOWN
        self._reader: DirectReader | None = None  # open until the mover closes
        self._reads_lock = threading.Lock()
        self._refused_jobs = 0  # jobs in a row whose every own GET s3fs had to serve

    def put_objects(
        self,
        objects: Sequence[tuple[str, OffloadKey, memoryview]],
        records: Records | None = None,
    ) -> list[str | None]:
        """PUT every object (its header keeping the key's chunk record from ``records``);
        after a failed batch, what landed counts as written."""
        payload = {}
        for path, key, view in objects:
            data = bytearray(HEADER_AREA + len(view))
            data[HEADER_AREA:] = view
            record = records.get(key, b"") if records else b""
            # the checksum reads the copy, still in the CPU cache, not the slot again
            data[:HEADER_AREA] = pack_header(key, memoryview(data)[HEADER_AREA:], None, record)
            payload[path] = data
        try:
            self.fs.pipe(payload)
        except Exception as exc:
            failure = store_error(exc, self.url)
            if isinstance(failure, StoreLost):
                raise failure from exc
            # the batch is all or nothing from here: find out what actually landed
            try:
                landed = exists_paths(self.fs, list(payload))
            except Exception:
                landed = set()
            return [None if path in landed else str(failure) for path, _, _ in objects]
        return [None] * len(objects)

    def get_objects(self, objects: Sequence[tuple[str, memoryview]]) -> list[bytes | None]:
        """GET every object; the header of each whole block, ``None`` if absent, ``b""`` if
        not a whole block.

        Raises:
            StoreLost: the bucket is gone.
            OSError: the store failed; the message names the cause.
        """
        with self._reads_lock:
            if self._reads is _Reads.UNKNOWN:  # the client exists once the namespace was opened
                self._reader = DirectReader.of(self.fs)
                self._reads = _Reads.S3FS if self._reader is None else _Reads.DIRECT
            direct = self._reader if self._reads is _Reads.DIRECT else None
        if direct is None:
            return self._cat(objects)
        out = direct.read(objects)
        refused = all(got is REFUSED for got in out)
        rest = [i for i, got in enumerate(out) if got is FALLBACK or got is REFUSED]
        if rest:
            for i, got in zip(rest, self._cat([objects[i] for i in rest]), strict=True):
                out[i] = got
        # s3fs found what the server refused the reader
        self._judge(direct, refused and any(got is not None for got in out))
        return out

    def _judge(self, direct: DirectReader, refused: bool) -> None:
        """After ``REFUSED_JOBS`` jobs in a row whose own GETs the server refused (a proxy
        that rejects their signature, say) while serving s3fs the same objects, reads go
        through s3fs only: one request per block, not two. Server errors and broken
        connections (a server restarting, throttling) do not count."""
        with self._reads_lock:
            self._refused_jobs = self._refused_jobs + 1 if refused else 0
            if self._refused_jobs < REFUSED_JOBS or self._reads is not _Reads.DIRECT:
                return
            # the reader stays open: another IO thread may be inside its read()
            self._reads = _Reads.S3FS
        log.warning(
            "s3_direct_reads_off", url=self.url, jobs=REFUSED_JOBS, last_refusal=direct.refusal
        )

    def _cat(self, objects: Sequence[tuple[str, memoryview]]) -> list[bytes | None]:
        """:meth:`get_objects` through one s3fs ``cat``."""
        paths = [path for path, _ in objects]
        try:
            got = self.fs.cat(paths, on_error="return", **self._cat_options)
        except Exception as exc:
            raise store_error(exc, self.url) from exc
        out: list[bytes | None] = []
        for path, view in objects:
            data = got.get(path)
            if data is None or isinstance(data, FileNotFoundError):
                out.append(None)
            elif isinstance(data, BaseException):
                raise store_error(data, self.url) from data
            elif len(data) != HEADER_AREA + len(view):
                out.append(b"")
            else:
                view[:] = memoryview(data)[HEADER_AREA:]  # one copy, not two
                out.append(bytes(data[:HEADER_AREA]))
        return out

    def close(self) -> None:
        """Stop the direct reader's request threads, if it has one."""
        with self._reads_lock:
            if self._reader is not None:
                self._reader.close()


def exists_paths(fs: Any, paths: list[str]) -> set[str]:
    """Which ``paths`` exist: one listing answers every path of a shard asked for twice or
    more, one request each for the rest."""
    by_prefix: dict[str, list[str]] = {}
    for path in paths:
        by_prefix.setdefault(path.rsplit("/", 1)[0], []).append(path)
    found: set[str] = set()
    for prefix, wanted in by_prefix.items():
        if len(wanted) > 1:
            try:
                listed = set(fs.find(prefix))
            except FileNotFoundError:
                listed = set()
            found.update(p for p in wanted if p in listed)
        else:
            found.update(p for p in wanted if fs.exists(p))
    return found
