"""``ObjectIo``: one object per block through any fsspec filesystem (s3fs for S3), the
:class:`~kvhex.adapters.storage.block_io.BlockIo` of the fsspec and NIXL tiers on an
``s3://`` root.

Layout under the namespace prefix (see :mod:`kvhex.adapters.storage.format` for the block
format)::

    config.json
    <k0k1>/<key hex>.blk     the whole block: header area, then payload

Object writes are single ``PUT``s, atomic by nature; every instance lists the namespace at
start-up (and reads the listed blocks' chunk records after it, a ranged ``GET`` of each
header area: :meth:`ObjectIo.read_records`), and, for a tier's peer view, whenever it scans
(:meth:`ObjectIo.peer_keys`). The bytes move through a mover
(:class:`~kvhex.adapters.storage.objects.mover.FsspecObjectMover` by default, NIXL's
``NixlObjectMover`` on the NIXL tier).

The store, not this instance, is the truth about what exists (anyone with access may delete
objects, a server may lose them): the tier checks what its index lists against it on probes
and puts (``exclusive`` is false). A namespace whose ``config.json`` vanished with every
block was emptied, and a bucket that no longer exists holds nothing: both raise
:class:`~kvhex.adapters.storage.block_io.StoreLost`, and the tier announces every block gone.
One whose ``config.json`` alone went (a lifecycle rule expired it) gets it back, and the tier
drops what a listing of the namespace lacks
(:class:`~kvhex.adapters.storage.block_io.NamespaceRecord`).

Errors: start-up raises what the store raised, for the tier to name
(:func:`~kvhex.adapters.storage.namespace.open_namespace`); at run time a failed call is a
failed job whose error names the cause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

from kvhex.adapters.storage.block_io import (
    Inventory,
    Located,
    NamespaceConflict,
    NamespaceRecord,
    ObjectMover,
    Records,
)
from kvhex.adapters.storage.format import CONFIG, HEADER_AREA, Verdict, holds_key, verify
from kvhex.adapters.storage.objects._errors import store_error
from kvhex.adapters.storage.objects.mover import FsspecObjectMover, exists_paths
from kvhex.adapters.storage.records import RecordOpener, header_record
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import ChunkRecord

SUFFIX = ".blk"


def _key_from_hex(stem: str) -> OffloadKey | None:
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return OffloadKey(key) if len(key) > 4 and key.hex() == stem else None


class ObjectIo:
    """One object per block under the namespace prefix ``root`` of the filesystem ``fs``.
    The bucket is checked, ``config.json`` written or compared, and the namespace listed at
    construction; the bucket is never created.

    Args:
        fs: an fsspec filesystem (s3fs for S3).
        root: ``bucket/prefix/<namespace digest>``.
        config: what ``config.json`` must record.
        mover: copies blocks into and out of objects (default: s3fs batches,
            :class:`FsspecObjectMover`).

    Raises:
        NamespaceConflict: ``config.json`` records another configuration.
        Exception: what the store raised (a missing bucket, credentials, an endpoint down).
    """

    exclusive = False
    """Anyone with access may delete objects: the store is the truth."""
    records_by_request = True
    """A block's chunk record costs a ranged GET."""

    def __init__(
        self,
        fs: Any,
        root: str,
        *,
        config: bytes,
        mover: ObjectMover | None = None,
        records_opener: RecordOpener | None = None,
    ) -> None:
        self.fs = fs
        self._open_record = records_opener
        self.root = root
        self.url = fs.unstrip_protocol(root)
        """The namespace as a URL (``s3://bucket/prefix/digest``), named in job errors."""
        self.config = config
        self.mover: ObjectMover = mover or FsspecObjectMover(fs, self.url)
        self._record = NamespaceRecord(self._namespace_intact, self.peer_keys, self.url)
        self._check_bucket()
        recorded = self._write_config()
        if recorded is not None and recorded != config:
            raise NamespaceConflict(recorded)
        self._inventory = self._list()

    def path(self, key: OffloadKey) -> str:
        """The object of ``key``'s block."""
        h = key.hex()
        return f"{self.root}/{h[:2]}/{h}{SUFFIX}"

    # -- start-up ------------------------------------------------------------------------
    def _check_bucket(self) -> None:
        """The bucket exists and the namespace can be listed.

        Raises:
            FileNotFoundError: the bucket does not exist.
            Exception: what the store raised (s3fs: a built-in error whose chain holds
                botocore's error code or the connection error).
        """
        bucket, _, prefix = self.root.partition("/")
        call_s3 = getattr(self.fs, "call_s3", None)
        if call_s3 is not None:
            # s3fs: one small listing, whose error names its cause (a HEAD's error has no
            # body, and `exists` answers False whatever went wrong)
            call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix + "/", MaxKeys=1)
        elif not self.fs.exists(bucket):
            raise FileNotFoundError(f"bucket or root {bucket!r} does not exist")

    def _write_config(self) -> bytes | None:
        path = f"{self.root}/{CONFIG}"
        if self.fs.exists(path):
            return bytes(self.fs.cat_file(path))
        self.fs.pipe_file(path, self.config)
        return None

    def _list(self) -> Inventory:
        found: list[tuple[float, OffloadKey]] = []
        foreign = 0
        for path, mtime in self._walk():
            key = self._key_of(path)
            if key is None:
                if path.rsplit("/", 1)[-1] != CONFIG:
                    foreign += 1
                continue
            found.append((mtime, key))
        found.sort(key=lambda f: f[0])
        return Inventory([key for _, key in found], foreign)

    def _key_of(self, path: str) -> OffloadKey | None:
        """The key whose block ``path`` is, or ``None`` (``config.json``, a foreign one)."""
        name = path.rsplit("/", 1)[-1]
        key = _key_from_hex(name[: -len(SUFFIX)]) if name.endswith(SUFFIX) else None
        return key if key is not None and path == self.path(key) else None

    def _walk(self) -> Iterable[tuple[str, float]]:
        try:
            listing = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return
        for path, info in listing.items():
            mtime = info.get("mtime") or info.get("LastModified") or 0.0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            yield path, float(mtime)

    def inventory(self) -> Inventory:
        """The blocks listed at start-up, oldest first, and the foreign objects seen."""
        return self._inventory

    # -- BlockIo -------------------------------------------------------------------------
    def write_many(
        self,
        items: Sequence[tuple[OffloadKey, memoryview]],
        evict: Sequence[OffloadKey] = (),
        records: Records | None = None,
    ) -> list[str | None]:
        """Delete the victims (one bulk request), then PUT ``items`` (with their chunk
        ``records`` in their headers) as one concurrent batch; per item ``None`` or why it
        was not stored."""
        if evict:
            self.remove_many(evict)
        if not items:
            return []
        errors = self.mover.put_objects([(self.path(k), k, v) for k, v in items], records)
        if any(e is not None for e in errors):
            self._record.check()
        return errors

    def read_many(
        self, items: Sequence[tuple[OffloadKey, memoryview]], *, up_to: bool = False
    ) -> list[Verdict]:
        """GET and verify each block (one concurrent batch), up to each view's length with
        ``up_to``."""
        if not items:
            return []
        headers = self.mover.get_objects([(self.path(k), v) for k, v in items], up_to=up_to)
        verdicts = [verify(h, k, v, up_to=up_to) for h, (k, v) in zip(headers, items, strict=True)]
        if Verdict.MISSING in verdicts:
            self._record.check()
        return verdicts

    def exists_many(self, keys: Sequence[OffloadKey]) -> set[OffloadKey]:
        """Which of ``keys`` have a block (one listing per shard of several keys).

        Raises:
            StoreLost: the bucket or the namespace is gone.
            OSError: the store failed; the message names the cause.
        """
        by_path = {self.path(k): k for k in keys}
        try:
            found = exists_paths(self.fs, list(by_path))
        except Exception as exc:
            raise store_error(exc, self.url) from exc
        if len(found) < len(by_path):
            self._record.check()
        return {by_path[p] for p in found}

    def read_records(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, ChunkRecord | None]:
        """The chunk record kept in each key's object: a ranged GET of its header area per
        object, all of them concurrently (one s3fs ``cat_ranges``). Keys without an object
        (or whose object is not a block of theirs) are left out.

        Raises:
            StoreLost: the bucket is gone.
            OSError: the store failed; the message names the cause.
        """
        if not keys:
            return {}
        paths = [self.path(k) for k in keys]
        try:
            got = self.fs.cat_ranges(paths, 0, HEADER_AREA, on_error="return")
        except Exception as exc:
            raise store_error(exc, self.url) from exc
        out: dict[OffloadKey, ChunkRecord | None] = {}
        for key, header in zip(keys, got, strict=True):
            if isinstance(header, FileNotFoundError):
                continue
            if isinstance(header, BaseException):
                raise store_error(header, self.url) from header
            if holds_key(header, key):
                out[key] = header_record(header, key, self._open_record)
        return out

    def peer_keys(self) -> set[OffloadKey]:
        """Every key listed under the namespace now (this instance's included: on an object
        store a block belongs to no one instance).

        Raises:
            OSError: the listing failed; the message names the cause.
        """
        try:
            return {key for path, _ in self._walk() if (key := self._key_of(path)) is not None}
        except Exception as exc:
            raise store_error(exc, self.url) from exc

    def take_listings(self) -> list[frozenset[OffloadKey]]:
        """(Scheduler thread.) Listings taken after ``config.json`` alone had gone (a
        lifecycle rule expired it): :class:`~kvhex.adapters.storage.block_io.Relisting`."""
        return self._record.take_listings()

    def remove_many(self, keys: Sequence[OffloadKey]) -> None:
        """Delete the blocks of ``keys`` in one batch (one bulk request on S3)."""
        paths = [self.path(key) for key in keys]
        if not paths:
            return
        try:
            self.fs.rm(paths)
        except FileNotFoundError:  # some were gone already: delete the rest one by one
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)

    def location(self, key: OffloadKey) -> Located:
        """The object of ``key``'s block; its header is at offset 0."""
        return self.path(key), 0

    def close(self) -> None:
        """Release the mover."""
        self.mover.close()

    def _namespace_intact(self) -> bool:
        """Whether ``config.json`` is still there (an emptied namespace or a deleted bucket
        has lost every block). A namespace found emptied gets its ``config.json`` back, so
        later puts land in a valid namespace.

        Raises:
            StoreLost: the bucket is gone.
        """
        path = f"{self.root}/{CONFIG}"
        try:
            if self.fs.exists(path):
                return True
            self.fs.pipe_file(path, self.config)
        except Exception as exc:
            raise store_error(exc, self.url) from exc
        return False
