"""A secondary tier whose bytes move through NIXL: the POSIX backend (files) or the OBJ
backend (an S3-compatible object store).

The bookkeeping (namespace layout, checksummed blocks, LRU capacity with announced
evictions, restart recovery, sharing, integrity checks on every read) is the fsspec tier's;
only the data path differs: blocks go host slot -> file or object and back as NIXL
transfers. Each IO thread has its own NIXL agent (agents are not thread-safe), so transfers
of concurrent jobs run side by side without a lock.

* POSIX: blocks live in the fsspec tier's slab files (registered with NIXL once each). One
  transfer per job (kept under 1 GiB: NIXL's POSIX backend fails transfers of 2 GiB) moves
  every block's header, from the agent's staging area, and payload, from its host slot;
  the job's blocks are then published in the shared index, so no torn block is ever found
  (a block cut short fails its checksum and was never published).
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from kvhex.adapters.storage.files.slabs import SlabIo
from kvhex.adapters.storage.format import HEADER_AREA, pack_header
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.adapters.storage.objects import ObjectIo
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality, Medium
from kvhex.ports.host_buffer import HostBuffer

__all__ = ["NixlTierStore"]

MAX_TRANSFER_BYTES = 1 << 30
STAGED_HEADERS = 256
"""Block headers one transfer moves through an agent's staging area (1 MiB of it)."""


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Agent:
    """One NIXL agent with one backend: the host slots and a staging area for block headers
    registered as DRAM, files registered once each. NIXL agents are not thread-safe, so each
    IO thread has its own (:class:`_Agents`) and no lock is held while a transfer runs."""

    def __init__(
        self, name: str, backend: str, params: Mapping[str, str], host: HostBuffer
    ) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.name = f"kvhex-{name}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=[]))
        self.agent.create_backend(backend, dict(params))
        self.registered: list[Any] = []
        if host.num_slots:
            slots = [_address(host.slot_view(s)) for s in range(host.num_slots)]
            self._register([(a, host.slot_bytes, 0, "") for a in slots], "DRAM")
        self.staging = bytearray(STAGED_HEADERS * HEADER_AREA)
        self.staging_at = _address(memoryview(self.staging))
        self._register([(self.staging_at, len(self.staging), 0, "")], "DRAM")
        self._files: set[int] = set()

    def _register(self, regions: list[tuple[int, int, int, str]], mem_type: str) -> Any:
        reg = self.agent.register_memory(regions, mem_type)
        self.registered.append(reg)
        return reg

    def register_file(self, fd: int) -> None:
        """Make every byte of the open file ``fd`` addressable (once per file)."""
        if fd not in self._files:
            self._register([(0, os.fstat(fd).st_size, fd, "")], "FILE")
            self._files.add(fd)

    def header(self, i: int) -> int:
        """Address of staging slot ``i`` (one header area)."""
        return self.staging_at + i * HEADER_AREA

    def start(
        self, op: str, local: list[tuple[int, int, int]], mem_type: str, remote: list[Any]
    ) -> Any:
        """Post a transfer of registered memory; the backend runs it on its own threads."""
        agent = self.agent
        handle = agent.initialize_xfer(
            op,
            agent.get_xfer_descs(local, "DRAM"),
            agent.get_xfer_descs(remote, mem_type),
            self.name,
        )
        try:
            state = agent.transfer(handle)
        except BaseException:
            agent.release_xfer_handle(handle)
            raise
        return handle, state

    def finish(self, posted: Any) -> bool:
        """Wait for a posted transfer and release it; True when NIXL reports DONE."""
        handle, state = posted
        agent = self.agent
        try:
            waits = 0
            while state in ("PROC", "INIT"):
                # naps from 10 us doubling up to 0.2 ms: a short job is seen done soon after
                # its last byte, a long one costs few checks, and no core is spun
                time.sleep(min(0.0002, 0.00001 * 2**waits))
                waits += 1
                state = agent.check_xfer_state(handle)
            return bool(state == "DONE")
        finally:
            agent.release_xfer_handle(handle)

    def transfer(
        self, op: str, local: list[tuple[int, int, int]], mem_type: str, remote: list[Any]
    ) -> bool:
        """One transfer, waited for; True when NIXL reports DONE."""
        return self.finish(self.start(op, local, mem_type, remote))

    def transfer_objects(
        self, op: str, local: list[tuple[int, int, int]], objects: list[tuple[int, str]]
    ) -> bool:
        """One transfer between DRAM and whole objects (length, object key), registered for
        this transfer only."""
        reg = self.agent.register_memory([(0, n, 1, name) for n, name in objects], "OBJ")
        try:
            return self.transfer(op, local, "OBJ", [(0, n, 1) for n, _ in objects])
        finally:
            self.agent.deregister_memory(reg)

    def close(self) -> None:
        for reg in reversed(self.registered):
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg)
        self.registered.clear()


