"""``kvhex run``: replay a serving workload through the whole stack and report.

With no arguments: the host tier plus a local file tier in a temporary directory, a
synthetic multi-turn chat with shared prefixes, the torch transfer on CUDA when present and
on CPU tensors otherwise (``--transfer`` names another ``kvhex.transfers`` entry point).
``--config`` takes a TOML/JSON file (``[primary]``, ``[[tiers]]``, ``[[sinks]]``, ``[run]``:
docs/configuration.md); flags override it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs

from kvhex.adapters.events.endpoints import endpoint_problem, is_endpoint
from kvhex.cli._args import EXIT_FAILED, EXIT_OK, fail, positive
from kvhex.config.loader import load_config
from kvhex.config.model import (
    CHECKS,
    KvhexConfig,
    Options,
    PluginName,
    PositiveInt,
    PrimaryConfig,
    SinkConfig,
    TierConfig,
)
from kvhex.errors import ConfigError
from kvhex.plugins import missing_package

if TYPE_CHECKING:
    from kvhex.sim.workload import Request

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
        type=_text,
        metavar="URL",
        help="a storage tier: a directory, s3://bucket/prefix or valkey://host:port/prefix "
        "(repeatable; replaces the configured tiers)",
    )
    p.add_argument("--tier-capacity", type=_size, metavar="BYTES", help="bytes per --tier")
    p.add_argument("--s3-endpoint", type=_text, metavar="URL", help="endpoint of s3:// tiers")
    p.add_argument("--host-capacity", type=_size, metavar="BYTES", help="host tier bytes")
    p.add_argument("--requests", type=positive(int), metavar="N", help="requests to replay")
    p.add_argument(
        "--duration",
        type=positive(float),
        metavar="SECONDS",
        help="stop after this long (alone: replay until then)",
    )
    p.add_argument(
        "--events",
        action="append",
        type=_text,
        metavar="FILE|tcp://...",
        help="also publish KV events: a JSONL file (replaced), or a ZMQ endpoint the PUB "
        "socket binds (repeatable)",
    )
    p.add_argument(
        "--events-replay",
        type=_text,
        metavar="tcp://...",
        help="bind a replay socket for the first ZMQ --events, so a late subscriber misses nothing",
    )
    p.add_argument(
        "--metrics-addr",
        type=_text,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics while the run lasts "
        "(needs kvhex[metrics])",
    )
    p.add_argument(
        "--metrics-hold",
        type=positive(float),
        metavar="SECONDS",
        help="keep serving the metrics this long after the summary (a last scrape)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="device KV cache")
    p.add_argument(
        "--transfer",
        type=_entry_point,
        metavar="NAME",
        help="the kvhex.transfers entry point copying device <-> host (default: [run] "
        "transfer, torch)",
    )
    p.add_argument("--seed", type=int, help="workload and KV bytes seed")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    return p


def _text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _entry_point(text: str) -> str:
    try:
        return str(CHECKS[PluginName](text))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in units else raw
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0: {text!r}")
    return value


class _Usage(Exception):
    """Flags that do not go together (argparse cannot tell); the message names them."""


def _check_flags(args: argparse.Namespace) -> None:
    """What argparse cannot check alone: flags that need another, and endpoints.

    Raises:
        _Usage: naming the flag and what would be right.
    """
    s3 = [url for url in args.tier or () if url.startswith("s3://")]
    if args.s3_endpoint and not s3:
        raise _Usage(
            f"--s3-endpoint {args.s3_endpoint}: no s3:// tier to send it to; add --tier "
            "s3://BUCKET/PREFIX (a configured S3 tier takes endpoint_url in its "
            "storage_options)"
        )
    if args.tier_capacity and not args.tier:
        raise _Usage(
            "--tier-capacity: sizes the --tier tiers, and none is given; add --tier URL (a "
            "configured tier takes capacity_bytes in its options)"
        )
    _check_metrics(args)
    zmq = [e for e in args.events or () if is_endpoint(e)]
    if args.events_replay and not zmq:
        raise _Usage(
            f"--events-replay {args.events_replay}: replays a ZMQ stream, and no --events "
            "is a ZMQ endpoint; add --events tcp://127.0.0.1:PORT"
        )
    for flag, endpoint in [
        *(("--events", e) for e in zmq),
        ("--events-replay", args.events_replay),
    ]:
        if endpoint is None:
            continue
        problem = endpoint_problem(endpoint, bind=True)
        if problem is None and endpoint.startswith("inproc://"):
            problem = "inproc:// reaches only this process: use tcp://HOST:PORT or ipc://PATH"
        if problem is not None:
            raise _Usage(f"{flag} {endpoint}: {problem}")


def _check_metrics(args: argparse.Namespace) -> None:
    if args.metrics_hold and not args.metrics_addr:
        raise _Usage("--metrics-hold: holds the --metrics-addr server, and none is given")
    if not args.metrics_addr:
        return
    try:
        from kvhex.adapters.metrics.prometheus import parse_metrics_address
    except ModuleNotFoundError as exc:
        missing = missing_package(exc)
        if missing is None:
            raise
        raise _Usage(f"--metrics-addr {args.metrics_addr}: {missing}") from None
    try:
        parse_metrics_address(args.metrics_addr)
    except ConfigError as exc:
        raise _Usage(f"--metrics-addr {exc.issues[0][1]}") from None


def _metrics_server(stack: Any, address: str) -> Any:
    """``/metrics`` of the run's engine at ``address`` (checked by ``_check_metrics``)."""
    from prometheus_client import CollectorRegistry

    from kvhex.adapters.metrics.prometheus import register_metrics, serve_metrics

    registry = CollectorRegistry()
    register_metrics(stack.engine, registry)
    try:
        server = serve_metrics(registry, address)
    except OSError as exc:
        raise _Usage(
            f"--metrics-addr {address}: cannot listen there ({exc.strerror or exc}); give a "
            "free port of this machine, or port 0 for any"
        ) from None
    print(f"kvhex run: metrics at {server.url}", file=sys.stderr, flush=True)
    return server


