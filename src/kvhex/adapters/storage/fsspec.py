"""``FsspecTierStore``: the storage tier on any fsspec URL: slab files on a local root
(:mod:`kvhex.adapters.storage.files.slabs`), one object per block on an object store such as
S3 (:mod:`kvhex.adapters.storage.objects`), both in the block format of
:mod:`kvhex.adapters.storage.format` and kept by
:class:`~kvhex.adapters.storage.tier.BlockTierStore`.

Layout under the configured root::

    ROOT/<namespace digest>/config.json       what makes blocks compatible, recorded
    ROOT/<namespace digest>/slabs/<id>.slab   local files: preallocated slabs of block slots
    ROOT/<namespace digest>/<k0k1>/<key hex>.blk   object stores: one object per block

Names are built only from hex (offload keys, random slab ids) under the configured root, so no
input can name a path outside it. Local files are created ``0600`` and directories ``0700``.

Also here, shared with the NIXL tier: opening the filesystem and the namespace, with every
start-up failure a :class:`~kvhex.errors.TierUnavailable` naming its cause.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvhex.adapters.storage.block_io import BlockIo, NamespaceConflict
from kvhex.adapters.storage.files.native import NativeUnavailable
from kvhex.adapters.storage.files.slabs import PosixSlotMover, SlabIo
from kvhex.adapters.storage.format import HEADER_AREA, namespace_config, namespace_digest
from kvhex.adapters.storage.object_errors import public_url, start_up_error
from kvhex.adapters.storage.objects import ObjectIo
from kvhex.adapters.storage.peers import check_peer_options
from kvhex.adapters.storage.tier import BlockTierStore, default_io_threads
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer

__all__ = ["S3_CLIENT_CONFIG", "FsspecTierStore", "open_fs", "open_namespace"]

IoT = TypeVar("IoT", bound=BlockIo)

S3_CLIENT_CONFIG = {
    "request_checksum_calculation": "when_required",
    "response_checksum_validation": "when_required",
}
"""botocore settings an ``s3://`` tier's client starts from (a user's ``config_kwargs`` win).
Every block already carries its XXH3 checksum, verified on every read, so the CRC32 botocore
adds to each PUT and checks on each GET by default (in Python, on the IO threads; and on the
server, which must check what it is sent) would guard the same bytes twice: it is asked only
where an operation requires one (docs/tiers.md)."""


class FsspecTierStore(BlockTierStore):
    """A file or object-store tier. See the module docstring, and
    :class:`~kvhex.adapters.storage.tier.BlockTierStore` for the guarantees.

    Args:
        host: the host buffer whose slots jobs name.
        url: root, e.g. ``/var/cache/kvhex`` or ``s3://bucket/prefix``.
        capacity_bytes: bytes the tier may hold (a 4 KiB header area per block included);
            LRU eviction beyond.
        name: ownership name announced in events and used in errors.
        namespace: what makes blocks compatible (model, geometry, dtype, ...).
        medium, locality: announced in events.
        io_threads: concurrent IO jobs (IO threads); by default as many as this machine
            has cores, up to 4, on local files (page-cache copies are CPU work: more
            threads only contend), and 8 on object stores (requests wait on the network).
        fsync: flush each job's blocks to the device before publishing them (local files
            only; without it a power loss can lose recent blocks, never tear one).
        native_io: local files only: ``True`` requires the native data path (a job's blocks
            checksummed and written with the GIL released once; built at install where a C
            compiler is found), ``False`` moves blocks in Python; by default the native path
            where it was built (:mod:`kvhex.adapters.storage.files.native`).
        storage_options: passed to fsspec (credentials never reach logs or events).
        announce_peers: also announce the blocks other instances hold on the same root or
            bucket (which this tier's gets load), under :attr:`peer_identity` (ownership
            ``<name>@peers``), each in full from the record its header keeps (docs/tiers.md).
            Off by default: each scan costs a look at every other instance's slot table (local
            files) or a listing of the namespace (object stores), and a header read per new
            block.
        peer_scan_interval_s: seconds between the scans of ``announce_peers`` (at most 3600;
            looked at when the tier is polled).

    Raises:
        TypeError: ``announce_peers`` is not a ``bool`` or ``peer_scan_interval_s`` not a
            number.
        ValueError: ``capacity_bytes`` holds no block, ``io_threads`` is below 1,
            ``peer_scan_interval_s`` is not in (0, 3600], or ``native_io`` is ``True`` where
            the native data path cannot run (or on an object store).
        TierUnavailable: the root cannot be created, written or listed (on an object store
            the message names the cause: no such bucket, an unknown access key id, a wrong
            secret, access denied, an endpoint down), or holds a namespace whose recorded
            configuration differs.
    """

    def __init__(
        self,
        host: HostBuffer,
        url: str,
        *,
        capacity_bytes: int,
        name: str = "files",
        namespace: Mapping[str, Any] | None = None,
        medium: Medium = Medium.STORAGE,
        locality: Locality | None = Locality.LOCAL,
        io_threads: int | None = None,
        fsync: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        native_io: bool | None = None,
        announce_peers: bool = False,
        peer_scan_interval_s: float = 1.0,
    ) -> None:
        check_peer_options(announce_peers, peer_scan_interval_s)
        block = check_sizes(host, capacity_bytes, io_threads)
        fs, root, local = open_fs(url, storage_options, name)
        threads = io_threads or default_io_threads(local)
        mover = None
        if local:
            try:
                mover = PosixSlotMover(native=native_io)
            except NativeUnavailable as exc:
                raise ValueError(f"native_io=True: {exc}") from exc
        elif native_io:
            raise ValueError("native_io=True: only local roots have a native data path")

        def make_io(base: str, config: bytes) -> BlockIo:
            if mover is not None:
                slots = capacity_bytes // block
                return SlabIo(
                    base, block, slots, config=config, fsync=fsync, stripes=threads, mover=mover
                )
            return ObjectIo(fs, base, config=config)

        io = open_namespace(make_io, root, namespace, host, url=url, tier=name)
        self.native_io = mover is not None and mover.native
        """Whether the native data path moves this tier's blocks."""
        self.namespace = recorded_namespace(namespace, host)
        self.root = io_root(root, self.namespace)
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


