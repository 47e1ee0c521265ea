"""ZMQ endpoints checked before a socket sees them, and ZMQ's refusals named as what they are.

libzmq is lenient where a mistake should be loud: it binds ``tcp://127.0.0.1:99999`` to a
random port and ``:-1`` to port 65535, and connects to anything that parses, so a typo only
shows up as a stream nobody receives. :func:`endpoint_problem` refuses such endpoints up
front, and :func:`refusal` turns the ``zmq.ZMQError`` of a bind or connect that still fails
(an address in use, an address no interface has) into a sentence saying what would work.

Nothing here imports zmq: the CLI checks its flags with it before loading pyzmq.
"""

from __future__ import annotations

import errno

SCHEMES = ("tcp", "ipc", "inproc")
"""The transports a PUB, SUB, ROUTER or DEALER socket can use."""

SHAPES = "tcp://HOST:PORT, ipc://PATH or inproc://NAME"

# libzmq's own error numbers (ZMQ_HAUSNUMERO + n) for what errno has no name for
_ENOCOMPATPROTO = 156384764


def is_endpoint(text: str) -> bool:
    """``text`` names a transport (``scheme://...``) rather than a file."""
    return "://" in text


def endpoint_problem(endpoint: str, *, bind: bool) -> str | None:
    """What is wrong with ``endpoint`` for a socket that binds (or connects), or ``None``.

    A TCP port must be 1-65535; a bound one may also be ``*`` or ``0`` (any free port).
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return f"not an endpoint: expected {SHAPES}"
    if scheme not in SCHEMES:
        return (
            f"transport {scheme!r} cannot carry KV events (ZMQ PUB/SUB sockets take tcp, "
            f"ipc and inproc): expected {SHAPES}"
        )
    if not rest:
        return f"{scheme}:// needs an address: expected {SHAPES}"
    return _tcp_problem(rest, bind=bind) if scheme == "tcp" else None


def _tcp_problem(address: str, *, bind: bool) -> str | None:
    host, colon, port = address.rpartition(":")
    any_port = " or * (any free port)" if bind else ""
    problem: str | None
    if not colon or not host:
        problem = (
            "a TCP endpoint needs a host and a port: tcp://HOST:PORT (e.g. tcp://127.0.0.1:5557)"
        )
    elif port == "*" or (bind and port == "0"):
        problem = None if bind else "cannot connect to port *: name the publisher's port"
    elif not port.isdigit():
        problem = f"port {port!r} is not a number: give 1-65535{any_port}"
    elif not 1 <= int(port) <= 65535:
        problem = f"port {port} is out of range: give 1-65535{any_port}"
    else:
        problem = None
    return problem


_REFUSALS = {
    errno.EADDRINUSE: (
        "address already in use (another kvhex run or engine publishes there?): pick a free "
        "port, or port * for any free one"
    ),
    errno.EADDRNOTAVAIL: (
        "no interface of this machine has that address: bind 127.0.0.1 (this machine only), "
        "* (every interface) or one of its own addresses"
    ),
    errno.ENOENT: "its directory does not exist: create it or pick another ipc:// path",
    errno.EACCES: "permission denied: pick a port above 1023 or a path you may write",
    errno.EPROTONOSUPPORT: f"transport not supported for this socket: expected {SHAPES}",
    _ENOCOMPATPROTO: f"transport not supported for this socket: expected {SHAPES}",
    errno.EINVAL: f"not a usable endpoint: expected {SHAPES}",
}
_REFUSALS[errno.ENODEV] = _REFUSALS[errno.EADDRNOTAVAIL]  # a bind to a name no interface has


def refusal(code: int | None, text: str, *, bind: bool, may_connect: bool = False) -> str:
    """The sentence for a bind (or connect) ZMQ refused with error ``code`` (``text``: ZMQ's
    own words, used when the code is not one of the known ones). ``may_connect``: the
    socket could connect instead (said when a bound address is not this machine's)."""
    known = _REFUSALS.get(code) if code is not None else None
    if known and bind and may_connect and code in (errno.EADDRNOTAVAIL, errno.ENODEV):
        known += "; to reach a subscriber on another host, connect to it instead (connect=True)"
    return known or f"cannot {'bind' if bind else 'connect'}: {text}"
