"""Test-wide setup: kvhex never configures logging for its host, so the test suite (the host
here) keeps structlog quiet below warnings."""

from __future__ import annotations

import logging

import structlog

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
