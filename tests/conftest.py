"""Test-wide setup: kvhex never configures logging for its host, so the test suite (the host
here) keeps structlog quiet below warnings. Fixtures every directory shares: Dynamo's KV
indexer (tests/dynamo.py), vllm-router and Dynamo's selection service (tests/routers.py)."""

from __future__ import annotations

import logging

import structlog

from tests.dynamo import dynamo_indexer
from tests.routers import dynamo_select, vllm_router

__all__ = ["dynamo_indexer", "dynamo_select", "vllm_router"]

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
