"""Primary-tier benchmark: kvhex's host tier beside vLLM's CPUOffloadingManager, same run.

Drives a synthetic serving trace (multi-chunk requests over Zipf-popular shared prefixes: a
lookup per chunk until the first miss, touch + load + complete_load of the hit prefix, store +
complete_store of the rest, events drained every step) through kvhex's ``PrimaryTier`` and,
when vLLM is importable, through vLLM's ``CPUOffloadingManager`` with the same requests,
alternating between the two every 512 requests so machine drift hits both alike.
Prints the median microseconds per call of each operation type and the kvhex/vLLM ratio, then
bytes per resident chunk in the index at 1M chunks (tracemalloc).

    python bench/primary_tier.py [--ops 1000000] [--policy lru|arc] [--index-chunks 1000000]
    python bench/primary_tier.py --quick --json   # tiny sizes; rows as JSON (see _report.py)

A plain script, never a timed test. Timer overhead (median of an empty timed region) is
subtracted from every sample.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from _report import Report, parse
from kvhex.domain import ArcPolicy, LookupResult, LruPolicy, PrimaryTier, ReqContext

QUICK = {"ops": 3000, "slots": 200, "prefixes": 100, "index_chunks": 2000}
"""Sizes of ``--quick`` (the smoke test's)."""
VLLM = "vLLM CPUOffloadingManager"

OPS = ("lookup", "touch", "prepare_load", "complete_load", "prepare_store", "complete_store")


def make_trace(n_requests: int, n_prefixes: int, seed: int) -> list[tuple[int, list[bytes]]]:
    """Requests as (request number, chunk keys): popular prefixes repeat (Zipf, s=1.1) and
    requests extend a shared prefix with a few private chunks."""
    rng = random.Random(seed)
    prefixes = []
    for _ in range(n_prefixes):
        length = rng.randint(4, 24)
        prefixes.append([rng.randbytes(32) + b"\0\0\0\0" for _ in range(length)])
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(n_prefixes)]
    chosen = rng.choices(range(n_prefixes), weights=weights, k=n_requests)
    trace = []
    for i, p in enumerate(chosen):
        tail = [rng.randbytes(32) + b"\0\0\0\0" for _ in range(rng.randint(0, 1))]
        trace.append((i, prefixes[p] + tail))
    return trace


def timer_overhead() -> int:
    pc = time.perf_counter_ns
    samples = []
    for _ in range(200_000):
        t0 = pc()
        samples.append(pc() - t0)
    return int(statistics.median(samples))


def run(
    impl: str,
    manager: Any,
    trace: list[tuple[int, list[bytes]]],
    *,
    max_ops: int,
    make_ctx: Callable[[str], Any],
    hit: Any,
    samples: dict[str, list[int]],
    counts: dict[str, int],
) -> None:
    """Replay ``trace`` until ``counts["ops"]`` reaches ``max_ops``, appending per-call
    nanoseconds per operation type to ``samples`` (called block by block)."""
    pc = time.perf_counter_ns
    s_lookup, s_touch = samples["lookup"], samples["touch"]
    s_pload, s_cload = samples["prepare_load"], samples["complete_load"]
    s_pstore, s_cstore = samples["prepare_store"], samples["complete_store"]
    vllm = impl == "vllm"
    lookup, touch = manager.lookup, manager.touch
    prepare_load, complete_load = manager.prepare_load, manager.complete_load
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    take_events = manager.take_events
    ops = counts["ops"]
    for req_no, keys in trace:
        if ops >= max_ops:
            break
        ctx = make_ctx(f"req-{req_no}")
        counts["chunks"] += len(keys)
        if vllm:
            manager.on_new_request(ctx)
        hits = 0
        for key in keys:
            if vllm:
                t0 = pc()
                result = lookup(key, ctx)
                s_lookup.append(pc() - t0)
            else:
                t0 = pc()
                result = lookup(key)
                s_lookup.append(pc() - t0)
            ops += 1
            counts["lookups"] += 1
            if result is not hit:
                break
            hits += 1
        counts["hits"] += hits
        if hits:
            prefix = keys[:hits]
            t0 = pc()
            touch(prefix, ctx)
            s_touch.append(pc() - t0)
            t0 = pc()
            prepare_load(prefix, ctx)
            s_pload.append(pc() - t0)
            t0 = pc()
            complete_load(prefix, ctx)
            s_cload.append(pc() - t0)
            ops += 3
        rest = keys[hits:]
        if rest:
            t0 = pc()
            out = prepare_store(rest, ctx)
            s_pstore.append(pc() - t0)
            ops += 1
            if out is None:
                counts["store_none"] += 1
            else:
                stored = out.keys_to_store if vllm else out.keys
                ok = req_no % 50 != 0  # 2% of stores fail
                t0 = pc()
                complete_store(stored, ctx, ok)
                s_cstore.append(pc() - t0)
                ops += 1
                if ok:
                    counts["chunks_stored"] += len(stored)
        if vllm:
            manager.on_request_finished(ctx)
        if req_no % 8 == 7:  # one scheduler step every 8 requests
            for _ in take_events():
                pass
    counts["ops"] = ops


def kvhex_manager(num_slots: int, policy: str, *, python: bool = False) -> PrimaryTier:
    """kvhex's host tier; ``python``: its Python path even where the native module was
    built (as where it was not; LRU runs natively by default, ARC always in Python)."""
    factory = {"lru": LruPolicy, "arc": ArcPolicy}[policy]
    return PrimaryTier(num_slots, factory(num_slots), native=False if python else None)


