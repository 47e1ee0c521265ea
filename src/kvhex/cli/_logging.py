"""Logging for the ``kvhex`` command: the library logs, the command decides where it goes.

Every log line goes to stderr, so stdout carries only what a command prints (a ``--json``
document parses whatever the tiers log). structlog's default would print to stdout; this
replaces it, and sends the standard library's loggers (botocore, s3fs, asyncio) through the same
renderer. Levels: warnings by default, info with ``-v``, debug with ``-vv`` (third-party
loggers stay at warnings until ``-vv``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

FORMATS = ("text", "json")


class _Stderr:
    """Whatever ``sys.stderr`` is when a line is written (a test may swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(verbosity: int, log_format: str) -> None:
    """Send structlog and standard-library logging to stderr at the level ``verbosity``
    (0 warnings, 1 info, 2 or more debug), as ``text`` or ``json`` lines."""
    level = (logging.WARNING, logging.INFO)[verbosity] if verbosity < 2 else logging.DEBUG
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                stamp,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)
