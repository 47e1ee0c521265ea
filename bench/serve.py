"""vLLM's OpenAI-compatible server under a multi-turn chat load, without offloading and with
kvhex (host memory; host memory and a file tier), in the same run: TTFT, inter-token latency,
requests per second, and where each prompt's cached tokens came from.

The script makes a random-weight Llama (``--layers`` x ``--hidden``, seed 0), then for each
configuration starts vLLM's server on loopback (``python -m
vllm.entrypoints.openai.api_server``: vLLM's CPU build has no working ``vllm`` script), runs
every point of the sweep against it, and stops it (its process group):

* ``none``: the server without offloading (prefix caching on), the baseline;
* ``host``: kvhex's host tier only (``--host-blocks``, twice the device cache by default);
* ``host+file``: the same host tier and a file tier in a temporary directory for the rest.

A point is ``U`` users (``--users``) chatting at once. Each has the point's shared system
prompt and a private history; a turn sends system + history + ``--new-tokens`` new tokens to
``/v1/completions`` (token ids: the server runs without a tokenizer), streams a greedy answer
of ``--answer-tokens`` (temperature 0, ``ignore_eos``, ``return_token_ids``) that joins the
history, and waits a think time (seeded, ``--think-s`` on average) before the user's next
turn. Token content is seeded per point, so every configuration sends the same prompts as long
as the answers are equal, which is checked. A point's working set (all users' final
histories) over the device cache (``--device-blocks``) is its ``ws/dev``; the default sweep
goes from fitting (0.7x) to 4.8x.

Reported per configuration and ``U``: TTFT p50 and p99 (at the first streamed token), ITL
p50 (each answer's mean gap between streamed tokens, the median over answers), completed
requests per second (requests over the point's wall time), and the point's prompt tokens by
where they came from, scraped from ``/metrics`` before and after the point
(``vllm:prompt_tokens_cached_by_source``: the device prefix cache, kvhex's host memory, its
file tier (``disk``); the rest was computed), with kvhex's per-tier chunk lookups, hits,
reads and writes (``vllm:kv_offload_tiering_*``) in the JSON rows. Ratios are against
``none`` at the same ``U``. ``--loading off`` or ``auto`` sets kvhex's load-or-recompute
mode (``kvhex.loading.mode``) in both kvhex configurations; by default kvhex's own applies.

Two settings keep the comparison fair on vLLM's CPU platform:

* every server runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (unless set): vLLM reserves a
  core for its scheduler, and one more whenever a KV connector is configured (meant for
  NIXL's P/D transfers), so kvhex's server would otherwise get one model core less (on 2
  cores its model would spin on both, none left for the scheduler and the API server, where
  the baseline's runs on one with one reserved);
* the model and its KV cache are float32 by default: vLLM's CPU kernels are not batch
  invariant, and in bf16 the baseline's own greedy answers changed between two runs (1-2 of
  8 users diverged), so the equality check would test rounding, not kvhex.

    .venv-vllm32/bin/python bench/serve.py                     # the sweep, about 5 minutes
    .venv-vllm32/bin/python bench/serve.py --quick --json --plot /tmp/serve.png

vLLM's own ``vllm bench serve`` datasets (``vllm.benchmarks.datasets``) are single-turn:
``random`` and ``prefix_repetition`` send independent prompts (a shared prefix at most) and
need a tokenizer, ShareGPT-style sets take only a conversation's first exchange and come from
a hub; none grows a per-user history, so this workload is the script's own.
A plain script, never a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import _vllm
from _report import Report, parse
from _vllm import VOCAB, make_model, scrape

CONFIGS = ("none", "host", "host+file")
"""The configurations compared, the baseline first."""
QUICK = {
    "users": [1, 4],
    "turns": 2,
    "system_tokens": 64,
    "new_tokens": 64,
    "answer_tokens": 8,
    "think_s": 0.05,
    "device_blocks": 12,
    "layers": 2,
    "hidden": 128,
}
"""Sizes of ``--quick`` (the smoke test's)."""
START_S = 600.0
"""How long a server may take to answer ``/health``."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SOURCES = ("device", "host", "disk")
"""``vllm:prompt_tokens_cached_by_source`` sources reported (kvhex's file tier is ``disk``)."""


def users_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of user counts") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every user count must be at least 1")
    return values


def block_size() -> int:
    """Tokens per KV block: 32 on vLLM's CPU platform (its attention backend needs a multiple
    of 32), vLLM's default of 16 elsewhere."""
    from vllm.platforms import current_platform

    return 32 if current_platform.is_cpu() else 16


# ---------------------------------------------------------------------------------------------
# the server


def transfer_config(config: str, chunk_bytes: int, args: argparse.Namespace, root: Path) -> Any:
    """vLLM's ``--kv-transfer-config`` of one configuration (None: no offloading)."""
    if config == "none":
        return None
    extra: dict[str, Any] = {
        "spec_name": "KvhexOffloadingSpec",
        "cpu_bytes_to_use": args.host_blocks * chunk_bytes,
    }
    if args.loading:
        extra["kvhex"] = {"loading": {"mode": args.loading}}
    if config == "host+file":
        extra["secondary_tiers"] = [
            {
                "type": "fs",
                "root_dir": str(root),
                "kvhex": {"capacity_bytes": args.file_blocks * chunk_bytes},
            }
        ]
    return {
        "kv_connector": "KvhexOffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


@contextlib.contextmanager
def server(
    model: Path,
    transfer: Any,
    args: argparse.Namespace,
    work: Path,
    log_path: Path,
    *,
    more: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    tokenizer: bool = False,
) -> Iterator[str]:
    """vLLM's OpenAI server on a free loopback port, in a process group of its own (the API
    server, its engine core and, on the CPU, its worker), stopped on the way out, errors
    included; ``more`` and ``env`` add to its command line and environment. Without
    ``tokenizer`` it runs with none (``--skip-tokenizer-init``); with one, the model's
    directory must hold it (``_vllm.make_tokenizer``)."""
    port = _vllm.free_port()
    options = {
        "--model": model,
        "--served-model-name": "serve-bench",
        "--host": "127.0.0.1",
        "--port": port,
        "--block-size": args.block,
        "--max-model-len": args.max_len,
        "--num-gpu-blocks-override": args.device_blocks,
        "--gpu-memory-utilization": args.gpu_memory_utilization,
        "--dtype": args.dtype,
        "--seed": 0,
    }
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += [str(part) for option in options.items() for part in option]
    command += ["--enforce-eager", "--enable-prefix-caching"]
    if not tokenizer:
        command.append("--skip-tokenizer-init")
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    command += more
    # a private vLLM cache: another vLLM version sharing ~/.cache/vllm breaks model inspection
    environ = {**os.environ, "VLLM_CACHE_ROOT": str(work / "vllm-cache"), **(env or {})}
    # the same CPU placement with a KV connector as without (see the module docstring)
    environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    with _vllm.server_process(
        command, env=environ, cwd=work, log_path=log_path, port=port, start_s=START_S
    ) as url:
        yield url


# ---------------------------------------------------------------------------------------------
# the workload


@dataclass
class Turn:
    """One request's figures."""

    user: int
    turn: int
    ttft: float
    itl: float
    """The mean gap between this answer's streamed tokens (its first to its last)."""
    tokens: list[int]


@dataclass
class Point:
    """One configuration at one ``U``."""

    config: str
    users: int
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    metrics: dict[tuple[str, str], float] = field(default_factory=dict)


def seeded_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB - 24) for _ in range(n)]


