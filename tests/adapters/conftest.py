"""A real S3-compatible server on loopback for the object-store tests: moto's threaded
server on 127.0.0.1 with a random port, started by the fixtures; buckets made by the tests."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

CREDENTIALS = {"key": "kvhex-test-key", "secret": "kvhex-test-secret"}


def _start() -> Any:
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    server = _start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


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
    """A server of the test's own, which the test may stop."""
    server = _start()
    yield server
    with contextlib.suppress(Exception):  # the test may have stopped it already
        server.stop()
