"""The ``kvhex`` command: a driving adapter over the composition root.

Each subcommand is a module here (found by listing this package) with
``add_parser(subparsers)`` (its flags and help) and ``main(args) -> int`` (its exit status).
The frame adds what every command shares: ``--version``, ``-v``/``--verbose`` and
``--log-format`` (before or after the subcommand), logging to stderr (``cli._logging``), and
the exit statuses of ``cli._args``. Bad flags, configuration, workload files, endpoints and
unreachable tiers exit 2 with a message naming the flag, key (with its path) or file; no
traceback for a user's mistake. ``SIGTERM`` (a service manager stopping kvhex) ends a command
as Ctrl-C does, its tiers closed and its scratch files removed, with status 143 (130 for
Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
import threading
from collections.abc import Sequence

from kvhex.cli._args import EXIT_FAILED, EXIT_USAGE
from kvhex.errors import ConfigError, KvhexError, MissingPackage, PluginError, TierUnavailable
from kvhex.plugins import missing_package

__all__ = ["build_parser", "main"]

ORDER = ("run", "bench", "tiers", "events", "fsck")
"""How ``kvhex --help`` orders the subcommands (any other module here comes after)."""


def _logging_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``-v`` and ``--log-format``; on a subcommand they default to what the top level set."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0 if top else argparse.SUPPRESS,
        help="log more on stderr: -v info, -vv debug (default: warnings only)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text" if top else argparse.SUPPRESS,
        help="log lines on stderr as text (default) or JSON objects",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand registered."""
    from kvhex import __version__

    parser = argparse.ArgumentParser(
        prog="kvhex",
        description="Multi-tier KV-cache offloading: run a workload through the tiers, "
        "benchmark them, list plugins, watch KV events, check a file tier.",
        epilog="Exit status: 0 ok; 1 the command ran and found something wrong; 2 bad input "
        "(nothing ran); 3 nothing to judge. docs/cli.md has the details.",
    )
    parser.add_argument("--version", action="version", version=f"kvhex {__version__}")
    _logging_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    for name in sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        module = importlib.import_module(f"kvhex.cli.{name}")
        command = module.add_parser(sub)
        _logging_flags(command, top=False)
        command.set_defaults(handler=module.main)
    return parser


class _Terminated(KeyboardInterrupt):
    """``SIGTERM`` arrived: unwinds like Ctrl-C (a command that ends its work on Ctrl-C, as
    ``kvhex events`` does, ends it the same way)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvhex`` script; returns the exit status."""
    from kvhex.cli._logging import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.log_format)
    if threading.current_thread() is not threading.main_thread():  # signals reach main only
        return _run(args)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(args)
    finally:  # None: a handler set outside Python, which Python cannot put back
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _handle(args: argparse.Namespace) -> int:
    """The command's handler; an optional package it needs and lacks is a ``MissingPackage``
    naming the extra to install (one line, exit 2), never a traceback."""
    try:
        status: int = args.handler(args)
    except ModuleNotFoundError as exc:
        missing = missing_package(exc)
        if missing is None:
            raise  # not one of kvhex's optional packages: a bug, shown whole
        raise missing from exc
    return status


def _run(args: argparse.Namespace) -> int:
    try:
        status: int = _handle(args)
    except (ConfigError, PluginError, TierUnavailable, MissingPackage) as exc:  # nothing ran
        print(f"kvhex {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KvhexError as exc:  # something failed while running
        print(f"kvhex {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except _Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (``kvhex tiers --json | head``)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush is silent
        return 0
    return status
