"""The loopback S3 server of the adapter tests, for the storage tiers' contract runs."""

from tests.adapters.conftest import bucket, s3_server

__all__ = ["bucket", "s3_server"]
