"""An object-store tier that cannot start, or loses its server, says why: a missing bucket, an
unknown access key id, a wrong secret, an endpoint that is down and a refused listing are each
named as what they are, at the option that would fix it, against real servers on loopback
(SeaweedFS, which checks every request's signature and each user's actions; moto for a server
the test stops), and no credential reaches a message or a log."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.adapters.storage.objects._errors import Cause, describe, public_url
from kvhex.domain import JobKind
from kvhex.errors import TierUnavailable
from tests.adapters.conftest import CREDENTIALS, AuthS3, s3_options
from tests.adapters.jobs import key, run

SLOT = 2048
NS = {"model": "tiny-llama", "dtype": "float16"}
FAST = {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}
"""botocore options for a server that is down: one attempt, short waits."""


Logged = Callable[[], list[str]]


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[Logged]:
    """What was logged so far: structlog's entries and the standard library's records
    (botocore, s3fs) at INFO and above."""
    caplog.set_level("INFO")
    with structlog.testing.capture_logs() as entries:
        yield lambda: [str(e) for e in entries] + [r.getMessage() for r in caplog.records]


def start(
    url: str, options: dict[str, Any], name: str = "s3", host: MemoryHostBuffer | None = None
) -> FsspecTierStore:
    return FsspecTierStore(
        host if host is not None else MemoryHostBuffer(2, SLOT),
        url,
        capacity_bytes=1 << 24,
        name=name,
        namespace=NS,
        storage_options=options,
        locality=None,
    )


def fails_to_start(url: str, options: dict[str, Any], name: str = "s3") -> TierUnavailable:
    with pytest.raises(TierUnavailable) as info:
        start(url, options, name)
    assert info.value.tier == name
    assert url in str(info.value)
    return info.value


def cause(error: BaseException) -> Cause:
    """The cause of a start-up failure, read from the exception it was raised from."""
    assert error.__cause__ is not None
    return describe(error.__cause__).cause


def assert_no_secrets(texts: list[Any], *secrets: str) -> None:
    for text in map(str, texts):
        for secret in secrets:
            assert secret not in text


# -- start-up, against real servers --------------------------------------------------------
def test_a_missing_bucket_is_named_and_never_created(s3_server: str, logged: Logged) -> None:
    import s3fs

    error = fails_to_start("s3://kvhex-no-such-bucket/kv", s3_options(s3_server))
    assert cause(error) is Cause.NO_BUCKET
    assert "bucket 'kvhex-no-such-bucket' does not exist (NoSuchBucket)" in str(error)
    assert "create the bucket" in str(error)
    assert not s3fs.S3FileSystem(**s3_options(s3_server)).exists("kvhex-no-such-bucket")
    assert_no_secrets([error, *logged()], CREDENTIALS["key"], CREDENTIALS["secret"])


def test_the_right_credentials_start_the_tier(s3_auth_server: AuthS3) -> None:
    """The control for the next tests: this server checks keys, and accepts the right ones."""
    admin = s3_auth_server.users["admin"]
    store = start(f"s3://{s3_auth_server.bucket}/kv", s3_options(s3_auth_server.endpoint, **admin))
    store.close()


def test_an_unknown_access_key_id_is_named(s3_auth_server: AuthS3, logged: Logged) -> None:
    admin = s3_auth_server.users["admin"]
    wrong = "AKIAKVHEXUNKNOWNKEY1"
    options = s3_options(s3_auth_server.endpoint, key=wrong, secret=admin["secret"])
    error = fails_to_start(f"s3://{s3_auth_server.bucket}/kv", options)
    assert cause(error) is Cause.UNKNOWN_ACCESS_KEY
    assert "access key id is not known to the server (InvalidAccessKeyId)" in str(error)
    assert error.option == "storage_options.key"
    assert_no_secrets([error, *logged()], wrong, admin["key"], admin["secret"])


def test_a_wrong_secret_is_named(s3_auth_server: AuthS3, logged: Logged) -> None:
    admin = s3_auth_server.users["admin"]
    wrong = "kvhex-wrong-secret-value"
    options = s3_options(s3_auth_server.endpoint, key=admin["key"], secret=wrong)
    error = fails_to_start(f"s3://{s3_auth_server.bucket}/kv", options)
    assert cause(error) is Cause.SIGNATURE_MISMATCH
    assert "wrong secret key (SignatureDoesNotMatch)" in str(error)
    assert error.option == "storage_options.secret"
    assert_no_secrets([error, *logged()], wrong, admin["key"], admin["secret"])


def test_anonymous_access_is_refused_and_named(s3_auth_server: AuthS3, logged: Logged) -> None:
    """No credentials at all (s3fs's ``anon``): the server refuses the unsigned listing; the
    tier names the refusal and asks for credentials with the permission."""
    options = {k: v for k, v in s3_options(s3_auth_server.endpoint).items() if k not in CREDENTIALS}
    url = f"s3://{s3_auth_server.bucket}/kv"
    error = fails_to_start(url, {**options, "anon": True})
    assert cause(error) is Cause.ACCESS_DENIED
    assert f"access denied listing {url} (AccessDenied)" in str(error)
    assert error.option == "url"
    assert_no_secrets([error, *logged()], CREDENTIALS["key"], CREDENTIALS["secret"])


def test_a_refused_listing_is_tier_unavailable_naming_access_denied(
    s3_auth_server: AuthS3, logged: Logged
) -> None:
    """The principal may read and write objects but not list them: the tier lists its
    namespace at start-up, so it cannot start (once a bare PermissionError)."""
    no_list = s3_auth_server.users["no-list"]
    url = f"s3://{s3_auth_server.bucket}/kv"
    error = fails_to_start(url, s3_options(s3_auth_server.endpoint, **no_list))
    assert not isinstance(error, PermissionError)
    assert cause(error) is Cause.ACCESS_DENIED
    assert f"access denied listing {url} (AccessDenied)" in str(error)
    assert "s3:ListBucket" in str(error)
    assert error.option == "url"
    assert_no_secrets([error, *logged()], no_list["key"], no_list["secret"])


def test_an_endpoint_nothing_listens_on_is_named(dead_endpoint: str, logged: Logged) -> None:
    error = fails_to_start("s3://kvhex-down/kv", s3_options(dead_endpoint, config_kwargs=FAST))
    assert cause(error) is Cause.REFUSED
    assert f"the endpoint {dead_endpoint} refused the connection" in str(error)
    assert "does not exist" not in str(error)
    assert_no_secrets([error, *logged()], CREDENTIALS["key"], CREDENTIALS["secret"])


def test_a_listing_that_fails_after_the_bucket_check_is_tier_unavailable() -> None:
    """The start-up listing (the inventory) runs after the constructor's other checks: its
    failure is a TierUnavailable too, not the bare error."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class NoListing(MemoryFileSystem):
        protocol = "kvhex-no-listing"
        store: dict[str, Any] = {}  # noqa: RUF012 (fsspec's own class-level store)
        pseudo_dirs = [""]  # noqa: RUF012

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            return path.removeprefix(f"{cls.protocol}://").strip("/")

        def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
            raise PermissionError(13, "listing refused")

    fsspec.register_implementation(NoListing.protocol, NoListing, clobber=True)
    NoListing().mkdir("bucket")
    with pytest.raises(TierUnavailable) as info:
        start("kvhex-no-listing://bucket/kv", {}, name="objects")
    assert info.value.tier == "objects"
    assert "listing refused" in str(info.value)


# -- run time: the server goes away ---------------------------------------------------------
def test_a_server_stopped_after_start_up_fails_jobs_naming_it(
    private_s3_server: Any, logged: Logged
) -> None:
    import s3fs

    host_name, port = private_s3_server.get_host_and_port()
    endpoint = f"http://{host_name}:{port}"
    s3fs.S3FileSystem(**s3_options(endpoint)).mkdir("kvhex-stopped")
    host = MemoryHostBuffer(2, SLOT)
    store = start("s3://kvhex-stopped/kv", s3_options(endpoint, config_kwargs=FAST), host=host)
    host.slot_view(0)[:] = b"\x07" * SLOT
    assert run(store, JobKind.PUT, [1]).success
    store.take_events()
    private_s3_server.stop()
    put = run(store, JobKind.PUT, [2], [0])
    get = run(store, JobKind.GET, [1], [1])
    probe = run(store, JobKind.PROBE, [3])
    for result in (put, get, probe):
        assert not result.success
        assert f"the endpoint {endpoint} refused the connection" in (result.error or "")
    assert store.take_events() == []  # nothing announced that did not happen
    assert store.keys() == [key(1)]
    errors = [put.error, get.error, probe.error]
    assert_no_secrets([*errors, *logged()], CREDENTIALS["key"], CREDENTIALS["secret"])
    store.close()


# -- the NIXL tier on s3:// starts through the same checks ----------------------------------
def test_the_nixl_tier_on_s3_names_the_same_causes(s3_auth_server: AuthS3, logged: Logged) -> None:
    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl==1.5.1) is not installed")
    from kvhex.adapters.storage.nixl import NixlTierStore

    admin = s3_auth_server.users["admin"]
    bucket = f"s3://{s3_auth_server.bucket}/kv"
    unknown = "AKIAKVHEXUNKNOWNKEY1"
    cases = [
        ("s3://kvhex-no-such-bucket/kv", admin["key"], admin["secret"], Cause.NO_BUCKET, "url"),
        (bucket, unknown, admin["secret"], Cause.UNKNOWN_ACCESS_KEY, "access_key"),
        (bucket, admin["key"], "kvhex-wrong", Cause.SIGNATURE_MISMATCH, "secret_key"),
    ]
    words = {
        Cause.NO_BUCKET: "does not exist",
        Cause.UNKNOWN_ACCESS_KEY: "(InvalidAccessKeyId)",
        Cause.SIGNATURE_MISMATCH: "wrong secret key",
    }
    for url, access_key, secret, expected, option in cases:
        with pytest.raises(TierUnavailable) as info:
            NixlTierStore(
                MemoryHostBuffer(2, 4096),
                url,
                capacity_bytes=1 << 20,
                name="nixl-s3",
                endpoint_url=s3_auth_server.endpoint,
                access_key=access_key,
                secret_key=secret,
                locality=None,
            )
        assert info.value.tier == "nixl-s3"
        assert cause(info.value) is expected
        assert words[expected] in str(info.value)
        assert info.value.option == option
        secrets = (admin["key"], admin["secret"], "kvhex-wrong", unknown)
        assert_no_secrets([info.value, *logged()], *secrets)