class Route(NamedTuple):
    """Where one request goes, and what to tell the router at its first streamed token and
    at its end (``bench/fleet.py``'s Dynamo selection: the reservation's load)."""

    url: str
    first: Callable[[], Awaitable[None]] | None = None
    done: Callable[[], Awaitable[None]] | None = None


Router = Callable[[list[int]], Awaitable[Route]]
"""Picks a request's server from its prompt (token ids)."""


def to(url: str) -> Router:
    """Every request to ``url`` (a server, or a router that forwards them)."""

    async def route(prompt: list[int]) -> Route:
        return Route(url)

    return route


async def chat(
    session: Any,
    router: Router,
    *,
    user: int,
    system: list[int],
    args: argparse.Namespace,
    seed: str,
) -> list[Turn]:
    """One user's turns, each after its think time."""
    rng = random.Random(f"{seed}-user-{user}")
    history: list[int] = []
    await asyncio.sleep(rng.uniform(0, args.think_s))
    out = []
    for turn in range(args.turns):
        new = seeded_tokens(rng, args.new_tokens)
        prompt = [*system, *history, *new]
        text = getattr(args, "token_text", False)  # the answer's ids read from its words
        body = {
            "model": "serve-bench",
            "prompt": prompt,
            "max_tokens": args.answer_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            **({} if text else {"return_token_ids": True}),
        }
        sent = time.perf_counter()
        first = last = 0.0
        tokens: list[int] = []
        route = await router(prompt)
        try:
            async with session.post(f"{route.url}/v1/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    now = time.perf_counter()
                    for choice in json.loads(line[6:]).get("choices", ()):
                        ids = choice.get("token_ids")
                        if text:
                            ids = [int(word[1:]) for word in choice.get("text", "").split()]
                        if ids:
                            if not first and route.first is not None:
                                await route.first()
                            first = first or now
                            last = now
                            tokens += ids
        finally:
            if route.done is not None:
                await route.done()
        if len(tokens) != args.answer_tokens:
            raise RuntimeError(f"user {user} turn {turn}: {len(tokens)} tokens streamed")
        out.append(
            Turn(
                user=user,
                turn=turn,
                ttft=first - sent,
                itl=(last - first) / max(1, len(tokens) - 1),
                tokens=tokens,
            )
        )
        history += [*new, *tokens]
        if turn + 1 < args.turns:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.think_s)
    return out


