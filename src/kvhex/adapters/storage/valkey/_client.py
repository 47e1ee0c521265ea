"""Connecting to Valkey: the tier's URL parsed, a standalone or cluster client built and
checked, and valkey-py's exceptions mapped in one place (start-up failures to
:class:`~kvhex.errors.TierUnavailable` blaming the option to fix, run-time ones to a text
without credentials).

URL: ``valkey://HOST:PORT[,HOST:PORT...]/PREFIX`` (``valkeys://`` for TLS). The hosts are
seed nodes: a cluster is found from any of them. Credentials are never part of the URL (it is
named in errors): they are the ``username`` and ``password`` options.

Blocks cross the wire without valkey-py's copies (:func:`tune`, run on every connection the
tier's clients open, after the handshake): a block's ``SET`` value (:class:`Parts`) goes out
as its header area, made as it is sent, then the host slot itself; and a large bulk reply (a
block's ``GET``) is received straight into one ``bytearray`` of its size, where valkey-py's
reader copies it three or four times on its way through a ``BytesIO``. On Linux over plain
TCP the command timeout is kept by the kernel (``SO_RCVTIMEO``/``SO_SNDTIMEO`` on a blocking
socket) rather than by Python, which polls before every ``send`` and ``recv`` of a socket
with a timeout; a timeout is still valkey-py's ``TimeoutError``. bench/valkey_tier.py
measures all of it against the raw client; docs/tiers.md has the figures.
"""

from __future__ import annotations

import functools
import socket
import struct
import sys
from collections.abc import Callable, Sequence
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
        client = lib.Valkey(
            host=host, port=port, valkey_connect_func=_handshake_then_tune, **kwargs
        )
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
        # the cluster client runs the handshake itself, then this hook
        client = nodes_lib.ValkeyCluster(startup_nodes=nodes, valkey_connect_func=tune, **kwargs)
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


# -- the wire ------------------------------------------------------------------------------
DIRECT_BYTES = 64 * 1024
"""Bulk replies from this size on are received straight into their own buffer."""


class Parts:
    """A command's last argument, sent as a head of ``head_bytes`` made by ``make_head`` (a
    block's header area, whose checksum reads the payload) just before it goes out, then
    ``body`` as it is, never copied: a block's ``SET`` value. Made at send time, the checksum
    pulls the payload into the CPU cache the send then copies it from; made for a whole
    pipeline ahead, each payload came from memory twice (on 2 MiB blocks to a standalone
    server, put fell from 0.96x to 0.80x of the raw client's rate). Only connections
    :func:`tune` set up can send one (valkey-py's packer refuses it)."""

    __slots__ = ("body", "head", "nbytes")

    def __init__(self, head_bytes: int, make_head: Callable[[], bytes], body: memoryview) -> None:
        self.head = _Head(head_bytes, make_head)
        self.body = body
        self.nbytes = head_bytes + body.nbytes


class _Head(bytearray):
    """Where a :class:`Parts` head goes in a packed command: an empty buffer (valkey-py
    keeps a ``memoryview`` of it apart from the bytes it joins) that names how to make the
    head and its length."""

    __slots__ = ("make", "nbytes")

    def __init__(self, nbytes: int, make: Callable[[], bytes]) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.make = make

    def made(self) -> bytes:
        head = self.make()
        if len(head) != self.nbytes:
            raise ValueError(f"a {len(head)}-byte head where {self.nbytes} were framed")
        return head


class _PartsPacker:
    """valkey-py's command packer (``inner``), but a command whose last argument is
    :class:`Parts` is framed here: its head as a placeholder (:class:`_Head`) that
    :class:`_PartsSender` makes when it sends it, its body as it is (valkey-py sends
    memoryviews apart, without joining them)."""

    def __init__(self, inner: Any, encode: Callable[[Any], Any]) -> None:
        self.inner = inner
        self.encode = encode

    def pack(self, *args: Any) -> list[Any]:
        value = args[-1]
        if type(value) is not Parts:
            packed: list[Any] = self.inner.pack(*args)
            return packed
        frame = [b"*%d\r\n" % len(args)]
        for arg in map(self.encode, args[:-1]):
            frame += (b"$%d\r\n" % len(arg), arg, b"\r\n")
        frame.append(b"$%d\r\n" % value.nbytes)
        return [b"".join(frame), memoryview(value.head), value.body, b"\r\n"]


def _is_head(item: Any) -> bool:
    return type(item) is memoryview and type(item.obj) is _Head


