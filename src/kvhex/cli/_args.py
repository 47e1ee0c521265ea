"""What the subcommands share: argument types (argparse names the flag in every error), the
exit statuses docs/cli.md lists, and the one way a command reports a bad input."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

EXIT_OK = 0
EXIT_FAILED = 1
"""The command ran and what it found is wrong: corrupt blocks, failed tier writes, an
inconsistent event stream, a benchmark or plugin that failed."""
EXIT_USAGE = 2
"""Nothing ran: a bad flag, configuration, workload file, endpoint or root, or a tier that
cannot be reached at start-up. The message names the flag, key (with its path) or file."""
EXIT_NOTHING = 3
"""There was nothing to judge: no publisher within ``--duration``, no kvhex tier under ROOT."""


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse ``type`` accepting finite numbers of ``kind`` above 0."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    return parse


def fail(command: str, message: str, status: int = EXIT_USAGE) -> int:
    """Print ``kvhex COMMAND: MESSAGE`` on stderr; return ``status`` for the command to exit
    with."""
    print(f"kvhex {command}: {message}", file=sys.stderr)
    return status