class _Agents:
    """One :class:`_Agent` per IO thread, made on first use; the first is made at start-up
    (so a backend that cannot load fails there) and handed to the first thread that asks."""

    def __init__(self, make: Callable[[], _Agent]) -> None:
        self._make = make
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all = [make()]
        self._spare = list(self._all)

    def get(self) -> _Agent:
        agent: _Agent | None = getattr(self._local, "agent", None)
        if agent is None:
            with self._lock:
                agent = self._spare.pop() if self._spare else None
            if agent is None:
                agent = self._make()
                with self._lock:
                    self._all.append(agent)
            self._local.agent = agent
        return agent

    def close(self) -> None:
        with self._lock:
            for agent in self._all:
                agent.close()
            self._all.clear()
            self._spare.clear()


def _chunks(items: list[Any], size_of: Callable[[Any], int]) -> Iterator[list[Any]]:
    """``items`` in batches of under 1 GiB (NIXL's POSIX backend fails a 2 GiB transfer) and
    at most ``STAGED_HEADERS`` blocks."""
    batch: list[Any] = []
    total = 0
    for item in items:
        size = size_of(item)
        if batch and (total + size > MAX_TRANSFER_BYTES or len(batch) == STAGED_HEADERS):
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size
    if batch:
        yield batch


class _NixlPosixIo(SlabIo):
    """Slab files whose blocks NIXL's POSIX backend writes and reads: one transfer per job
    (per 1 GiB, per ``STAGED_HEADERS`` blocks) moves every header and payload, the headers
    through the agent's staging area."""

    def __init__(
        self, root: str, slot_size: int, max_slots: int, agents: _Agents, stripes: int
    ) -> None:
        super().__init__(root, slot_size, max_slots, fsync=False, stripes=stripes)
        self.agents = agents

    def _write_blocks(
        self, blocks: list[tuple[int, int, OffloadKey, memoryview]]
    ) -> list[str | None]:
        nixl = self.agents.get()
        errors: list[str | None] = []
        for batch in _chunks(blocks, lambda b: HEADER_AREA + len(b[3])):
            local: list[tuple[int, int, int]] = []
            remote: list[tuple[int, int, int]] = []
            for i, (fd, offset, key, payload) in enumerate(batch):
                nixl.register_file(fd)
                nixl.staging[i * HEADER_AREA : (i + 1) * HEADER_AREA] = pack_header(key, payload)
                local += ((nixl.header(i), HEADER_AREA, 0), (_address(payload), len(payload), 0))
                remote += ((offset, HEADER_AREA, fd), (offset + HEADER_AREA, len(payload), fd))
            try:
                ok = nixl.transfer("WRITE", local, "FILE", remote)
            except Exception as exc:  # NIXL refused the transfer (its errors, one place)
                errors.extend(f"NIXL POSIX write failed: {exc}" for _ in batch)
                continue
            errors.extend(None if ok else "NIXL POSIX write failed" for _ in batch)
        return errors

    def _read_blocks(
        self, blocks: list[tuple[tuple[int, int] | None, memoryview]]
    ) -> list[bytes | None]:
        nixl = self.agents.get()
        out: list[bytes | None] = [None] * len(blocks)
        sizes: dict[int, int] = {}
        todo: list[tuple[int, int, int, memoryview]] = []  # index, fd, offset, view
        for i, (place, view) in enumerate(blocks):
            if place is None:
                continue
            fd, offset = place
            if fd not in sizes:
                sizes[fd] = os.fstat(fd).st_size
            if sizes[fd] < offset + HEADER_AREA + len(view):
                out[i] = b""  # truncated: corrupt
                continue
            nixl.register_file(fd)
            todo.append((i, fd, offset, view))
        staged = memoryview(nixl.staging)
        for batch in _chunks(todo, lambda t: HEADER_AREA + len(t[3])):
            local: list[tuple[int, int, int]] = []
            remote: list[tuple[int, int, int]] = []
            for j, (_, fd, offset, view) in enumerate(batch):
                local += ((nixl.header(j), HEADER_AREA, 0), (_address(view), len(view), 0))
                remote += ((offset, HEADER_AREA, fd), (offset + HEADER_AREA, len(view), fd))
            ok = nixl.transfer("READ", local, "FILE", remote)
            for j, (i, _, _, _) in enumerate(batch):
                header = staged[j * HEADER_AREA : (j + 1) * HEADER_AREA]
                out[i] = bytes(header) if ok else b""  # one copy out of the staging area
        return out

    def close(self) -> None:
        self.agents.close()  # deregisters the files before the slabs close them
        super().close()


