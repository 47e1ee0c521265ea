"""Scheduler-side cost: kvhex's ``KvhexOffloadingManager`` beside vLLM's
``CPUOffloadingManager``, both driven through vLLM's ``OffloadingManager`` interface on one
trace in one run.

The serving trace of ``primary_tier.py`` (Zipf-popular shared prefixes, a few private chunks
per request) is replayed in scheduler steps of 8 new requests, each manager called as vLLM
0.33's offloading connector calls it: per request a vLLM ``ReqContext`` (the key positions
recorded as the connector records them), ``on_new_request``, ``lookup`` per key until the
first answer that is not ``HIT``, ``touch`` + ``prepare_load`` of the hit prefix,
``prepare_store`` of the rest;
``on_request_finished`` of the previous step's requests; ``on_schedule_end``; the step's
jobs completing (``complete_load`` / ``complete_store`` with each job's keys as a set, 2% of
stores failing); then the step's events drained (``take_events``) and ``get_stats``.

One warm-up pass (the tier fills) is dropped; then ``--repeats`` passes, each of blocks of
about 64 steps that every side replays in turn, the first side rotating block by block, so
machine drift hits them alike. The sides:

* ``vllm``: vLLM 0.33's ``CPUOffloadingManager`` (LRU, events on);
* ``kvhex``: ``KvhexOffloadingSpec(...).get_manager()`` as vLLM builds it (host tier only,
  in vLLM's shared region; events on), drained by ``take_events`` (vLLM's raw events, as its
  stock ``OffloadingConnector`` calls it);
* ``kvhex-py``: the same without the native module ``_hostslots`` (as where no C compiler
  was found at install): the host tier's per-key work and every lookup in Python;
* ``kvhex-kv``: the same, each request announced inside ``incoming(request)`` and drained by
  ``take_kv_events`` (kvhex's full-provenance events, as ``KvhexOffloadingConnector`` does).

Prints each operation's median microseconds per call, each operation's share of the time per
chunk operation, and the headline: all bookkeeping time of a pass per chunk operation (a lookup
is one; a batch call counts its keys), kvhex / vLLM as the median of per-pass ratios with its
95% interval (``_report.median_interval``); without ``get_stats``, then with it.
Without vLLM importable (``.venv``) it says so and measures kvhex's ``OffloadEngine`` alone,
on kvhex request contexts (the manager's vLLM adapter cannot be built there).

    .venv-vllm/bin/python bench/manager.py [--ops 1000000] [--slots 40000] [--repeats 9]
    python bench/manager.py --quick --json   # tiny sizes; rows as JSON (see _report.py)
    python bench/manager.py --profile kvhex  # cProfile of one side's replay instead

A plain script, never a timed test. Timer overhead (median of an empty timed region) is
subtracted from every call.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import logging
import pstats
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any
from unittest import mock

import structlog

import _vllm
from _report import Report, add_repeats, parse, summarize
from kvhex.cli.bench import interval_text
from primary_tier import make_trace, timer_overhead

QUICK = {"ops": 6000, "slots": 200, "prefixes": 100, "repeats": 6}
"""Sizes of ``--quick`` (the smoke test's)."""
VLLM = "vLLM CPUOffloadingManager"
STEP_REQUESTS = 8
"""New requests per scheduler step."""
BLOCK_STEPS = 64
"""Steps one side replays before the next side's turn."""
TOKENS_PER_CHUNK = 16
PAGE = 4096

OPS = (
    "on_new_request",
    "lookup",
    "touch",
    "prepare_load",
    "prepare_store",
    "on_request_finished",
    "on_schedule_end",
    "complete_load",
    "complete_store",
    "take_events",
    "get_stats",
)
CHUNK_OPS = ("lookup", "touch", "prepare_load", "prepare_store", "complete_load", "complete_store")
"""Operations whose calls carry chunks (the denominator counts their keys)."""
HEADLINE_OPS = tuple(op for op in OPS if op != "get_stats")
"""What the issue counts as bookkeeping; ``get_stats`` (vLLM asks every step) separately."""


class Request:
    """What vLLM's ``Request`` offers kvhex's ``provenance_of`` (live token ids and block
    hashes; no LoRA, multimodal input, salt or prompt embeddings)."""

    __slots__ = ("all_token_ids", "block_hashes", "request_id")
    lora_request = None
    mm_features = None
    cache_salt = None
    prompt_embeds = None
    session_id = None
    kv_transfer_params = None
    kv_hints = None

    def __init__(self, request_id: str, keys: list[bytes]) -> None:
        self.request_id = request_id
        self.block_hashes = [key[:-4] for key in keys]  # one block per chunk, group 0
        self.all_token_ids = list(range(len(keys) * TOKENS_PER_CHUNK))


class Side:
    """One manager and what was measured of it."""

    def __init__(self, name: str, manager: Any, api: str, kv_events: bool = False) -> None:
        self.name = name
        self.manager = manager
        self.api = api  # "vllm": vLLM's OffloadingManager; "engine": kvhex's OffloadEngine
        self.kv_events = kv_events
        self.samples: dict[str, list[int]] = {op: [] for op in OPS}
        self.counts = dict.fromkeys(("lookups", "hits", "refused", "stored", "chunk_ops"), 0)
        self.finishing: list[Any] = []  # the contexts of the requests that finish next step
        self.geometry: Any = None  # the engine side's, for its requests' provenance
        self.pass_ns: list[float] = []
        self.pass_stats_ns: list[float] = []
        self.pass_ops: list[int] = []


def offloading_config(slots: int, events: bool) -> Any:
    """vLLM 0.33's normalized offloading config: one full-attention group of 16-token
    blocks, one block per chunk, one worker, ``slots`` host chunks of one page."""
    return _vllm.offloading_config(
        block_bytes=PAGE,
        cpu_bytes=slots * PAGE,
        engine_id=f"kvhex-bench-{uuid.uuid4().hex[:12]}",
        events=events,
        tokens_per_block=TOKENS_PER_CHUNK,
        max_model_len=1 << 16,
    )


def vllm_sides(slots: int) -> list[Side] | None:
    """vLLM's CPU manager and kvhex's manager (twice: one per event path); ``None`` without
    vLLM."""
    try:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        from kvhex.vllm import KvhexOffloadingSpec
    except ImportError:
        return None
    theirs = CPUOffloadingManager(num_chunks=slots, cache_policy="lru", enable_events=True)
    sides = [Side("vllm", theirs, "vllm")]
    for name, kv_events, native in (
        ("kvhex", False, True),
        ("kvhex-py", False, False),
        ("kvhex-kv", True, True),
    ):
        with contextlib.ExitStack() as stack:
            if not native:  # as where no C compiler was found at install
                for where in ("kvhex.domain.primary", "kvhex.service.tiering"):
                    stack.enter_context(
                        mock.patch(f"{where}.native_module", return_value=(None, "off"))
                    )
            ours = KvhexOffloadingSpec(offloading_config(slots, events=True)).get_manager()
        # the side measures what it says (a patch that missed fails here): natively, vLLM's
        # lookup is the native hit path
        assert (type(ours.lookup).__name__ == "HitPath") is native, name
        sides.append(Side(name, ours, "vllm", kv_events))
    return sides


def engine_side(slots: int) -> Side:
    """kvhex's ``OffloadEngine`` as the vLLM spec composes it (host tier only, events on),
    over an in-memory host buffer."""
    from kvhex.adapters.memory import MemoryHostBuffer
    from kvhex.domain import KvGeometry, KvGroup
    from kvhex.domain.geometry import CacheKind
    from kvhex.plugins import Registry
    from kvhex.vllm.compose import build_engine
    from kvhex.vllm.settings import parse_settings

    geometry = KvGeometry(
        (KvGroup(0, TOKENS_PER_CHUNK, 1, CacheKind.FULL_ATTENTION),), TOKENS_PER_CHUNK
    )
    engine, _ = build_engine(
        parse_settings({"cpu_bytes_to_use": slots * 16}),
        MemoryHostBuffer(slots, 16),
        registry=Registry.discover(),
        namespace={},
        record_events=True,
        geometry=geometry,
    )
    side = Side("kvhex-engine", engine, "engine")
    side.geometry = geometry
    return side


def replay(side: Side, steps: list[list[tuple[int, list[bytes]]]]) -> None:
    """Replay ``steps`` through ``side``'s manager, appending per-call nanoseconds."""
    pc = time.perf_counter_ns
    m = side.manager
    s = side.samples
    s_new, s_lookup, s_touch = s["on_new_request"], s["lookup"], s["touch"]
    s_pload, s_pstore = s["prepare_load"], s["prepare_store"]
    s_finished, s_end = s["on_request_finished"], s["on_schedule_end"]
    s_cload, s_cstore = s["complete_load"], s["complete_store"]
    s_events, s_stats = s["take_events"], s["get_stats"]
    counts = side.counts
    vllm_api = side.api == "vllm"
    if vllm_api:
        from vllm.v1.kv_offload.base import LookupResult as VllmLookup
        from vllm.v1.kv_offload.base import ReqContext as VllmCtx
        from vllm.v1.kv_offload.base import ScheduleEndContext

        hit: Any = VllmLookup.HIT
    else:
        from kvhex.domain import LookupResult, Provenance, ReqContext

        hit = LookupResult.HIT
        geometry = side.geometry
    lookup, touch = m.lookup, m.touch
    prepare_load, complete_load = m.prepare_load, m.complete_load
    prepare_store, complete_store = m.prepare_store, m.complete_store
    on_new_request, on_request_finished = m.on_new_request, m.on_request_finished
    on_schedule_end = m.on_schedule_end
    take_events: Callable[[], Any] = m.take_kv_events if side.kv_events else m.take_events
    get_stats = m.get_stats if vllm_api else None
    incoming = m.incoming if side.kv_events else None
    lookups = hits = refused = stored = chunk_ops = 0
    for step in steps:
        new_ids = []
        started = []
        pending: list[tuple[Any, set[bytes], bool, bool]] = []
        for req_no, keys in step:
            rid = f"req-{req_no}"
            new_ids.append(rid)
            # the connector's own work, untimed: the request's context and key positions
            if vllm_api:
                ctx = VllmCtx(req_id=rid)
                for i, key in enumerate(keys):
                    ctx.set_offload_key_position(key, (i + 1) * TOKENS_PER_CHUNK)
            else:
                request = Request(rid, keys)
                ctx = ReqContext(
                    rid,
                    provenance=Provenance(
                        geometry, request.all_token_ids, request.block_hashes, device_events=True
                    ),
                )
            if incoming is not None:
                request = Request(rid, keys)
                t0 = pc()
                with incoming(request):
                    on_new_request(ctx)
                s_new.append(pc() - t0)
            else:
                t0 = pc()
                on_new_request(ctx)
                s_new.append(pc() - t0)
            started.append(ctx)
            n_hits = 0
            for key in keys:
                t0 = pc()
                result = lookup(key, ctx)
                s_lookup.append(pc() - t0)
                lookups += 1
                if result is not hit:
                    break
                n_hits += 1
            hits += n_hits
            chunk_ops += n_hits + (n_hits < len(keys))
            if n_hits:
                prefix = keys[:n_hits]
                t0 = pc()
                touch(prefix, ctx)
                s_touch.append(pc() - t0)
                t0 = pc()
                prepare_load(prefix, ctx)
                s_pload.append(pc() - t0)
                pending.append((ctx, set(prefix), False, True))
                chunk_ops += 3 * n_hits  # touch, prepare_load, complete_load
            rest = keys[n_hits:]
            if rest:
                t0 = pc()
                out = prepare_store(rest, ctx)
                s_pstore.append(pc() - t0)
                chunk_ops += len(rest)
                if out is None:
                    refused += 1
                else:
                    to_store = out.keys_to_store if vllm_api else out.keys
                    if to_store:
                        ok = req_no % 50 != 0  # 2% of stores fail
                        pending.append((ctx, set(to_store), True, ok))
                        chunk_ops += len(to_store)
                        if ok:
                            stored += len(to_store)
        for ctx in side.finishing:
            t0 = pc()
            on_request_finished(ctx)
            s_finished.append(pc() - t0)
        side.finishing = started
        if vllm_api:
            end = ScheduleEndContext(new_req_ids=new_ids, preempted_req_ids=())
            t0 = pc()
            on_schedule_end(end)
            s_end.append(pc() - t0)
        else:
            t0 = pc()
            on_schedule_end()
            s_end.append(pc() - t0)
        # the workers' output of this step: each job's keys as a set, as vLLM passes them
        for ctx, job_keys, is_store, ok in pending:
            if is_store:
                t0 = pc()
                complete_store(job_keys, ctx, ok)
                s_cstore.append(pc() - t0)
            else:
                t0 = pc()
                complete_load(job_keys, ctx)
                s_cload.append(pc() - t0)
        t0 = pc()
        list(take_events())
        s_events.append(pc() - t0)
        if get_stats is not None:
            t0 = pc()
            get_stats()
            s_stats.append(pc() - t0)
    counts["lookups"] += lookups
    counts["hits"] += hits
    counts["refused"] += refused
    counts["stored"] += stored
    counts["chunk_ops"] += chunk_ops


def quiet_logs() -> None:
    """The library logs start-up lines and one warning per spec built outside vLLM's
    connector (its namespace is this process's own); a bench wants its table only."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ops",
        type=int,
        default=1_000_000,
        help="trace size as in primary_tier.py: ops/8 requests",
    )
    parser.add_argument("--slots", type=int, default=40_000)
    parser.add_argument("--prefixes", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--profile",
        metavar="SIDE",
        help="instead of measuring: cProfile SIDE's replay of the whole trace (top functions)",
    )
    add_repeats(parser)
    args = parse(parser, QUICK)
    report = Report("manager", args)
    quiet_logs()

    trace = make_trace(args.ops // 8, args.prefixes, args.seed)
    steps = [trace[i : i + STEP_REQUESTS] for i in range(0, len(trace), STEP_REQUESTS)]
    report.say(
        f"trace: {len(trace)} requests in {len(steps)} steps of {STEP_REQUESTS}, "
        f"{args.slots} host slots"
    )
    sides = vllm_sides(args.slots)
    if sides is None:
        report.say("vllm: not installed; kvhex's OffloadEngine alone (the adapter needs vLLM)")
        sides = [engine_side(args.slots)]
    try:
        if args.profile:
            profile(report, sides, args.profile, steps)
        else:
            measure(report, sides, steps, args.repeats)
    finally:  # kvhex's managers give vLLM's shared region (in /dev/shm) back
        for side in sides:
            side.manager.shutdown()


def measure(report: Report, sides: list[Side], steps: list[Any], repeats: int) -> None:
    """Replay ``steps`` through every side, block by block, and report."""
    overhead = timer_overhead()
    # one warm-up pass (the tier fills), then --repeats timed passes of whole blocks
    n_blocks = max(len(steps) // BLOCK_STEPS, repeats + 1)
    per_pass = max(n_blocks // (repeats + 1), 1)
    block_steps = max(len(steps) // (per_pass * (repeats + 1)), 1)
    report.say(
        f"{repeats} passes of {per_pass} blocks of {block_steps} steps after one warm-up "
        f"pass; timer overhead {overhead} ns subtracted"
    )
    gc.collect()
    gc.freeze()
    turn = 0
    for p in range(repeats + 1):
        marks = {side.name: {op: len(side.samples[op]) for op in OPS} for side in sides}
        ops_before = {side.name: side.counts["chunk_ops"] for side in sides}
        for b in range(per_pass):
            begin = (p * per_pass + b) * block_steps
            block = steps[begin : begin + block_steps]
            for i in range(len(sides)):  # the first side rotates block by block
                replay(sides[(turn + i) % len(sides)], block)
            turn += 1
        for side in sides:
            if p == 0:  # warm-up: dropped
                for op in OPS:
                    del side.samples[op][:]
                side.counts = dict.fromkeys(side.counts, 0)
                continue
            mark = marks[side.name]

            def spent(ops: tuple[str, ...], side: Side = side, mark: dict[str, int] = mark) -> int:
                new = [side.samples[op][mark[op] :] for op in ops]
                return sum(sum(xs) - overhead * len(xs) for xs in new)

            side.pass_ns.append(spent(HEADLINE_OPS))
            side.pass_stats_ns.append(spent(("get_stats",)))
            side.pass_ops.append(side.counts["chunk_ops"] - ops_before[side.name])
    gc.unfreeze()
    summarize_run(report, sides, overhead)
    report.finish()


def summarize_run(report: Report, sides: list[Side], overhead: int) -> None:
    """The per-operation table, where the time goes, the decisions, then the headline."""

    def med(xs: list[int]) -> float:
        return max(statistics.median(xs) - overhead, 0) / 1000

    def cell(value: float | None, fmt: str) -> str:
        return f"{'-' if value is None else format(value, fmt):>{width}}"

    names = [side.name for side in sides]
    width = max(11, *(len(n) + 2 for n in names))
    base = sides[0] if sides[0].name == "vllm" else None
    header = f"{'operation (us/call)':<22}{'calls':>9}" + "".join(f"{n:>{width}}" for n in names)
    if base is not None:
        header += "".join(f"{n + '/vllm':>15}" for n in names[1:])
    report.say(header)
    for op in OPS:
        figures = [med(side.samples[op]) if side.samples[op] else None for side in sides]
        calls = len(sides[-1].samples[op])
        line = f"{op:<22}{calls:>9}" + "".join(cell(f, ".3f") for f in figures)
        if base is not None:
            line += "".join(_ratio(f, figures[0]) for f in figures[1:])
        report.say(line)
        for side, figure in zip(sides, figures, strict=True):
            if side is not base and figure is not None:
                baseline = figures[0] if base is not None else None
                report.row(
                    f"{op} ({side.name})", figure, baseline, unit="us/call", baseline_name=VLLM
                )
    report.say("where the time goes: each operation's share of the time per chunk operation, us")
    report.say(f"{'operation':<31}" + "".join(f"{n:>{width}}" for n in names))
    for op in OPS:
        shares = [
            (sum(side.samples[op]) - overhead * len(side.samples[op]))
            / max(side.counts["chunk_ops"], 1)
            / 1000
            if side.samples[op]
            else None
            for side in sides
        ]
        report.say(f"{op:<31}" + "".join(cell(f, ".3f") for f in shares))
    for side in sides:
        c = side.counts
        rate = c["hits"] / c["lookups"] if c["lookups"] else 0.0
        report.say(
            f"{side.name}: {c['lookups']} lookups, hit rate {rate:.1%}, {c['stored']} chunks "
            f"stored, {c['refused']} stores refused, {c['chunk_ops']} chunk operations"
        )
    report.say("bookkeeping per chunk operation (all calls above but get_stats), us:")
    headline(report, sides, base, "per chunk operation")
    if all(side.samples["get_stats"] for side in sides):
        report.say("the same with get_stats (vLLM asks every step), us:")
        for side in sides:
            side.pass_ns = [a + b for a, b in zip(side.pass_ns, side.pass_stats_ns, strict=True)]
        headline(report, sides, base, "per chunk operation incl. get_stats")


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:>15.2f}" if ours is not None and theirs else f"{'-':>15}"


def headline(report: Report, sides: list[Side], base: Side | None, case: str) -> None:
    """Each side's bookkeeping microseconds per chunk operation (median over passes) and,
    beside vLLM's, the median of the per-pass ratios with its 95% interval."""

    def per_op(side: Side) -> float:
        return statistics.median(
            ns / max(ops, 1) / 1000 for ns, ops in zip(side.pass_ns, side.pass_ops, strict=True)
        )

    for side in sides:
        line = f"  {side.name:<14}{per_op(side):>8.3f}"
        if base is None:
            report.row(
                f"bookkeeping {case} ({side.name})",
                per_op(side),
                None,
                unit="us/chunk op",
                baseline_name=VLLM,
            )
        elif side is not base:
            # per chunk operation on each side: LRU ties among one job's keys (a set) break
            # differently, so the two sides' decisions, and counts, differ slightly
            ratios = [
                (a / max(n, 1)) / (b / max(m, 1))
                for a, n, b, m in zip(
                    side.pass_ns, side.pass_ops, base.pass_ns, base.pass_ops, strict=True
                )
            ]
            fig = summarize({"ratio": ratios})
            low, high = fig["ratio low"], fig["ratio high"]
            line += f"   {side.name}/vllm {fig['ratio']:.3f} (95% {interval_text(low, high)})"
            report.row(
                f"bookkeeping {case} ({side.name})",
                per_op(side),
                per_op(base),
                unit="us/chunk op",
                baseline_name=VLLM,
                ratio=fig["ratio"],
                interval=(low, high),
            )
        report.say(line)


def profile(report: Report, sides: list[Side], name: str, steps: list[Any]) -> None:
    chosen = [side for side in sides if side.name == name]
    if not chosen:
        raise SystemExit(f"no side {name!r}; sides: {', '.join(s.name for s in sides)}")
    gc.collect()
    gc.freeze()  # as when measuring: the trace is no garbage collector's work
    profiler = cProfile.Profile()
    profiler.enable()
    replay(chosen[0], steps)
    profiler.disable()
    gc.unfreeze()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    report.finish()


if __name__ == "__main__":
    main()
