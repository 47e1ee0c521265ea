"""``kvhex bench``: run the benchmarks of ``bench/`` and print one ratio table.

Each benchmark is a plain script of a source checkout's ``bench/`` directory (they are not
installed with the package). This command runs each in a child process of the same Python
with ``--json`` (and ``--quick`` for tiny sizes), reads the one JSON document it prints on
stdout (``bench/_report.py`` defines it), and prints every figure beside its baseline from the
same run: benchmark, case, kvhex figure, baseline figure, ratio (kvhex / baseline), the 95%
interval of a median ratio where the script gives one (``-`` otherwise), unit.
A benchmark that fails or times out is reported and the others still run; the exit status is
then 1.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvhex.cli._args import EXIT_FAILED, EXIT_USAGE, positive

BENCHMARKS = ("primary_tier", "manager", "tiering", "events", "tiers", "gpu_transfer")
"""The scripts of ``bench/`` (without ``.py``), in the order they run."""


@attrs.frozen
class Row:
    """One figure of one benchmark beside its baseline."""

    bench: str
    case: str
    kvhex: float | None
    baseline: float | None
    ratio: float | None
    unit: str
    baseline_name: str
    better: str
    ratio_low: float | None = None
    ratio_high: float | None = None


@attrs.frozen
class Outcome:
    """What running one benchmark gave: its rows, or why there are none."""

    bench: str
    rows: tuple[Row, ...] = ()
    error: str | None = None
    seconds: float = 0.0


def _benchmark_names(text: str) -> list[str]:
    names = [n.strip().replace("-", "_").removesuffix(".py") for n in text.split(",")]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        named = ", ".join(map(repr, unknown))
        raise argparse.ArgumentTypeError(
            f"unknown benchmark {named}; choose from {', '.join(BENCHMARKS)}"
        )
    return names


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``kvhex bench`` and its flags."""
    parser = subparsers.add_parser(
        "bench",
        help="run the benchmarks of bench/ and print one ratio table",
        description="Run the benchmark scripts of a source checkout's bench/ directory (each "
        "against its baseline, measured in the same run) and print one table: benchmark, "
        "case, kvhex figure, baseline figure, ratio (kvhex / baseline), unit.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes: checks that every benchmark runs (seconds), measures nothing",
    )
    parser.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        type=_benchmark_names,
        help=f"run only these (repeat or comma-separate): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument(
        "--bench-dir",
        metavar="DIR",
        type=Path,
        help="the bench/ directory (default: the one of the source checkout kvhex runs from)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON document")
    parser.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=positive(float),
        help="stop a benchmark that runs longer (default: no limit)",
    )
    # -v (the frame's) also shows each benchmark's own report as it runs, on stderr
    return parser


class BenchDirNotFound(Exception):
    """No directory with the benchmark scripts."""


def find_bench_dir(given: Path | None, names: Sequence[str]) -> Path:
    """The directory holding the scripts ``names``: ``given``, or the ``bench/`` beside the
    ``src/`` directory kvhex was imported from (a source checkout).

    Raises:
        BenchDirNotFound: a message saying where it looked and what to pass instead.
    """
    if given is not None:
        where = given
    else:
        import kvhex

        package = Path(kvhex.__file__).resolve().parent
        if package.parent.name != "src":
            raise BenchDirNotFound(
                f"kvhex is imported from {package.parent}, not from a source checkout, and "
                "the benchmarks are not installed with the package; pass --bench-dir "
                "PATH/TO/CHECKOUT/bench"
            )
        where = package.parent.parent / "bench"
    missing = [f"{n}.py" for n in names if not (where / f"{n}.py").is_file()]
    if missing:
        raise BenchDirNotFound(
            f"no benchmark scripts in {where} (missing {', '.join(missing)}); pass "
            "--bench-dir PATH/TO/CHECKOUT/bench"
        )
    return where


