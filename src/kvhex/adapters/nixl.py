"""A secondary tier whose bytes move through NIXL: the POSIX backend (files) or the OBJ
backend (an S3-compatible object store).

The bookkeeping (namespace layout, checksummed blocks, LRU capacity with announced
evictions, restart recovery, sharing, integrity checks on every read) is the fsspec tier's;
only the data path differs: block payloads go host slot -> file or object and back as NIXL
transfers, one transfer per job with one descriptor per block (kept under 1 GiB, NIXL's
POSIX backend fails transfers of 2 GiB).

* POSIX: blocks live in the fsspec tier's slab files; NIXL writes each payload at its slot
  (one transfer per job), then the header is written and the job's blocks are published in
  the shared index, so no torn block is ever found.
* OBJ: each block is two objects, the payload (written by NIXL) and then its header
  (``<block>.hdr``: checksum and key, written by NIXL from a small staging buffer). The header
  is written last, so a block exists only once both are complete. Listing and deletes, which
  NIXL does not offer, go through s3fs on the same bucket.

Works CPU-only with ``nixl==1.5.1``; the API module is ``nixl_cu12`` (the ``nixl_cu13`` build
that ``import nixl`` picks on CPU cannot load the OBJ plugin).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from kvhex.adapters.fsspec import (
    HEADER_AREA,
    FsspecTierStore,
    _ObjectIo,
    _SlabIo,
    pack_header,
)
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality, Medium
from kvhex.ports.host_buffer import HostBuffer

__all__ = ["NixlTierStore"]

MAX_TRANSFER_BYTES = 1 << 30


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Agent:
    """One NIXL agent with one backend and the host slots registered as DRAM."""

    def __init__(
        self, name: str, backend: str, params: Mapping[str, str], host: HostBuffer
    ) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.name = f"kvhex-{name}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=[]))
        self.agent.create_backend(backend, dict(params))
        self.host = host
        self.addresses = [_address(host.slot_view(s)) for s in range(host.num_slots)]
        if self.addresses:
            self.dram = self.agent.register_memory(
                [(a, host.slot_bytes, 0, "") for a in self.addresses], "DRAM"
            )
        self._lock = threading.Lock()

    def transfer(
        self,
        op: str,
        local: list[tuple[int, int, int]],
        mem_type: str,
        remote_reg: list[tuple[int, int, int, str]],
    ) -> bool:
        """One transfer of many descriptors; True when NIXL reports DONE."""
        return self.finish(self.start(op, local, mem_type, remote_reg))

    def start(
        self,
        op: str,
        local: list[tuple[int, int, int]],
        mem_type: str,
        remote_reg: list[tuple[int, int, int, str]],
    ) -> tuple[Any, Any, str]:
        """Post a transfer; the backend runs it on its own threads (no GIL held)."""
        agent = self.agent
        with self._lock:
            reg = agent.register_memory(remote_reg, mem_type)
            try:
                local_descs = agent.get_xfer_descs(local, "DRAM")
                remote_descs = agent.get_xfer_descs([r[:3] for r in remote_reg], mem_type)
                handle = agent.initialize_xfer(op, local_descs, remote_descs, self.name)
                state = agent.transfer(handle)
            except BaseException:
                agent.deregister_memory(reg)
                raise
        return handle, reg, state

    def finish(self, posted: tuple[Any, Any, str]) -> bool:
        """Wait for a posted transfer, release it; True when NIXL reports DONE."""
        agent = self.agent
        handle, reg, state = posted
        try:
            # the lock is not held while the backend works: other jobs' transfers overlap
            while state in ("PROC", "INIT"):
                time.sleep(0.0002)
                with self._lock:
                    state = agent.check_xfer_state(handle)
            return bool(state == "DONE")
        finally:
            with self._lock:
                agent.release_xfer_handle(handle)
                agent.deregister_memory(reg)

    def slot_of(self, view: memoryview) -> int:
        return _address(view)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.addresses:
                self.agent.deregister_memory(self.dram)


def _chunks(items: list[Any], size_of: Any) -> Iterator[list[Any]]:
    batch: list[Any] = []
    total = 0
    for item in items:
        size = size_of(item)
        if batch and total + size > MAX_TRANSFER_BYTES:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size
    if batch:
        yield batch


class _NixlPosixIo(_SlabIo):
    """Slab files whose payloads NIXL's POSIX backend writes and reads (headers with
    ``os.pwrite``/``os.pread``, after the payload on writes)."""

    def __init__(self, root: str, slot_size: int, max_slots: int, agent: _Agent) -> None:
        super().__init__(root, slot_size, max_slots, fsync=False)
        self.nixl = agent

    def _write_blocks(
        self, blocks: list[tuple[int, int, OffloadKey, memoryview]]
    ) -> list[str | None]:
        errors: list[str | None] = []
        for batch in _chunks(blocks, lambda b: len(b[3])):
            local = [(self.nixl.slot_of(payload), len(payload), 0) for _, _, _, payload in batch]
            remote = [(off + HEADER_AREA, len(p), fd, "") for fd, off, _, p in batch]
            posted = self.nixl.start("WRITE", local, "FILE", remote)
            # checksums while NIXL writes the same (pinned, unchanging) bytes
            headers = [pack_header(key, payload) for _, _, key, payload in batch]
            if not self.nixl.finish(posted):
                errors.extend("NIXL POSIX write failed" for _ in batch)
                continue
            for (fd, offset, _, _), header in zip(batch, headers, strict=True):
                try:
                    os.pwrite(fd, header, offset)
                    errors.append(None)
                except OSError as exc:
                    errors.append(f"{type(exc).__name__}: {exc.strerror or exc}")
        return errors

    def _read_blocks(
        self, blocks: list[tuple[tuple[int, int] | None, memoryview]]
    ) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(blocks)
        todo: list[tuple[int, int, int, memoryview]] = []  # index, fd, offset, view
        for i, (place, view) in enumerate(blocks):
            if place is None:
                continue
            fd, offset = place
            if os.fstat(fd).st_size < offset + HEADER_AREA + len(view):
                out[i] = b""  # truncated: corrupt
                continue
            out[i] = os.pread(fd, HEADER_AREA, offset)
            todo.append((i, fd, offset, view))
        for batch in _chunks(todo, lambda t: len(t[3])):
            local = [(self.nixl.slot_of(v), len(v), 0) for _, _, _, v in batch]
            remote = [(off + HEADER_AREA, len(v), fd, "") for _, fd, off, v in batch]
            if not self.nixl.transfer("READ", local, "FILE", remote):
                for i, _, _, _ in batch:
                    out[i] = b""
        return out

    def close(self) -> None:
        super().close()
        self.nixl.close()


class _NixlObjIo(_ObjectIo):
    """Objects written and read by NIXL's OBJ backend; s3fs lists and deletes."""

    def __init__(self, fs: Any, root: str, agent: _Agent, bucket: str) -> None:
        super().__init__(fs, root)
        self.nixl = agent
        self.bucket = bucket
        self._staging_lock = threading.Lock()

    def _object(self, path: str) -> str:
        return path[len(self.bucket) + 1 :]

    def write_many(self, items: list[tuple[OffloadKey, memoryview]]) -> list[str | None]:
        errors: list[str | None] = []
        for key, view in items:
            header = pack_header(key, view)
            # payload first, header last: a block is readable only once both exist
            path = self.path(key)
            ok = self.nixl.transfer(
                "WRITE",
                [(self.nixl.slot_of(view), len(view), 0)],
                "OBJ",
                [(0, len(view), 1, self._object(path))],
            ) and self._put_small(path + ".hdr", header)
            errors.append(None if ok else "NIXL OBJ write failed")
        return errors

    def _put_small(self, path: str, data: bytes) -> bool:
        buf = bytearray(data)
        view = memoryview(buf)
        with self._staging_lock:
            reg = self.nixl.agent.register_memory([(_address(view), len(buf), 0, "")], "DRAM")
            try:
                return self.nixl.transfer(
                    "WRITE",
                    [(_address(view), len(buf), 0)],
                    "OBJ",
                    [(0, len(buf), 1, self._object(path))],
                )
            finally:
                self.nixl.agent.deregister_memory(reg)

    def read_many(self, items: list[tuple[OffloadKey, memoryview]]) -> list[bytes | None]:
        paths = [self.path(key) for key, _ in items]
        headers = self.fs.cat([p + ".hdr" for p in paths], on_error="return")
        out: list[bytes | None] = []
        for path, (_, view) in zip(paths, items, strict=True):
            header = headers.get(path + ".hdr")
            if header is None or isinstance(header, FileNotFoundError):
                out.append(None)
                continue
            if isinstance(header, BaseException) or len(header) != HEADER_AREA:
                out.append(b"")
                continue
            ok = self.nixl.transfer(
                "READ",
                [(self.nixl.slot_of(view), len(view), 0)],
                "OBJ",
                [(0, len(view), 1, self._object(path))],
            )
            out.append(bytes(header) if ok else b"")
        return out

    def _exists_paths(self, paths: list[str]) -> set[str]:
        headers = {p + ".hdr": p for p in paths}
        return {headers[h] for h in super()._exists_paths(list(headers))}

    def remove_many(self, keys: Sequence[OffloadKey], *, defer: bool = False) -> None:
        paths = [self.path(key) for key in keys]
        self._remove_paths([p + ".hdr" for p in paths])  # headers first: gone at once
        self._remove_paths(paths)

    def _walk(self) -> Iterable[tuple[str, float]]:
        for path, mtime in super()._walk():
            if not path.endswith(".hdr"):  # a header belongs to its block
                yield path, mtime

    def close(self) -> None:
        self.nixl.close()