def vllm_classes() -> tuple[Any, Any, Any] | None:
    try:
        from vllm.v1.kv_offload.base import LookupResult as VllmLookup
        from vllm.v1.kv_offload.base import ReqContext as VllmCtx
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError:
        return None
    return CPUOffloadingManager, VllmCtx, VllmLookup


def index_bytes_per_chunk(
    build: Callable[[int], Any], store: Callable[[Any, list[bytes]], None], n_chunks: int
) -> float:
    """tracemalloc growth per resident chunk when ``n_chunks`` are stored and completed.
    Keys are created before tracing starts: they belong to the engine's requests."""
    keys = [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(n_chunks)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    manager = build(n_chunks)
    for i in range(0, n_chunks, 16):
        store(manager, keys[i : i + 16])
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del manager
    return (after - before) / n_chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--policy", choices=("lru", "arc"), default="lru")
    parser.add_argument(
        "--python",
        action="store_true",
        help="kvhex's Python path even where the native module was built",
    )
    parser.add_argument("--slots", type=int, default=40_000)
    parser.add_argument("--prefixes", type=int, default=10_000)
    parser.add_argument("--index-chunks", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=7)
    args = parse(parser, QUICK)
    report = Report("primary_tier", args)

    trace = make_trace(args.ops // 8, args.prefixes, args.seed)
    overhead = timer_overhead()
    report.say(
        f"trace: {len(trace)} requests, policy {args.policy}, {args.slots} slots, kvhex's "
        f"{'Python' if not kvhex_manager(1, args.policy, python=args.python).native else 'native'}"
        f" path; timer overhead {overhead} ns subtracted"
    )

    managers: dict[str, tuple[Any, Callable[[str], Any], Any]] = {
        "kvhex": (
            kvhex_manager(args.slots, args.policy, python=args.python),
            ReqContext,
            LookupResult.HIT,
        ),
    }
    vllm = vllm_classes()
    if vllm is None:
        report.say("vllm: not installed")
    else:
        cpu_manager, vllm_ctx, vllm_lookup = vllm
        managers["vllm"] = (
            cpu_manager(args.slots, cache_policy=args.policy, enable_events=True),
            lambda rid: vllm_ctx(req_id=rid),
            vllm_lookup.HIT,
        )
    results: dict[str, tuple[dict[str, list[int]], dict[str, int]]] = {
        impl: (
            {op: [] for op in OPS},
            {"ops": 0, "lookups": 0, "hits": 0, "chunks": 0, "store_none": 0, "chunks_stored": 0},
        )
        for impl in managers
    }
    gc.collect()
    gc.freeze()
    block = 512  # alternate implementations block by block: machine drift hits both alike
    for begin in range(0, len(trace), block):
        for impl, (manager, make_ctx, hit) in managers.items():
            samples, counts = results[impl]
            run(
                impl,
                manager,
                trace[begin : begin + block],
                max_ops=args.ops,
                make_ctx=make_ctx,
                hit=hit,
                samples=samples,
                counts=counts,
            )
    gc.unfreeze()

    def med(xs: list[int]) -> float:
        return max(statistics.median(xs) - overhead, 0) / 1000 if xs else float("nan")

    header = f"{'operation':<16}{'calls':>10}{'kvhex us':>11}"
    if "vllm" in results:
        header += f"{'vllm us':>10}{'kvhex/vllm':>12}"
    report.say(header)
    for op in OPS:
        ours = results["kvhex"][0][op]
        line = f"{op:<16}{len(ours):>10}{med(ours):>11.3f}"
        baseline = None
        if "vllm" in results:
            theirs = results["vllm"][0][op]
            baseline = med(theirs)
            ratio = med(ours) / med(theirs) if med(theirs) else float("nan")
            line += f"{med(theirs):>10.3f}{ratio:>12.2f}"
        report.say(line)
        case = f"{op} ({args.policy})"
        report.row(case, med(ours), baseline, unit="us/call", baseline_name=VLLM)
    for impl, (_, counts) in results.items():
        rate = counts["hits"] / counts["lookups"] if counts["lookups"] else 0.0
        chunk_rate = counts["hits"] / counts["chunks"] if counts["chunks"] else 0.0
        report.say(
            f"{impl}: {counts['ops']} calls, lookup hit rate {rate:.1%}, "
            f"chunk hit rate {chunk_rate:.1%}, "
            f"{counts['store_none']} stores refused, {counts['chunks_stored']} chunks stored"
        )

    def kvhex_store(m: PrimaryTier, keys: list[bytes]) -> None:
        plan = m.prepare_store(keys)  # type: ignore[arg-type]
        assert plan is not None
        m.complete_store(plan.keys)
        m.take_events()  # the engine drains events every step

    n = args.index_chunks
    ours = index_bytes_per_chunk(
        lambda c: kvhex_manager(c, args.policy, python=args.python), kvhex_store, n
    )
    line = f"index memory at {n} resident chunks: kvhex {ours:.0f} B/chunk"
    theirs = None
    if vllm is not None:
        cpu_manager, vllm_ctx, _ = vllm
        ctx = vllm_ctx(req_id="fill")

        def vllm_store(m: Any, keys: list[bytes]) -> None:
            out = m.prepare_store(keys, ctx)
            m.complete_store(out.keys_to_store, ctx)

        theirs = index_bytes_per_chunk(
            lambda c: cpu_manager(c, cache_policy=args.policy), vllm_store, n
        )
        line += f", vllm {theirs:.0f} B/chunk, ratio {ours / theirs:.2f}"
    report.say(line + " (key bytes objects excluded: the engine owns them; +69 B each if counted)")
    case = f"index bytes per resident chunk ({args.policy})"
    report.row(case, ours, theirs, unit="B/chunk", baseline_name=VLLM)
    report.finish()


if __name__ == "__main__":
    main()
