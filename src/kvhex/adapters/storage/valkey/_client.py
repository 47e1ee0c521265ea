"""Connecting to Valkey: the tier's URL parsed, a standalone or cluster client built and
checked, and valkey-py's exceptions mapped in one place (start-up failures to
:class:`~kvhex.errors.TierUnavailable` blaming the option to fix, run-time ones to a text
without credentials).

URL: ``valkey://HOST:PORT[,HOST:PORT...]/PREFIX`` (``valkeys://`` for TLS). The hosts are
seed nodes: a cluster is found from any of them. Credentials are never part of the URL (it is
named in errors): they are the ``username`` and ``password`` options.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvhex.errors import TierUnavailable

SCHEMES = ("valkey://", "valkeys://")
DEFAULT_PORT = 6379


@attrs.frozen
class Endpoint:
    """Where the tier's data lives: seed nodes, the key prefix, TLS from the scheme."""

    nodes: tuple[tuple[str, int], ...]
    prefix: str
    tls: bool


@attrs.frozen
class Connection:
    """How to reach the servers (everything but the seed nodes). ``password`` is never
    shown: ``repr`` leaves it out."""

    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    connect_timeout_s: float = 5.0
    command_timeout_s: float = 10.0

    def client_kwargs(self) -> dict[str, Any]:
        """The keyword arguments valkey-py's clients (standalone and cluster) take."""
        kwargs: dict[str, Any] = {
            "username": self.username,
            "password": self.password,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_timeout": self.command_timeout_s,
        }
        if self.tls:
            kwargs["ssl"] = True
            kwargs["ssl_ca_certs"] = self.tls_ca_file
            kwargs["ssl_certfile"] = self.tls_cert_file
            kwargs["ssl_keyfile"] = self.tls_key_file
        return kwargs


def parse_url(url: str, *, tier: str) -> Endpoint:
    """The seed nodes and key prefix of ``url``.

    Raises:
        TierUnavailable: ``url`` is not ``valkey://HOST:PORT[,...]/PREFIX`` (at ``url``).
    """

    def bad(problem: str) -> TierUnavailable:
        return TierUnavailable(
            f"{problem}; give valkey://HOST:PORT[,HOST:PORT...]/PREFIX", tier=tier, option="url"
        )

    scheme = next((s for s in SCHEMES if url.startswith(s)), None)
    if scheme is None:
        return _raise(bad(f"url {url!r} is not a valkey:// url"))
    hosts, _, prefix = url[len(scheme) :].partition("/")
    if "@" in hosts:
        # never echo the url here: it may hold a password
        return _raise(bad("the url holds credentials: give them as username and password"))
    prefix = prefix.strip("/")
    if not prefix:
        return _raise(bad(f"url {url!r} names no key prefix"))
    if "{" in prefix or "}" in prefix:
        return _raise(
            bad(
                f"the prefix {prefix!r} holds a hash tag: it would pin every key to "
                "one cluster slot"
            )
        )
    nodes = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon:
            host, port = port, str(DEFAULT_PORT)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return _raise(bad(f"url {url!r}: {part!r} is not HOST:PORT"))
        nodes.append((host, int(port)))
    return Endpoint(tuple(nodes), prefix, scheme == "valkeys://")


def _raise(exc: TierUnavailable) -> Endpoint:
    raise exc


