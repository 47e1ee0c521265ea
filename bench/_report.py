"""What every benchmark script shares: ``--quick`` and ``--json``, and its figures as rows.

By default a script prints its human report on stdout, unchanged. With ``--json`` the same
human lines, and anything else written to stdout (log lines, native libraries' output), go to
stderr, and stdout carries exactly one JSON document, which ``kvhex bench`` reads instead of
scraping text::

    {"bench": "tiers", "rows": [{"case": "files 2048 KiB put", "kvhex": 2.56, "baseline": 4.9,
      "ratio": 0.52, "ratio_low": 0.47, "ratio_high": 0.58, "unit": "GB/s",
      "baseline_name": "raw os.pwrite", "better": "higher"}]}

``ratio`` is kvhex / baseline as the script computed it (some scripts take the median of
per-pass ratios, not the ratio of medians); ``baseline`` and ``ratio`` are ``null`` when the
script had no baseline for that figure (vLLM not installed, say). ``ratio_low`` and
``ratio_high`` bound that median of per-pass ratios with 95% confidence
(:func:`median_interval`); they are ``null`` where a script gives no interval or ran too few
passes for one. ``--quick`` replaces every
size flag still at its default with the tiny size of the script's ``QUICK`` table (what the
smoke tests run): a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from kvhex.cli._args import positive

CONFIDENCE = 0.95
"""How sure :func:`median_interval` is that the median lies inside its interval."""


def parse(parser: argparse.ArgumentParser, quick: Mapping[str, Any]) -> argparse.Namespace:
    """Add ``--quick`` and ``--json`` to ``parser`` and parse the command line."""
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: check the script runs, measure nothing"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="human report on stderr, one JSON document of rows on stdout",
    )
    args = parser.parse_args()
    args.document = _reserve_stdout() if args.json else sys.stdout
    if args.quick:
        for name, value in quick.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    return args


def add_chunk_sizes(parser: argparse.ArgumentParser) -> None:
    """Add ``--chunk-kib``: the chunk sizes a tier bench measures, in KiB (2 MiB and 256 KiB
    by default), as ``args.chunk_kib``, a list of byte counts."""
    parser.add_argument(
        "--chunk-kib",
        type=_chunk_sizes,
        default=[2048 * 1024, 256 * 1024],
        metavar="KIB[,KIB...]",
        help="chunk sizes in KiB, each measured on its own (default: 2048,256)",
    )


def add_repeats(parser: argparse.ArgumentParser) -> None:
    """Add ``--repeats``: the timed passes of a bench that alternates sides (9 by default, so
    that each median of per-pass ratios gets its :func:`median_interval`)."""
    parser.add_argument(
        "--repeats",
        type=positive(int),
        default=9,
        help="timed passes (9 by default: each median ratio gets a 95%% interval from 6 on)",
    )


def _chunk_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) * 1024 for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of whole KiB") from None
    if not all(size > 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: every chunk size must be at least 1 KiB")
    return sizes


def median_interval(
    values: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """An interval that holds the median of the distribution ``values`` sample with at least
    ``confidence``, assuming nothing of its shape: the order statistics ``x(k)`` and
    ``x(n + 1 - k)`` with ``k`` the largest for which fewer than ``k`` of ``n`` values fall
    below the median with probability at most ``(1 - confidence) / 2`` (a binomial of one
    half). ``None`` when ``n`` is too small for any (fewer than 6 values at 95%)."""
    n = len(values)
    tail = (1 - confidence) / 2
    k, below = 0, 0.0  # below: P(fewer than k + 1 of n fall below the median)
    while k < n // 2:
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def summarize(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median of each series; and for each series whose name holds ``ratio``, its
    :func:`median_interval` as ``"<name> low"`` and ``"<name> high"`` (NaN when there is
    none)."""
    out: dict[str, float] = {}
    for name, values in samples.items():
        out[name] = statistics.median(values)
        if "ratio" in name:
            interval = median_interval(values)
            out[f"{name} low"], out[f"{name} high"] = interval or (math.nan, math.nan)
    return out


def _reserve_stdout() -> TextIO:
    """The original stdout, kept for the JSON document, with file descriptor 1 pointed at
    stderr: log lines (structlog prints to stdout) and native libraries that write to fd 1
    (NIXL's logger) then land on stderr instead of corrupting the document."""
    sys.stdout.flush()
    document = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return document


def _number(value: float | None) -> float | None:
    if value is None or math.isnan(value) or math.isinf(value):
        return None
    return value


class Report:
    """The human lines and the machine rows of one benchmark run."""

    def __init__(self, bench: str, args: argparse.Namespace) -> None:
        self.bench = bench
        self.as_json: bool = args.json
        self._document: TextIO = args.document
        self.rows: list[dict[str, Any]] = []

    def say(self, *parts: object) -> None:
        """Print a human line (to stderr under ``--json``)."""
        print(*parts, file=sys.stderr if self.as_json else sys.stdout, flush=True)

    def row(
        self,
        case: str,
        kvhex: float,
        baseline: float | None,
        *,
        unit: str,
        baseline_name: str,
        better: str = "lower",
        ratio: float | None = None,
        interval: tuple[float | None, float | None] = (None, None),
    ) -> None:
        """Record one figure beside its baseline (``ratio`` defaults to kvhex / baseline;
        ``interval`` bounds a median ratio, :func:`median_interval`)."""
        if ratio is None and baseline:
            ratio = kvhex / baseline
        self.rows.append(
            {
                "case": case,
                "kvhex": _number(kvhex),
                "baseline": _number(baseline),
                "ratio": _number(ratio),
                "ratio_low": _number(interval[0]),
                "ratio_high": _number(interval[1]),
                "unit": unit,
                "baseline_name": baseline_name,
                "better": better,
            }
        )

    def finish(self) -> None:
        """Under ``--json``, print the rows as one JSON document on stdout."""
        if self.as_json:
            json.dump({"bench": self.bench, "rows": self.rows}, self._document)
            self._document.write("\n")
            self._document.flush()
