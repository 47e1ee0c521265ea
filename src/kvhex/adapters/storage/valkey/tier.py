"""``ValkeyTierStore``: the storage tier on a Valkey server or cluster (one key per block,
:mod:`kvhex.adapters.storage.valkey.io`), kept by
:class:`~kvhex.adapters.storage.tier.BlockTierStore` like every persistent tier.

Who evicts is the ``eviction`` option:

* ``"kvhex"`` (default): the tier holds at most ``capacity_bytes`` (a 4 KiB header area per
  block included) and evicts by its policy beyond, announcing each removal. A server that
  also evicts or expires keys is tolerated, not announced ahead: a get or probe that finds a
  block gone drops it from the index and announces it removed.
* ``"server"``: the server's ``maxmemory-policy`` evicts; kvhex sets no bound of its own and
  announces what the server dropped, heard from keyspace notifications on every primary
  (:mod:`kvhex.adapters.storage.valkey.notifications`): each poll drops those keys from the
  index as a get that finds them gone would, so the events never claim a block the pool
  lost (docs/tiers.md).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import structlog

from kvhex.adapters.codecs.chain import CodecChain, as_chain
from kvhex.adapters.storage.block_io import NamespaceConflict
from kvhex.adapters.storage.format import namespace_config, namespace_digest
from kvhex.adapters.storage.namespace import check_sizes, io_root, recorded_namespace
from kvhex.adapters.storage.peers import check_peer_options
from kvhex.adapters.storage.tier import BlockTierStore
from kvhex.adapters.storage.valkey._client import (
    Connection,
    connect,
    parse_url,
    start_up_error,
)
from kvhex.adapters.storage.valkey.io import ValkeyIo
from kvhex.adapters.storage.valkey.notifications import ServerDrops
from kvhex.domain.jobs import JobResult
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.codec import BlockCodec
from kvhex.ports.host_buffer import HostBuffer

log = structlog.get_logger(__name__)

DEFAULT_IO_THREADS = 8
"""Concurrent IO jobs: each waits on the network, not the CPU."""
EVICTIONS = ("kvhex", "server")


class ValkeyTierStore(BlockTierStore):
    """A tier on Valkey. See the module docstring, and
    :class:`~kvhex.adapters.storage.tier.BlockTierStore` for the guarantees.

    Args:
        host: the host buffer whose slots jobs name.
        url: ``valkey://HOST:PORT[,HOST:PORT...]/PREFIX`` (``valkeys://``: TLS); the hosts
            are seed nodes, the prefix starts every key of the tier.
        capacity_bytes: bytes the tier may hold (a 4 KiB header area per block included);
            kvhex's eviction beyond. Required with ``eviction = "kvhex"``, refused with
            ``"server"``.
        eviction: who evicts: ``"kvhex"`` (its policy at ``capacity_bytes``) or
            ``"server"`` (the server's ``maxmemory-policy``; kvhex announces what it drops).
        name: ownership name announced in events and used in errors.
        namespace: what makes blocks compatible (model, geometry, dtype, ...).
        medium, locality: announced in events (by default remote storage).
        cluster: ``None`` (default): a cluster client where the server says
            ``cluster_enabled``; ``True`` requires a cluster, ``False`` talks to the first
            node alone.
        username, password: ACL credentials (never logged, never in events or errors).
        password_file: a file holding the password instead (a mounted secret: vLLM logs its
            whole ``kv_connector_extra_config`` at start-up, so a password given there is in
            vLLM's log); one trailing newline is dropped.
        tls: TLS without the ``valkeys://`` scheme; ``tls_ca_file``, ``tls_cert_file``,
            ``tls_key_file``: the CA bundle and the client certificate and key (PEM).
        connect_timeout_s, command_timeout_s: seconds to connect, and to wait for a reply.
        io_threads: concurrent IO jobs (default 8).
        announce_peers: also announce the blocks other instances hold under the same prefix
            and namespace, under :attr:`peer_identity` (a ``SCAN`` of every primary each
            ``peer_scan_interval_s``, at most 3600).
        codec: codecs every block goes through on its IO thread (compression, quantization,
            encryption; docs/codecs.md), in encoding order; blocks stored with another chain
            live under another namespace digest.

    Raises:
        TypeError: ``announce_peers`` is not a ``bool`` or ``peer_scan_interval_s`` not a
            number.
        ValueError: ``capacity_bytes`` holds no block, ``io_threads`` is below 1, a timeout
            is not positive, or ``peer_scan_interval_s`` is out of range.
        TierUnavailable: the url is malformed, no node answers, the credentials are refused,
            the cluster is not ``ok``, or the namespace records another configuration; the
            message names the cause and :attr:`~TierUnavailable.option` the option to fix
            (``url``, ``password``, ``password_file``, ``username``, ``cluster``,
            ``tls_ca_file``,
            ``capacity_bytes``, ``eviction``: an unknown value, or a server that refuses
            ``CONFIG``, needed to turn keyspace notifications on).
    """

    def __init__(
        self,
        host: HostBuffer,
        url: str,
        *,
        capacity_bytes: int | None = None,
        eviction: Literal["kvhex", "server"] = "kvhex",
        name: str = "valkey",
        namespace: Mapping[str, Any] | None = None,
        medium: Medium = Medium.STORAGE,
        locality: Locality | None = Locality.REMOTE,
        cluster: bool | None = None,
        username: str | None = None,
        password: str | None = None,
        password_file: str | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        connect_timeout_s: float = 5.0,
        command_timeout_s: float = 10.0,
        io_threads: int | None = None,
        announce_peers: bool = False,
        peer_scan_interval_s: float = 1.0,
        codec: CodecChain | Sequence[BlockCodec] | None = None,
    ) -> None:
        check_peer_options(announce_peers, peer_scan_interval_s)
        chain = as_chain(codec)
        block = check_sizes(host, capacity_bytes, io_threads, chain)
        capacity_bytes = _bound(eviction, capacity_bytes, block, tier=name)
        for option, value in (
            ("connect_timeout_s", connect_timeout_s),
            ("command_timeout_s", command_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{option} must be > 0, got {value}")
        endpoint = parse_url(url, tier=name)
        conn = Connection(
            username=username,
            password=_password(password, password_file, tier=name),
            tls=tls or endpoint.tls,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            connect_timeout_s=connect_timeout_s,
            command_timeout_s=command_timeout_s,
        )
        client = connect(endpoint, conn, cluster, tier=name)
        self.namespace = recorded_namespace(namespace, host, chain)
        self.root = io_root(endpoint.prefix, self.namespace)
        self.url = url
        where = ",".join(f"{h}:{p}" for h, p in endpoint.nodes)
        try:
            io = ValkeyIo(
                client,
                self.root,
                config=namespace_config(self.namespace),
                where=where,
                records_opener=chain.record_sealer.open_record
                if chain and chain.record_sealer
                else None,
            )
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
        self.eviction = eviction
        self._drops: ServerDrops | None = None
        self._evicted_pending: set[OffloadKey] = set()
        if eviction == "server":
            try:
                self._drops = ServerDrops(
                    _primaries(client),
                    conn.client_kwargs(),
                    io.prefix,
                    io.key_of,
                    io.peer_keys,
                    primaries=_topology(client, endpoint.nodes, conn.client_kwargs()),
                    tier=name,
                )
            except TierUnavailable:
                client.close()
                raise
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
            announce_peers=announce_peers,
            peer_scan_interval_s=peer_scan_interval_s,
            codec=chain,
        )

    @property
    def server_gaps(self) -> int:
        """Times a node's notifications were lost (``eviction = "server"``); after each, a
        listing of the namespace found what the server dropped meanwhile."""
        return 0 if self._drops is None else self._drops.gaps

    @property
    def notified_by(self) -> list[str]:
        """``host:port`` of every primary whose keyspace notifications the tier listens to
        now (``eviction = "server"``; after a failover, the promoted replica's)."""
        return [] if self._drops is None else [f"{h}:{p}" for h, p in self._drops.nodes]

    def poll(self) -> list[JobResult]:
        """As :meth:`BlockTierStore.poll`; with ``eviction = "server"`` also drops (and
        announces removed) the blocks the server evicted or expired since the last poll."""
        results = super().poll()
        if self._closed:
            return results
        if self._drops is not None:
            self._apply_drops(*self._drops.take())
        return results

    def next_poll_at(self) -> float | None:
        """As :meth:`BlockTierStore.next_poll_at`; with ``eviction = "server"``, ``-inf``
        while the server's drops wait to be applied (an idle engine then polls, and
        announces them removed)."""
        if self._drops is not None and not self._closed and self._drops.waiting:
            return -math.inf
        return super().next_poll_at()

    def close(self) -> None:
        """As :meth:`BlockTierStore.close`, the notification listeners stopped first."""
        if self._drops is not None:
            self._drops.close()
        super().close()

    def _apply_drops(
        self, keys: list[OffloadKey], listings: Sequence[frozenset[OffloadKey]]
    ) -> None:
        """Drop what the server no longer holds (:meth:`BlockTierStore.drop_lost`): the keys
        it notified, and after a lost notification what a listing lacks. A key whose put was
        in flight is dropped once it lands."""
        gone = [*self._evicted_pending, *keys]
        held = self.keys() if listings else []
        for listed in listings:
            gone += [k for k in held if k not in listed]
        if gone:
            self._evicted_pending = self.drop_lost(gone)


def _password(password: str | None, password_file: str | None, *, tier: str) -> str | None:
    """The password given, or read from ``password_file``.

    Raises:
        TierUnavailable: both are given, or the file cannot be read (at ``password_file``;
            the message never holds the file's content).
    """
    if password_file is None:
        return password
    if password is not None:
        raise TierUnavailable(
            "give password or password_file, not both", tier=tier, option="password_file"
        )
    try:
        with open(password_file, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TierUnavailable(
            f"cannot read the password from {password_file!r}: {type(exc).__name__}"
            + (f" ({exc.strerror})" if isinstance(exc, OSError) and exc.strerror else ""),
            tier=tier,
            option="password_file",
        ) from None
    return text[:-1] if text.endswith("\n") else text


def _bound(eviction: str, capacity_bytes: int | None, block: int, *, tier: str) -> int:
    """The residency's bound: ``capacity_bytes``, or none to speak of where the server
    evicts.

    Raises:
        TierUnavailable: an unknown ``eviction``, ``capacity_bytes`` missing with kvhex's
            eviction or given with the server's.
    """
    if eviction not in EVICTIONS:
        raise TierUnavailable(
            f"eviction must be one of {', '.join(EVICTIONS)}, got {eviction!r}",
            tier=tier,
            option="eviction",
        )
    if eviction == "server":
        if capacity_bytes is not None:
            raise TierUnavailable(
                'with eviction = "server" the server\'s maxmemory bounds the tier: drop '
                "capacity_bytes",
                tier=tier,
                option="capacity_bytes",
            )
        return sys.maxsize // block * block
    if capacity_bytes is None:
        raise TierUnavailable(
            'capacity_bytes is required with eviction = "kvhex" (the default)',
            tier=tier,
            option="capacity_bytes",
        )
    return capacity_bytes


def _primaries(client: Any) -> list[tuple[str, int]]:
    """(host, port) of every primary of a cluster client, or of a standalone client's
    server."""
    if hasattr(client, "get_primaries"):
        return [(n.host, int(n.port)) for n in client.get_primaries()]
    kwargs = client.connection_pool.connection_kwargs
    return [(str(kwargs["host"]), int(kwargs["port"]))]


def _topology(
    client: Any, seeds: Sequence[tuple[str, int]], kwargs: dict[str, Any]
) -> Callable[[], list[tuple[str, int]]] | None:
    """For a cluster client: what asks the cluster for its primaries now (``CLUSTER
    NODES`` of the first node that answers, among those the client knows and the seeds), so
    that a failover's new primary is listened to; ``None`` for a standalone server."""
    if not hasattr(client, "get_primaries"):
        return None

    def primaries() -> list[tuple[str, int]]:
        import valkey

        lib: Any = valkey
        try:
            known = [(str(n.host), int(n.port)) for n in client.get_nodes()]
        except Exception:  # the client is rebuilding its table on another thread
            known = []
        for host, port in dict.fromkeys([*known, *seeds]):
            probe = lib.Valkey(host=host, port=port, **kwargs)
            try:
                nodes = probe.cluster("nodes")
            except Exception:
                continue
            finally:
                probe.close()
            return sorted(_serving_primaries(nodes))
        raise ConnectionError("no node of the cluster answers CLUSTER NODES")

    return primaries


def _serving_primaries(nodes: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, int]]:
    """The primaries that serve slots and are not marked failed, from valkey-py's parsed
    ``CLUSTER NODES`` (``"host:port"`` -> its ``flags`` and ``slots``)."""
    found = []
    for address, info in nodes.items():
        flags = str(info.get("flags", "")).split(",")
        if "master" in flags and "fail" not in flags and info.get("slots"):
            host, _, port = address.rpartition(":")
            found.append((host, int(port.partition("@")[0])))
    return found