async def run_point(
    url: str | Router, users: int, args: argparse.Namespace
) -> tuple[list[Turn], float]:
    """Every user of one point at once, each request to ``url`` (or where the router
    sends it); their turns and the point's wall seconds."""
    import aiohttp

    seed = f"{args.seed}-U{users}"
    system = seeded_tokens(random.Random(f"{seed}-system"), args.system_tokens)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        began = time.perf_counter()
        router = to(url) if isinstance(url, str) else url
        results = await asyncio.gather(
            *(
                chat(session, router, user=u, system=system, args=args, seed=seed)
                for u in range(users)
            )
        )
        wall = time.perf_counter() - began
    return [turn for turns in results for turn in turns], wall


async def warm_up(url: str, args: argparse.Namespace) -> None:
    """One request of tokens no point sends, so the first point does not pay for first use."""
    await run_point(url, 1, argparse.Namespace(**{**vars(args), "seed": "warm-up", "turns": 1}))


def measure(config: str, url: str, args: argparse.Namespace, report: Report) -> list[Point]:
    asyncio.run(warm_up(url, args))
    points = []
    for users in args.users:
        before = scrape(url)
        turns, wall = asyncio.run(run_point(url, users, args))
        time.sleep(1.0)  # the engine's last stats reach the API server's metrics
        after = scrape(url)
        metrics = {key: after[key] - before.get(key, 0.0) for key in after}
        point = Point(config, users, turns, wall, metrics)
        points.append(point)
        s = summary(point)
        report.say(
            f"  {config:<9} U={users:<3} TTFT p50 {s['ttft_p50_s']:.3f} s, "
            f"p99 {s['ttft_p99_s']:.3f} s, {s['requests_per_s']:.2f} req/s ({wall:.1f} s)"
        )
    return points


