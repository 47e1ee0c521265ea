"""``kvhex run``: replay a serving workload through the whole stack and report.

With no arguments: the host tier plus a local file tier in a temporary directory, a
synthetic multi-turn chat with shared prefixes, the torch transfer on CUDA when present and
on CPU tensors otherwise. ``--config`` takes a TOML/JSON file (``[primary]``, ``[[tiers]]``,
``[[sinks]]``, ``[run]``: docs/configuration.md); flags override it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvhex.cli._args import positive
from kvhex.config.loader import load_config
from kvhex.config.model import (
    KvhexConfig,
    Options,
    PluginName,
    PositiveInt,
    PrimaryConfig,
    SinkConfig,
    TierConfig,
)

__all__ = ["add_parser", "main"]

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_HOST_BYTES = 48 * MiB
DEFAULT_TIER_BYTES = 2 * GiB


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``kvhex run``."""
    p: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="replay a workload through the tiers and report hit rates, traffic, events and "
        "integrity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="a kvhex .toml or .json configuration")
    p.add_argument(
        "--workload",
        metavar="FILE",
        help="a JSONL workload (tokens or lengths, prefix groups, lora, cache_salt, mm)",
    )
    p.add_argument(
        "--tier",
        action="append",
        metavar="URL",
        help="a file tier: a directory, or s3://bucket/prefix (repeatable; replaces the "
        "configured tiers)",
    )
    p.add_argument("--tier-capacity", type=_size, metavar="BYTES", help="bytes per --tier")
    p.add_argument("--s3-endpoint", metavar="URL", help="endpoint of s3:// tiers")
    p.add_argument("--host-capacity", type=_size, metavar="BYTES", help="host tier bytes")
    p.add_argument("--requests", type=positive(int), metavar="N", help="requests to replay")
    p.add_argument(
        "--duration", type=positive(float), metavar="SECONDS", help="stop after this long"
    )
    p.add_argument(
        "--events",
        metavar="PATH|tcp://...",
        help="also publish KV events: a JSONL file, or a ZMQ PUB endpoint",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="device KV cache")
    p.add_argument("--seed", type=int, help="workload and KV bytes seed")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    return p


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in units else raw
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0: {text!r}")
    return value


def _configure(args: argparse.Namespace, scratch: str) -> KvhexConfig:
    """The configuration to run: the file's or the embedded default, with flags applied."""
    if args.config:
        config = load_config(args.config)
    else:
        config = KvhexConfig(
            primary=PrimaryConfig(capacity_bytes=PositiveInt(DEFAULT_HOST_BYTES)),
            tiers=(_file_tier(scratch, DEFAULT_TIER_BYTES, None, 0),),
        )
    primary = config.primary
    if args.host_capacity:
        primary = attrs.evolve(primary, capacity_bytes=PositiveInt(args.host_capacity))
    tiers = config.tiers
    if args.tier:
        capacity = args.tier_capacity or DEFAULT_TIER_BYTES
        tiers = tuple(
            _file_tier(url, capacity, args.s3_endpoint, i) for i, url in enumerate(args.tier)
        )
    sinks = config.sinks
    if args.events:
        if args.events.startswith(("tcp://", "ipc://", "inproc://")):
            sinks += (
                SinkConfig(type=PluginName("zmq"), options=Options({"endpoint": args.events})),
            )
        else:
            sinks += (SinkConfig(type=PluginName("jsonl"), options=Options({"path": args.events})),)
    run = attrs.evolve(
        config.run,
        requests=args.requests or config.run.requests,
        seed=config.run.seed if args.seed is None else args.seed,
        device=args.device or config.run.device,
    )
    return KvhexConfig(primary=primary, tiers=tiers, sinks=sinks, run=run)


def _file_tier(url: str, capacity: int, endpoint: str | None, i: int) -> TierConfig:
    options: dict[str, Any] = {"url": url, "capacity_bytes": capacity}
    name = "files" if i == 0 else f"files{i}"
    if url.startswith("s3://"):
        name = "s3" if i == 0 else f"s3-{i}"
        options["locality"] = "REMOTE"
        if endpoint:
            options["storage_options"] = {"endpoint_url": endpoint}
    return TierConfig(type=PluginName("fsspec"), name=name, options=Options(options))


def main(args: argparse.Namespace) -> int:
    """Run the replay; exit 0 when every loaded block was intact, 1 otherwise."""
    scratch = tempfile.mkdtemp(prefix="kvhex-run-")
    try:
        config = _configure(args, scratch)
        from kvhex.cli._stack import Stack  # torch is imported only when a run starts

        with Stack(config, source=args.config) as stack:
            requests = stack.requests(args.workload)
            progress = None if args.no_progress or not sys.stderr.isatty() else _progress()
            report = stack.run(requests, duration_s=args.duration, progress=progress)
        if progress is not None:
            print(file=sys.stderr)
        summary = report.as_dict()
        summary["device"] = stack.device
        summary["tiers"] = stack.tier_labels
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print(_table(summary))
        return 0 if report.intact else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _progress() -> Callable[[Any, int, int], None]:
    """A progress line on stderr, redrawn at most five times a second."""
    shown = 0.0

    def show(replay: Any, done: int, total: int) -> None:
        nonlocal shown
        now = time.monotonic()
        if now - shown < 0.2 and done != total:
            return
        shown = now
        r = replay.report
        rate = sum(r.hits.values()) / r.chunks if r.chunks else 0.0
        moved = (r.device_store.nbytes + r.device_load.nbytes) / 1e9
        print(
            f"\rkvhex run: {done}/{total} requests  chunk hit rate {rate:5.1%}  "
            f"device<->host {moved:6.2f} GB  events {sum(r.events.values()):,}  ",
            end="",
            file=sys.stderr,
            flush=True,
        )

    return show


def _table(s: dict[str, Any]) -> str:
    lines = [
        f"kvhex run: {s['requests']} requests, {s['tokens']:,} prompt tokens, "
        f"{s['seconds']:.1f} s on {s['device']}; tiers: {', '.join(s['tiers']) or 'host only'}",
        "",
        f"{'hits from':<14}{'chunks':>10}{'rate':>9}{'tokens':>12}",
    ]
    for source, h in s["hits"].items():
        lines.append(f"{source:<14}{h['chunks']:>10,}{h['rate']:>9.1%}{h['tokens']:>12,}")
    lines.append(
        f"{'all':<14}{sum(h['chunks'] for h in s['hits'].values()):>10,}"
        f"{s['chunk_hit_rate']:>9.1%}{'':>12}   of {s['chunks_looked_up']:,} chunks looked up"
    )
    lines += ["", f"{'traffic':<22}{'bytes':>14}{'GB/s':>9}"]
    for name, t in s["transfers"].items():
        gbps = f"{t['gbps']:.2f}" if t["gbps"] else "-"
        lines.append(f"{name:<22}{t['bytes']:>14,}{gbps:>9}")
    lines += ["", f"{'events':<30}{'count':>10}"]
    for name, n in s["events"].items():
        lines.append(f"{name:<30}{n:>10,}")
    if s["placeholder_events"]:
        lines.append(f"{'(placeholders among them)':<30}{s['placeholder_events']:>10,}")
    i = s["integrity"]
    lines += [
        "",
        f"integrity: {i['verdict']} ({i['blocks_checked']:,} loaded blocks checked, "
        f"{i['blocks_bad']:,} wrong, {i['failed_transfers']} failed copies)",
    ]
    return "\n".join(lines)
