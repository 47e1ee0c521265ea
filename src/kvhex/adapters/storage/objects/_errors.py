"""What went wrong talking to an object store, named as what it is.

s3fs turns every failed S3 call into a built-in error (``FileNotFoundError``,
``PermissionError``, ``OSError``) whose message is the server's; the cause worth telling an
operator (a wrong access key id, a wrong secret, a server that is down, a bucket that does not
exist) is further down the chain, in botocore's error code or the socket error under aiohttp.
:func:`describe` walks that chain (``__cause__``, ``__context__``) and returns a
:class:`StoreFailure`: a :class:`Cause` callers and tests can check without parsing text, a
short description and what would fix it. No credential reaches either: the texts are built
from error codes, the bucket, the tier's URL and the endpoint (its user info stripped), never
from the server's messages.

A tier that cannot start blames the option that would fix it
(:attr:`~kvhex.errors.TierUnavailable.option`): :class:`StoreOptions` names, in the tier's own
terms, the options that hold the access key id, the secret and the endpoint, and
:func:`start_up_error` picks the one the cause is about (the ``url`` for the rest).

Nothing here imports botocore or aiohttp: exceptions are recognised by the names of their
classes, so this module loads without the ``kvhex[s3]`` extra.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import attrs

from kvhex.adapters.storage.block_io import StoreLost
from kvhex.errors import TierUnavailable


class Cause(enum.Enum):
    """Why a call to an object store failed."""

    NO_BUCKET = "no_bucket"
    UNKNOWN_ACCESS_KEY = "unknown_access_key"
    SIGNATURE_MISMATCH = "signature_mismatch"
    BAD_TOKEN = "bad_token"
    NO_CREDENTIALS = "no_credentials"
    ACCESS_DENIED = "access_denied"
    CLOCK_SKEW = "clock_skew"
    WRONG_REGION = "wrong_region"
    REFUSED = "refused"
    UNRESOLVED = "unresolved"
    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    BAD_ENDPOINT = "bad_endpoint"
    OTHER = "other"
    """Not recognised: the text is the exception's type and its credential-free message."""


@attrs.frozen
class StoreFailure:
    """A failed object-store call: its cause, what happened and what would fix it (``fix``
    is empty for :attr:`Cause.OTHER`). Neither text holds a credential."""

    cause: Cause
    text: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.text}; {self.fix}" if self.fix else self.text


_FIX = {
    Cause.NO_BUCKET: "create the bucket (kvhex never creates one) or correct the url",
    Cause.UNKNOWN_ACCESS_KEY: "correct the access key id (storage_options 'key')",
    Cause.SIGNATURE_MISMATCH: "correct the secret key paired with this access key id",
    Cause.BAD_TOKEN: "renew the session credentials",
    Cause.NO_CREDENTIALS: "pass 'key' and 'secret' in storage_options",
    Cause.ACCESS_DENIED: (
        "grant s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject on the prefix"
    ),
    Cause.CLOCK_SKEW: "synchronise this machine's clock (NTP)",
    Cause.WRONG_REGION: "set the bucket's region (AWS_DEFAULT_REGION)",
    Cause.REFUSED: "start the server or correct endpoint_url",
    Cause.UNRESOLVED: "correct the host name in endpoint_url",
    Cause.TIMEOUT: "check the network path, or raise connect_timeout / read_timeout",
    Cause.UNREACHABLE: "check that the server is up and reachable from here",
    Cause.BAD_ENDPOINT: "give endpoint_url as scheme://host:port, without user:password@",
}

_CODES = {
    "NoSuchBucket": Cause.NO_BUCKET,
    "InvalidAccessKeyId": Cause.UNKNOWN_ACCESS_KEY,
    "InvalidClientTokenId": Cause.UNKNOWN_ACCESS_KEY,
    "SignatureDoesNotMatch": Cause.SIGNATURE_MISMATCH,
    "InvalidToken": Cause.BAD_TOKEN,
    "ExpiredToken": Cause.BAD_TOKEN,
    "TokenRefreshRequired": Cause.BAD_TOKEN,
    "AccessDenied": Cause.ACCESS_DENIED,
    "AllAccessDisabled": Cause.ACCESS_DENIED,
    "403": Cause.ACCESS_DENIED,  # a HEAD's answer has no body, so no code beyond its status
    "RequestTimeTooSkewed": Cause.CLOCK_SKEW,
    "PermanentRedirect": Cause.WRONG_REGION,
    "AuthorizationHeaderMalformed": Cause.WRONG_REGION,
    "IllegalLocationConstraintException": Cause.WRONG_REGION,
}

_VERBS = {
    "ListObjectsV2": "listing",
    "ListObjects": "listing",
    "HeadBucket": "checking",
    "HeadObject": "reading",
    "GetObject": "reading",
    "PutObject": "writing",
    "CreateMultipartUpload": "writing",
    "UploadPart": "writing",
    "CompleteMultipartUpload": "writing",
    "DeleteObject": "deleting in",
    "DeleteObjects": "deleting in",
}


