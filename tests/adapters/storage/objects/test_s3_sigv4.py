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


def _botocore(method: str, url: str, credentials: Any, region: str) -> dict[str, str]:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest

    request = AWSRequest(method=method, url=url, headers={})
    if method == "PUT":  # botocore hashes an http payload unless told not to
        request.context["client_config"] = _UnsignedPayloadConfig()
    with mock.patch("botocore.auth.get_current_datetime", return_value=NOW.replace(tzinfo=None)):
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


def test_the_days_key_is_kept_and_a_new_day_or_secret_gets_its_own() -> None:
    from botocore.credentials import Credentials

    signer = SigV4("us-east-1", "h")
    one = Credentials("A", "s1").get_frozen_credentials()
    two = Credentials("A", "s2").get_frozen_credentials()
    first = signer.headers("GET", "b/k", one, EMPTY_SHA256, NOW)["Authorization"]
    assert signer.headers("GET", "b/k", one, EMPTY_SHA256, NOW)["Authorization"] == first
    assert signer.headers("GET", "b/k", two, EMPTY_SHA256, NOW)["Authorization"] != first
    tomorrow = NOW + datetime.timedelta(seconds=1)
    theirs = _botocore("GET", "http://h/b/k", one, "us-east-1")
    assert first == theirs["Authorization"]
    later = signer.headers("GET", "b/k", one, EMPTY_SHA256, tomorrow)["Authorization"]
    assert "/20261205/us-east-1/s3/aws4_request" in later


def test_anonymous_requests_are_not_signed() -> None:
    headers = SigV4("us-east-1", "h").headers("GET", "b/k", None, EMPTY_SHA256, NOW)
    assert "Authorization" not in headers
