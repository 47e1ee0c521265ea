"""``kvhex fsck ROOT``: verify a local file tier, read-only.

A thin front of :func:`kvhex.adapters.storage.files.fsck.check_root` (which says what is
checked and how it stays read-only). Exit status: 0 when every namespace is clean (orphans,
unfinished slabs and foreign files are reported but harmless), 1 when a block is corrupt or
missing or a namespace has a problem, 2 when ROOT cannot be checked at all (missing, not a
directory, unreadable) or a flag is bad, 3 when ROOT holds no kvhex tier.
"""

from __future__ import annotations

import argparse
import json

from kvhex.cli._args import EXIT_FAILED, EXIT_NOTHING, fail

SHOWN = 10
"""Orphans listed without ``--verbose``."""


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``kvhex fsck`` and its flags."""
    parser = subparsers.add_parser(
        "fsck",
        help="verify a local file tier read-only (checksums, slot tables, orphans, foreign files)",
        description="Verify the local file tier under ROOT without modifying it or taking its "
        "locks: every slot record's block is where it says and matches its checksum. Exit 0 "
        "when clean, 1 when anything is corrupt or missing, 2 when ROOT cannot be checked, "
        "3 when ROOT holds no kvhex tier.",
    )
    parser.add_argument(
        "root",
        metavar="ROOT",
        help="the tier's root directory (the url of a local fsspec tier), or one namespace in it",
    )
    parser.add_argument("--json", action="store_true", help="one JSON document instead of text")
    # -v (the frame's) also lists every orphan, not just the first few
    return parser


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def main(args: argparse.Namespace) -> int:
    """Check ROOT and print the verdict."""
    # without the file tier's packages: one line naming the extra (``kvhex.cli``)
    from kvhex.adapters.storage.files.fsck import check_root

    try:
        report = check_root(args.root)
    except OSError as exc:
        return fail("fsck", f"ROOT {args.root}: {exc.strerror or exc}")
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    if not report.namespaces:
        n = len(report.foreign)
        found = f" ({n} entries, none a kvhex namespace)" if n else " (it is empty)"
        return fail(
            "fsck",
            f"ROOT {args.root} holds no kvhex tier{found}: pass the directory a local fsspec "
            "tier's url names, or one namespace directory in it",
            EXIT_NOTHING,
        )
    if args.json:
        return 0 if report.clean else EXIT_FAILED
    print(f"kvhex fsck {report.root}")
    for ns in report.namespaces:
        print(
            f"namespace {ns.name}: {ns.blocks_ok} ok, {ns.blocks_corrupt} corrupt, "
            f"{ns.blocks_missing} missing; {ns.slabs} slab(s) of {_size(ns.slab_bytes)}, "
            f"{_size(ns.block_bytes)} in intact blocks"
        )
        for problem in ns.problems:
            print(f"  PROBLEM {problem}")
        for f in ns.findings:
            print(f"  {f.finding.name:<8}{f.key}: {f.reason} (slab {f.slab}, slot {f.slot})")
        shown = ns.orphans if args.verbose else ns.orphans[:SHOWN]
        for o in shown:
            print(f"  orphan  {o.key} (slab {o.slab}, slot {o.slot}; no record, harmless)")
        if len(shown) < len(ns.orphans):
            print(f"  ... {len(ns.orphans) - len(shown)} more orphans (--verbose lists them)")
        records = ns.bad_records if args.verbose else ns.bad_records[:SHOWN]
        for r in records:
            print(
                f"  bad record {r.key} (slab {r.slab}, slot {r.slot}; announced as a "
                "placeholder, harmless)"
            )
        if len(records) < len(ns.bad_records):
            more = len(ns.bad_records) - len(records)
            print(f"  ... {more} more bad records (--verbose lists them)")
        for name in ns.unfinished_slabs:
            print(f"  unfinished slab {name} (a crash while creating it; removed at next start)")
        for name in ns.foreign:
            print(f"  foreign {name} (ignored by the tier)")
    for name in report.foreign:
        print(f"foreign {name} (not a namespace; ignored by the tier)")
    if report.clean:
        print("clean")
        return 0
    corrupt = sum(ns.blocks_corrupt for ns in report.namespaces)
    missing = sum(ns.blocks_missing for ns in report.namespaces)
    problems = sum(len(ns.problems) for ns in report.namespaces)
    print(
        f"NOT CLEAN: {corrupt} corrupt and {missing} missing block(s), "
        f"{problems} namespace problem(s)"
    )
    return EXIT_FAILED