def public_url(url: str) -> str:
    """``url`` without user info (``user:password@``), whatever else it holds."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def describe(exc: BaseException, where: str | None = None) -> StoreFailure:
    """Name why an object-store call failed, from the exception it raised.

    Args:
        exc: what s3fs, botocore, aiohttp or the socket layer raised; its ``__cause__`` and
            ``__context__`` chain is searched, a botocore error code first, then the
            connection error underneath.
        where: the URL the call was about (``s3://bucket/prefix``), named in the text.
    """
    where = public_url(where) if where else None
    chain = list(_chain(exc))
    for err in chain:
        if _is(err, "botocore.exceptions", "ClientError"):
            return _client_error(err, where)
    found = {c for c in map(_connection_cause, chain) if c is not None}
    for cause in (Cause.REFUSED, Cause.UNRESOLVED, Cause.TIMEOUT, Cause.UNREACHABLE):
        if cause in found:  # the most specific one: the socket error under botocore's
            endpoint = next((e for e in map(_endpoint, chain) if e), "")
            return StoreFailure(cause, _connection_text(cause, endpoint), _FIX[cause])
    for err in chain:
        if _is(err, "botocore.exceptions", "NoCredentialsError", "PartialCredentialsError"):
            text = "no complete credentials were found for the object store"
            return StoreFailure(Cause.NO_CREDENTIALS, text, _FIX[Cause.NO_CREDENTIALS])
        if _bad_endpoint(err):
            text = "the endpoint URL is not usable"
            return StoreFailure(Cause.BAD_ENDPOINT, text, _FIX[Cause.BAD_ENDPOINT])
    return StoreFailure(Cause.OTHER, f"{type(exc).__name__}: {_credential_free(exc)}")


_ENDPOINT_CAUSES = frozenset(
    (Cause.REFUSED, Cause.UNRESOLVED, Cause.TIMEOUT, Cause.UNREACHABLE, Cause.BAD_ENDPOINT)
)


@attrs.frozen
class StoreOptions:
    """A tier's own options (constructor arguments, dotted into a mapping one:
    ``storage_options.key``) that hold its URL and, where the tier was given them, an object
    store's access key id, secret and endpoint: what a start-up failure blames."""

    url: str = "url"
    access_key: str | None = None
    secret: str | None = None
    endpoint: str | None = None

    @classmethod
    def given(cls, options: Mapping[str, Any], **names: str) -> StoreOptions:
        """Each of ``names`` (``access_key``, ``secret``, ``endpoint`` -> the option's dotted
        name) whose option holds a value in ``options`` (the tier's arguments)."""
        kept = {}
        for field, name in names.items():
            value: Any = options
            for part in name.split("."):
                value = value.get(part) if isinstance(value, Mapping) else None
            if value is not None:
                kept[field] = name
        return cls(**kept)

    def blamed(self, cause: Cause) -> str:
        """The option that would correct a failure of ``cause``: the credential or endpoint
        it is about where the tier was given that, else the URL."""
        if cause is Cause.UNKNOWN_ACCESS_KEY:
            named = self.access_key
        elif cause is Cause.SIGNATURE_MISMATCH:
            named = self.secret
        elif cause in _ENDPOINT_CAUSES:
            named = self.endpoint
        else:
            named = None
        return named or self.url


def start_up_error(
    exc: BaseException, *, url: str, tier: str, options: StoreOptions
) -> TierUnavailable:
    """The error a tier raises when it cannot start on ``url``: the cause, the URL and what
    would fix it (for a cause :func:`describe` does not recognise, the exception's type and
    credential-free message), blaming the option of ``options`` the cause is about."""
    failure = describe(exc, url)
    return TierUnavailable(
        f"cannot use root {public_url(url)!r}: {failure}",
        tier=tier,
        option=options.blamed(failure.cause),
    )


def store_error(exc: BaseException, url: str) -> OSError | StoreLost:
    """What a failed store call at run time means: the bucket gone, or an error naming the
    cause (the failed job's error)."""
    failure = describe(exc, url)
    if failure.cause is Cause.NO_BUCKET:
        return StoreLost(failure.text)
    return OSError(job_error(exc, url))


def job_error(exc: BaseException, where: str | None = None) -> str:
    """The error text of a failed job: the cause when recognised, without the fix (the tier
    keeps running and the next job may succeed)."""
    return describe(exc, where).text


# -- internals ---------------------------------------------------------------------------
_CREDENTIAL_MARKERS = ("key=", "secret=", "token=", "aws_secret_access_key", "aws_access_key_id")


