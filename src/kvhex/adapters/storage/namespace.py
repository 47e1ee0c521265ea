"""Opening a storage tier's root and its namespace, for the fsspec and NIXL tiers alike: the
sizes checked before any IO, the fsspec filesystem of the URL, a local root created, the
default capacity of a local root (its free space), and the namespace directory or prefix
under the root with its data path built. Every start-up failure is a
:class:`~kvhex.errors.TierUnavailable` naming its cause and blaming the tier's option that
would fix it (:class:`~kvhex.adapters.storage.objects._errors.StoreOptions`): the root's own
reason on local files (it cannot be created, a permission, a read-only filesystem, no
space), an object store's cause otherwise (no such bucket, an unknown access key id, a wrong
secret, an endpoint down).

Layout under a root::

    ROOT/<namespace digest>/config.json   what makes blocks compatible, recorded
    ROOT/<namespace digest>/...           the data path's own (slab files, objects)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvhex.adapters.codecs.chain import CodecChain
from kvhex.adapters.storage.block_io import BlockIo, NamespaceConflict
from kvhex.adapters.storage.format import HEADER_AREA, namespace_config, namespace_digest
from kvhex.adapters.storage.objects._errors import StoreOptions, public_url, start_up_error
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer

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


def check_sizes(
    host: HostBuffer,
    capacity_bytes: int | None,
    io_threads: int | None,
    codec: CodecChain | None = None,
) -> int:
    """What a block costs in storage, once the sizes were checked (before any IO;
    ``capacity_bytes`` ``None``: the root's free space, checked by :func:`free_capacity`).
    With a ``codec`` chain, a block holds its longest frame, rounded up to whole 4 KiB pages
    (a slab's next block stays page-aligned): a quantizing chain's blocks cost less.

    Raises:
        ValueError: ``capacity_bytes`` holds no block, or ``io_threads`` is below 1.
    """
    data = stored_bytes(host.slot_bytes, codec)
    block = HEADER_AREA + data
    if capacity_bytes is not None and capacity_bytes < block:
        coded = f", coded by {'+'.join(codec.names)}" if codec is not None else ""
        raise ValueError(
            f"capacity_bytes {capacity_bytes} holds no block of {block} bytes "
            f"({data} of KV data{coded} and a {HEADER_AREA}-byte header)"
        )
    if io_threads is not None and io_threads < 1:
        raise ValueError(f"io_threads must be >= 1, got {io_threads}")
    return block


def stored_bytes(slot_bytes: int, codec: CodecChain | None) -> int:
    """The room a block's payload takes after its header area: a host slot, or a codec
    chain's longest frame rounded up to whole 4 KiB pages (a slab's next block stays
    page-aligned)."""
    if codec is None:
        return slot_bytes
    return -(-codec.max_stored_bytes(slot_bytes) // HEADER_AREA) * HEADER_AREA


def default_io_threads(local: bool) -> int:
    """Local files: the cores, up to 4 (page-cache copies are CPU work); object stores: 8
    (requests wait on the network)."""
    return min(4, os.cpu_count() or 1) if local else 8


def open_fs(
    url: str, storage_options: Mapping[str, Any] | None, tier: str, options: StoreOptions
) -> tuple[Any, str, bool]:
    """The fsspec filesystem of ``url``, the root path in it, and whether it is local
    (nothing created: a local root is made by :func:`make_root`).

    Args:
        options: the tier's options a failure blames.

    Raises:
        TierUnavailable: ``url`` names no usable filesystem (an empty one included).
    """
    if not url.strip():
        raise TierUnavailable(
            "the url is empty: give a directory or s3://bucket/prefix",
            tier=tier,
            option=options.url,
        )
    try:
        import fsspec

        kwargs = dict(storage_options or {})
        if url.startswith(("s3://", "s3a://")):
            kwargs["config_kwargs"] = {**S3_CLIENT_CONFIG, **kwargs.get("config_kwargs", {})}
        fs, root = fsspec.core.url_to_fs(url, **kwargs)
    except ImportError as exc:  # the filesystem's package (s3fs for s3://) is not installed
        scheme = url.partition("://")[0]
        hint = ": pip install 'kvhex[s3]'" if scheme in ("s3", "s3a") else ""
        raise TierUnavailable(
            f"{scheme}:// needs a package that is not installed ({exc}){hint}",
            tier=tier,
            option=options.url,
        ) from exc
    except Exception as exc:
        raise start_up_error(exc, url=url, tier=tier, options=options) from exc
    protocol = fs.protocol
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return fs, str(root), "file" in protocols


def make_root(root: str, *, url: str, tier: str, options: StoreOptions) -> None:
    """Create the local directory ``root`` with its missing parents, if absent (with the
    umask's mode, as the namespace directory's parents would be).

    Raises:
        TierUnavailable: it cannot be created (the reason named: a permission, a read-only
            filesystem, a file in the way, a filesystem that takes no directories).
    """
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise TierUnavailable(
            f"cannot use root {url!r}: cannot create {exc.filename or root!r}: {_reason(exc)}",
            tier=tier,
            option=options.url,
        ) from exc


def free_bytes(root: str) -> int:
    """Free bytes on the filesystem of the local directory ``root``."""
    return shutil.disk_usage(root).free


def free_capacity(root: str, block: int, *, url: str, tier: str, options: StoreOptions) -> int:
    """The default capacity of a local root: its filesystem's free space now (blocks the tier
    already holds there not counted, as before it started).

    Raises:
        TierUnavailable: the free space holds no block (a full disk), or cannot be read.
    """
    try:
        free = free_bytes(root)
    except OSError as exc:
        raise TierUnavailable(
            f"cannot use root {url!r}: cannot read its free space: {_reason(exc)}",
            tier=tier,
            option=options.url,
        ) from exc
    if free < block:
        raise TierUnavailable(
            f"no space left on the filesystem of root {url!r} for its default capacity (its "
            f"free space): {free} bytes free hold no block of {block} bytes; free some space, "
            "choose another root or give capacity_bytes",
            tier=tier,
            option=options.url,
        )
    return free


def recorded_namespace(
    namespace: Mapping[str, Any] | None, host: HostBuffer, codec: CodecChain | None = None
) -> dict[str, Any]:
    """The namespace a tier records: the caller's, with the host slot size and, with a
    codec chain, its description (blocks of another chain live under another digest) and
    the room a block's payload takes (``stored_bytes``: what ``kvhex fsck`` sizes slots by,
    without the codecs or their keys)."""
    ns = dict(namespace or {})
    ns.setdefault("slot_bytes", host.slot_bytes)
    if codec is not None:
        ns["codec"] = codec.description
        ns["stored_bytes"] = stored_bytes(host.slot_bytes, codec)
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
    local: bool,
    options: StoreOptions,
    codec: CodecChain | None = None,
) -> IoT:
    """Build the data path of ``namespace`` under ``root`` with ``make_io(base, config)``.

    Args:
        local: ``root`` is a local directory (its ``OSError`` named by its reason).
        options: the tier's options a failure blames.
        codec: the tier's codec chain, recorded in the namespace.

    Raises:
        TierUnavailable: the namespace records another configuration, or the storage cannot
            be used (the cause named, no credential in the message).
    """
    ns = recorded_namespace(namespace, host, codec)
    base = io_root(root, ns)
    try:
        return make_io(base, namespace_config(ns))
    except TierUnavailable:
        raise
    except NamespaceConflict as exc:
        raise TierUnavailable(
            f"namespace {namespace_digest(ns)} under {public_url(url)!r} records another config",
            tier=tier,
            option=options.url,
        ) from exc
    except OSError as exc:
        if not local:
            raise start_up_error(exc, url=url, tier=tier, options=options) from exc
        where = f"{exc.filename!r}" if exc.filename else "it"
        raise TierUnavailable(
            f"cannot use root {url!r}: cannot write {where}: {_reason(exc)}",
            tier=tier,
            option=options.url,
        ) from exc
    except Exception as exc:
        raise start_up_error(exc, url=url, tier=tier, options=options) from exc


def _reason(exc: OSError) -> str:
    """What the system said (``Permission denied``, ``Read-only file system``, ...)."""
    return exc.strerror or f"{type(exc).__name__}: {exc}"
