"""Metrics overhead: a host-hit lookup with kvhex's Prometheus collector registered and scraped,
beside the same lookup with no collector, in the same run.

The engine's counters are plain integers it keeps whatever the configuration, so the cost of
"metrics on" is what a scrape takes from the scheduler thread (the GIL, while the collector
reads the engine) plus nothing per lookup. Each pass times ``--lookups`` host-hit lookups
without a collector, then the same with one registered and a thread scraping it every
``--scrape-interval`` seconds (Prometheus' own default is 15 s; 1 s is already harsh), in
alternating order. Prints the median nanoseconds per lookup of each, their ratio (median of
per-pass ratios), and what one scrape costs.

    python bench/metrics.py [--lookups 200000] [--passes 15] [--scrape-interval 1.0]
    python bench/metrics.py --quick --json

A plain script, never a timed test.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest

from _report import Report, parse
from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.adapters.metrics.prometheus import register_metrics
from kvhex.domain import LruPolicy, PrimaryTier, ReqContext, make_offload_key
from kvhex.service import EventPipeline, OffloadEngine, TieringManager

QUICK = {"lookups": 2000, "passes": 3, "slots": 64}
SLOT_BYTES = 256


def build(slots: int) -> tuple[OffloadEngine, list[bytes]]:
    """An engine whose host memory holds ``slots`` chunks (one memory tier behind it)."""
    host = MemoryHostBuffer(slots, SLOT_BYTES)
    primary = PrimaryTier(slots, LruPolicy(slots))
    tier = MemoryTierStore(host, capacity_bytes=4 * slots * SLOT_BYTES, name="mem")
    engine = OffloadEngine(TieringManager(primary, [tier], host=host), EventPipeline())
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(slots)]
    ctx = ReqContext("fill")
    plan = engine.prepare_store(keys, ctx)
    assert plan is not None
    assert len(plan.keys) == slots
    engine.complete_store(plan.keys, ctx)
    for _ in range(3):
        engine.on_schedule_end()
    engine.take_events()
    return engine, keys


def time_lookups(engine: OffloadEngine, keys: list[bytes], n: int) -> float:
    """Nanoseconds per host-hit lookup over ``n`` lookups."""
    ctx = ReqContext("bench")
    lookup = engine.lookup
    rounds, rest = divmod(n, len(keys))
    order = keys * rounds + keys[:rest]
    start = time.perf_counter_ns()
    for key in order:
        lookup(key, ctx)
    elapsed = time.perf_counter_ns() - start
    engine.on_schedule_end()
    return elapsed / n


class Scraper:
    """A thread scraping ``registry`` every ``interval`` seconds until stopped."""

    def __init__(self, registry: CollectorRegistry, interval: float) -> None:
        self.registry = registry
        self.interval = interval
        self.costs: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            generate_latest(self.registry)
            self.costs.append(time.perf_counter() - start)
            if self._stop.wait(self.interval):
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=200_000, help="lookups per pass")
    parser.add_argument("--passes", type=int, default=15, help="alternating passes")
    parser.add_argument("--slots", type=int, default=4096, help="host slots, all resident")
    parser.add_argument(
        "--scrape-interval", type=float, default=1.0, help="seconds between scrapes"
    )
    args = parse(parser, QUICK)
    report = Report("metrics", args)
    engine, keys = build(args.slots)
    time_lookups(engine, keys, args.lookups)  # warm up
    off: list[float] = []
    on: list[float] = []
    ratios: list[float] = []
    costs: list[float] = []
    for i in range(args.passes):
        registry = CollectorRegistry()
        collector = register_metrics(engine, registry)

        def metrics_on(registry: CollectorRegistry = registry) -> float:
            with Scraper(registry, args.scrape_interval) as scraper:
                ns = time_lookups(engine, keys, args.lookups)
            costs.extend(scraper.costs)
            return ns

        def metrics_off() -> float:
            return time_lookups(engine, keys, args.lookups)

        if i % 2:
            with_metrics, without = metrics_on(), metrics_off()
        else:
            without, with_metrics = metrics_off(), metrics_on()
        registry.unregister(collector)
        off.append(without)
        on.append(with_metrics)
        ratios.append(with_metrics / without)
    stats = engine.stats()
    engine.shutdown()
    median_off, median_on = statistics.median(off), statistics.median(on)
    ratio = statistics.median(ratios)
    report.say(
        f"host-hit lookup, {args.slots} resident chunks, {args.lookups} lookups x "
        f"{args.passes} passes (alternating), scrape every {args.scrape_interval} s"
    )
    report.say(f"{'case':<28} {'ns/lookup':>10}")
    report.say(f"{'no collector (baseline)':<28} {median_off:>10.0f}")
    report.say(f"{'collector + scrapes':<28} {median_on:>10.0f}   ratio {ratio:.3f}x")
    scrape_ms = statistics.median(costs) * 1e3 if costs else float("nan")
    report.say(
        f"one scrape: {scrape_ms:.2f} ms (median of {len(costs)}); lookups counted: "
        f"{stats.lookups}, host hits {stats.host_hits}"
    )
    report.row(
        "host-hit lookup with metrics",
        median_on,
        baseline=median_off,
        ratio=ratio,
        unit="ns",
        baseline_name="no collector",
        better="lower",
    )
    report.row("one scrape", scrape_ms, None, unit="ms", baseline_name="none", better="lower")
    report.finish()


if __name__ == "__main__":
    main()