def _credential_free(exc: BaseException) -> str:
    """The message of an error no cause was found for, unless it may echo a credential (as
    fsspec's and botocore's can echo options): then nothing (the rule of the storage
    adapters' ``safe_error``, kept here so this module needs nothing else of theirs)."""
    text = str(exc)
    return "(message withheld)" if any(m in text for m in _CREDENTIAL_MARKERS) else text[:300]


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        err = todo.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        nested = getattr(err, "kwargs", None)  # botocore keeps the socket error here
        if isinstance(nested, dict) and isinstance(nested.get("error"), BaseException):
            todo.append(nested["error"])
        todo.extend(e for e in (err.__cause__, err.__context__) if e is not None)


def _is(err: BaseException, module: str, *names: str) -> bool:
    return any(k.__module__ == module and k.__name__ in names for k in type(err).__mro__)


def _client_error(err: BaseException, where: str | None) -> StoreFailure:
    response: dict[str, Any] = getattr(err, "response", None) or {}
    error: dict[str, Any] = response.get("Error") or {}
    code = str(error.get("Code") or "")
    operation = str(getattr(err, "operation_name", "") or "")
    cause = _CODES.get(code)
    if code == "404" and operation == "HeadBucket":
        cause = Cause.NO_BUCKET
    bucket = error.get("BucketName") or _bucket(where)
    place = where or (f"bucket {bucket!r}" if bucket else "the bucket")
    verb = _VERBS.get(operation, "accessing")
    if cause is Cause.NO_BUCKET:
        text = f"bucket {bucket!r} does not exist" if bucket else "the bucket does not exist"
    elif cause is Cause.UNKNOWN_ACCESS_KEY:
        text = "the access key id is not known to the server"
    elif cause is Cause.SIGNATURE_MISMATCH:
        text = "the request signature does not match: wrong secret key"
    elif cause is Cause.BAD_TOKEN:
        text = "the session token is invalid or expired"
    elif cause is Cause.ACCESS_DENIED and code == "403":
        text = f"access denied {verb} {place} (HTTP 403 without an error code: wrong credentials"
        text += " or no permission)"
    elif cause is Cause.ACCESS_DENIED:
        text = f"access denied {verb} {place}"
    elif cause is Cause.CLOCK_SKEW:
        text = "this machine's clock differs too much from the server's"
    elif cause is Cause.WRONG_REGION:
        text = f"{place} is in another region than the client signs for"
    else:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        shown = code or (f"HTTP {status}" if status else type(err).__name__)
        return StoreFailure(Cause.OTHER, f"the server answered {shown} {verb} {place}")
    if code and code != "403":
        text += f" ({code})"
    return StoreFailure(cause, text, _FIX[cause])


def _bucket(where: str | None) -> str | None:
    if not where:
        return None
    parts = urlsplit(where)
    return parts.netloc or where.split("/", 1)[0] or None


def _endpoint(err: BaseException) -> str | None:
    """``scheme://host:port`` of the endpoint an error names, without user info or path."""
    kwargs = getattr(err, "kwargs", None)
    url = kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None
    if isinstance(url, str) and url:
        parts = urlsplit(url)
        return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], "", "", ""))
    host, port = getattr(err, "host", None), getattr(err, "port", None)
    if _is(err, "aiohttp.client_exceptions", "ClientConnectorError") and host:
        return f"{host}:{port}" if port else str(host)
    return None


def _connection_cause(err: BaseException) -> Cause | None:
    if isinstance(err, ConnectionRefusedError):
        return Cause.REFUSED
    if _is(err, "socket", "gaierror") or _is(
        err, "aiohttp.client_exceptions", "ClientConnectorDNSError"
    ):
        return Cause.UNRESOLVED
    if _is(err, "botocore.exceptions", "ConnectTimeoutError", "ReadTimeoutError") or (
        isinstance(err, TimeoutError)
    ):
        return Cause.TIMEOUT
    if isinstance(err, ConnectionError) or _is(
        err,
        "botocore.exceptions",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ProxyConnectionError",
    ):
        return Cause.UNREACHABLE
    if _is(err, "aiohttp.client_exceptions", "ClientConnectionError"):
        return Cause.UNREACHABLE
    return None


def _connection_text(cause: Cause, endpoint: str) -> str:
    it = f"the endpoint {endpoint}" if endpoint else "the endpoint"
    if cause is Cause.REFUSED:
        return f"{it} refused the connection (is the S3 server running?)"
    if cause is Cause.UNRESOLVED:
        return f"the host name of {it} could not be resolved"
    if cause is Cause.TIMEOUT:
        return f"{it} did not answer in time"
    return f"{it} could not be reached or dropped the connection"


def _bad_endpoint(err: BaseException) -> bool:
    if _is(err, "botocore.exceptions", "EndpointResolutionError"):
        return True
    text = str(err)
    return isinstance(err, ValueError) and (
        text.startswith("Invalid endpoint") or "credentials encoded in URL" in text
    )