def check_sizes(host: HostBuffer, capacity_bytes: int, io_threads: int | None) -> int:
    """What a block costs in storage, once the sizes were checked (before any IO).

    Raises:
        ValueError: ``capacity_bytes`` holds no block, or ``io_threads`` is below 1.
    """
    block = HEADER_AREA + host.slot_bytes
    if capacity_bytes < block:
        raise ValueError(
            f"capacity_bytes {capacity_bytes} holds no block of {block} bytes "
            f"({host.slot_bytes} of KV data and a {HEADER_AREA}-byte header)"
        )
    if io_threads is not None and io_threads < 1:
        raise ValueError(f"io_threads must be >= 1, got {io_threads}")
    return block


def open_fs(
    url: str, storage_options: Mapping[str, Any] | None, tier: str
) -> tuple[Any, str, bool]:
    """The fsspec filesystem of ``url``, the root path in it, and whether it is local.

    Raises:
        TierUnavailable: ``url`` names no usable filesystem (an empty one included).
    """
    if not url.strip():
        raise TierUnavailable("the url is empty: give a directory or s3://bucket/prefix", tier=tier)
    try:
        import fsspec

        options = dict(storage_options or {})
        if url.startswith(("s3://", "s3a://")):
            options["config_kwargs"] = {**S3_CLIENT_CONFIG, **options.get("config_kwargs", {})}
        fs, root = fsspec.core.url_to_fs(url, **options)
    except Exception as exc:
        raise start_up_error(exc, url=url, tier=tier) from exc
    protocol = fs.protocol
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return fs, str(root), "file" in protocols


def recorded_namespace(namespace: Mapping[str, Any] | None, host: HostBuffer) -> dict[str, Any]:
    """The namespace a tier records: the caller's, with the host slot size."""
    ns = dict(namespace or {})
    ns.setdefault("slot_bytes", host.slot_bytes)
    return ns


def io_root(root: str, namespace: Mapping[str, Any]) -> str:
    """The namespace directory or prefix under ``root``."""
    return root.rstrip("/") + "/" + namespace_digest(namespace)


def open_namespace(
    make_io: Callable[[str, bytes], IoT],
    root: str,
    namespace: Mapping[str, Any] | None,
    host: HostBuffer,
    *,
    url: str,
    tier: str,
) -> IoT:
    """Build the data path of ``namespace`` under ``root`` with ``make_io(base, config)``.

    Raises:
        TierUnavailable: the namespace records another configuration, or the storage cannot
            be used (the cause named, no credential in the message).
    """
    ns = recorded_namespace(namespace, host)
    base = io_root(root, ns)
    try:
        return make_io(base, namespace_config(ns))
    except NamespaceConflict as exc:
        raise TierUnavailable(
            f"namespace {namespace_digest(ns)} under {public_url(url)!r} records another config",
            tier=tier,
        ) from exc
    except Exception as exc:
        raise start_up_error(exc, url=url, tier=tier) from exc