class _NixlObjIo(ObjectIo):
    """Objects written and read by NIXL's OBJ backend; s3fs lists and deletes."""

    def __init__(self, fs: Any, root: str, agents: _Agents, bucket: str) -> None:
        super().__init__(fs, root)
        self.agents = agents
        self.bucket = bucket

    def _object(self, path: str) -> str:
        return path[len(self.bucket) + 1 :]

    def write_many(
        self, items: list[tuple[OffloadKey, memoryview]], room: Sequence[Any] = ()
    ) -> list[str | None]:
        nixl = self.agents.get()
        errors: list[str | None] = []
        for key, view in items:
            nixl.staging[:HEADER_AREA] = pack_header(key, view)
            # payload first, header last: a block is readable only once both exist
            path = self._object(self.path(key))
            ok = nixl.transfer_objects(
                "WRITE", [(_address(view), len(view), 0)], [(len(view), path)]
            ) and nixl.transfer_objects(
                "WRITE", [(nixl.header(0), HEADER_AREA, 0)], [(HEADER_AREA, path + ".hdr")]
            )
            errors.append(None if ok else "NIXL OBJ write failed")
        return errors

    def read_many(self, items: list[tuple[OffloadKey, memoryview]]) -> list[bytes | None]:
        nixl = self.agents.get()
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
            ok = nixl.transfer_objects(
                "READ", [(_address(view), len(view), 0)], [(len(view), self._object(path))]
            )
            out.append(bytes(header) if ok else b"")
        return out

    def _exists_paths(self, paths: list[str]) -> set[str]:
        headers = {p + ".hdr": p for p in paths}
        return {headers[h] for h in super()._exists_paths(list(headers))}

    def remove_many(self, keys: Sequence[OffloadKey], *, defer: bool = False) -> list[Any]:
        paths = [self.path(key) for key in keys]
        self._remove_paths([p + ".hdr" for p in paths])  # headers first: gone at once
        self._remove_paths(paths)
        return []

    def _walk(self) -> Iterable[tuple[str, float]]:
        for path, mtime in super()._walk():
            if not path.endswith(".hdr"):  # a header belongs to its block
                yield path, mtime

    def close(self) -> None:
        self.agents.close()


class NixlTierStore(FsspecTierStore):
    """A tier moving bytes with NIXL.

    Args:
        host, capacity_bytes, name, namespace, medium, locality, io_threads: as for
            :class:`~kvhex.adapters.storage.fsspec.FsspecTierStore`.
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
        io_threads: int | None = None,
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
            obj = _Agents(lambda: _Agent(self._name, "OBJ", self._obj_params, self._host))
            return _NixlObjIo(fs, base, obj, self._obj_params["bucket"])
        posix = _Agents(lambda: _Agent(self._name, "POSIX", {}, self._host))
        return _NixlPosixIo(base, *self._slab_geometry(), posix, self.io_threads)
