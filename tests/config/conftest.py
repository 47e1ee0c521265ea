"""The loopback S3 servers of the object-store tests, for the tests that build tiers on S3
from a configuration."""

from tests.adapters.conftest import dead_endpoint, s3_auth_server, s3_server

__all__ = ["dead_endpoint", "s3_auth_server", "s3_server"]
