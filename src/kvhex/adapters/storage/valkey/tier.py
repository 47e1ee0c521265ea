"""``ValkeyTierStore``: the storage tier on a Valkey server or cluster (one key per block,
:mod:`kvhex.adapters.storage.valkey.io`), kept by
:class:`~kvhex.adapters.storage.tier.BlockTierStore` like every persistent tier.

Who evicts: kvhex. The tier holds at most ``capacity_bytes`` (a 4 KiB header area per block
included) and evicts by its policy beyond, announcing each removal. A server that also evicts
(``maxmemory-policy``) or expires keys is tolerated, not announced ahead: a get or probe that
finds a block gone drops it from the index and announces it removed (docs/tiers.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvhex.adapters.storage.block_io import NamespaceConflict
from kvhex.adapters.storage.format import namespace_config, namespace_digest
from kvhex.adapters.storage.namespace import check_sizes, io_root, recorded_namespace
from kvhex.adapters.storage.tier import BlockTierStore
from kvhex.adapters.storage.valkey._client import (
    Connection,
    connect,
    parse_url,
    start_up_error,
)
from kvhex.adapters.storage.valkey.io import ValkeyIo
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer

DEFAULT_IO_THREADS = 8
"""Concurrent IO jobs: each waits on the network, not the CPU."""


class ValkeyTierStore(BlockTierStore):
    """A tier on Valkey. See the module docstring, and
    :class:`~kvhex.adapters.storage.tier.BlockTierStore` for the guarantees.

    Args:
        host: the host buffer whose slots jobs name.
        url: ``valkey://HOST:PORT[,HOST:PORT...]/PREFIX`` (``valkeys://``: TLS); the hosts
            are seed nodes, the prefix starts every key of the tier.
        capacity_bytes: bytes the tier may hold (a 4 KiB header area per block included);
            kvhex's eviction beyond.
        name: ownership name announced in events and used in errors.
        namespace: what makes blocks compatible (model, geometry, dtype, ...).
        medium, locality: announced in events (by default remote storage).
        cluster: ``None`` (default): a cluster client where the server says
            ``cluster_enabled``; ``True`` requires a cluster, ``False`` talks to the first
            node alone.
        username, password: ACL credentials (never logged, never in events or errors).
        tls: TLS without the ``valkeys://`` scheme; ``tls_ca_file``, ``tls_cert_file``,
            ``tls_key_file``: the CA bundle and the client certificate and key (PEM).
        connect_timeout_s, command_timeout_s: seconds to connect, and to wait for a reply.
        io_threads: concurrent IO jobs (default 8).

    Raises:
        ValueError: ``capacity_bytes`` holds no block, ``io_threads`` is below 1, or a
            timeout is not positive.
        TierUnavailable: the url is malformed, no node answers, the credentials are refused,
            the cluster is not ``ok``, or the namespace records another configuration; the
            message names the cause and :attr:`~TierUnavailable.option` the option to fix
            (``url``, ``password``, ``username``, ``cluster``, ``tls_ca_file``).
    """

    def __init__(
        self,
        host: HostBuffer,
        url: str,
        *,
        capacity_bytes: int,
        name: str = "valkey",
        namespace: Mapping[str, Any] | None = None,
        medium: Medium = Medium.STORAGE,
        locality: Locality | None = Locality.REMOTE,
        cluster: bool | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        connect_timeout_s: float = 5.0,
        command_timeout_s: float = 10.0,
        io_threads: int | None = None,
    ) -> None:
        block = check_sizes(host, capacity_bytes, io_threads)
        for option, value in (
            ("connect_timeout_s", connect_timeout_s),
            ("command_timeout_s", command_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{option} must be > 0, got {value}")
        endpoint = parse_url(url, tier=name)
        conn = Connection(
            username=username,
            password=password,
            tls=tls or endpoint.tls,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            connect_timeout_s=connect_timeout_s,
            command_timeout_s=command_timeout_s,
        )
        client = connect(endpoint, conn, cluster, tier=name)
        self.namespace = recorded_namespace(namespace, host)
        self.root = io_root(endpoint.prefix, self.namespace)
        self.url = url
        where = ",".join(f"{h}:{p}" for h, p in endpoint.nodes)
        try:
            io = ValkeyIo(client, self.root, config=namespace_config(self.namespace), where=where)
        except NamespaceConflict as exc:
            client.close()
            raise TierUnavailable(
                f"namespace {namespace_digest(self.namespace)} under {url!r} records another "
                "config",
                tier=name,
                option="url",
            ) from exc
        except Exception as exc:
            client.close()
            raise start_up_error(exc, endpoint, tier=name) from exc
        super().__init__(
            host,
            io,
            identity=TierIdentity(medium, locality, name),
            capacity_bytes=capacity_bytes,
            block_bytes=block,
            io_threads=io_threads or DEFAULT_IO_THREADS,
        )
