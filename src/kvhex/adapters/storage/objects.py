"""Object-store tiers: one object per block through any fsspec filesystem (s3fs for S3), what
:class:`~kvhex.adapters.storage.fsspec.FsspecTierStore` uses on a non-local root.

Layout under the namespace prefix (see :mod:`kvhex.adapters.storage.format` for the block format)::

    config.json
    <k0k1>/<key hex>.blk

Object writes are single ``PUT``s, atomic by nature; every instance lists the namespace at
start-up.

Start-up (:meth:`ObjectIo.prepare`, :meth:`~ObjectIo.write_config`,
:meth:`~ObjectIo.inventory`) raises what the store raised, for the tier to name
(:func:`kvhex.adapters.storage.object_errors.start_up_error`); at run time a failed call is
a failed job whose error names the cause (:func:`~kvhex.adapters.storage.object_errors.job_error`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

from kvhex.adapters.storage.format import CONFIG, HEADER_AREA, Located, pack_header
from kvhex.adapters.storage.object_errors import job_error
from kvhex.domain.keys import OffloadKey

__all__ = ["SUFFIX", "ObjectIo"]

SUFFIX = ".blk"


def _key_from_hex(stem: str) -> OffloadKey | None:
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return OffloadKey(key) if len(key) > 4 and key.hex() == stem else None


def _object(key: OffloadKey, payload: memoryview) -> bytearray:
    """A block as one object: header area then payload, copied once."""
    data = bytearray(HEADER_AREA + len(payload))
    data[HEADER_AREA:] = payload
    data[:HEADER_AREA] = pack_header(key, payload)
    return data


class ObjectIo:
    """One object per block through any fsspec filesystem. Object stores get one concurrent
    batch of requests per job (``pipe``/``cat`` of many paths) and existence probes by
    listing where a listing is cheaper than one request per key."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root
        self.url = fs.unstrip_protocol(root)
        """The namespace as a URL (``s3://bucket/prefix/digest``), named in job errors."""

    def path(self, key: OffloadKey) -> str:
        h = key.hex()
        return f"{self.root}/{h[:2]}/{h}{SUFFIX}"

    def prepare(self) -> None:
        """Check that the bucket exists and the namespace can be listed (the tier lists it
        at start-up and on probes); never creates the bucket.

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

    def write_config(self, name: str, data: bytes) -> bytes | None:
        path = f"{self.root}/{name}"
        if self.fs.exists(path):
            return bytes(self.fs.cat_file(path))
        self.fs.pipe_file(path, data)
        return None

    def inventory(self) -> tuple[list[tuple[OffloadKey, float]], int]:
        found: list[tuple[OffloadKey, float]] = []
        foreign = 0
        for path, mtime in self._walk():
            name = path.rsplit("/", 1)[-1]
            if name == CONFIG:
                continue
            key = _key_from_hex(name[: -len(SUFFIX)]) if name.endswith(SUFFIX) else None
            if key is None or path != self.path(key):
                foreign += 1
                continue
            found.append((key, mtime))
        return found, foreign

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

    def write_many(
        self, items: list[tuple[OffloadKey, memoryview]], room: Sequence[Any] = ()
    ) -> list[str | None]:
        """PUT ``items`` as one concurrent batch; per item ``None`` or why it was not stored
        (``room`` is the slab IO's: an object store has no slots to reuse)."""
        if not items:
            return []
        payload = {self.path(key): _object(key, view) for key, view in items}
        try:
            self.fs.pipe(payload)
        except Exception as exc:
            # the batch is all or nothing from here: find out what actually landed
            error = job_error(exc, self.url)
            try:
                landed = self.exists_many([key for key, _ in items])
            except Exception:
                landed = set()
            return [None if key in landed else error for key, _ in items]
        return [None] * len(items)

    def read_many(self, items: list[tuple[OffloadKey, memoryview]]) -> list[bytes | None]:
        if not items:
            return []
        paths = [self.path(key) for key, _ in items]
        try:
            got = self.fs.cat(paths, on_error="return")
        except Exception as exc:
            raise OSError(job_error(exc, self.url)) from exc
        out: list[bytes | None] = []
        for path, (_, view) in zip(paths, items, strict=True):
            data = got.get(path)
            if data is None or isinstance(data, FileNotFoundError):
                out.append(None)
            elif isinstance(data, BaseException):
                raise OSError(job_error(data, self.url)) from data
            elif len(data) != HEADER_AREA + len(view):
                out.append(b"")
            else:
                view[:] = memoryview(data)[HEADER_AREA:]  # one copy, not two
                out.append(bytes(data[:HEADER_AREA]))
        return out

    def invalid(self, key: OffloadKey) -> bool:
        """A block failed verification: delete it (True)."""
        self.remove_many([key])
        return True

    def exists_many(self, keys: list[OffloadKey]) -> set[OffloadKey]:
        """Which of ``keys`` have a block.

        Raises:
            OSError: the store failed; the message names the cause.
        """
        by_path = {self.path(k): k for k in keys}
        try:
            found = self._exists_paths(list(by_path))
        except Exception as exc:
            raise OSError(job_error(exc, self.url)) from exc
        return {by_path[p] for p in found}

    def _exists_paths(self, paths: list[str]) -> set[str]:
        by_prefix: dict[str, list[str]] = {}
        for path in paths:
            by_prefix.setdefault(path.rsplit("/", 1)[0], []).append(path)
        found: set[str] = set()
        for prefix, wanted in by_prefix.items():
            if len(wanted) > 1:  # one LIST answers every key under this shard
                try:
                    listed = set(self.fs.find(prefix))
                except FileNotFoundError:
                    listed = set()
                found.update(p for p in wanted if p in listed)
            else:
                found.update(p for p in wanted if self.fs.exists(p))
        return found

    def remove_many(self, keys: Sequence[OffloadKey], *, defer: bool = False) -> list[Any]:
        """Delete the blocks of ``keys`` in one batch (one bulk request on S3). ``defer`` is
        accepted for the slab IO's sake: an object is gone once deleted, no room to reuse."""
        self._remove_paths([self.path(key) for key in keys])
        return []

    def _remove_paths(self, paths: list[str]) -> None:
        if not paths:
            return
        try:
            self.fs.rm(paths)
        except FileNotFoundError:  # some were gone already: delete the rest one by one
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)

    def location(self, key: OffloadKey) -> Located:
        return self.path(key), 0

    def close(self) -> None:
        """Nothing held."""
