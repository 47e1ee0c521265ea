"""Event benchmark: translation + wire encoding per stored chunk, and event-state memory.

1. Cost per stored chunk event with a full payload: chunks of 16 blocks x 16 tokens (256
   tokens), a LoRA adapter and one multimodal feature, translated from raw ``Stored`` events by
   kvhex's ``EventTranslator`` and encoded to vLLM's msgpack wire format, one batch per
   scheduler step (64 chunks). Baseline in the same run: the encoding alone (what any
   publisher pays anyway).
2. Memory held by event state for 100,000 resident chunks whose requests finished: kvhex keeps
   only detached chunk hashes; beside it, a snapshot-payload design (what vLLM's tracker keeps:
   per-chunk hashes, parent, token ids, LoRA and extra keys until the last removal), measured
   the same way (tracemalloc).

    python bench/events.py [--chunks 20000] [--resident 100000]
    python bench/events.py --quick --json   # tiny sizes; rows as JSON (see _report.py)

A plain script, never a timed test.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from typing import Any

from _report import Report, parse
from kvhex.adapters.events.wire import encode_batch
from kvhex.domain import (
    EventBatch,
    EventTranslator,
    KvGeometry,
    KvGroup,
    Medium,
    MmFeature,
    Provenance,
    ReqContext,
    Stored,
    TierIdentity,
    make_offload_key,
)
from kvhex.domain.locator import locate

QUICK = {"chunks": 640, "resident": 800, "repeats": 1}
"""Sizes of ``--quick`` (the smoke test's)."""

GROUP = KvGroup(0, tokens_per_block=16, blocks_per_chunk=16)
GEO = KvGeometry((GROUP,), tokens_per_hash=16)
CPU = TierIdentity(Medium.CPU)
TOKENS_PER_CHUNK = GROUP.tokens_per_chunk


def request(i: int, chunks: int) -> tuple[ReqContext, list[bytes]]:
    """A finished-looking request of ``chunks`` chunks and its chunk keys (hashes made up:
    the benchmark measures translation, not hashing)."""
    n_tokens = chunks * TOKENS_PER_CHUNK
    tokens = list(range(i, i + n_tokens))
    hashes = [(i * 1_000_003 + j).to_bytes(32, "big") for j in range(n_tokens // 16)]
    prov = Provenance(
        geometry=GEO,
        token_ids=tokens,
        block_hashes=hashes,
        lora_id=3,
        lora_name="adapter-a",
        mm_features=(MmFeature(f"img-{i}", offset=40, length=64),),
    )
    ctx = ReqContext(f"req-{i}", provenance=prov)
    keys = [make_offload_key(hashes[(c + 1) * 16 - 1], 0) for c in range(chunks)]
    for c, key in enumerate(keys):  # as the engine records them at prepare_store
        ctx.record_position(key, (c + 1) * TOKENS_PER_CHUNK)
    return ctx, keys


def bench_cost(n_chunks: int, repeats: int, report: Report) -> None:
    """Per scheduler step: 8 requests x 8 chunks translated, encoded as one batch, dropped."""
    per_request, per_step = 8, 8
    requests = [request(i, per_request) for i in range(n_chunks // per_request)]
    steps = [requests[i : i + per_step] for i in range(0, len(requests), per_step)]
    translate_us, encode_us = [], []
    size = n_events = 0
    for _ in range(repeats):
        translator = EventTranslator(GEO)
        gc.collect()
        gc.freeze()  # long-lived state out of the collector's way, as a serving engine does
        t_translate = t_encode = 0.0
        n_events = 0
        for step in steps:
            raw = [Stored(tuple(keys), CPU, ctx) for ctx, keys in step]
            t0 = time.perf_counter()
            events = translator.translate(raw)
            t1 = time.perf_counter()
            payload = encode_batch(EventBatch(1.0, events))
            t2 = time.perf_counter()
            t_translate += t1 - t0
            t_encode += t2 - t1
            n_events += len(events)
            size = len(payload) // len(events)
            assert not events[0].is_placeholder  # type: ignore[union-attr]
        gc.unfreeze()
        translate_us.append(t_translate / n_events * 1e6)
        encode_us.append(t_encode / n_events * 1e6)
    tr, enc = statistics.median(translate_us), statistics.median(encode_us)
    full = tr + enc
    report.say(
        f"chunk events: {n_events} per run in steps of {per_step * per_request} "
        f"(16 blocks x 16 tokens, LoRA, 1 mm feature), {size} wire bytes each"
    )
    report.say(f"  translate            {tr:8.2f} us/event")
    report.say(f"  encode (baseline)    {enc:8.2f} us/event")
    report.say(
        f"  translate + encode   {full:8.2f} us/event  ({1e6 / full:,.0f} events/s), "
        f"ratio to encoding alone {full / enc:.2f}"
    )
    step = steps[0]  # the same step again and again: warm caches, the code path alone
    warm = []
    for _ in range(200):
        translator = EventTranslator(GEO)
        raw = [Stored(tuple(keys), CPU, ctx) for ctx, keys in step]
        t0 = time.perf_counter()
        events = translator.translate(raw)
        encode_batch(EventBatch(1.0, events))
        warm.append((time.perf_counter() - t0) / len(events) * 1e6)
    report.say(f"  translate + encode, warm caches: {statistics.median(warm):.2f} us/event")
    report.row(
        "translate + encode, cold (per event)",
        full,
        enc,
        unit="us/event",
        baseline_name="wire encoding alone",
    )
    report.row(
        "translate + encode, warm caches (per event)",
        statistics.median(warm),
        enc,
        unit="us/event",
        baseline_name="wire encoding alone",
    )


def snapshot(ctx: ReqContext, key: bytes) -> tuple[Any, ...]:
    """What a snapshot design keeps per stored chunk until its last removal."""
    p = locate(ctx, key)  # type: ignore[arg-type]
    assert p is not None
    prov = ctx.provenance
    assert prov is not None
    return (
        tuple(p.block_hashes),
        p.parent_block_hash,
        tuple(p.token_ids),
        p.block_size,
        prov.lora_id,
        prov.lora_name,
        tuple(p.extra_keys or ()),
        0,
    )


def retained_per_chunk(resident: int, keep: Any) -> float:
    """Bytes still allocated per chunk once the requests are gone: ``keep(reqs)`` builds the
    event state from live requests; then the requests (tokens, hashes, contexts) are dropped,
    as when they finished, and only what the event state still references remains."""
    per_request = 8
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    reqs = [request(i, per_request) for i in range(resident // per_request)]
    state = keep(reqs)
    del reqs
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del state
    return retained / resident


def bench_memory(resident: int, report: Report) -> None:
    def kvhex_state(reqs: list[tuple[ReqContext, list[bytes]]]) -> EventTranslator:
        translator = EventTranslator(GEO)
        translator.translate([Stored(tuple(keys), CPU, ctx) for ctx, keys in reqs])
        return translator

    def snapshot_state(reqs: list[tuple[ReqContext, list[bytes]]]) -> dict[bytes, Any]:
        return {k: snapshot(ctx, k) for ctx, keys in reqs for k in keys}

    ours = retained_per_chunk(resident, kvhex_state)
    theirs = retained_per_chunk(resident, snapshot_state)
    report.say(
        f"event state for {resident:,} resident chunks of finished requests: kvhex "
        f"{ours:,.0f} B/chunk (detached hashes only), snapshot design {theirs:,.0f} B/chunk, "
        f"ratio {ours / theirs:.3f}"
    )
    report.row(
        "retained event state per resident chunk",
        ours,
        theirs,
        unit="B/chunk",
        baseline_name="snapshot-payload design",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20_000)
    parser.add_argument("--resident", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parse(parser, QUICK)
    report = Report("events", args)
    bench_cost(args.chunks, args.repeats, report)
    bench_memory(args.resident, report)
    report.finish()


if __name__ == "__main__":
    main()