# ---------------------------------------------------------------------------------------------
# the figures


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank above), NaN of nothing."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def per_tier(point: Point, name: str) -> dict[str, float]:
    """A ``tier``-labelled family of the point, by tier (kvhex's ``0:primary`` is host
    memory, ``1:fs`` the file tier)."""
    return {
        label.removeprefix("tier="): value
        for (sample, label), value in point.metrics.items()
        if sample == name and label.startswith("tier=")
    }


def summary(point: Point) -> dict[str, Any]:
    """The point's figures: latencies from the client, the rest from the server's metrics."""
    m = point.metrics
    ttfts = [t.ttft for t in point.turns]
    prompt = m.get(("vllm:prompt_tokens_total", ""), 0.0)
    by_source = {
        s: m.get(("vllm:prompt_tokens_cached_by_source_total", f"source={s}"), 0.0) for s in SOURCES
    }
    waits = m.get(("vllm:kv_offload_tiering_lookup_async_delay_seconds_count", "tier=0:primary"))
    waited = m.get(("vllm:kv_offload_tiering_lookup_async_delay_seconds_sum", "tier=0:primary"))
    requests = len(point.turns)
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_s": statistics.median(t.itl for t in point.turns),
        "requests_per_s": requests / point.wall_s,
        "requests": requests,
        "wall_s": point.wall_s,
        "prompt_tokens": prompt,
        **{f"tokens_{source}": by_source[source] for source in SOURCES},
        "tokens_computed": prompt - sum(by_source.values()),
        "engine_steps": m.get(("vllm:iteration_tokens_total_count", ""), 0.0),
        "queue_s_mean": m.get(("vllm:request_queue_time_seconds_sum", ""), 0.0) / requests,
        "prefill_s_mean": m.get(("vllm:request_prefill_time_seconds_sum", ""), 0.0) / requests,
        "loaded_bytes": m.get(("vllm:kv_offload_load_bytes_total", ""), 0.0),
        "stored_bytes": m.get(("vllm:kv_offload_store_bytes_total", ""), 0.0),
        "chunk_queries": per_tier(point, "vllm:kv_offload_tiering_chunk_queries_total"),
        "chunk_hits": per_tier(point, "vllm:kv_offload_tiering_chunk_hits_total"),
        "tier_read_bytes": per_tier(point, "vllm:kv_offload_tiering_read_bytes_total"),
        "tier_read_s": per_tier(point, "vllm:kv_offload_tiering_read_time_total"),
        "tier_write_bytes": per_tier(point, "vllm:kv_offload_tiering_write_bytes_total"),
        "tier_write_s": per_tier(point, "vllm:kv_offload_tiering_write_time_total"),
        "deferred_lookups": waits or 0.0,
        "deferred_lookup_s_mean": (waited or 0.0) / waits if waits else 0.0,
    }


def diverged(point: Point, baseline: Point) -> dict[int, int]:
    """The users whose answers differ from the baseline's, each with its first such turn
    (later turns' prompts then differ too: the answer joins the history)."""
    expected = {(t.user, t.turn): t.tokens for t in baseline.turns}
    first: dict[int, int] = {}
    for t in sorted(point.turns, key=lambda t: t.turn):
        if t.tokens != expected[t.user, t.turn]:
            first.setdefault(t.user, t.turn)
    return first


def working_set_blocks(users: int, args: argparse.Namespace) -> int:
    """Full blocks of all users' final histories, the shared system prompt counted once."""
    system: int = args.system_tokens // args.block
    final: int = (
        args.system_tokens + args.turns * (args.new_tokens + args.answer_tokens)
    ) // args.block
    return system + users * (final - system)


def two_and_five(y: float, _: object) -> str:
    """A log axis' minor label at 2 and 5 times a power of ten only."""
    return f"{y:g}" if y > 0 and round(y / 10 ** math.floor(math.log10(y))) in (2, 5) else ""