def _configure(args: argparse.Namespace, scratch: str) -> tuple[KvhexConfig, dict[str, str]]:
    """The configuration to run: the file's or the embedded default, with flags applied; and
    which flag each configuration path came from (to name it in errors)."""
    if args.config:
        config = load_config(args.config)
    else:
        config = KvhexConfig(
            primary=PrimaryConfig(capacity_bytes=PositiveInt(DEFAULT_HOST_BYTES)),
            tiers=(_file_tier(scratch, DEFAULT_TIER_BYTES, None, 0),),
        )
    flags: dict[str, str] = {}
    primary = config.primary
    if args.host_capacity:
        primary = attrs.evolve(primary, capacity_bytes=PositiveInt(args.host_capacity))
        flags["$.primary.capacity_bytes"] = f"--host-capacity {args.host_capacity}"
    tiers = config.tiers
    if args.tier:
        capacity = args.tier_capacity or DEFAULT_TIER_BYTES
        tiers = tuple(
            _file_tier(url, capacity, args.s3_endpoint, i) for i, url in enumerate(args.tier)
        )
        flags.update({f"$.tiers[{i}]": f"--tier {url}" for i, url in enumerate(args.tier)})
    sinks = config.sinks
    replay = args.events_replay
    for events in args.events or ():
        flags[f"$.sinks[{len(sinks)}]"] = f"--events {events}"
        if is_endpoint(events):
            options: dict[str, Any] = {"endpoint": events}
            if replay:
                options["replay_endpoint"] = replay
                flags[f"$.sinks[{len(sinks)}]"] += f" --events-replay {replay}"
                replay = None
            sinks += (SinkConfig(type=PluginName("zmq"), options=Options(options)),)
        else:
            sinks += (SinkConfig(type=PluginName("jsonl"), options=Options({"path": events})),)
    run = attrs.evolve(
        config.run,
        requests=args.requests or config.run.requests,
        seed=config.run.seed if args.seed is None else args.seed,
        device=args.device or config.run.device,
        transfer=args.transfer or config.run.transfer,
    )
    if args.device:
        flags["$.run.device"] = f"--device {args.device}"
    if args.transfer:
        flags["$.run.transfer"] = f"--transfer {args.transfer}"
    # evolve, not rebuild: every other table (``[loading]``, ...) stays as configured
    return attrs.evolve(config, primary=primary, tiers=tiers, sinks=sinks, run=run), flags


def _file_tier(url: str, capacity: int, endpoint: str | None, i: int) -> TierConfig:
    options: dict[str, Any] = {"url": url, "capacity_bytes": capacity}
    name = "files" if i == 0 else f"files{i}"
    if url.startswith(("valkey://", "valkeys://")):  # the Valkey tier (kvhex[valkey])
        name = "valkey" if i == 0 else f"valkey-{i}"
        return TierConfig(type=PluginName("valkey"), name=name, options=Options(options))
    if url.startswith("s3://"):
        name = "s3" if i == 0 else f"s3-{i}"
        options["locality"] = "REMOTE"
        if endpoint:
            options["storage_options"] = {"endpoint_url": endpoint}
    return TierConfig(type=PluginName("fsspec"), name=name, options=Options(options))


def _named(exc: ConfigError, flags: dict[str, str]) -> ConfigError:
    """``exc`` with each path that a flag made followed by that flag."""
    if not flags:
        return exc
    issues = []
    for path, problem in exc.issues:
        made = [
            flag
            for prefix, flag in flags.items()
            if path == prefix or path.startswith((f"{prefix}.", f"{prefix}["))
        ]
        issues.append((f"{path} (from {made[0]})" if made else path, problem))
    return ConfigError(issues, exc.source)