def _rows(bench: str, stdout: str) -> tuple[Row, ...]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("printed no JSON document")
    document = json.loads(lines[-1])
    if not isinstance(document, dict) or not isinstance(document.get("rows"), list):
        raise ValueError("its JSON document has no list of rows")
    rows = []
    for raw in document["rows"]:
        rows.append(
            Row(
                bench=bench,
                case=str(raw["case"]),
                kvhex=_float(raw.get("kvhex")),
                baseline=_float(raw.get("baseline")),
                ratio=_float(raw.get("ratio")),
                unit=str(raw["unit"]),
                baseline_name=str(raw.get("baseline_name") or ""),
                better=str(raw.get("better") or "lower"),
                ratio_low=_float(raw.get("ratio_low")),
                ratio_high=_float(raw.get("ratio_high")),
            )
        )
    return tuple(rows)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def run_one(script: Path, *, quick: bool, timeout: float | None, verbose: bool) -> Outcome:
    """Run one benchmark script with ``--json`` and read its rows."""
    bench = script.stem
    command = [sys.executable, str(script), "--json"] + (["--quick"] if quick else [])
    started = time.monotonic()
    try:
        done = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=None if verbose else subprocess.PIPE,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Outcome(bench, error=f"timed out after {timeout:g} s")
    seconds = time.monotonic() - started
    if done.returncode != 0:
        tail = [line for line in (done.stderr or "").splitlines() if line.strip()]
        why = f": {tail[-1].strip()}" if tail else ""
        return Outcome(bench, error=f"exit status {done.returncode}{why}", seconds=seconds)
    try:
        return Outcome(bench, _rows(bench, done.stdout), seconds=seconds)
    except (ValueError, KeyError, TypeError) as exc:
        return Outcome(bench, error=f"unreadable output: {exc}", seconds=seconds)


def _figure(value: float | None) -> str:
    if value is None:
        return "-"
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 0.01 or size == 0:
        return f"{value:.2f}"
    return f"{value:.2g}"


def format_table(outcomes: Sequence[Outcome]) -> list[str]:
    """The ratio table, a legend of baselines, and one line per failed benchmark."""
    rows = [row for outcome in outcomes for row in outcome.rows]
    header = ("benchmark", "case", "kvhex", "baseline", "ratio", "95% CI", "unit")
    cells = [
        (
            r.bench,
            r.case,
            _figure(r.kvhex),
            _figure(r.baseline),
            _ratio(r.ratio),
            interval_text(r.ratio_low, r.ratio_high),
            r.unit,
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    right = (False, False, True, True, True, True, False)

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line(header)] + [line(c) for c in cells]
    out.append("")
    for outcome in outcomes:
        if outcome.error is not None:
            out.append(f"{outcome.bench}: FAILED ({outcome.error})")
            continue
        out.append(f"{outcome.bench} ({outcome.seconds:.0f} s): {_legend(outcome.rows)}")
    return out


def _legend(rows: Sequence[Row]) -> str:
    """What each baseline of a benchmark is, and which way is better."""
    parts = []
    for name in sorted({r.baseline_name for r in rows}):
        mine = [r for r in rows if r.baseline_name == name]
        better = "/".join(sorted({r.better for r in mine}))
        measured = "" if any(r.baseline is not None for r in mine) else ", not measured here"
        parts.append(f"vs {name or 'no baseline'} ({better} is better{measured})")
    return "; ".join(parts) or "no rows"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def interval_text(low: float | None, high: float | None) -> str:
    """A median ratio's interval as ``low-high`` to two places, or ``-`` where there is none
    (``None``, or NaN as the bench scripts keep it); the scripts print it the same way."""
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return "-"
    return f"{low:.2f}-{high:.2f}"


def main(args: argparse.Namespace) -> int:
    """Run the selected benchmarks; 0 when every one produced its rows, 1 otherwise."""
    names = (
        [n for n in BENCHMARKS if any(n in group for group in args.only)]
        if args.only
        else list(BENCHMARKS)
    )
    try:
        bench_dir = find_bench_dir(args.bench_dir, names)
    except BenchDirNotFound as exc:
        print(f"kvhex bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    outcomes = []
    for name in names:
        print(
            f"kvhex bench: running {name}{' (quick)' if args.quick else ''}",
            file=sys.stderr,
            flush=True,
        )
        outcomes.append(
            run_one(
                bench_dir / f"{name}.py",
                quick=args.quick,
                timeout=args.timeout,
                verbose=args.verbose > 0,
            )
        )
    if args.json:
        document = {
            "rows": [attrs.asdict(r) for o in outcomes for r in o.rows],
            "failed": [{"bench": o.bench, "error": o.error} for o in outcomes if o.error],
        }
        print(json.dumps(document))
    else:
        print("\n".join(format_table(outcomes)))
    return EXIT_FAILED if any(o.error for o in outcomes) else 0
