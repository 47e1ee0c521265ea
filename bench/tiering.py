"""Tiering benchmark: the cost of kvhex's tiering bookkeeping over the bare primary tier.

Replays the serving trace of ``primary_tier.py`` through the bare ``PrimaryTier`` (the
baseline) and through a ``TieringManager`` with its own primary tier plus two in-memory
secondary tiers (a cascade on every store, probes and promotions on host misses). The two
alternate in blocks of 256 requests, so machine drift hits both alike. A scheduler step every 8
requests; requests finish at their step's end. Prints the median microseconds per call of
each operation and the tiering/primary-only ratio, twice: as measured, and excluding the time
spent inside the in-memory tier adapters themselves (their job execution and byte copies run
inside ``poll``/``submit``; a real tier does that on its own threads), which isolates the
manager's bookkeeping. Blocks are 16 bytes so byte copies stay small.

    python bench/tiering.py [--ops 1000000] [--slots 40000]
    python bench/tiering.py --quick --json   # tiny sizes; rows as JSON (see _report.py)

A plain script, never a timed test.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from _report import Report, parse
from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain import JobResult, LookupResult, LruPolicy, PrimaryTier, ReqContext, TierJob
from kvhex.domain.events import TierEvent
from kvhex.service import TieringManager
from primary_tier import make_trace, timer_overhead

QUICK = {"ops": 4000, "slots": 200, "prefixes": 100}
"""Sizes of ``--quick`` (the smoke test's)."""
BASELINE = "bare PrimaryTier"

OPS = ("lookup", "store lifecycle", "load lifecycle", "step end", "request begin/end")
SLOT_BYTES = 16


class AdapterClock:
    """Nanoseconds spent inside the tier adapters' own methods (their IO, here byte copies)."""

    ns = 0


class TimedTier(MemoryTierStore):
    """The in-memory tier, adding the time spent inside each of its methods to
    ``AdapterClock`` (the timer wraps the adapter's own work only)."""

    def submit_put(self, job: TierJob) -> None:
        t0 = time.perf_counter_ns()
        super().submit_put(job)
        AdapterClock.ns += time.perf_counter_ns() - t0

    def submit_get(self, job: TierJob) -> None:
        t0 = time.perf_counter_ns()
        super().submit_get(job)
        AdapterClock.ns += time.perf_counter_ns() - t0

    def submit_probe(self, job: TierJob) -> None:
        t0 = time.perf_counter_ns()
        super().submit_probe(job)
        AdapterClock.ns += time.perf_counter_ns() - t0

    def poll(self) -> list[JobResult]:
        t0 = time.perf_counter_ns()
        results = super().poll()
        AdapterClock.ns += time.perf_counter_ns() - t0
        return results

    def take_events(self) -> list[TierEvent]:
        t0 = time.perf_counter_ns()
        events = super().take_events()
        AdapterClock.ns += time.perf_counter_ns() - t0
        return events


class Driver:
    """Feeds one request at a time to ``target`` and records per-call nanoseconds."""

    def __init__(self, target: Any, *, tiered: bool) -> None:
        self.target = target
        self.tiered = tiered
        self.samples: dict[str, list[int]] = {op: [] for op in OPS}
        self.own: dict[str, list[int]] = {op: [] for op in OPS}  # minus adapter time
        self.live: list[ReqContext] = []
        self.calls = 0

    def _record(self, op: str, elapsed: int, adapter_before: int) -> None:
        self.samples[op].append(elapsed)
        self.own[op].append(elapsed - (AdapterClock.ns - adapter_before))

    def request(self, req_no: int, keys: list[bytes]) -> None:
        pc = time.perf_counter_ns
        target, tiered = self.target, self.tiered
        record = self._record
        ctx = ReqContext(f"req-{req_no}")
        if tiered:
            a0, t0 = AdapterClock.ns, pc()
            target.on_new_request(ctx)
            record("request begin/end", pc() - t0, a0)
        lookup: Callable[..., LookupResult] = target.lookup
        hits = 0
        for key in keys:
            if tiered:
                a0, t0 = AdapterClock.ns, pc()
                result = lookup(key, ctx)
                record("lookup", pc() - t0, a0)
            else:
                a0, t0 = AdapterClock.ns, pc()
                result = lookup(key)
                record("lookup", pc() - t0, a0)
            self.calls += 1
            if result is not LookupResult.HIT:
                break
            hits += 1
        if hits:
            prefix = keys[:hits]
            a0, t0 = AdapterClock.ns, pc()
            target.prepare_load(prefix, ctx)
            target.complete_load(prefix, ctx)
            record("load lifecycle", pc() - t0, a0)
            self.calls += 2
        rest = keys[hits:]
        if rest:
            a0, t0 = AdapterClock.ns, pc()
            plan = target.prepare_store(rest, ctx)
            if plan is not None:
                target.complete_store(plan.keys, ctx, True)
            record("store lifecycle", pc() - t0, a0)
            self.calls += 2
        self.live.append(ctx)
        if req_no % 8 == 7:
            a0, t0 = AdapterClock.ns, pc()
            if tiered:
                target.on_schedule_end()
            target.take_events()
            record("step end", pc() - t0, a0)
            self.calls += 1
            if tiered:
                for done in self.live:
                    a0, t0 = AdapterClock.ns, pc()
                    target.on_request_finished(done)
                    record("request begin/end", pc() - t0, a0)
            self.live.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--slots", type=int, default=40_000)
    parser.add_argument("--prefixes", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=7)
    args = parse(parser, QUICK)
    report = Report("tiering", args)
    trace = make_trace(args.ops // 8, args.prefixes, args.seed)
    overhead = timer_overhead()
    report.say(
        f"trace: {len(trace)} requests, {args.slots} host slots, 2 in-memory tiers of "
        f"{4 * args.slots} blocks; timer overhead {overhead} ns subtracted"
    )
    base = Driver(PrimaryTier(args.slots, LruPolicy(args.slots)), tiered=False)
    host = MemoryHostBuffer(args.slots, SLOT_BYTES)
    tiers = [
        TimedTier(host, capacity_bytes=4 * args.slots * SLOT_BYTES, name=f"mem{i}")
        for i in range(2)
    ]
    manager = TieringManager(
        PrimaryTier(args.slots, LruPolicy(args.slots)),
        tiers,
        host=host,
    )
    tiered = Driver(manager, tiered=True)
    gc.collect()
    gc.freeze()
    block = 256  # alternate in blocks of 32 steps: drift hits both, caches stay warm
    for start in range(0, len(trace), block):
        if base.calls >= args.ops:
            break
        for driver in (base, tiered):
            for req_no, keys in trace[start : start + block]:
                driver.request(req_no, keys)
    gc.unfreeze()

    def med(xs: list[int]) -> float:
        return max(statistics.median(xs) - overhead, 0) / 1000 if xs else float("nan")

    report.say(
        f"{'operation':<20}{'calls':>9}{'primary us':>12}{'tiering us':>12}{'ratio':>8}"
        f"{'excl. tiers us':>16}{'ratio':>8}"
    )
    for op in OPS:
        b, t, own = base.samples[op], tiered.samples[op], tiered.own[op]
        base_us = med(b) if b else float("nan")
        row = f"{op:<20}{len(t):>9}{base_us:>12.3f}{med(t):>12.3f}{med(t) / base_us:>8.2f}"
        report.say(row + f"{med(own):>16.3f}{med(own) / base_us:>8.2f}")
        report.row(op, med(t), base_us, unit="us/call", baseline_name=BASELINE)
        report.row(
            f"{op} (excl. tier adapters)", med(own), base_us, unit="us/call", baseline_name=BASELINE
        )

    def per_store(samples: dict[str, list[int]]) -> float:
        total = sum(samples["store lifecycle"]) + sum(samples["step end"])
        return total / len(samples["store lifecycle"]) / 1000

    full_base, full, full_own = (
        per_store(base.samples),
        per_store(tiered.samples),
        per_store(tiered.own),
    )
    report.say(
        "store lifecycle incl. cascade completion (stores + step ends, per store): "
        f"primary {full_base:.3f} us, tiering {full:.3f} us (ratio {full / full_base:.2f}), "
        f"excl. tier adapters {full_own:.3f} us (ratio {full_own / full_base:.2f})"
    )
    for t in manager.stats().tiers:
        report.say(
            f"{t.name}: {t.puts_ok} puts ({t.keys_put} chunks), {t.keys_promoted} chunks "
            f"promoted, {t.probes_submitted} probe batches, {t.cascades_dropped} dropped"
        )
    report.row(
        "full store lifecycle incl. cascade completion",
        full,
        full_base,
        unit="us/store",
        baseline_name=BASELINE,
    )
    report.row(
        "full store lifecycle incl. cascade completion (excl. tier adapters)",
        full_own,
        full_base,
        unit="us/store",
        baseline_name=BASELINE,
    )
    manager.shutdown()
    report.finish()


if __name__ == "__main__":
    main()
