"""Blocks to and from an S3-compatible endpoint straight out of and into host memory: the
data path of the fsspec tier on ``s3://`` where its requests are plain to build.

s3fs runs every request of a process on one asyncio loop thread. That thread's Python work
(botocore building, hashing and parsing each request, aiohttp taking a body in chunks and
joining them into one ``bytes``, or copying one out) was the tier's limit: it ran all the time
while the server waited (docs/performance.md). Here the tier's own threads send requests with
``http.client``, signed with SigV4 by botocore from the s3fs client's credentials, region and
endpoint. A GET receives each block with ``recv_into``: its header area into a small buffer,
its payload straight into the host slot. A PUT sends the header area and then the payload from
the host slot as they are, unhashed (``UNSIGNED-PAYLOAD``: the block's own XXH3 checksum, in
its header, is verified on every read). No event loop, no copy; the socket waits release the
GIL.

Used only where a request is plain to build the way botocore builds it for that client: a
custom ``endpoint_url`` (S3-compatible servers, not an IPv6 literal) with path-style
addressing, over http or https with the default certificate checks, a path of URL-safe
characters, no CRC asked of botocore (``response_checksum_validation`` for GETs,
``request_checksum_calculation`` for PUTs) and no payload signing asked
(``payload_signing_enabled``). Otherwise, and for every answer but a whole block (200) or a
missing key (404 ``NoSuchKey``) to a GET and a stored object (200) to a PUT, the request goes
through s3fs, which names the cause (a lost bucket, credentials, an endpoint down:
:mod:`kvhex.adapters.storage.objects._errors`). Refusals (a 4xx answer) are told apart from
other fallbacks (:data:`REFUSED`), and :attr:`DirectS3.refusal` keeps the last one, for the
caller that turns direct requests off when the server keeps refusing them what s3fs is served.

Threads: :meth:`DirectS3.read` and :meth:`DirectS3.write` run on any IO thread and hand a
job's requests to the object's own request threads (:data:`REQUESTS_IN_FLIGHT`), each keeping
its own connection (kept alive when the server allows it, closed by :meth:`DirectS3.close`).
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import hashlib
import hmac
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
"""What :meth:`DirectS3.read` and :meth:`DirectS3.write` answer for an object they left to
s3fs."""
REFUSED = object()
"""What :meth:`DirectS3.read` and :meth:`DirectS3.write` answer for an object the server
refused with a client error (4xx but a GET's ``NoSuchKey``): left to s3fs too. A server that
keeps refusing requests that s3fs is served (a proxy rejecting their signature) is not going
to serve them."""
_PLAIN_PATH = re.compile(r"[A-Za-z0-9._~/-]+")
REQUESTS_IN_FLIGHT = 32
"""Requests in flight at once, over every IO thread's jobs (one connection each): a job's
blocks are read or written side by side, as s3fs's batches are, so a server's latency is paid
once per batch, not once per block."""
_TIMEOUT_S = 60.0
"""Seconds a socket may wait, where the client's config gives no timeouts (botocore's own
connect and read timeouts otherwise, the longer of the two)."""
_AWS_HOSTS = (".amazonaws.com", ".amazonaws.com.cn")


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


class SigV4:
    """AWS Signature Version 4 in headers, for the tier's own requests, by S3's rules: the
    path as sent (plain: nothing to escape), no query, the payload's hash a header (a GET's
    empty body, or a PUT's ``UNSIGNED-PAYLOAD``: a block's integrity is its own checksum's).
    Signs ``host``, ``x-amz-content-sha256``, ``x-amz-date`` and a session token. The day's
    signing key is kept: per request one SHA-256 and one HMAC, about a tenth of botocore's
    Python work.

    Args:
        region: the signing region.
        host: the ``Host`` header the request carries (``HOST:PORT`` unless the port is the
            scheme's default).
    """

    def __init__(self, region: str, host: str) -> None:
        self._region = region
        self._host = host
        self._key: tuple[str, str, bytes] | None = None  # (secret, day, key)

    def headers(
        self, method: str, path: str, credentials: Any, payload: str, now: datetime.datetime
    ) -> dict[str, str]:
        """The headers that sign a ``method`` request on ``/path`` at ``now`` (UTC) with
        ``credentials`` (botocore's frozen ones; ``None``: anonymous, nothing signed)."""
        stamp = now.strftime("%Y%m%dT%H%M%SZ")
        headers = {"host": self._host, "x-amz-content-sha256": payload, "x-amz-date": stamp}
        if credentials is None:
            return headers
        if credentials.token:
            headers["x-amz-security-token"] = credentials.token
        names = sorted(headers)
        signed = ";".join(names)
        canonical = "\n".join(
            [method, f"/{path}", "", *(f"{n}:{headers[n].strip()}" for n in names), "", signed]
        )
        canonical += "\n" + payload
        scope = f"{stamp[:8]}/{self._region}/s3/aws4_request"
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{digest}"
        key = self._day_key(credentials.secret_key, stamp[:8])
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}"
        )
        return headers

    def _day_key(self, secret: str, day: str) -> bytes:
        kept = self._key
        if kept is not None and kept[0] == secret and kept[1] == day:
            return kept[2]
        key = f"AWS4{secret}".encode()
        for part in (day, self._region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        self._key = (secret, day, key)
        return key


class DirectS3:
    """Signed GETs and PUTs for the objects of one s3fs filesystem. Build with :meth:`of`."""

    def __init__(
        self, fs: Any, scheme: str, host: str, port: int | None, *, region: str, timeout: float
    ) -> None:
        self._fs = fs
        self._timeout = timeout
        self._https = scheme == "https"
        self._host = host
        self._port = port
        default = 443 if self._https else 80
        self._signer = SigV4(region, host if port in (None, default) else f"{host}:{port}")
        self.refusal: str | None = None
        """The method and status of the last refused request (``GET HTTP 403``, say)."""
        self._local = threading.local()
        self._connections: set[http.client.HTTPConnection] = set()
        self._connections_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(REQUESTS_IN_FLIGHT, thread_name_prefix="kvhex-s3")

    @classmethod
    def of(cls, fs: Any) -> DirectS3 | None:
        """Direct requests for ``fs`` (an s3fs filesystem whose client was made), or ``None``
        where its requests are not plain to build (see the module docstring)."""
        meta = getattr(getattr(fs, "s3", None), "meta", None)
        if meta is None or "verify" in (getattr(fs, "client_kwargs", None) or {}):
            return None
        s3_config = getattr(meta.config, "s3", None) or {}
        addressing = s3_config.get("addressing_style") or "auto"
        parts = urlsplit(meta.endpoint_url or "")
        if (
            addressing == "virtual"
            # a user who asked botocore for a CRC of each request, or to hash each PUT's
            # payload into its signature, gets botocore's requests
            or getattr(meta.config, "response_checksum_validation", None) == "when_supported"
            or getattr(meta.config, "request_checksum_calculation", None) == "when_supported"
            or s3_config.get("payload_signing_enabled")
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

    def read(self, objects: Sequence[tuple[str, memoryview]], *, up_to: bool = False) -> list[Any]:
        """GET each (path, view): per object the header area of a whole block (its payload in
        the view; with ``up_to`` a payload shorter than the view fills its start), ``None``
        for a missing key, ``b""`` for an object that is not a whole block, or
        :data:`FALLBACK` (left to s3fs: any other answer or failure)."""
        credentials = self._credentials()
        if credentials is FALLBACK:
            return [FALLBACK] * len(objects)

        def get(one: tuple[str, memoryview]) -> Any:
            path, view = one
            if not _PLAIN_PATH.fullmatch(path):
                return FALLBACK
            return self._get(path, view, credentials, up_to)

        if len(objects) == 1:
            return [get(objects[0])]
        return list(self._pool.map(get, objects))

    def write(self, objects: Sequence[tuple[str, bytes, memoryview]]) -> list[Any]:
        """PUT each (path, header area, payload), the two sent as they are: per object
        ``None`` once the server stored it, :data:`REFUSED` (a client error) or
        :data:`FALLBACK` (left to s3fs: any other answer or failure)."""
        credentials = self._credentials()
        if credentials is FALLBACK:
            return [FALLBACK] * len(objects)

        def put(one: tuple[str, bytes, memoryview]) -> Any:
            path, header, payload = one
            if not _PLAIN_PATH.fullmatch(path):
                return FALLBACK
            return self._put(path, header, payload, credentials)

        if len(objects) == 1:
            return [put(objects[0])]
        return list(self._pool.map(put, objects))

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

    def _get(self, path: str, view: memoryview, credentials: Any, up_to: bool) -> Any:
        headers = self._signed("GET", path, credentials)
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more
            conn = self._connection(fresh=attempt > 0)
            try:
                conn.request("GET", f"/{path}", headers=headers)
                response = conn.getresponse()
                return self._answer(response, view, conn, up_to)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()  # tried once more on a fresh connection, then left to s3fs
            except (OSError, http.client.HTTPException):
                conn.close()
                return FALLBACK
        return FALLBACK

    def _put(self, path: str, header: bytes, payload: memoryview, credentials: Any) -> Any:
        length = str(len(header) + len(payload))
        headers = {**self._signed("PUT", path, credentials), "Content-Length": length}
        for attempt in (0, 1):  # as for a GET: a PUT of the same bytes again is harmless
            conn = self._connection(fresh=attempt > 0)
            try:
                conn.putrequest("PUT", f"/{path}", skip_host=True, skip_accept_encoding=True)
                for name, value in headers.items():
                    conn.putheader(name, value)
                conn.endheaders()
                conn.send(header)
                conn.send(payload)
                response = conn.getresponse()
                response.read(64 << 10)  # an answer to a PUT is small: read, so the
                if response.will_close or not response.isclosed():  # connection is reusable
                    conn.close()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                continue
            except (OSError, http.client.HTTPException):
                conn.close()
                return FALLBACK
            if response.status == 200:
                return None
            if 400 <= response.status < 500 and response.status != 404:
                self.refusal = f"PUT HTTP {response.status}"
                return REFUSED
            return FALLBACK  # a lost bucket (404), a server error: s3fs retries and names it
        return FALLBACK

    def _answer(
        self,
        response: http.client.HTTPResponse,
        view: memoryview,
        conn: http.client.HTTPConnection,
        up_to: bool,
    ) -> Any:
        length = response.getheader("Content-Length")
        if up_to and length is not None and length.isdigit():
            size = int(length) - HEADER_AREA
            if 0 < size < len(view):
                view, length = view[:size], str(HEADER_AREA + size)  # a shorter coded block
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
            self.refusal = f"GET HTTP {response.status}"
            return REFUSED
        return FALLBACK  # a server error (503 SlowDown, say) is s3fs's to retry

    def _signed(self, method: str, path: str, credentials: Any) -> dict[str, str]:
        """The headers of a ``method`` request on ``path``, signed (a PUT's payload not
        hashed into the signature)."""
        payload = UNSIGNED_PAYLOAD if method == "PUT" else EMPTY_SHA256
        now = datetime.datetime.now(datetime.UTC)
        signed = self._signer.headers(method, path, credentials, payload, now)
        return {"User-Agent": "kvhex", **signed}

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
