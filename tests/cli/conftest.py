"""The loopback S3 server fixtures of the adapter tests, for CLI runs against S3."""

from tests.adapters.conftest import bucket, s3_server

__all__ = ["bucket", "s3_server"]