class NixlTierStore(FsspecTierStore):
    """A tier moving bytes with NIXL.

    Args:
        host, capacity_bytes, name, namespace, medium, locality, io_threads: as for
            :class:`~kvhex.adapters.fsspec.FsspecTierStore`.
        url: a local directory (POSIX backend) or ``s3://bucket/prefix`` (OBJ backend).
        endpoint_url, access_key, secret_key, region: the object store (OBJ only); the
            bucket must exist.
    """

    def __init__(
        self,
        host: HostBuffer,
        url: str,
        *,
        capacity_bytes: int,
        name: str = "nixl",
        namespace: Mapping[str, Any] | None = None,
        medium: Medium = Medium.STORAGE,
        locality: Locality | None = Locality.LOCAL,
        io_threads: int = 4,
        endpoint_url: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
    ) -> None:
        self._obj = url.startswith("s3://")
        self._obj_params = {
            "access_key": access_key or "",
            "secret_key": secret_key or "",
            "bucket": url[5:].split("/", 1)[0] if self._obj else "",
            "endpoint_override": endpoint_url or "",
            "scheme": (endpoint_url or "https://").split("://", 1)[0],
            "region": region,
            "use_virtual_addressing": "false",
            "req_checksum": "supported",
        }
        options: dict[str, Any] = {}
        if self._obj:
            options = {
                "key": access_key,
                "secret": secret_key,
                "endpoint_url": endpoint_url,
                "use_listings_cache": False,
                "skip_instance_cache": True,
            }
        super().__init__(
            host,
            url,
            capacity_bytes=capacity_bytes,
            name=name,
            namespace=namespace,
            medium=medium,
            locality=locality,
            io_threads=io_threads,
            storage_options=options,
        )

    def _make_io(self, fs: Any, base: str) -> Any:
        if self._obj:
            agent = _Agent(self._name, "OBJ", self._obj_params, self._host)
            return _NixlObjIo(fs, base, agent, self._obj_params["bucket"])
        slot_size, max_slots = self._slab_geometry()
        return _NixlPosixIo(base, slot_size, max_slots, _Agent(self._name, "POSIX", {}, self._host))