def connect(endpoint: Endpoint, conn: Connection, cluster: bool | None, *, tier: str) -> Any:
    """A checked client: standalone, or a cluster client when ``cluster`` is true or (``None``)
    the first node that answers says ``cluster_enabled``; a cluster must be ``ok``.

    Raises:
        TierUnavailable: no node answers, the credentials are refused, the server is not a
            cluster where one was asked for, or the cluster is not ``ok``; the option to fix
            named (``url``, ``username``, ``password``, ``tls_*``).
    """
    import valkey
    from valkey import cluster as valkey_cluster

    # valkey-py's annotations are partial (sync and async unions): its clients are Any here
    lib: Any = valkey
    nodes_lib: Any = valkey_cluster
    kwargs = conn.client_kwargs()
    probe = None
    failure: BaseException | None = None
    for host, port in endpoint.nodes:
        client = lib.Valkey(host=host, port=port, **kwargs)
        try:
            enabled = bool(client.info("cluster").get("cluster_enabled"))
        except Exception as exc:
            client.close()
            failure = exc
            if isinstance(exc, valkey.AuthenticationError | valkey.ResponseError):
                break  # the node answered: the others would answer the same
            continue
        probe = (client, host, port, enabled)
        break
    if probe is None:
        assert failure is not None
        if _client_certificate_wanted(failure, conn):
            raise TierUnavailable(
                f"TLS to {_nodes(endpoint.nodes)}: the server closed the connection after the "
                f"handshake ({safe_text(failure)}): it may require a client certificate: "
                "give tls_cert_file and tls_key_file",
                tier=tier,
                option="tls_cert_file",
            ) from failure
        raise start_up_error(failure, endpoint, tier=tier) from failure
    client, host, port, enabled = probe
    if cluster is None:
        cluster = enabled
    if not cluster:
        return client
    client.close()
    where = _nodes(endpoint.nodes)
    if not enabled:
        raise TierUnavailable(
            f"{host}:{port} is not a cluster node (cluster_enabled is 0): drop the cluster "
            "option or point the url at a cluster",
            tier=tier,
            option="cluster",
        )
    try:
        nodes = [nodes_lib.ClusterNode(h, p) for h, p in endpoint.nodes]
        client = nodes_lib.ValkeyCluster(startup_nodes=nodes, **kwargs)
        state = client.cluster_info().get("cluster_state")
    except Exception as exc:
        client.close()
        raise start_up_error(exc, endpoint, tier=tier) from exc
    if state != "ok":
        client.close()
        raise TierUnavailable(
            f"the cluster at {where} is not ok (cluster_state: {state}): a node is down or "
            "slots are not covered",
            tier=tier,
            option="url",
        )
    return client


def _client_certificate_wanted(exc: BaseException, conn: Connection) -> bool:
    """Whether ``exc`` is a TLS server hanging up on a client without a certificate: with
    TLS 1.3 the server checks the client's certificate after the handshake, and the client
    only sees the connection close."""
    import valkey

    if not conn.tls or conn.tls_cert_file is not None:
        return False
    text = safe_text(exc)
    return isinstance(exc, valkey.ConnectionError) and any(
        cue in text for cue in ("closed", "reset", "certificate required")
    )


def _nodes(nodes: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{h}:{p}" for h, p in nodes)


def start_up_error(exc: BaseException, endpoint: Endpoint, *, tier: str) -> TierUnavailable:
    """What a failed start-up reports, and the option that would fix it."""
    import valkey
    from valkey.exceptions import ClusterError, ValkeyClusterException

    where = _nodes(endpoint.nodes)
    text = safe_text(exc)
    if isinstance(exc, valkey.AuthenticationError) or "WRONGPASS" in text or "NOAUTH" in text:
        return TierUnavailable(
            f"{where} refused the credentials: {text}", tier=tier, option="password"
        )
    if isinstance(exc, valkey.exceptions.NoPermissionError) or "NOPERM" in text:
        return TierUnavailable(
            f"the user may not run kvhex's commands on {where}: {text}",
            tier=tier,
            option="username",
        )
    if isinstance(exc, ClusterError | ValkeyClusterException):
        return TierUnavailable(
            f"the cluster at {where} is not usable: {text}", tier=tier, option="url"
        )
    if isinstance(exc, valkey.ConnectionError | valkey.TimeoutError | OSError):
        if endpoint.tls and ("SSL" in text or "certificate" in text):
            return TierUnavailable(
                f"TLS to {where} failed: {text}", tier=tier, option="tls_ca_file"
            )
        return TierUnavailable(f"no node of {where} answers: {text}", tier=tier, option="url")
    return TierUnavailable(f"{where}: {type(exc).__name__}: {text}", tier=tier, option="url")


def safe_text(exc: BaseException) -> str:
    """``exc``'s message, short, with nothing that could be a credential (valkey-py's
    messages name hosts and server replies, never the password; AUTH commands are cut)."""
    text = str(exc)
    if "AUTH" in text and "WRONGPASS" not in text and "NOAUTH" not in text:
        return type(exc).__name__
    return text[:300]
