"""``kvhex tiers``: every tier, transfer, sink and policy installed, and whether it loads.

Lists the entry points of kvhex's groups (``kvhex.tiers``, ``kvhex.transfers``,
``kvhex.sinks``, ``kvhex.policies``) with the distribution and version that declares each,
whether it is one of kvhex's built-ins, and whether it imports and passes its port's check;
a plugin that does not load shows the ``PluginError`` text, install hint included. Loading a
plugin imports its module; nothing is instantiated.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import attrs

from kvhex.cli._args import EXIT_FAILED, EXIT_OK, fail
from kvhex.errors import PluginError
from kvhex.plugins import GROUPS, PluginSpec, Registry


@attrs.frozen
class PluginStatus:
    """One entry point and whether it loads (``error`` is the ``PluginError`` text if not)."""

    group: str
    name: str
    target: str
    distribution: str | None
    version: str | None
    builtin: bool
    extras: tuple[str, ...]
    loaded: bool
    error: str | None


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``kvhex tiers`` and its flags."""
    parser = subparsers.add_parser(
        "tiers",
        help="list the installed tiers, transfers, sinks and policies, and whether they load",
        description="List every plugin of kvhex's entry-point groups with the distribution "
        "(and version) that declares it, whether it is built in, and whether it loads (the "
        "error and an install hint when it does not).",
    )
    parser.add_argument(
        "--group",
        choices=[g.removeprefix("kvhex.") for g in GROUPS],
        action="append",
        help="only this group (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when any listed plugin fails to load"
    )
    return parser


def survey(registry: Registry, groups: Sequence[str]) -> list[PluginStatus]:
    """Load every plugin of ``groups`` in ``registry`` (sorted by group, then name)."""
    statuses = []
    for group in groups:
        for spec in registry.specs(group):
            try:
                registry.load(spec.group, spec.name)
            except PluginError as exc:
                statuses.append(_status(spec, str(exc)))
            else:
                statuses.append(_status(spec, None))
    return statuses


def _status(spec: PluginSpec, error: str | None) -> PluginStatus:
    return PluginStatus(
        group=spec.group,
        name=spec.name,
        target=spec.value,
        distribution=spec.distribution,
        version=spec.version,
        builtin=spec.builtin,
        extras=spec.extras,
        loaded=error is None,
        error=error,
    )


def format_table(statuses: Sequence[PluginStatus]) -> list[str]:
    """A table of the plugins; each load error in full on its own line below its row."""
    header = ("GROUP", "NAME", "DISTRIBUTION", "BUILT-IN", "STATUS", "TARGET")
    rows = [
        (
            s.group.removeprefix("kvhex."),
            s.name,
            f"{s.distribution or '?'} {s.version or ''}".rstrip(),
            "yes" if s.builtin else "no",
            "ok" if s.loaded else "FAILED",
            s.target,
        )
        for s in statuses
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    out = [line(header)]
    for status, row in zip(statuses, rows, strict=True):
        out.append(line(row))
        if status.error is not None:
            out.append(f"    {status.error}")
    failed = sum(not s.loaded for s in statuses)
    out.append(f"{len(statuses)} plugins, {len(statuses) - failed} load, {failed} fail")
    return out


def main(args: argparse.Namespace) -> int:
    """Print the plugins; 0, or 1 under ``--check`` when any fails to load.

    A registry that cannot be built (one name declared by two distributions) is what this
    command is for finding: it is reported naming both, exit 1 (not 2: the input was fine).
    """
    groups = [f"kvhex.{g}" for g in args.group] if args.group else list(GROUPS)
    try:
        registry = Registry.discover(groups)
    except PluginError as exc:
        return fail("tiers", str(exc), EXIT_FAILED)
    statuses = survey(registry, groups)
    if args.json:
        print(json.dumps({"plugins": [attrs.asdict(s) for s in statuses]}, indent=2))
    else:
        print("\n".join(format_table(statuses)))
    if args.check and not all(s.loaded for s in statuses):
        return fail("tiers", "some plugins fail to load", EXIT_FAILED)
    return EXIT_OK
