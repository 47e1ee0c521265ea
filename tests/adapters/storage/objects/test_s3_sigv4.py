"""The S3 tier's own SigV4 signer (``s3_direct.SigV4``) signs as botocore does: for the same
request, time, region and credentials (with and without a session token) its
``Authorization`` header is botocore's, byte for byte, for a GET (empty body) and for a PUT
whose payload is left out of the signature. Servers that check signatures (SeaweedFS, in the
S3 tier's other tests) take what it signs."""

from __future__ import annotations

import datetime
from typing import Any
from unittest import mock

import pytest

from kvhex.adapters.storage.objects.s3_direct import EMPTY_SHA256, UNSIGNED_PAYLOAD, SigV4

NOW = datetime.datetime(2026, 12, 4, 23, 59, 59, tzinfo=datetime.UTC)


class _UnsignedPayloadConfig:
    s3 = {"payload_signing_enabled": False}  # noqa: RUF012 (what botocore reads)


def _botocore(
    method: str, url: str, credentials: Any, region: str, now: datetime.datetime = NOW
) -> dict[str, str]:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest

    request = AWSRequest(method=method, url=url, headers={})
    if method == "PUT":  # botocore hashes an http payload unless told not to
        request.context["client_config"] = _UnsignedPayloadConfig()
    with mock.patch("botocore.auth.get_current_datetime", return_value=now.replace(tzinfo=None)):
        S3SigV4Auth(credentials, "s3", region).add_auth(request)
    return dict(request.headers.items())


@pytest.mark.parametrize("token", [None, "session-token"], ids=["keys", "session"])
@pytest.mark.parametrize(
    ("method", "payload"), [("GET", EMPTY_SHA256), ("PUT", UNSIGNED_PAYLOAD)], ids=["get", "put"]
)
@pytest.mark.parametrize("host", ["127.0.0.1:8333", "s3.example"], ids=["port", "default-port"])
def test_signatures_are_botocores(token: str | None, method: str, payload: str, host: str) -> None:
    from botocore.credentials import Credentials

    credentials = Credentials("AKIAKVHEXTEST", "kvhex/secret+key", token).get_frozen_credentials()
    path = "bucket/kv/0123abcd/7f/00ff.blk"
    ours = SigV4("eu-west-3", host).headers(method, path, credentials, payload, NOW)
    theirs = _botocore(method, f"http://{host}/{path}", credentials, "eu-west-3")
    assert ours["Authorization"] == theirs["Authorization"]
    assert ours["x-amz-date"] == theirs["X-Amz-Date"]
    assert ours["x-amz-content-sha256"] == theirs["X-Amz-Content-SHA256"] == payload
    assert ours.get("x-amz-security-token") == theirs.get("X-Amz-Security-Token")


def test_one_signer_stays_right_across_secrets_and_days() -> None:
    """The signer keeps the day's signing key: signing again with another secret, or past
    midnight, must not reuse it (each signature is botocore's for that secret and time)."""
    from botocore.credentials import Credentials

    signer = SigV4("us-east-1", "h")
    one = Credentials("A", "s1").get_frozen_credentials()
    two = Credentials("A", "s2").get_frozen_credentials()
    tomorrow = NOW + datetime.timedelta(seconds=1)  # 2026-12-05
    for credentials, now in [(one, NOW), (two, NOW), (one, tomorrow), (one, NOW)]:
        ours = signer.headers("GET", "b/k", credentials, EMPTY_SHA256, now)["Authorization"]
        theirs = _botocore("GET", "http://h/b/k", credentials, "us-east-1", now)
        assert ours == theirs["Authorization"]


def test_anonymous_requests_are_not_signed() -> None:
    headers = SigV4("us-east-1", "h").headers("GET", "b/k", None, EMPTY_SHA256, NOW)
    assert "Authorization" not in headers
