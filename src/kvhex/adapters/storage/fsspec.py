"""``FsspecTierStore``: the storage tier on any fsspec URL: slab files on a local root
(:mod:`kvhex.adapters.storage.files.slabs`), one object per block on an object store such as
S3 (:mod:`kvhex.adapters.storage.objects`), both in the block format of
:mod:`kvhex.adapters.storage.format`, opened by :mod:`kvhex.adapters.storage.namespace` and
kept by :class:`~kvhex.adapters.storage.tier.BlockTierStore`.

Layout under the configured root::

    ROOT/<namespace digest>/config.json       what makes blocks compatible, recorded
    ROOT/<namespace digest>/slabs/<id>.slab   local files: preallocated slabs of block slots
    ROOT/<namespace digest>/<k0k1>/<key hex>.blk   object stores: one object per block

Names are built only from hex (offload keys, random slab ids) under the configured root, so no
input can name a path outside it. Local files are created ``0600`` and directories ``0700``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvhex.adapters.codecs.chain import CodecChain, as_chain
from kvhex.adapters.storage.block_io import BlockIo
from kvhex.adapters.storage.files._native import NativeUnavailable
from kvhex.adapters.storage.files.posix import PosixSlotMover
from kvhex.adapters.storage.files.slabs import SlabIo
from kvhex.adapters.storage.namespace import (
    check_sizes,
    default_io_threads,
    free_capacity,
    io_root,
    make_root,
    open_fs,
    open_namespace,
    recorded_namespace,
)
from kvhex.adapters.storage.objects._errors import StoreOptions
from kvhex.adapters.storage.objects.io import ObjectIo
from kvhex.adapters.storage.peers import check_peer_options
from kvhex.adapters.storage.tier import BlockTierStore
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.ports.codec import BlockCodec
from kvhex.ports.host_buffer import HostBuffer


class FsspecTierStore(BlockTierStore):
    """A file or object-store tier. See the module docstring, and
    :class:`~kvhex.adapters.storage.tier.BlockTierStore` for the guarantees.

    Args:
        host: the host buffer whose slots jobs name.
        url: root, e.g. ``/var/cache/kvhex`` or ``s3://bucket/prefix``.
        capacity_bytes: bytes the tier may hold (a 4 KiB header area per block included);
            LRU eviction beyond. ``None`` (local roots only): the free space of the root's
            filesystem at start-up (what vLLM's ``fs`` entries default to).
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
            where it was built (:mod:`kvhex.adapters.storage.files._native`).
        storage_options: passed to fsspec (credentials never reach logs or events).
        announce_peers: also announce the blocks other instances hold on the same root or
            bucket (which this tier's gets load), under :attr:`peer_identity` (ownership
            ``<name>@peers``), each in full from the record its header keeps (docs/tiers.md).
            Off by default: each scan costs a look at every other instance's slot table (local
            files) or a listing of the namespace (object stores), and a header read per new
            block.
        peer_scan_interval_s: seconds between the scans of ``announce_peers`` (at most 3600;
            looked at when the tier is polled).
        codec: codecs every block goes through on its IO thread (compression, quantization,
            encryption; docs/codecs.md), in encoding order; blocks stored with another chain
            live under another namespace digest.

    Raises:
        TypeError: ``announce_peers`` is not a ``bool`` or ``peer_scan_interval_s`` not a
            number.
        ValueError: ``capacity_bytes`` holds no block (or is ``None`` on an object store),
            ``io_threads`` is below 1, ``peer_scan_interval_s`` is not in (0, 3600], or
            ``native_io`` is ``True`` where the native data path cannot run (or on an object
            store).
        TierUnavailable: the root cannot be created, written or listed, its filesystem has
            no space for the default capacity, or it holds a namespace whose recorded
            configuration differs: the message names the cause (the system's reason on local
            files; on an object store no such bucket, an unknown access key id, a wrong
            secret, access denied, an endpoint down) and :attr:`~TierUnavailable.option`
            the option to correct (``url``, or ``storage_options.key``, ``.secret``,
            ``.endpoint_url`` where given and at fault).
    """

    def __init__(
        self,
        host: HostBuffer,
        url: str,
        *,
        capacity_bytes: int | None,
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
        codec: CodecChain | Sequence[BlockCodec] | None = None,
    ) -> None:
        check_peer_options(announce_peers, peer_scan_interval_s)
        chain = as_chain(codec)
        block = check_sizes(host, capacity_bytes, io_threads, chain)
        blamed = StoreOptions.given(
            {"storage_options": storage_options},
            access_key="storage_options.key",
            secret="storage_options.secret",
            endpoint="storage_options.endpoint_url",
        )
        fs, root, local = open_fs(url, storage_options, name, blamed)
        if capacity_bytes is None and not local:
            raise ValueError("capacity_bytes None: only local roots default to their free space")
        threads = io_threads or default_io_threads(local)
        mover = None
        if local:
            try:
                mover = PosixSlotMover(native=native_io)
            except NativeUnavailable as exc:
                raise ValueError(f"native_io=True: {exc}") from exc
            make_root(root, url=url, tier=name, options=blamed)
        elif native_io:
            raise ValueError("native_io=True: only local roots have a native data path")
        if capacity_bytes is None:
            capacity_bytes = free_capacity(root, block, url=url, tier=name, options=blamed)
        capacity = capacity_bytes

        opener = chain.record_sealer.open_record if chain and chain.record_sealer else None

        def make_io(base: str, config: bytes) -> BlockIo:
            if mover is not None:
                slots = capacity // block
                return SlabIo(
                    base,
                    block,
                    slots,
                    config=config,
                    fsync=fsync,
                    stripes=threads,
                    mover=mover,
                    records_opener=opener,
                )
            return ObjectIo(fs, base, config=config, records_opener=opener)

        io = open_namespace(
            make_io,
            root,
            namespace,
            host,
            url=url,
            tier=name,
            local=local,
            options=blamed,
            codec=chain,
        )
        self.native_io = mover is not None and mover.native
        """Whether the native data path moves this tier's blocks."""
        self.namespace = recorded_namespace(namespace, host, chain)
        self.root = io_root(root, self.namespace)
        super().__init__(
            host,
            io,
            identity=TierIdentity(medium, locality, name),
            capacity_bytes=capacity,
            block_bytes=block,
            io_threads=threads,
            announce_peers=announce_peers,
            peer_scan_interval_s=peer_scan_interval_s,
            codec=chain,
        )
