"""The ``kvhex`` command: a driving adapter over the composition root.

Each subcommand is a module here (found by listing this package) with
``add_parser(subparsers)`` (its flags and help) and ``main(args) -> int`` (its exit status).
Bad flags, config files and arguments exit non-zero with a message naming the flag, key or
file; no traceback for a user's mistake.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from kvhex.errors import KvhexError

__all__ = ["main"]

ORDER = ("run", "bench", "tiers", "events", "fsck")
"""How ``kvhex --help`` orders the subcommands (any other module here comes after)."""

EXIT_USAGE = 2
EXIT_FAILED = 1


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="kvhex",
        description="Multi-tier KV-cache offloading: run a workload through the tiers, "
        "benchmark them, list plugins, watch KV events, check a file tier.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    for name in sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        module = importlib.import_module(f"kvhex.cli.{name}")
        command = module.add_parser(sub)
        command.set_defaults(handler=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvhex`` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.handler(args)
    except KvhexError as exc:  # a configuration or environment problem the user can fix
        print(f"kvhex {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (``kvhex tiers --json | head``)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush is silent
        return 0
    return status