# -- the mapping, on constructed exceptions ------------------------------------------------
def client_error(code: str, operation: str, **error: str) -> BaseException:
    """What s3fs raises for a botocore ClientError: a built-in error caused by it."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    response: Any = {"Error": {"Code": code, "Message": "key=AKIASECRET secret=hunter2", **error}}
    return translate_boto_error(ClientError(response, operation))  # type: ignore[no-any-return]


def connection_error(underneath: BaseException) -> BaseException:
    """What botocore raises when no connection could be made, ``underneath`` its cause."""
    from botocore.exceptions import EndpointConnectionError

    url = "http://user:hunter2@127.0.0.1:9/bucket/kv/a.blk?list-type=2"
    outer = EndpointConnectionError(endpoint_url=url, error=underneath)
    outer.__cause__ = underneath
    return outer


@pytest.mark.parametrize(
    ("make", "expected", "words"),
    [
        (
            lambda: client_error("NoSuchBucket", "ListObjectsV2", BucketName="b1"),
            Cause.NO_BUCKET,
            "bucket 'b1' does not exist (NoSuchBucket)",
        ),
        (lambda: client_error("404", "HeadBucket"), Cause.NO_BUCKET, "bucket 'bkt' does not"),
        (
            lambda: client_error("InvalidAccessKeyId", "PutObject"),
            Cause.UNKNOWN_ACCESS_KEY,
            "access key id is not known",
        ),
        (
            lambda: client_error("SignatureDoesNotMatch", "GetObject"),
            Cause.SIGNATURE_MISMATCH,
            "wrong secret key",
        ),
        (lambda: client_error("ExpiredToken", "GetObject"), Cause.BAD_TOKEN, "session token"),
        (
            lambda: client_error("AccessDenied", "ListObjectsV2"),
            Cause.ACCESS_DENIED,
            "access denied listing s3://bkt/kv (AccessDenied)",
        ),
        (
            lambda: client_error("403", "HeadObject"),
            Cause.ACCESS_DENIED,
            "access denied reading s3://bkt/kv (HTTP 403",
        ),
        (lambda: client_error("RequestTimeTooSkewed", "PutObject"), Cause.CLOCK_SKEW, "clock"),
        (
            lambda: client_error("PermanentRedirect", "ListObjectsV2"),
            Cause.WRONG_REGION,
            "another region",
        ),
        (
            lambda: client_error("SlowDown", "PutObject"),
            Cause.OTHER,
            "the server answered SlowDown writing s3://bkt/kv",
        ),
        (
            lambda: connection_error(ConnectionRefusedError(111, "Connect call failed")),
            Cause.REFUSED,
            "the endpoint http://127.0.0.1:9 refused the connection",
        ),
        (
            lambda: connection_error(socket.gaierror(-2, "Name or service not known")),
            Cause.UNRESOLVED,
            "could not be resolved",
        ),
        (
            lambda: connection_error(OSError(113, "No route to host")),
            Cause.UNREACHABLE,
            "the endpoint http://127.0.0.1:9 could not be reached",
        ),
        (
            lambda: _botocore("ConnectTimeoutError", endpoint_url="http://h:1/b"),
            Cause.TIMEOUT,
            "the endpoint http://h:1 did not answer in time",
        ),
        (lambda: _botocore("NoCredentialsError"), Cause.NO_CREDENTIALS, "no complete credentials"),
        (lambda: ValueError("Invalid endpoint: u:hunter2@h"), Cause.BAD_ENDPOINT, "not usable"),
        (
            lambda: PermissionError(13, "Permission denied"),
            Cause.OTHER,
            "PermissionError: [Errno 13] Permission denied",
        ),
    ],
)
def test_describe_names_each_cause_without_credentials(
    make: Any, expected: Cause, words: str
) -> None:
    failure = describe(make(), "s3://bkt/kv")
    assert failure.cause is expected
    assert words in failure.text
    assert bool(failure.fix) is (expected is not Cause.OTHER)
    assert_no_secrets([failure], "hunter2", "AKIASECRET")


def _botocore(name: str, **kwargs: str) -> BaseException:
    import botocore.exceptions

    error: BaseException = getattr(botocore.exceptions, name)(**kwargs)
    return error


def test_urls_lose_their_user_info() -> None:
    assert public_url("s3://user:hunter2@bucket/kv") == "s3://bucket/kv"
    assert public_url("http://127.0.0.1:9000/x") == "http://127.0.0.1:9000/x"
    assert public_url("/var/cache/kvhex") == "/var/cache/kvhex"
