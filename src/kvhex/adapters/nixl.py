"""A secondary tier whose bytes move through NIXL: the POSIX backend (files) or the OBJ
backend (an S3-compatible object store).

The bookkeeping (namespace layout, checksummed blocks, LRU capacity with announced
evictions, restart recovery, sharing, integrity checks on every read) is the fsspec tier's;
only the data path differs: block payloads go host slot -> file or object and back as NIXL
transfers, one transfer per job with one descriptor per block (kept under 1 GiB, NIXL's
POSIX backend fails transfers of 2 GiB).

* POSIX: a block file is written under ``tmp/`` (header with ``os.pwrite``, payload by NIXL
  at the header's end) and renamed into place, so no torn block is ever readable.
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
from collections.abc import Iterator, Mapping
from typing import Any

from kvhex.adapters.fsspec import FsspecTierStore, _FsspecIo, _LocalIo
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
        agent = self.agent
        with self._lock:
            reg = agent.register_memory(remote_reg, mem_type)
            try:
                local_descs = agent.get_xfer_descs(local, "DRAM")
                remote_descs = agent.get_xfer_descs([r[:3] for r in remote_reg], mem_type)
                handle = agent.initialize_xfer(op, local_descs, remote_descs, self.name)
                try:
                    state = agent.transfer(handle)
                    while state in ("PROC", "INIT"):
                        time.sleep(0.0002)
                        state = agent.check_xfer_state(handle)
                    return state == "DONE"
                finally:
                    agent.release_xfer_handle(handle)
            finally:
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


class _NixlPosixIo(_LocalIo):
    """Local block files whose payload NIXL's POSIX backend writes and reads."""

    def __init__(self, root: str, agent: _Agent) -> None:
        super().__init__(root)
        self.nixl = agent

    def write_many(self, items: list[tuple[str, list[bytes | memoryview]]]) -> list[str | None]:
        errors: list[str | None] = []
        for batch in _chunks(items, lambda it: len(it[1][1])):
            errors.extend(self._write_batch(batch))
        return errors

    def _write_batch(self, items: list[tuple[str, list[bytes | memoryview]]]) -> list[str | None]:
        opened: list[tuple[str, str, int, int, int]] = []  # path, tmp, fd, header, length
        try:
            for path, (header, payload) in items:
                self.ensure_dir(path)
                tmp, recycled = self.take()
                flags = os.O_RDWR if recycled else os.O_RDWR | os.O_CREAT | os.O_EXCL
                fd = os.open(tmp, flags, 0o600)
                opened.append((path, tmp, fd, len(header), len(payload)))
                os.pwrite(fd, header, 0)
                if os.fstat(fd).st_size != len(header) + len(payload):
                    os.ftruncate(fd, len(header) + len(payload))
            local = [
                (self.nixl.slot_of(memoryview(payload)), len(payload), 0)
                for _, (_, payload) in items
            ]
            remote = [(hdr, length, fd, "") for _, _, fd, hdr, length in opened]
            ok = self.nixl.transfer("WRITE", local, "FILE", remote)
        except OSError as exc:
            ok = False
            error: str | None = f"{type(exc).__name__}: {exc.strerror or exc}"
        else:
            error = None if ok else "NIXL POSIX write failed"
        for path, tmp, fd, _, _ in opened:
            os.close(fd)
            if ok:
                os.replace(tmp, path)
            else:
                os.unlink(tmp)
        return [None if ok else error for _ in items]

    def read_many(self, items: list[tuple[str, int, memoryview]]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(items)
        todo: list[tuple[int, int, int, memoryview]] = []  # index, fd, header size, view
        try:
            for i, (path, header_size, view) in enumerate(items):
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    continue
                if os.fstat(fd).st_size != header_size + len(view):
                    os.close(fd)
                    out[i] = b""  # truncated or foreign: corrupt
                    continue
                out[i] = os.pread(fd, header_size, 0)
                todo.append((i, fd, header_size, view))
            if todo:
                local = [(self.nixl.slot_of(v), len(v), 0) for _, _, _, v in todo]
                remote = [(h, len(v), fd, "") for _, fd, h, v in todo]
                if not self.nixl.transfer("READ", local, "FILE", remote):
                    for i, _, _, _ in todo:
                        out[i] = b""
        finally:
            for _, fd, _, _ in todo:
                os.close(fd)
        return out

    def close(self) -> None:
        self.nixl.close()


class _NixlObjIo(_FsspecIo):
    """Objects written and read by NIXL's OBJ backend; s3fs lists and deletes."""

    def __init__(self, fs: Any, root: str, agent: _Agent, bucket: str) -> None:
        super().__init__(fs, root)
        self.nixl = agent
        self.bucket = bucket
        self._staging_lock = threading.Lock()

    def _key(self, path: str) -> str:
        return path[len(self.bucket) + 1 :]

    def write_many(self, items: list[tuple[str, list[bytes | memoryview]]]) -> list[str | None]:
        errors: list[str | None] = []
        for path, (header, payload) in items:
            # payload first, header last: a block is readable only once both exist
            view = memoryview(payload)
            ok = self.nixl.transfer(
                "WRITE",
                [(self.nixl.slot_of(view), len(view), 0)],
                "OBJ",
                [(0, len(view), 1, self._key(path))],
            ) and self._put_small(path + ".hdr", bytes(header))
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
                    [(0, len(buf), 1, self._key(path))],
                )
            finally:
                self.nixl.agent.deregister_memory(reg)

    def read_many(self, items: list[tuple[str, int, memoryview]]) -> list[bytes | None]:
        headers = self.fs.cat([p + ".hdr" for p, _, _ in items], on_error="return")
        out: list[bytes | None] = []
        for path, header_size, view in items:
            header = headers.get(path + ".hdr")
            if header is None or isinstance(header, FileNotFoundError):
                out.append(None)
                continue
            if isinstance(header, BaseException) or len(header) != header_size:
                out.append(b"")
                continue
            ok = self.nixl.transfer(
                "READ",
                [(self.nixl.slot_of(view), len(view), 0)],
                "OBJ",
                [(0, len(view), 1, self._key(path))],
            )
            out.append(bytes(header) if ok else b"")
        return out

    def exists_many(self, paths: list[str]) -> set[str]:
        headers = {p + ".hdr": p for p in paths}
        return {headers[h] for h in super().exists_many(list(headers))}

    def remove(self, path: str) -> None:
        for name in (path + ".hdr", path):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(name)

    def walk(self) -> Iterator[tuple[str, int, float]]:
        for path, size, mtime in super().walk():
            if not path.endswith(".hdr"):  # a header belongs to its block
                yield path, size, mtime

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
        return _NixlPosixIo(base, _Agent(self._name, "POSIX", {}, self._host))
