"""``FsspecObjectMover``: blocks into and out of objects through fsspec, the default mover of
:class:`~kvhex.adapters.storage.objects.io.ObjectIo`.

On an S3-compatible endpoint a job's blocks go out and come back by the tier's own signed
requests, straight from and into the host slots
(:mod:`kvhex.adapters.storage.objects.s3_direct`); otherwise, and for whatever those leave, a
job's objects go out as one concurrent s3fs ``pipe`` and come back as one s3fs ``cat``.

Threads: every method may run on any IO thread; ``_lock`` guards the choice of requests.
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
from kvhex.adapters.storage.objects.s3_direct import FALLBACK, REFUSED, DirectS3
from kvhex.domain.keys import OffloadKey

log = structlog.get_logger(__name__)

REFUSED_JOBS = 3
"""Jobs in a row whose every own request the server refused (a 4xx answer), while s3fs was
served the same objects, before the fsspec tier goes through s3fs only."""


class _Requests(enum.Enum):
    """Whose requests :class:`FsspecObjectMover` sends."""

    UNKNOWN = "unknown"
    """Not decided yet: the first job decides, once the namespace's client exists."""
    DIRECT = "direct"
    """The tier's own signed requests, from and into the slots; s3fs for what they leave."""
    S3FS = "s3fs"
    """s3fs only: an endpoint whose requests are not plain to build, or a server that
    refused the own requests ``REFUSED_JOBS`` jobs in a row."""


class FsspecObjectMover:
    """Blocks as objects through fsspec. On an S3-compatible endpoint by signed requests
    straight from and into the host slots
    (:class:`~kvhex.adapters.storage.objects.s3_direct.DirectS3`); otherwise, or for whatever
    those leave, a job's objects go out as one concurrent ``pipe`` (a block's object built
    with one copy of the payload) and come back as one ``cat`` copied into the slots."""

    def __init__(self, fs: Any, url: str) -> None:
        self.fs = fs
        self.url = url
        # s3fs asks for an object's size (a HEAD) before every GET unless told to read each
        # object in one request: a block is one object, read whole
        self._cat_options = {"max_concurrency": 1} if hasattr(fs, "max_concurrency") else {}
        self._requests = _Requests.UNKNOWN
        self._direct: DirectS3 | None = None  # open until the mover closes
        self._lock = threading.Lock()
        self._refused_jobs = 0  # jobs in a row whose every own request s3fs had to serve

    def put_objects(
        self,
        objects: Sequence[tuple[str, OffloadKey, memoryview]],
        records: Records | None = None,
    ) -> list[str | None]:
        """PUT every object (its header keeping the key's chunk record from ``records``);
        per object ``None`` once stored, or why not."""
        direct = self._direct_requests()
        if direct is None:
            return self._pipe(objects, records)
        sent = [
            (path, pack_header(key, view, None, records.get(key, b"") if records else b""), view)
            for path, key, view in objects
        ]
        answers = direct.write(sent)
        out: list[str | None] = [None] * len(objects)
        rest = [i for i, got in enumerate(answers) if got is FALLBACK or got is REFUSED]
        if rest:
            for i, why in zip(rest, self._pipe([objects[i] for i in rest], records), strict=True):
                out[i] = why
        # s3fs stored what the server refused the tier's own PUTs
        refused = bool(answers) and all(got is REFUSED for got in answers)
        self._judge(direct, refused and any(why is None for why in out))
        return out

    def get_objects(
        self, objects: Sequence[tuple[str, memoryview]], *, up_to: bool = False
    ) -> list[bytes | None]:
        """GET every object; the header of each whole block, ``None`` if absent, ``b""`` if
        not a whole block (with ``up_to``, a block shorter than its view fills its start).

        Raises:
            StoreLost: the bucket is gone.
            OSError: the store failed; the message names the cause.
        """
        direct = self._direct_requests()
        if direct is None:
            return self._cat(objects, up_to)
        out = direct.read(objects, up_to=up_to)
        refused = all(got is REFUSED for got in out)
        rest = [i for i, got in enumerate(out) if got is FALLBACK or got is REFUSED]
        if rest:
            for i, got in zip(rest, self._cat([objects[i] for i in rest], up_to), strict=True):
                out[i] = got
        # s3fs found what the server refused the tier's own GETs
        self._judge(direct, refused and any(got is not None for got in out))
        return out

    def _direct_requests(self) -> DirectS3 | None:
        """The tier's own requests, where they are on."""
        with self._lock:
            if self._requests is _Requests.UNKNOWN:  # the client exists once the namespace
                self._direct = DirectS3.of(self.fs)  # was opened
                self._requests = _Requests.S3FS if self._direct is None else _Requests.DIRECT
            return self._direct if self._requests is _Requests.DIRECT else None

    def _judge(self, direct: DirectS3, refused: bool) -> None:
        """After ``REFUSED_JOBS`` jobs in a row whose own requests the server refused (a
        proxy that rejects their signature, say) while serving s3fs the same objects, every
        request goes through s3fs: one request per block, not two. Server errors and broken
        connections (a server restarting, throttling) do not count."""
        with self._lock:
            self._refused_jobs = self._refused_jobs + 1 if refused else 0
            if self._refused_jobs < REFUSED_JOBS or self._requests is not _Requests.DIRECT:
                return
            # the requests object stays open: another IO thread may be inside it
            self._requests = _Requests.S3FS
        log.warning(
            "s3_direct_requests_off", url=self.url, jobs=REFUSED_JOBS, last_refusal=direct.refusal
        )

    def _pipe(
        self,
        objects: Sequence[tuple[str, OffloadKey, memoryview]],
        records: Records | None,
    ) -> list[str | None]:
        """:meth:`put_objects` through one s3fs ``pipe``; after a failed batch, what landed
        counts as written."""
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

    def _cat(self, objects: Sequence[tuple[str, memoryview]], up_to: bool) -> list[bytes | None]:
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
            elif len(data) != HEADER_AREA + len(view) and not (
                up_to and HEADER_AREA < len(data) < HEADER_AREA + len(view)
            ):
                out.append(b"")
            else:
                view[: len(data) - HEADER_AREA] = memoryview(data)[HEADER_AREA:]  # one copy
                out.append(bytes(data[:HEADER_AREA]))
        return out

    def close(self) -> None:
        """Stop the direct requests' threads, if there are any."""
        with self._lock:
            if self._direct is not None:
                self._direct.close()


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