def _requests(
    config: KvhexConfig, workload: str | None, limit: int | None, source: str | None
) -> Iterator[Request]:
    """The workload file's requests, or the synthetic chat, made as the run takes them; at
    most ``limit`` (``None``: the whole file, or an endless chat). Checked before anything is
    built, so a bad workload costs no tier directory and no torch import.

    Raises:
        ConfigError: a bad workload line, or a request the device cache cannot hold (naming
            ``[run].device_blocks``).
    """
    from kvhex.sim.workload import (
        DeviceCache,
        read_workload,
        synthetic_chat,
        synthetic_max_tokens,
    )

    run = config.run
    tokens_per_chunk = run.tokens_per_block * run.blocks_per_chunk
    device = DeviceCache(tokens_per_chunk, run.blocks_per_chunk, run.device_blocks)
    if workload:
        return read_workload(workload, seed=run.seed, limit=limit, device=device)
    problem = device.problem(synthetic_max_tokens(tokens_per_chunk))
    if problem is not None:
        raise ConfigError(
            [("$.run.device_blocks", f"the synthetic chat's longest prompt: {problem}")], source
        )
    return synthetic_chat(limit, seed=run.seed, tokens_per_chunk=tokens_per_chunk)


def main(args: argparse.Namespace) -> int:
    """Run the replay; exit 0 when nothing went wrong, 1 when a loaded block was wrong, a
    copy failed or a tier job failed, 2 when it could not start (docs/cli.md)."""
    try:
        _check_flags(args)
    except _Usage as exc:
        return fail("run", str(exc))
    scratch = tempfile.mkdtemp(prefix="kvhex-run-")
    flags: dict[str, str] = {}
    try:
        config, flags = _configure(args, scratch)
        # --duration alone replays until the time is up; otherwise [run].requests or --requests
        limit = None if args.duration and not args.requests else config.run.requests
        requests = _requests(config, args.workload, limit, args.config)
        from kvhex.cli._stack import Stack  # torch is imported only when a run starts

        with Stack(config, source=args.config) as stack:
            server = _metrics_server(stack, args.metrics_addr) if args.metrics_addr else None
            try:
                progress = None if args.no_progress or not sys.stderr.isatty() else _progress()
                report = stack.run(
                    requests, duration_s=args.duration, total=limit, progress=progress
                )
                if progress is not None:
                    print(file=sys.stderr)
                _print_summary(args, stack, report)
                if server is not None and args.metrics_hold:
                    time.sleep(args.metrics_hold)  # the engine stays up for a last scrape
            finally:
                if server is not None:
                    server.close()
    except ConfigError as exc:
        raise _named(exc, flags) from exc
    except _Usage as exc:
        return fail("run", str(exc))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return EXIT_OK if report.ok else EXIT_FAILED


def _print_summary(args: argparse.Namespace, stack: Any, report: Any) -> None:
    summary = report.as_dict()
    summary["device"] = stack.device
    summary["tiers"] = stack.tier_labels
    loading = stack.engine.stats().loading
    summary["load_decisions"] = {
        "load_all": loading.loaded_all,
        "load_part": loading.loaded_part,
        "recompute": loading.recomputed,
        "explore": loading.explored,
        "chunks_loaded": loading.chunks_loaded,
        "chunks_recomputed": loading.chunks_recomputed,
    }
    if args.json:
        print(json.dumps(summary, indent=2), flush=True)
    else:
        print(_table(summary), flush=True)


def _progress() -> Callable[[Any, int, int | None], None]:
    """A progress line on stderr, redrawn at most five times a second."""
    shown = 0.0

    def show(replay: Any, done: int, total: int | None) -> None:
        nonlocal shown
        now = time.monotonic()
        if now - shown < 0.2 and done != total:
            return
        shown = now
        r = replay.report
        rate = sum(r.hits.values()) / r.chunks if r.chunks else 0.0
        moved = (r.device_store.nbytes + r.device_load.nbytes) / 1e9
        of = f"/{total}" if total is not None else ""
        print(
            f"\rkvhex run: {done}{of} requests  chunk hit rate {rate:5.1%}  "
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
    d = s["load_decisions"]
    if d["load_all"] + d["load_part"] + d["recompute"]:
        lines += [
            "",
            f"load or recompute: {d['load_all']:,} prefixes loaded, {d['load_part']:,} in part, "
            f"{d['recompute']:,} recomputed ({d['chunks_loaded']:,} tier chunks loaded, "
            f"{d['chunks_recomputed']:,} left to recompute)",
        ]
    if s["tier_failures"]:
        lines += ["", f"{'FAILED tier jobs':<30}{'count':>10}"]
        for tier, failed in s["tier_failures"].items():
            for what, n in failed.items():
                label = f"{tier} {what.replace('_', ' ')}"
                lines.append(f"{label:<30}{n:>10,}")
    i = s["integrity"]
    checked = (
        f"({i['blocks_checked']:,} loaded blocks checked, {i['blocks_bad']:,} wrong, "
        f"{i['failed_transfers']} failed copies)"
    )
    if i["verdict"] == "unchecked":
        checked = "(no block was loaded back, so none could be compared)"
    lines += ["", f"integrity: {i['verdict']} {checked}"]
    if s["tier_failures"]:
        jobs = sum(n for failed in s["tier_failures"].values() for n in failed.values())
        lines.append(f"NOT OK: {jobs:,} tier job(s) failed (the warnings on stderr say why)")
    return "\n".join(lines)