class _PartsSender:
    """A tuned connection's ``send_packed_command``: a packed command holding a
    :class:`Parts` head is sent here, each head made as its turn comes and sent joined to
    the frame before it (one send per block's frame, as valkey-py's framing takes: each
    send is a TCP segment the server wakes for), with valkey-py's error mapping; any other
    goes to valkey-py's own (``send``)."""

    __slots__ = ("connection", "send")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.send: Callable[..., None] = connection.send_packed_command

    def __call__(self, command: Any, check_health: bool = True) -> None:
        if not isinstance(command, list) or not any(map(_is_head, command)):
            self.send(command, check_health)
            return
        connection = self.connection
        if not connection._sock:
            connection.connect()
        if check_health:
            connection.check_health()
        sendall = connection._sock.sendall
        last = len(command) - 1
        try:
            for at, item in enumerate(command):
                if _is_head(item):
                    before, head = command[at - 1], item.obj.made()
                    sendall(before + head if type(before) is bytes else head)
                elif at == last or type(item) is not bytes or not _is_head(command[at + 1]):
                    sendall(item)  # else it goes out with the head after it
        except BaseException as exc:
            connection.disconnect()  # part of the pipeline may have gone out
            error = _send_error(exc)
            if error is exc:
                raise
            raise error from exc


def _send_error(exc: BaseException) -> BaseException:
    """What valkey-py's ``send_packed_command`` raises for ``exc``; a kernel send timeout
    (:func:`tune`: ``EAGAIN`` from a blocking socket) is a timeout too."""
    from valkey.exceptions import ConnectionError as ValkeyConnectionError
    from valkey.exceptions import TimeoutError as ValkeyTimeoutError

    if isinstance(exc, TimeoutError | BlockingIOError):
        return ValkeyTimeoutError("Timeout writing to socket")
    if isinstance(exc, OSError):
        errno, message = ("UNKNOWN", exc.args[0]) if len(exc.args) == 1 else exc.args[:2]
        return ValkeyConnectionError(f"Error {errno} while writing to socket. {message}.")
    return exc


def _handshake_then_tune(connection: Any) -> None:
    """valkey-py's connect hook on a standalone client, which replaces its handshake (AUTH,
    HELLO, ...): the handshake, then :func:`tune`."""
    connection.on_connect()
    tune(connection)


def tune(connection: Any) -> None:
    """Set up a connection just opened (and handshaken) to send :class:`Parts` and to receive
    large bulk replies without copies, its timeout kept by the kernel where it can be. Runs
    on every (re)connection; a connection with valkey-py's C reader (``libvalkey``
    installed) keeps it, and Python's timeouts."""
    packer = connection._command_packer
    if not isinstance(packer, _PartsPacker):
        connection._command_packer = _PartsPacker(packer, connection.encoder.encode)
        connection.send_packed_command = _PartsSender(connection)
    parser = connection._parser
    buffer: Any = getattr(parser, "_buffer", None)  # valkey-py's reader in Python
    bulk = _bulk_buffer()
    if type(buffer) is not bulk.__base__ or buffer.unread_bytes():
        return
    sock, timeout = buffer._sock, buffer.socket_timeout
    if timeout and sys.platform == "linux" and type(sock) is socket.socket:  # not TLS
        seconds = int(timeout)
        interval = struct.pack("@ll", seconds, int((timeout - seconds) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, interval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, interval)
        sock.settimeout(None)  # blocking: valkey-py's poll-free path
        parser._buffer = bulk(_KernelTimed(sock), buffer.socket_read_size, None)
    else:
        parser._buffer = bulk(sock, buffer.socket_read_size, timeout)


class _KernelTimed:
    """The blocking socket a tuned reply buffer reads from, whose kernel timeout (which a
    ``recv`` reports as ``EAGAIN``) is raised as ``socket.timeout``, as a socket with a
    Python timeout raises it: valkey-py then reports a ``TimeoutError``. A read that
    valkey-py makes non-blocking itself (``can_read``) keeps its ``BlockingIOError``."""

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def recv(self, size: int) -> bytes:
        try:
            return self.sock.recv(size)
        except BlockingIOError:
            if self.sock.gettimeout() is not None:
                raise
            raise TimeoutError("timed out") from None

    def recv_into(self, buffer: memoryview) -> int:
        try:
            return self.sock.recv_into(buffer)
        except BlockingIOError:
            if self.sock.gettimeout() is not None:
                raise
            raise TimeoutError("timed out") from None

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)


@functools.cache
def _bulk_buffer() -> Any:
    """valkey-py's reply buffer, where a bulk reply of at least :data:`DIRECT_BYTES` is
    received into a ``bytearray`` of its size (the bytes already buffered, then
    ``recv_into`` the rest), which the reply then is. Built on first use: valkey-py is
    imported only by a tier that runs."""
    from valkey._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR, SocketBuffer
    from valkey.exceptions import ConnectionError as ValkeyConnectionError

    class BulkBuffer(SocketBuffer):
        def read(self, length: int) -> Any:
            if length < DIRECT_BYTES:
                return super().read(length)
            value = bytearray(length + 2)  # with the reply's closing CRLF
            with memoryview(value) as view:
                got = self._buffer.readinto(view)
                while got < len(view):
                    # a timeout or a broken socket: the connection disconnects and raises
                    n = self._sock.recv_into(view[got:])
                    if not n:
                        raise ValkeyConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                    got += n
            del value[length:]
            return value

    return BulkBuffer
