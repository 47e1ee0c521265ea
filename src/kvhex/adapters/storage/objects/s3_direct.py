"""Block reads from an S3-compatible endpoint straight into host memory: the read path of the
fsspec tier on ``s3://`` where its requests are plain to build.

s3fs runs every request of a process on one asyncio loop thread. On reads that thread's Python
work (botocore building and parsing each request, aiohttp taking the body in chunks and joining
them into one ``bytes``) was the tier's limit: it ran all the time while the server waited
(docs/performance.md). Here the reader's own threads send GETs with ``http.client``, signed
with SigV4 by botocore from the s3fs client's credentials, region and endpoint, and receive
each block with ``recv_into``: its header area into a small buffer, its payload straight into
the host slot. No event loop, no copy; the socket waits release the GIL.

Used only where a request is plain to build the way botocore builds it for that client: a
custom ``endpoint_url`` (S3-compatible servers, not an IPv6 literal) with path-style
addressing, over http or https with the default certificate checks, a path of URL-safe
characters, and no CRC check of each response asked of botocore
(``response_checksum_validation``). Otherwise, and for every answer but a whole block (200)
or a missing key (404 ``NoSuchKey``), the read goes through s3fs, which names the cause (a
lost bucket, credentials, an endpoint down: :mod:`kvhex.adapters.storage.objects._errors`).
Refusals (a 4xx answer) are told apart from other fallbacks (:data:`REFUSED`), and
:attr:`DirectReader.refusal` keeps the last one, for the caller that turns the reader off
when the server keeps refusing it what s3fs is served.

Threads: :meth:`DirectReader.read` runs on any IO thread and hands a job's GETs to the
reader's own request threads (:data:`REQUESTS_IN_FLIGHT`), each keeping its own connection
(kept alive when the server allows it, closed by :meth:`DirectReader.close`).
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import re
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import structlog

from kvhex.adapters.storage.format import HEADER_AREA

log = structlog.get_logger(__name__)

FALLBACK = object()
"""What :meth:`DirectReader.read` answers for an object it left to s3fs."""
REFUSED = object()
"""What :meth:`DirectReader.read` answers for an object the server refused it with a client
error (4xx but ``NoSuchKey``): left to s3fs too. A server that keeps refusing GETs that s3fs
is served (a proxy rejecting their signature) is not going to serve them."""
_PLAIN_PATH = re.compile(r"[A-Za-z0-9._~/-]+")
REQUESTS_IN_FLIGHT = 32
"""GETs in flight at once, over every IO thread's jobs (one connection each): a job's
blocks are read side by side, as s3fs's batches are, so a server's latency is paid once per
batch, not once per block."""
_TIMEOUT_S = 60.0
"""Seconds a socket may wait, where the client's config gives no timeouts (botocore's own
connect and read timeouts otherwise, the longer of the two)."""
_AWS_HOSTS = (".amazonaws.com", ".amazonaws.com.cn")


class DirectReader:
    """Signed GETs for the objects of one s3fs filesystem. Build with :meth:`of`."""

    def __init__(
        self, fs: Any, scheme: str, host: str, port: int | None, *, region: str, timeout: float
    ) -> None:
        self._fs = fs
        self._timeout = timeout
        self._https = scheme == "https"
        self._host = host
        self._port = port
        self._origin = f"{scheme}://{host}" + (f":{port}" if port else "")
        self._region = region
        self.refusal: str | None = None
        """The status of the last refused GET (``HTTP 403``, say)."""
        self._local = threading.local()
        self._connections: set[http.client.HTTPConnection] = set()
        self._connections_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(REQUESTS_IN_FLIGHT, thread_name_prefix="kvhex-s3-get")

    @classmethod
    def of(cls, fs: Any) -> DirectReader | None:
        """A reader for ``fs`` (an s3fs filesystem whose client was made), or ``None`` where
        its requests are not plain to build (see the module docstring)."""
        meta = getattr(getattr(fs, "s3", None), "meta", None)
        if meta is None or "verify" in (getattr(fs, "client_kwargs", None) or {}):
            return None
        addressing = (getattr(meta.config, "s3", None) or {}).get("addressing_style") or "auto"
        parts = urlsplit(meta.endpoint_url or "")
        if (
            addressing == "virtual"
            # a user who asked botocore to check each GET's CRC gets botocore's reads
            or getattr(meta.config, "response_checksum_validation", None) == "when_supported"
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or ":" in parts.hostname  # an IPv6 literal
            or parts.hostname.endswith(_AWS_HOSTS)  # AWS's own: virtual-hosted addressing
            or parts.path not in ("", "/")
        ):
            return None
        timeout = max(meta.config.connect_timeout or 0, meta.config.read_timeout or 0)
        region = meta.region_name or "us-east-1"
        return cls(
            fs,
            parts.scheme,
            parts.hostname,
            parts.port,
            region=region,
            timeout=timeout or _TIMEOUT_S,
        )

    def read(self, objects: Sequence[tuple[str, memoryview]]) -> list[Any]:
        """GET each (path, view): per object the header area of a whole block (its payload in
        the view), ``None`` for a missing key, ``b""`` for an object that is not a whole
        block, or :data:`FALLBACK` (left to s3fs: any other answer or failure)."""
        credentials = self._credentials()
        if credentials is FALLBACK:
            return [FALLBACK] * len(objects)

        def get(one: tuple[str, memoryview]) -> Any:
            path, view = one
            return self._get(path, view, credentials) if _PLAIN_PATH.fullmatch(path) else FALLBACK

        if len(objects) == 1:
            return [get(objects[0])]
        return list(self._pool.map(get, objects))

    def close(self) -> None:
        """Stop the request threads and close their connections."""
        self._pool.shutdown(wait=True)
        with self._connections_lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()

    # -- one request ---------------------------------------------------------------------
    def _credentials(self) -> Any:
        """The client's current credentials (refreshed as its own requests would be),
        ``None`` for anonymous access, or :data:`FALLBACK`."""
        try:
            from fsspec.asyn import sync

            signer_credentials = self._fs.s3._request_signer._credentials
            if signer_credentials is None:
                return None
            return sync(self._fs.loop, signer_credentials.get_frozen_credentials)
        except Exception as exc:  # a client without the usual signer: s3fs reads
            log.debug("s3_direct_unavailable", error=type(exc).__name__)
            return FALLBACK

    def _get(self, path: str, view: memoryview, credentials: Any) -> Any:
        url = f"{self._origin}/{path}"
        headers = self._signed(url, credentials)
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more
            conn = self._connection(fresh=attempt > 0)
            try:
                conn.request("GET", f"/{path}", headers=headers)
                response = conn.getresponse()
                return self._answer(response, view, conn)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()  # tried once more on a fresh connection, then left to s3fs
            except (OSError, http.client.HTTPException):
                conn.close()
                return FALLBACK
        return FALLBACK

    def _answer(
        self, response: http.client.HTTPResponse, view: memoryview, conn: http.client.HTTPConnection
    ) -> Any:
        length = response.getheader("Content-Length")
        if response.status == 200 and length == str(HEADER_AREA + len(view)):
            header = bytearray(HEADER_AREA)
            if _fill(response, memoryview(header)) and _fill(response, view):
                _done(response, conn)
                return bytes(header)
            conn.close()
            return FALLBACK  # the connection broke off: s3fs tries again and names why
        body = response.read(64 << 10) if response.status != 200 else b""
        conn.close()
        if response.status == 200:
            # another length is not a whole block; no length at all (a chunked answer) is
            # left to s3fs, which reads it whole and judges it
            return b"" if length is not None else FALLBACK
        if response.status == 404 and b"<Code>NoSuchKey</Code>" in body:
            return None
        if 400 <= response.status < 500:
            self.refusal = f"HTTP {response.status}"
            return REFUSED
        return FALLBACK  # a server error (503 SlowDown, say) is s3fs's to retry

    def _signed(self, url: str, credentials: Any) -> dict[str, str]:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method="GET", url=url, headers={"User-Agent": "kvhex"})
        if credentials is not None:
            S3SigV4Auth(credentials, "s3", self._region).add_auth(request)
        return dict(request.headers.items())

    def _connection(self, *, fresh: bool) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
                with self._connections_lock:
                    self._connections.discard(conn)
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self._timeout)
            self._local.conn = conn
            with self._connections_lock:
                self._connections.add(conn)
        return conn


def _fill(response: http.client.HTTPResponse, view: memoryview) -> bool:
    """Read exactly ``len(view)`` bytes into ``view``; False when the body ends first."""
    got = 0
    while got < len(view):
        n = response.readinto(view[got:])
        if not n:
            return False
        got += n
    return True


def _done(response: http.client.HTTPResponse, conn: http.client.HTTPConnection) -> None:
    """The body was read whole: keep the connection unless the server closes it."""
    # more than Content-Length said, or the server ends it: not a connection to reuse
    if response.read(1) or response.will_close:
        conn.close()
