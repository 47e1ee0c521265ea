"""A secondary tier whose bytes move through NIXL: the POSIX backend (files) or the OBJ
backend (an S3-compatible object store).

Everything but the copies is the other storage tiers': the bookkeeping
(:class:`~kvhex.adapters.storage.tier.BlockTierStore` over the domain's residency), the slab
files and their index on a local root (:class:`~kvhex.adapters.storage.files.slabs.SlabIo`),
one object per block on an object store (:class:`~kvhex.adapters.storage.objects.io.ObjectIo`),
the block format, checksums on every read. This module only hands those a NIXL mover. Each IO
thread has its own NIXL agent (agents are not thread-safe), so transfers of concurrent jobs
run side by side without a lock.

* POSIX (:class:`NixlSlotMover`): each slab file is registered with NIXL once; one transfer
  per job (kept under 1 GiB: NIXL's POSIX backend fails transfers of 2 GiB, and at most
  ``STAGED_HEADERS`` blocks) moves every block's header, from the agent's staging area, and
  payload, straight from its host slot.
* OBJ (:class:`NixlObjectMover`): one object per block in the block format, the same objects
  the fsspec tier writes on S3. NIXL writes whole objects from contiguous memory, so a
  block's header and payload are staged back to back in the agent's staging area (one copy of
  the payload) and a batch of objects goes out in one transfer; reads fetch each object whole
  into the staging area (one request per block: NIXL makes a request of every descriptor)
  and copy its payload into the host slot, again one transfer per batch. Listing and
  deletes, which NIXL does not offer, go through s3fs on the same bucket.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kvhex.adapters.storage.block_io import Records
from kvhex.adapters.storage.files.slabs import SlabIo
from kvhex.adapters.storage.format import HEADER_AREA, pack_header
from kvhex.adapters.storage.namespace import (
    check_sizes,
    default_io_threads,
    make_root,
    open_fs,
    open_namespace,
)
from kvhex.adapters.storage.objects._errors import StoreOptions
from kvhex.adapters.storage.objects.io import ObjectIo
from kvhex.adapters.storage.objects.s3_direct import REQUESTS_IN_FLIGHT
from kvhex.adapters.storage.peers import check_peer_options
from kvhex.adapters.storage.tier import BlockTierStore
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.ports.host_buffer import HostBuffer

T = TypeVar("T")

MAX_TRANSFER_BYTES = 1 << 30
STAGED_HEADERS = 256
"""Block headers one POSIX transfer moves through an agent's staging area (1 MiB of it)."""
STAGED_OBJECT_BYTES = 64 << 20
"""Most bytes of whole blocks one OBJ write transfer stages (at least one block)."""
POLL_FRACTION = 1 / 16
POLL_MIN_S = 0.00002
POLL_MAX_S = 0.005
"""A thread waiting for its transfer naps ``POLL_FRACTION`` of the time it has waited, from
``POLL_MIN_S`` to ``POLL_MAX_S``: NIXL offers no blocking wait, and on a 2-vCPU VM each nap
costs about 35 us of CPU, which naps of at most 0.2 ms made a tenth of a core per waiting
thread (docs/performance.md)."""


