"""A routed fleet: two vLLM OpenAI servers behind a KV-aware router, with and without kvhex,
under a multi-turn chat load, in one run: TTFT, inter-token latency, requests per second, the
share of requests the router credited, and where each server's cached tokens came from.

Arms (each on fresh servers and a fresh pool, the same prompts in each):

* ``rr``: vllm-router ``--policy round_robin``, servers without offloading (prefix caching on);
* ``kv``: vllm-router ``--policy kv_aware`` on vLLM's own events (the device's only), no
  offloading: the fleet as vLLM serves it today;
* ``rr+kvhex``: round robin, each server with kvhex (host memory and a pool the fleet shares);
* ``kv+kvhex``: ``kv_aware`` on the servers' events, kvhex's included (host memory at the
  router's ``CPU`` weight, the shared pool at ``STORAGE``);
* ``dynamo+kvhex``: Dynamo's selection service (``python -m dynamo.select_service``, the scoring
  core Ray Serve's KV-aware router embeds) picks each request's server
  (``/select_and_reserve``, its load reported at the first streamed token and at the end);
  the benchmark's client sends the request there itself (a proxy would add one loopback hop).

Each server with kvhex has ``--host-blocks`` of host memory and a pool shared by the fleet: a
file root both servers write (``--pool files``, the default) or a Valkey 3-node cluster on
loopback (``--pool valkey``), with ``announce_peers`` on, so each server also announces what
the other stored there. The servers are vLLM's CPU build here (block size 32); elsewhere the
script passes 16 and runs unchanged on CUDA.

The workload is bench/serve.py's: ``--users`` users at once, each with the shared system
prompt and a private history that grows each turn, greedy answers (temperature 0), token-id
prompts (the servers run without a tokenizer). Its working set outgrows one server's device
cache (``ws/dev`` in the header), so where a user's history is, and whether the router knows,
decides each turn's TTFT.

Reported per arm: TTFT p50 and p99, ITL p50, requests per second, the share of requests the
router credited with some prefix (vllm-router's ``credited_prefix_tokens`` in its debug log;
Dynamo's selection overlap), prompt tokens per server by where they came from (device, host,
disk, computed; from ``/metrics``), and whether every answer equals the first arm's. A table,
``--json`` rows, and a plot. Targets (issue 44): ``kv+kvhex`` at most 0.5x the TTFT p50 of
``kv`` and at most 0.7x that of ``rr+kvhex``, and at least 1.3x the requests per second of
``kv``.

    .venv-vllm32/bin/python bench/fleet.py                    # about 10 minutes
    .venv-vllm32/bin/python bench/fleet.py --pool valkey
    .venv-vllm32/bin/python bench/fleet.py --quick --json     # the smoke test's run

The routers come from ``make``'s ``.venv-router`` (vllm-router 0.1.17) and ``.venv-dynamo``
(ai-dynamo-runtime 1.6.1), or the pythons ``KVHEX_ROUTER_PYTHON`` and ``KVHEX_DYNAMO_PYTHON``
name. vLLM's publishers bind ``tcp://*:PORT`` (vLLM binds only for ``*``: every interface,
while the run lasts; the streams hold only the run's random tokens); everything else binds
127.0.0.1. A plain script, never a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import _vllm
import serve
from _report import Report, parse
from _vllm import make_model, make_tokenizer, scrape
from serve import DTYPE_BYTES, SOURCES, Route, Router, Turn, percentile, to

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the router launchers
from tests.routers import DynamoSelect, VllmRouter

MODEL = "serve-bench"
"""The name the servers serve the model as (bench/serve.py's)."""
ROOT = Path(__file__).resolve().parent.parent


class Arm(NamedTuple):
    """One arm: who routes, and whether the servers run kvhex."""

    router: str  # round_robin, kv_aware or dynamo
    kvhex: bool


ARMS = {
    "rr": Arm("round_robin", False),
    "kv": Arm("kv_aware", False),
    "rr+kvhex": Arm("round_robin", True),
    "kv+kvhex": Arm("kv_aware", True),
    "dynamo+kvhex": Arm("dynamo", True),
}
QUICK = {
    "users": 4,
    "turns": 2,
    "system_tokens": 64,
    "new_tokens": 64,
    "answer_tokens": 8,
    "think_s": 0.05,
    "device_blocks": 12,
    "layers": 2,
    "hidden": 128,
    "arms": ["kv", "kv+kvhex", "dynamo+kvhex"],
}


def python_of(variable: str, venv: str) -> str:
    """The python ``variable`` names, else ``make``'s environment ``venv``."""
    python = os.environ.get(variable) or str(ROOT / venv / "bin" / "python")
    if not Path(python).exists():
        raise SystemExit(
            f"{python} not found: run `make {venv}/.kvhex-installed` (or set {variable})"
        )
    return python


# ---------------------------------------------------------------------------------------------
# the fleet


class Server(NamedTuple):
    url: str
    events: str
    replay: str


def pool_entry(args: argparse.Namespace, chunk_bytes: int, pool: Any) -> dict[str, Any]:
    """The secondary tier every kvhex server shares: the file root, or the Valkey cluster
    under a prefix of this arm's (announced ``LOCAL``: every server loads from it)."""
    kvhex = {"announce_peers": True, "peer_scan_interval_s": args.peer_scan_s}
    capacity = args.pool_blocks * (chunk_bytes + 4096)
    if args.pool == "files":
        return {
            "type": "fs",
            "root_dir": str(pool),
            "enable_kv_events": True,
            "locality": "LOCAL",
            "kvhex": {**kvhex, "capacity_bytes": capacity},
        }
    seeds = ",".join(f"127.0.0.1:{node.port}" for node in pool)
    return {
        "type": "KvhexSecondaryTier",
        "tier": "valkey",
        "url": f"valkey://{seeds}/fleet-{uuid.uuid4().hex[:8]}",
        "capacity_bytes": capacity,
        "enable_kv_events": True,
        "locality": "LOCAL",
        "kvhex": kvhex,
    }


@contextlib.contextmanager
def servers(
    model: Path, arm: Arm, args: argparse.Namespace, work: Path, *, chunk_bytes: int, pool: Any
) -> Iterator[list[Server]]:
    """Two servers, one after the other (two starting at once on two cores take minutes),
    each on one core of its own where the machine has two."""
    transfer = None
    if arm.kvhex:
        extra = {
            "spec_name": "KvhexOffloadingSpec",
            "cpu_bytes_to_use": args.host_blocks * chunk_bytes,
            "secondary_tiers": [pool_entry(args, chunk_bytes, pool)],
        }
        kvhex: dict[str, Any] = {}
        if args.loading:
            kvhex["loading"] = {"mode": args.loading}
        if arm.router != "round_robin":
            kvhex["router"] = "dynamo" if arm.router == "dynamo" else "vllm-router"
            if arm.router == "kv_aware":
                kvhex["router_block_size"] = args.block
        if kvhex:
            extra["kvhex"] = kvhex
        transfer = {
            "kv_connector": "KvhexOffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    cores = os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        out = []
        for i in range(2):
            events, replay = _vllm.free_port(), _vllm.free_port()
            kv_events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            env = {"OMP_NUM_THREADS": "1", "VLLM_SERVER_DEV_MODE": "1"}
            if cores >= 2:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % cores)
            log = work / f"server-{arm.router}-{int(arm.kvhex)}-{i}.log"
            options = ["--kv-events-config", json.dumps(kv_events)]
            url = stack.enter_context(
                serve.server(
                    model, transfer, args, work, log, more=options, env=env, tokenizer=True
                )
            )
            out.append(Server(url, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))
        yield out


class Credits:
    """How many requests the router credited with some prefix, of how many."""

    def __init__(self) -> None:
        self.credited = 0
        self.requests = 0

    @property
    def share(self) -> float | None:
        return self.credited / self.requests if self.requests else None


@contextlib.contextmanager
def router(
    arm: Arm, fleet: list[Server], args: argparse.Namespace, work: Path
) -> Iterator[tuple[Router, Credits, Any]]:
    """The arm's router, as bench/serve.py's workload calls it, and what it credited."""
    credits = Credits()
    if arm.router == "dynamo":
        python = python_of("KVHEX_DYNAMO_PYTHON", ".venv-dynamo")
        with DynamoSelect(python, work / "dynamo.log") as dynamo:
            for i, s in enumerate(fleet, 1):
                dynamo.register(
                    i, s.url, s.events, replay=s.replay, block_size=args.block, model=MODEL
                )
            yield dynamo_router(dynamo, credits), credits, dynamo
        return
    python = python_of("KVHEX_ROUTER_PYTHON", ".venv-router")
    sources = {s.url: s.events for s in fleet}
    replay = {s.url: s.replay for s in fleet}
    log = work / f"vllm-router-{arm.router}-{int(arm.kvhex)}.log"
    level = "debug" if arm.router == "kv_aware" else "info"
    with VllmRouter(
        python,
        log,
        sources,
        replay_sources=replay,
        block_size=args.block,
        model=MODEL,
        policy=arm.router,
        log_level=level,
    ) as vllm_router:
        yield to(vllm_router.url), credits, vllm_router


def dynamo_router(dynamo: DynamoSelect, credits: Credits) -> Router:
    """Each request to the server Dynamo selects for it, its reservation reported."""
    import aiohttp

    session: list[Any] = []

    async def call(method: str, path: str, body: object = None) -> Any:
        if not session:
            session.append(aiohttp.ClientSession())
        async with session[0].request(method, dynamo.url + path, json=body) as response:
            if response.status >= 300:
                raise RuntimeError(f"Dynamo {path}: HTTP {response.status} {await response.text()}")
            return await response.json() if response.content_type == "application/json" else None

    async def route(prompt: list[int]) -> Route:
        selection = uuid.uuid4().hex
        body = {"selection_id": selection, "model_name": MODEL, "token_ids": prompt}
        answer = await call("POST", "/select_and_reserve", body)
        credits.requests += 1
        credits.credited += len(prompt) > answer["effective_prefill_tokens"]
        done = False

        async def first() -> None:
            await call("POST", f"/reservations/{selection}/prefill_complete", {})

        async def end() -> None:
            nonlocal done
            if not done:
                done = True
                await call("DELETE", f"/reservations/{selection}")

        return Route(answer["endpoint"], first, end)

    async def close() -> None:
        if session:
            await session.pop().close()

    route.close = close  # type: ignore[attr-defined]
    return route


# ---------------------------------------------------------------------------------------------
# one arm


class Result(NamedTuple):
    arm: str
    turns: list[Turn]
    wall_s: float
    metrics: list[dict[tuple[str, str], float]]  # per server, the point's deltas
    credited: float | None


def run_arm(
    name: str, fleet: list[Server], args: argparse.Namespace, work: Path, report: Report
) -> Result:
    arm = ARMS[name]
    for s in fleet:  # first use of each server, and a cold device cache for the arm
        asyncio.run(serve.warm_up(s.url, args))
        reset = urllib.request.Request(f"{s.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(reset, timeout=60):
            pass
    with router(arm, fleet, args, work) as (route, credits, handle):
        before = [scrape(s.url) for s in fleet]
        seen = len(handle.decisions()) if isinstance(handle, VllmRouter) else 0
        turns, wall = asyncio.run(_run(route, args))
        time.sleep(1.0)  # the engines' last stats reach the API servers' metrics
        after = [scrape(s.url) for s in fleet]
        if isinstance(handle, VllmRouter) and arm.router == "kv_aware":
            decisions = handle.decisions()[seen:]
            credits.requests = len(decisions)
            credits.credited = sum(d.credited_prefix_tokens > 0 for d in decisions)
    metrics = [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]
    result = Result(name, turns, wall, metrics, credits.share)
    figures = summary(result)
    report.say(
        f"  {name:<13} TTFT p50 {figures['ttft_p50_s']:.3f} s, p99 {figures['ttft_p99_s']:.3f}"
        f" s, {figures['requests_per_s']:.2f} req/s ({wall:.1f} s)"
    )
    return result


async def _run(route: Router, args: argparse.Namespace) -> tuple[list[Turn], float]:
    try:
        return await serve.run_point(route, args.users, args)
    finally:
        close = getattr(route, "close", None)
        if close is not None:
            await close()


def summary(result: Result) -> dict[str, Any]:
    ttfts = [t.ttft for t in result.turns]
    per_server = []
    for m in result.metrics:
        prompt = m.get(("vllm:prompt_tokens_total", ""), 0.0)
        by = {
            s: m.get(("vllm:prompt_tokens_cached_by_source_total", f"source={s}"), 0.0)
            for s in SOURCES
        }
        per_server.append({**by, "computed": prompt - sum(by.values()), "prompt": prompt})
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_s": statistics.median(t.itl for t in result.turns),
        "requests_per_s": len(result.turns) / result.wall_s,
        "requests": len(result.turns),
        "credited_share": result.credited,
        "servers": per_server,
    }


# ---------------------------------------------------------------------------------------------
# the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=12, help="users chatting at once")
    serve.add_workload(parser, device_blocks=128)
    parser.add_argument(
        "--pool-blocks",
        type=int,
        default=0,
        help="the shared pool's blocks (0: 2x the working set)",
    )
    parser.add_argument(
        "--pool", choices=("files", "valkey"), default="files", help="the shared pool"
    )
    parser.add_argument("--peer-scan-s", type=float, default=1.0, help="peer_scan_interval_s")
    parser.add_argument(
        "--arms",
        type=lambda text: text.split(","),
        default=list(ARMS),
        help=f"a subset of {','.join(ARMS)} (answers are compared with the first)",
    )
    parser.add_argument("--plot", type=Path, default=Path("fleet.png"), help="the PNG written")
    parser.add_argument(
        "--keep", type=Path, help="keep the servers' and routers' logs in this directory"
    )
    args = parse(parser, QUICK)
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    report = Report("fleet", args)
    began = time.perf_counter()
    args.block = serve.block_size()
    args.host_blocks = args.host_blocks or 2 * args.device_blocks
    context = args.system_tokens + args.turns * (args.new_tokens + args.answer_tokens)
    args.max_len = (context // args.block + 2) * args.block
    ws = serve.working_set_blocks(args.users, args)
    args.pool_blocks = args.pool_blocks or 2 * ws
    heads = max(1, args.hidden // 64)
    chunk_bytes = args.layers * 2 * heads * 64 * DTYPE_BYTES[args.dtype] * args.block
    report.say(
        f"2 servers: {args.layers}x{args.hidden} Llama ({args.dtype}), block {args.block} tokens "
        f"({chunk_bytes >> 10} KiB of KV), device {args.device_blocks} blocks each; kvhex host "
        f"{args.host_blocks} blocks each, shared pool ({args.pool}) {args.pool_blocks} blocks; "
        f"{args.users} users x {args.turns} turns, working set {ws} blocks = "
        f"{ws / args.device_blocks:.1f}x one server's device cache"
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stopped on the way out
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="kvhex-fleet-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            work = args.keep
        model = make_model(work / "model", args.layers, args.hidden, args.max_len, args.dtype)
        make_tokenizer(model)
        args.token_text = True  # answers read from their words (see make_tokenizer)
        nodes = None
        if args.pool == "valkey" and any(ARMS[a].kvhex for a in args.arms):
            from tests.adapters.storage.valkey.servers import start_cluster

            nodes = start_cluster(work / "valkey")
            for node in nodes:
                stack.callback(node.kill)
        for name in args.arms:
            arm = ARMS[name]
            pool = (work / f"pool-{name}") if args.pool == "files" else nodes
            started = time.perf_counter()
            with servers(model, arm, args, work, chunk_bytes=chunk_bytes, pool=pool) as fleet:
                report.say(f"{name}: servers up in {time.perf_counter() - started:.0f} s")
                results[name] = run_arm(name, fleet, args, work, report)
    finish(results, args, report, began)


def answers_equal(result: Result, baseline: Result) -> int:
    """How many users' answers differ from the baseline's."""
    expected = {(t.user, t.turn): t.tokens for t in baseline.turns}
    return len({t.user for t in result.turns if t.tokens != expected[t.user, t.turn]})


def finish(
    results: dict[str, Result], args: argparse.Namespace, report: Report, began: float
) -> None:
    first = results[args.arms[0]]
    table = {name: summary(result) for name, result in results.items()}
    report.say(
        f"{'arm':<13} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'req/s':>6} {'credited':>8}  "
        f"{'device':>7} {'host':>7} {'disk':>7} {'computed':>8}  per server (A / B)  answers"
    )
    for name, s in table.items():
        a, b = s["servers"]
        share = "-" if s["credited_share"] is None else f"{s['credited_share']:.0%}"
        cells = [f"{a[k]:.0f}/{b[k]:.0f}" for k in ("device", "host", "disk", "computed")]
        differ = answers_equal(results[name], first)
        report.say(
            f"{name:<13} {s['ttft_p50_s']:>9.3f} {s['ttft_p99_s']:>7.3f} "
            f"{s['itl_p50_s'] * 1000:>6.1f}ms {s['requests_per_s']:>6.2f} {share:>8}  "
            + " ".join(f"{c:>7}" for c in cells)
            + ("  equal" if not differ else f"  {differ}/{args.users} users differ")
        )
        report.row(
            f"TTFT p50, {name}",
            s["ttft_p50_s"],
            table[args.arms[0]]["ttft_p50_s"],
            unit="s",
            baseline_name=args.arms[0],
        )
        report.rows[-1].update(arm=name, answers_equal=not differ, **s)

    def ratio(a: str, b: str, key: str) -> float | None:
        if a in table and b in table:
            return float(table[a][key] / table[b][key])
        return None

    for text, value, target in (
        ("kv+kvhex TTFT p50 / kv", ratio("kv+kvhex", "kv", "ttft_p50_s"), "<= 0.5"),
        ("kv+kvhex TTFT p50 / rr+kvhex", ratio("kv+kvhex", "rr+kvhex", "ttft_p50_s"), "<= 0.7"),
        ("kv+kvhex req/s / kv", ratio("kv+kvhex", "kv", "requests_per_s"), ">= 1.3"),
    ):
        if value is not None:
            report.say(f"{text}: {value:.2f} (target {target})")
    plot(args.plot, table, args)
    report.say(f"plot: {args.plot}")
    report.say(f"took {time.perf_counter() - began:.0f} s")
    report.finish()


def plot(path: Path, table: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """TTFT p50, TTFT p99 and requests per second per arm."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, 3, figsize=(15, 4.4))
    names = list(table)
    for ax, (key, title) in zip(
        axes,
        (
            ("ttft_p50_s", "TTFT p50 (s)"),
            ("ttft_p99_s", "TTFT p99 (s)"),
            ("requests_per_s", "requests / s"),
        ),
        strict=True,
    ):
        ax.bar(
            names,
            [table[n][key] for n in names],
            color=["#999" if "kvhex" not in n else "#2a7" for n in names],
        )
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
        ax.grid(axis="y", alpha=0.3)
    figure.suptitle(
        f"two vLLM servers behind a router, {args.users} users x {args.turns} turns "
        f"({args.layers}x{args.hidden} Llama, device {args.device_blocks} blocks each, "
        f"pool {args.pool})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


if __name__ == "__main__":
    main()