def plot(
    path: Path, table: dict[tuple[str, int], dict[str, Any]], args: argparse.Namespace
) -> None:
    """TTFT p50, TTFT p99 and completed requests per second against ``U``, a line per
    configuration."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker

    figure, axes = pyplot.subplots(1, 3, figsize=(15, 4.6))
    panels = (
        ("ttft_p50_s", "TTFT p50 (s, log)"),
        ("ttft_p99_s", "TTFT p99 (s, log)"),
        ("requests_per_s", "completed requests / s"),
    )
    for ax, (key, title) in zip(axes, panels, strict=True):
        for config in args.configs:
            ax.plot(args.users, [table[config, u][key] for u in args.users], "o-", label=config)
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            args.users,
            [f"{u}\n{working_set_blocks(u, args) / args.device_blocks:.1f}x" for u in args.users],
        )
        ax.set_xlabel("users U (working set / device KV cache)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key.startswith("ttft"):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(ticker.FuncFormatter(two_and_five))
    axes[0].legend(title="configuration")
    figure.suptitle(
        f"vLLM OpenAI server, multi-turn chat: {args.layers}x{args.hidden} Llama ({args.dtype}), "
        f"device cache {args.device_blocks} blocks of {args.block}, kvhex host "
        f"{args.host_blocks} blocks, {args.turns} turns, think {args.think_s} s"
        + (f", kvhex loading {args.loading}" if args.loading else "")
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def add_workload(parser: argparse.ArgumentParser, *, device_blocks: int) -> None:
    """The chat workload's, the model's and each server's flags (bench/fleet.py's too)."""
    parser.add_argument("--turns", type=int, default=8, help="turns per user")
    parser.add_argument("--system-tokens", type=int, default=512, help="shared system prompt")
    parser.add_argument("--new-tokens", type=int, default=192, help="new user tokens per turn")
    parser.add_argument("--answer-tokens", type=int, default=32, help="streamed answer tokens")
    parser.add_argument("--think-s", type=float, default=1.0, help="mean think time")
    parser.add_argument(
        "--device-blocks", type=int, default=device_blocks, help="device KV cache blocks"
    )
    parser.add_argument(
        "--host-blocks", type=int, default=0, help="kvhex host memory in blocks (0: 2x device)"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPE_BYTES),
        default="float32",
        help="the model's and KV cache's dtype (float32: see bench/serve.py's docstring)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    parser.add_argument("--seed", default="0", help="the token content's seed")
    parser.add_argument(
        "--loading",
        choices=("auto", "off"),
        help="kvhex's load-or-recompute mode (kvhex.loading.mode; default: kvhex's own)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=users_list, default=[2, 4, 8, 16], help="U values")
    add_workload(parser, device_blocks=192)
    parser.add_argument(
        "--configs",
        type=lambda text: text.split(","),
        default=list(CONFIGS),
        help=f"a subset of {','.join(CONFIGS)} (the first is the baseline)",
    )
    parser.add_argument("--plot", type=Path, default=Path("serve.png"), help="the PNG written")
    args = parse(parser, QUICK)
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    report = Report("serve", args)
    began = time.perf_counter()

    args.block = block_size()
    args.host_blocks = args.host_blocks or 2 * args.device_blocks
    context = args.system_tokens + args.turns * (args.new_tokens + args.answer_tokens)
    args.max_len = (context // args.block + 2) * args.block
    args.file_blocks = 2 * working_set_blocks(max(args.users), args) + args.device_blocks
    heads = max(1, args.hidden // 64)
    chunk_bytes = args.layers * 2 * heads * 64 * DTYPE_BYTES[args.dtype] * args.block
    report.say(
        f"{args.layers} layers x {args.hidden} {args.dtype}, block {args.block} tokens "
        f"({chunk_bytes >> 10} KiB of KV); device {args.device_blocks} blocks, kvhex host "
        f"{args.host_blocks}, file {args.file_blocks}; U {args.users}, {args.turns} turns of "
        f"{args.new_tokens} new + {args.answer_tokens} answer tokens after a "
        f"{args.system_tokens}-token system prompt, think {args.think_s} s; kvhex loading "
        f"{args.loading or 'as configured by default'}"
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stopped on the way out
    points: dict[tuple[str, int], Point] = {}
    with tempfile.TemporaryDirectory(prefix="kvhex-serve-") as tmp:
        work = Path(tmp)
        model = make_model(work / "model", args.layers, args.hidden, args.max_len, args.dtype)
        for config in args.configs:
            transfer = transfer_config(config, chunk_bytes, args, work / "kv")
            started = time.perf_counter()
            log = work / f"server-{config.replace('+', '-')}.log"
            with server(model, transfer, args, work, log) as url:
                report.say(f"{config}: server up in {time.perf_counter() - started:.0f} s")
                for point in measure(config, url, args, report):
                    points[config, point.users] = point
    finish(points, args, report, began)


def finish(
    points: dict[tuple[str, int], Point], args: argparse.Namespace, report: Report, began: float
) -> None:
    """The table, the rows, the targets at the largest ``U``, the plot."""
    baseline = args.configs[0]
    table = {key: summary(point) for key, point in points.items()}
    report.say(
        f"{'config':<9} {'U':>3} {'ws/dev':>6} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} "
        f"{'req/s':>6} {'p50 x':>6} {'req/s x':>7} {'device':>7} {'host':>7} {'file':>7} "
        f"{'computed':>8}  answers"
    )
    all_equal = True
    for users in args.users:
        base = table[baseline, users]
        for config in args.configs:
            s = table[config, users]
            off = diverged(points[config, users], points[baseline, users])
            all_equal &= not off
            ws = working_set_blocks(users, args) / args.device_blocks
            rps_ratio = s["requests_per_s"] / base["requests_per_s"]
            report.say(
                f"{config:<9} {users:>3} {ws:>6.1f} {s['ttft_p50_s']:>9.3f} "
                f"{s['ttft_p99_s']:>7.3f} {s['itl_p50_s'] * 1000:>6.1f}ms "
                f"{s['requests_per_s']:>6.2f} {s['ttft_p50_s'] / base['ttft_p50_s']:>6.2f} "
                f"{rps_ratio:>7.2f} {s['tokens_device']:>7.0f} {s['tokens_host']:>7.0f} "
                f"{s['tokens_disk']:>7.0f} {s['tokens_computed']:>8.0f}  "
                + ("equal" if not off else f"{len(off)}/{users} users differ")
            )
            report.row(
                f"TTFT p50, U={users}, {config}",
                s["ttft_p50_s"],
                base["ttft_p50_s"],
                unit="s",
                baseline_name=f"server without offloading ({baseline})",
            )
            report.rows[-1].update(
                config=config,
                users=users,
                working_set_blocks=working_set_blocks(users, args),
                device_blocks=args.device_blocks,
                requests_per_s_ratio=rps_ratio,
                answers_equal=not off,
                users_diverged={str(user): turn for user, turn in off.items()},
                **s,
            )
    largest = max(args.users)
    for config in args.configs[1:]:
        s, base = table[config, largest], table[baseline, largest]
        report.say(
            f"at U={largest}, {config}: TTFT p50 {s['ttft_p50_s'] / base['ttft_p50_s']:.2f}x "
            f"the server without offloading (target <= 0.3), throughput "
            f"{s['requests_per_s'] / base['requests_per_s']:.2f}x (target >= 1.5)"
        )
    plot(args.plot, table, args)
    report.say(f"plot: {args.plot}")
    report.say(f"answers equal across configurations: {'yes' if all_equal else 'NO'}")
    report.say(f"took {time.perf_counter() - began:.0f} s")
    report.finish()


if __name__ == "__main__":
    main()