def obj_backend_threads(io_threads: int) -> int:
    """OBJ backend threads of each IO thread's agent: together at most
    :data:`~kvhex.adapters.storage.objects.s3_direct.REQUESTS_IN_FLIGHT` requests in flight (one
    per agent at least), as the fsspec tier's own GETs, so a job's blocks are read and
    written side by side and a store's latency is paid about once per job, not once per
    block (NIXL's default, half the cores, is one on a 2-core machine: one request at a time
    per job)."""
    return max(1, REQUESTS_IN_FLIGHT // io_threads)


def _address(view: memoryview | bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def settle(state: str, check: Callable[[], str]) -> str:
    """The state a transfer that was ``state`` when submitted ends in, asking ``check`` (NIXL
    offers no blocking wait). Each nap is ``POLL_FRACTION`` of the time waited so far: a
    transfer is seen done within about that fraction of its time, and one of a second wakes
    its thread a few hundred times, not thousands."""
    started = time.perf_counter()
    while state in ("PROC", "INIT"):
        waited = time.perf_counter() - started
        time.sleep(min(POLL_MAX_S, max(POLL_MIN_S, waited * POLL_FRACTION)))
        state = check()
    return state


class _Agent:
    """One NIXL agent with one backend: the host slots and a staging area registered as
    DRAM, files registered once each. NIXL agents are not thread-safe, so each IO thread has
    its own (:class:`_Agents`) and no lock is held while a transfer runs."""

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
        self.staging_at = _address(self.staging)
        self._staging_reg = self._register([(self.staging_at, len(self.staging), 0, "")], "DRAM")
        self._files: set[int] = set()
        self._devices = 0

    def _register(self, regions: list[tuple[int, int, int, str]], mem_type: str) -> Any:
        reg = self.agent.register_memory(regions, mem_type)
        self.registered.append(reg)
        return reg

    def stage(self, size: int) -> memoryview:
        """A staging area of at least ``size`` bytes (grown and registered again if
        smaller)."""
        if len(self.staging) < size:
            self.agent.deregister_memory(self._staging_reg)
            self.registered.remove(self._staging_reg)
            self.staging = bytearray(size)
            self.staging_at = _address(self.staging)
            self._staging_reg = self._register(
                [(self.staging_at, len(self.staging), 0, "")], "DRAM"
            )
        return memoryview(self.staging)

    def register_file(self, fd: int) -> None:
        """Make every byte of the open file ``fd`` addressable (once per file)."""
        if fd not in self._files:
            self._register([(0, os.fstat(fd).st_size, fd, "")], "FILE")
            self._files.add(fd)

    def transfer(
        self, op: str, local: list[tuple[int, int, int]], mem_type: str, remote: list[Any]
    ) -> bool:
        """One transfer of registered memory, waited for; True when NIXL reports DONE."""
        agent = self.agent
        handle = agent.initialize_xfer(
            op,
            agent.get_xfer_descs(local, "DRAM"),
            agent.get_xfer_descs(remote, mem_type),
            self.name,
        )
        try:
            return settle(agent.transfer(handle), lambda: agent.check_xfer_state(handle)) == "DONE"
        finally:
            agent.release_xfer_handle(handle)

    def transfer_objects(
        self,
        op: str,
        local: list[tuple[int, int, int]],
        objects: list[tuple[int, str]],
        remote: list[tuple[int, int, int]],
    ) -> bool:
        """One transfer between DRAM and objects (size, object key), registered for this
        transfer only under device ids ``0..len(objects)-1`` that ``remote`` descriptors
        (offset, length, device id) name."""
        base = self._devices
        self._devices += len(objects)
        regions = [(0, n, base + i, name) for i, (n, name) in enumerate(objects)]
        reg = self.agent.register_memory(regions, "OBJ")
        try:
            return self.transfer(op, local, "OBJ", [(off, n, base + dev) for off, n, dev in remote])
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


def _batches(
    items: Sequence[T], size_of: Callable[[T], int], limit: int, count: int
) -> Iterator[list[T]]:
    """``items`` in batches of at most ``limit`` bytes (at least one item) and ``count``
    items."""
    batch: list[T] = []
    total = 0
    for item in items:
        size = size_of(item)
        if batch and (total + size > limit or len(batch) == count):
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size
    if batch:
        yield batch


def _slot_size(block: tuple[int, int, OffloadKey, memoryview]) -> int:
    return HEADER_AREA + len(block[3])


def _read_size(block: tuple[int, int, int, memoryview]) -> int:
    return HEADER_AREA + len(block[3])


def _object_size(obj: tuple[str, OffloadKey, memoryview]) -> int:
    return HEADER_AREA + len(obj[2])


def _get_size(obj: tuple[int, tuple[str, memoryview]]) -> int:
    return HEADER_AREA + len(obj[1][1])


class NixlSlotMover:
    """Slab slots written and read by NIXL's POSIX backend: one transfer per job (per 1 GiB,
    per ``STAGED_HEADERS`` blocks) moves every header and payload, the headers through the
    agent's staging area."""

    def __init__(self, agents: _Agents) -> None:
        self.agents = agents

    def write_slots(
        self,
        blocks: Sequence[tuple[int, int, OffloadKey, memoryview]],
        records: Records | None = None,
    ) -> list[str | None]:
        """Write each (fd, offset, key, payload) as a whole block, its header keeping the
        key's chunk record from ``records``."""
        nixl = self.agents.get()
        errors: list[str | None] = []
        for batch in _batches(blocks, _slot_size, MAX_TRANSFER_BYTES, STAGED_HEADERS):
            local: list[tuple[int, int, int]] = []
            remote: list[tuple[int, int, int]] = []
            staged = nixl.stage(len(batch) * HEADER_AREA)
            for i, (fd, offset, key, payload) in enumerate(batch):
                nixl.register_file(fd)
                record = records.get(key, b"") if records else b""
                staged[i * HEADER_AREA : (i + 1) * HEADER_AREA] = pack_header(
                    key, payload, None, record
                )
                header = nixl.staging_at + i * HEADER_AREA
                local += ((header, HEADER_AREA, 0), (_address(payload), len(payload), 0))
                remote += ((offset, HEADER_AREA, fd), (offset + HEADER_AREA, len(payload), fd))
            try:
                ok = nixl.transfer("WRITE", local, "FILE", remote)
            except Exception as exc:  # NIXL refused the transfer (its errors, one place)
                errors.extend(f"NIXL POSIX write failed: {exc}" for _ in batch)
                continue
            errors.extend(None if ok else "NIXL POSIX write failed" for _ in batch)
        return errors

    def read_slots(
        self, blocks: Sequence[tuple[int, int, memoryview]]
    ) -> list[tuple[bytes, int | None]]:
        """The header area of each block (``b""`` when cut short), its payload into the
        view; the caller checksums the payloads."""
        nixl = self.agents.get()
        out: list[tuple[bytes, int | None]] = [(b"", None)] * len(blocks)
        sizes: dict[int, int] = {}
        todo: list[tuple[int, int, int, memoryview]] = []  # index, fd, offset, view
        for i, (fd, offset, view) in enumerate(blocks):
            if fd not in sizes:
                sizes[fd] = os.fstat(fd).st_size
            if sizes[fd] < offset + HEADER_AREA + len(view):
                continue  # truncated: cut short
            nixl.register_file(fd)
            todo.append((i, fd, offset, view))
        for batch in _batches(todo, _read_size, MAX_TRANSFER_BYTES, STAGED_HEADERS):
            staged = nixl.stage(len(batch) * HEADER_AREA)
            local: list[tuple[int, int, int]] = []
            remote: list[tuple[int, int, int]] = []
            for j, (_, fd, offset, view) in enumerate(batch):
                header = nixl.staging_at + j * HEADER_AREA
                local += ((header, HEADER_AREA, 0), (_address(view), len(view), 0))
                remote += ((offset, HEADER_AREA, fd), (offset + HEADER_AREA, len(view), fd))
            ok = nixl.transfer("READ", local, "FILE", remote)
            for j, (i, _, _, _) in enumerate(batch):
                if ok:  # one copy out of the staging area
                    out[i] = (bytes(staged[j * HEADER_AREA : (j + 1) * HEADER_AREA]), None)
        return out

    def close(self) -> None:
        """Deregister everything (before the slabs close the files)."""
        self.agents.close()


class NixlObjectMover:
    """Whole blocks as objects, written and read by NIXL's OBJ backend (see the module
    docstring)."""

    def __init__(self, agents: _Agents, bucket: str) -> None:
        self.agents = agents
        self.bucket = bucket

    def _object(self, path: str) -> str:
        return path[len(self.bucket) + 1 :]

    def put_objects(
        self,
        objects: Sequence[tuple[str, OffloadKey, memoryview]],
        records: Records | None = None,
    ) -> list[str | None]:
        """Stage each block whole (its header keeping the key's chunk record from
        ``records``) and write a batch of objects per transfer."""
        nixl = self.agents.get()
        errors: list[str | None] = []
        for batch in _batches(objects, _object_size, STAGED_OBJECT_BYTES, len(objects)):
            staged = nixl.stage(sum(_object_size(o) for o in batch))
            local: list[tuple[int, int, int]] = []
            names: list[tuple[int, str]] = []
            at = 0
            for path, key, payload in batch:
                n = HEADER_AREA + len(payload)
                staged[at + HEADER_AREA : at + n] = payload
                record = records.get(key, b"") if records else b""
                # the checksum reads the staged copy, still in the CPU cache
                staged[at : at + HEADER_AREA] = pack_header(
                    key, staged[at + HEADER_AREA : at + n], None, record
                )
                local.append((nixl.staging_at + at, n, 0))
                names.append((n, self._object(path)))
                at += n
            remote = [(0, n, i) for i, (n, _) in enumerate(names)]
            try:
                ok = nixl.transfer_objects("WRITE", local, names, remote)
            except Exception as exc:  # NIXL refused the transfer
                errors.extend(f"NIXL OBJ write failed: {exc}" for _ in batch)
                continue
            errors.extend(None if ok else "NIXL OBJ write failed" for _ in batch)
        return errors

    def get_objects(
        self, objects: Sequence[tuple[str, memoryview]], *, up_to: bool = False
    ) -> list[bytes | None]:
        """Each object whole into the staging area (one request each), a batch per transfer,
        then its payload into its view; a batch that fails is read again object by object, so
        one missing object fails only itself. Transfers have fixed lengths: no ``up_to``
        (the NIXL tier takes no codec)."""
        if up_to:
            raise ValueError("NIXL's object mover reads blocks of one length only")
        nixl = self.agents.get()
        out: list[bytes | None] = [None] * len(objects)
        indexed = list(enumerate(objects))
        for batch in _batches(indexed, _get_size, STAGED_OBJECT_BYTES, len(objects)):
            if not self._get(nixl, batch, out) and len(batch) > 1:
                for one in batch:
                    self._get(nixl, [one], out)
        return out

    def _get(
        self,
        nixl: _Agent,
        batch: list[tuple[int, tuple[str, memoryview]]],
        out: list[bytes | None],
    ) -> bool:
        staged = nixl.stage(sum(_get_size(one) for one in batch))
        local: list[tuple[int, int, int]] = []
        names: list[tuple[int, str]] = []
        at = 0
        for _, (path, view) in batch:
            n = HEADER_AREA + len(view)
            staged[at : at + HEADER_AREA] = bytes(HEADER_AREA)  # no stale header
            local.append((nixl.staging_at + at, n, 0))
            names.append((n, self._object(path)))
            at += n
        remote = [(0, n, j) for j, (n, _) in enumerate(names)]
        try:
            ok = nixl.transfer_objects("READ", local, names, remote)
        except Exception:  # a missing object fails the transfer at submission
            ok = False
        if ok:
            at = 0
            for i, (_, view) in batch:
                view[:] = staged[at + HEADER_AREA : at + HEADER_AREA + len(view)]
                out[i] = bytes(staged[at : at + HEADER_AREA])
                at += HEADER_AREA + len(view)
        return ok

    def close(self) -> None:
        """Deregister everything."""
        self.agents.close()


class NixlTierStore(BlockTierStore):
    """A tier moving bytes with NIXL.

    Args:
        host, capacity_bytes, name, namespace, medium, locality, io_threads, announce_peers,
            peer_scan_interval_s: as for
            :class:`~kvhex.adapters.storage.fsspec.FsspecTierStore` (a capacity given in
            bytes).
        url: a local directory (POSIX backend) or ``s3://bucket/prefix`` (OBJ backend).
        endpoint_url, access_key, secret_key, region: the object store (OBJ only); the
            bucket must exist.

    Raises:
        TypeError, ValueError: a bad option, as for the fsspec tier.
        TierUnavailable: the root or bucket cannot be used, or NIXL's backend cannot load
            (each cause named; :attr:`~kvhex.errors.TierUnavailable.option` the option to
            correct: ``url``, or ``access_key``, ``secret_key``, ``endpoint_url`` where given
            and at fault).
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
        announce_peers: bool = False,
        peer_scan_interval_s: float = 1.0,
    ) -> None:
        check_peer_options(announce_peers, peer_scan_interval_s)
        block = check_sizes(host, capacity_bytes, io_threads)
        obj = url.startswith("s3://")
        options: dict[str, Any] = {}
        params: dict[str, str] = {}
        if obj:
            options = {
                "key": access_key,
                "secret": secret_key,
                "endpoint_url": endpoint_url,
                "use_listings_cache": False,
                "skip_instance_cache": True,
            }
            params = {
                "access_key": access_key or "",
                "secret_key": secret_key or "",
                "bucket": url[5:].split("/", 1)[0],
                "endpoint_override": endpoint_url or "",
                "scheme": (endpoint_url or "https://").split("://", 1)[0],
                "region": region,
                "use_virtual_addressing": "false",
                # every block carries its own checksum, verified on every read: no CRC per
                # request (docs/tiers.md, "No transport checksums")
                "req_checksum": "required",
                "resp_checksum": "required",
            }
        blamed = StoreOptions.given(
            {"access_key": access_key, "secret_key": secret_key, "endpoint_url": endpoint_url},
            access_key="access_key",
            secret="secret_key",
            endpoint="endpoint_url",
        )
        fs, root, local = open_fs(url, options, name, blamed)
        if local:
            make_root(root, url=url, tier=name, options=blamed)
        threads = io_threads or default_io_threads(local)
        if obj:
            params["num_threads"] = str(obj_backend_threads(threads))

        def make_io(base: str, config: bytes) -> SlabIo | ObjectIo:
            if obj:
                agents = _Agents(lambda: _Agent(name, "OBJ", params, host))
                return ObjectIo(
                    fs, base, config=config, mover=NixlObjectMover(agents, params["bucket"])
                )
            agents = _Agents(lambda: _Agent(name, "POSIX", {}, host))
            return SlabIo(
                base,
                block,
                max(1, capacity_bytes // block),
                config=config,
                stripes=threads,
                mover=NixlSlotMover(agents),
            )

        io = open_namespace(
            make_io, root, namespace, host, url=url, tier=name, local=local, options=blamed
        )
        super().__init__(
            host,
            io,
            identity=TierIdentity(medium, locality, name),
            capacity_bytes=capacity_bytes,
            block_bytes=block,
            io_threads=threads,
            announce_peers=announce_peers,
            peer_scan_interval_s=peer_scan_interval_s,
        )
