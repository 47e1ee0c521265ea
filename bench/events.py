"""Event benchmark: full KV events per stored chunk, kvhex beside vLLM's own tracker, and
event-state memory.

1. What the scheduler side pays per stored chunk for full ``BlockStored`` events, on one
   trace, both sides in the same run:

   * kvhex: each request's ``Provenance`` (as the vLLM adapter attaches it at
     ``on_new_request``: it exists for events; each chunk's place in the request is found
     from the request's own hashes, as the adapter finds it); at the step's end
     ``Announcer.order`` of the tiers' raw
     ``Stored`` events (one per request), ``EventTranslator.translate`` (one chained
     ``BlockStored`` per run of chunks) and ``wire.encode_batch`` of the step's batch;
   * vLLM 0.33: ``OffloadingEventsTracker.record_store`` of each chunk at prepare time (real
     ``vllm.v1.request.Request`` objects); at the step's end ``take_events`` of the
     manager's raw ``OffloadingEvent``s (one per request, as its CPU manager emits them) and
     vLLM's own msgspec encoding of the step's ``KVEventBatch``, as its ``ZmqEventPublisher``
     does; with vLLM's environment cache on, as its ``EngineCore`` turns it on at start-up.

   Two chunk shapes: 16 blocks x 16 tokens per chunk (4 chunks per request) and vLLM's CPU
   engine's 1 block x 32 tokens (32 chunks per request); 1,024-token prompts, 8 requests per
   step (8,192 tokens a step), every chunk of a request stored in one step. Then one removal
   step per request (``Removed`` / ``OffloadingEvent(removed=True)``): stores + removals per
   stored chunk. No LoRA or multimodal input in the head-to-head (vLLM's tracker defers
   ``extra_keys`` and publishes ``None``; kvhex computes GPU-equal ones); kvhex with a LoRA
   adapter and one multimodal feature per request runs as a third side, beside the same
   vLLM figure. Both sides publish hashes as vLLM does by default
   (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). An untimed first pass warms every side up, and
   the decoded batches of both sides are checked to describe the same blocks; then in each
   timed pass the sides run interleaved step by step (each side's step right after the
   others' same step, the first side rotating), so that load on the machine hits them alike.
2. Memory held by event state for 40,000 resident chunks whose requests finished: kvhex's
   announcer and translator (detached chunk hashes); beside it, a snapshot-payload design
   (what vLLM's tracker keeps: per-chunk hashes, parent, token ids, LoRA and extra keys until
   the last removal) and, where vLLM is importable, vLLM's tracker itself, measured the same
   way (tracemalloc).

Without vLLM importable (``.venv``) only kvhex's side runs; run it with
``.venv-vllm/bin/python`` for the comparison.

    python bench/events.py [--chunks 8192] [--resident 40000] [--repeats 9]
    python bench/events.py --quick --json   # tiny sizes; rows as JSON (see _report.py)

A plain script, never a timed test. Each figure is the median of ``--repeats`` passes; each
ratio is the median of the per-pass ratios, with its 95% interval
(``_report.median_interval``; from 6 passes on).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from _report import Report, add_repeats, parse, summarize
from kvhex.adapters.events.wire import decode_batch, encode_batch
from kvhex.cli.bench import interval_text
from kvhex.domain import (
    EventBatch,
    EventTranslator,
    KvGeometry,
    KvGroup,
    Medium,
    MmFeature,
    OffloadKey,
    Provenance,
    Removed,
    ReqContext,
    Stored,
    TierIdentity,
    make_offload_key,
)
from kvhex.domain.announce import Announcer
from kvhex.domain.locator import record_of

QUICK = {"chunks": 256, "resident": 800, "repeats": 1}
"""Sizes of ``--quick`` (the smoke test's)."""

CPU = TierIdentity(Medium.CPU)
PER_STEP = 8
"""Requests whose chunks are stored in one scheduler step."""
INT_HASHES = bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))
"""vLLM's default: hashes published as the low 64 bits of their value."""
VLLM = "vLLM OffloadingEventsTracker"


class Shape(NamedTuple):
    """A chunk shape of the trace (hash block = cache block, as with one KV group)."""

    tokens_per_block: int
    blocks_per_chunk: int
    chunks_per_request: int

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def label(self) -> str:
        blocks = "block" if self.blocks_per_chunk == 1 else "blocks"
        return f"{self.blocks_per_chunk} {blocks} x {self.tokens_per_block} tokens"

    @property
    def geometry(self) -> KvGeometry:
        group = KvGroup(0, self.tokens_per_block, self.blocks_per_chunk)
        return KvGeometry((group,), tokens_per_hash=self.tokens_per_block)


SHAPES = (Shape(16, 16, 4), Shape(32, 1, 32))


class Req(NamedTuple):
    """One request of the trace: its live tokens and hashes, chunk keys and chunk ends."""

    req_id: str
    tokens: Sequence[int]
    hashes: list[bytes]
    keys: tuple[OffloadKey, ...]
    ends: tuple[int, ...]
    vllm: Any  # the vllm.v1.request.Request, or None


class Vllm:
    """vLLM 0.33's scheduler-side events path: real Requests, tracker, raw events, encoder."""

    def __init__(self) -> None:
        import msgspec
        import torch
        import vllm
        from vllm import envs
        from vllm.distributed.kv_events import KVEventBatch
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import events, scheduler
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
        from vllm.v1.kv_offload import base
        from vllm.v1.request import Request

        from kvhex.vllm._convert import provenance_of

        envs.enable_envs_cache()  # as vLLM's EngineCore does once started
        self.version = vllm.__version__
        self.int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        self.provenance_of = provenance_of
        self._request, self._params = Request, SamplingParams(max_tokens=1)
        self._hash = get_hash_fn_by_name("sha256")
        kv_cache_utils.init_none_hash(self._hash)
        self._hashers: dict[int, Any] = {}
        self._hasher_of = kv_cache_utils.get_request_block_hasher
        self._group = scheduler.GroupOffloadConfig
        self._spec = lambda block: FullAttentionSpec(
            block_size=block, num_kv_heads=4, head_size=16, dtype=torch.float16
        )
        self._group_spec = lambda spec: events.get_offloading_event_group_spec(
            KVCacheGroupSpec(["layer.0"], spec)
        )
        self._manager = FullAttentionManager
        self._tracker = events.OffloadingEventsTracker
        self._config = base.OffloadingKVEventsConfig(
            enable_kv_cache_events=True, self_describing_kv_events=True
        )
        self._event, self._medium = base.OffloadingEvent, base.Medium.CPU
        self.batch, self.encoder = KVEventBatch, msgspec.msgpack.Encoder

    def request(self, req_id: str, tokens: list[int], block: int) -> Any:
        """A ``Request`` with vLLM's sha256 block hasher (its ``block_hashes`` filled in)."""
        hasher = self._hashers.get(block)
        if hasher is None:
            hasher = self._hashers[block] = self._hasher_of(block, self._hash)
        return self._request(req_id, tokens, self._params, None, block_hasher=hasher)

    def group_config(self, shape: Shape) -> Any:
        """The scheduler's ``GroupOffloadConfig`` of one full-attention group."""
        spec = self._spec(shape.tokens_per_block)
        return self._group(
            group_idx=0,
            tokens_per_block=shape.tokens_per_block,
            tokens_per_chunk=shape.tokens_per_chunk,
            hashes_per_chunk=shape.blocks_per_chunk,
            kv_event_group_spec=self._group_spec(spec),
            sliding_window_size_in_chunks=None,
            kv_cache_spec=spec,
            manager_cls=self._manager,
        )

    def tracker(self, group: Any) -> Any:
        return self._tracker(self._config, {0: group.kv_event_group_spec})

    def raw(self, keys: tuple[OffloadKey, ...], removed: bool) -> Any:
        return self._event(keys=list(keys), medium=self._medium, removed=removed)


def load_vllm() -> tuple[Vllm | None, str]:
    """vLLM's side, or why it cannot run here."""
    try:
        return Vllm(), ""
    except ImportError as exc:
        return None, str(exc)


def build_trace(shape: Shape, n_requests: int, vllm: Vllm | None) -> list[Req]:
    """``n_requests`` distinct 1,024-token prompts (vLLM's token ids and sha256 block hashes
    where vLLM is importable, made-up hashes otherwise)."""
    n_tokens = shape.chunks_per_request * shape.tokens_per_chunk
    per_chunk = shape.blocks_per_chunk
    trace = []
    for i in range(n_requests):
        tokens = [(i * 7919 + j) % 32000 for j in range(n_tokens)]  # each prompt its own
        if vllm is not None:
            request = vllm.request(f"req-{i}", tokens, shape.tokens_per_block)
            live, hashes = request.all_token_ids, request.block_hashes
        else:
            request, live = None, tokens
            n_hashes = n_tokens // shape.tokens_per_block
            hashes = [hashlib.sha256(b"%d.%d" % (i, j)).digest() for j in range(n_hashes)]
        keys = tuple(
            make_offload_key(hashes[(c + 1) * per_chunk - 1], 0)
            for c in range(shape.chunks_per_request)
        )
        ends = tuple((c + 1) * shape.tokens_per_chunk for c in range(shape.chunks_per_request))
        trace.append(Req(f"req-{i}", live, hashes, keys, ends, request))
    return trace


class Step(NamedTuple):
    """One side's work of one scheduler step: seconds, events published, the batch's bytes."""

    removal: bool
    seconds: float
    events: int
    payload: bytes


class Pass:
    """One side's totals over a pass: seconds, events and wire bytes of the store steps and
    of the removal steps; and the payloads, when kept."""

    def __init__(self, keep: bool) -> None:
        self.seconds = [0.0, 0.0]
        self.events = [0, 0]
        self.bytes = [0, 0]
        self.payloads: list[bytes] | None = [] if keep else None

    def add(self, step: Step) -> None:
        self.seconds[step.removal] += step.seconds
        self.events[step.removal] += step.events
        self.bytes[step.removal] += len(step.payload)
        if self.payloads is not None:
            self.payloads.append(step.payload)


def steps_of(trace: list[Req]) -> list[list[Req]]:
    return [trace[i : i + PER_STEP] for i in range(0, len(trace), PER_STEP)]


def kvhex_steps(
    trace: list[Req], shape: Shape, provenance: Callable[[Req], Provenance]
) -> Iterator[Step]:
    """kvhex's side, step by step: each request's provenance (at ``on_new_request``) and its
    chunks' positions (at prepare time); at the step's end order, translate, encode. Then one
    removal step per request."""
    contexts = {r.req_id: ReqContext(r.req_id) for r in trace}
    announcer, translator = Announcer(), EventTranslator(shape.geometry, int_hashes=INT_HASHES)
    clock, now = time.perf_counter, time.time
    for step in steps_of(trace):
        at = [contexts[r.req_id] for r in step]
        raw = [Stored(r.keys, CPU, ctx) for r, ctx in zip(step, at, strict=True)]
        t0 = clock()
        for r, ctx in zip(step, at, strict=True):
            # on_new_request: what events are built from (the chunks' places are found
            # from the request's own hashes, as the vLLM adapter finds them)
            ctx.provenance = provenance(r)
        events = translator.translate(announcer.order(raw))  # take_events, step end
        payload = encode_batch(EventBatch(now(), events))
        yield Step(False, clock() - t0, len(events), payload)
    for r in trace:
        raw = [Removed(r.keys, CPU)]
        t0 = clock()
        events = translator.translate(announcer.order(raw))
        payload = encode_batch(EventBatch(now(), events))
        yield Step(True, clock() - t0, len(events), payload)


def vllm_steps(trace: list[Req], shape: Shape, vllm: Vllm) -> Iterator[Step]:
    """vLLM's side, step by step: ``record_store`` of each chunk (``_build_store_jobs``); at
    the step's end ``take_events`` and the publisher's encoding. Then one removal step per
    request."""
    group = vllm.group_config(shape)
    tracker, encoder, batch = vllm.tracker(group), vllm.encoder(), vllm.batch
    record = tracker.record_store
    clock, now = time.perf_counter, time.time
    for step in steps_of(trace):
        raw = [vllm.raw(r.keys, removed=False) for r in step]
        t0 = clock()
        for r in step:
            for chunk, key in enumerate(r.keys):
                record(r.vllm, group, chunk, key)
        events = list(tracker.take_events(raw))  # the connector's take_events, step end
        payload = encoder.encode(batch(ts=now(), events=events))  # as ZmqEventPublisher
        yield Step(False, clock() - t0, len(events), payload)
    for r in trace:
        raw = [vllm.raw(r.keys, removed=True)]
        t0 = clock()
        events = list(tracker.take_events(raw))
        payload = encoder.encode(batch(ts=now(), events=events))
        yield Step(True, clock() - t0, len(events), payload)


def run_pass(
    sides: dict[str, Callable[[], Iterator[Step]]], order: list[str], keep: bool = False
) -> dict[str, Pass]:
    """One pass of every side over the trace, interleaved step by step in ``order`` (each
    side's step runs right after the others' same step: load on the machine hits all alike)."""
    totals = {name: Pass(keep) for name in order}
    gc.collect()
    gc.freeze()  # long-lived state out of the collector's way, as vLLM's engine does
    try:
        steps = [sides[name]() for name in order]
        for done in zip(*steps, strict=True):
            for name, step in zip(order, done, strict=True):
                totals[name].add(step)
    finally:
        gc.unfreeze()
    return totals


def described_blocks(payloads: list[bytes]) -> list[tuple[Any, ...]]:
    """Every block the batches describe, one tuple per block (hash, parent, tokens, ...),
    and every removed hash: equal for two streams that announce the same blocks."""
    blocks: list[tuple[Any, ...]] = []
    for payload in payloads:
        for e in decode_batch(payload).events:
            if type(e).__name__ == "BlockRemoved":
                blocks.extend(("removed", h, e.medium) for h in e.block_hashes)
                continue
            parent, size = e.parent_block_hash, e.block_size
            for i, block_hash in enumerate(e.block_hashes):
                tokens = tuple(e.token_ids[i * size : (i + 1) * size])
                extra = e.extra_keys[i] if e.extra_keys else None
                blocks.append((block_hash, parent, tokens, size, e.medium, e.group_idx, extra))
                parent = block_hash
    return blocks


def bench_cost(shape: Shape, args: argparse.Namespace, vllm: Vllm | None, report: Report) -> None:
    """Both sides (and kvhex with LoRA + mm) over one trace of ``shape``, passes alternating."""
    n_requests = max(1, args.chunks // shape.chunks_per_request)
    trace = build_trace(shape, n_requests, vllm)
    n_chunks = n_requests * shape.chunks_per_request
    geometry = shape.geometry

    def plain(r: Req) -> Provenance:
        if vllm is not None:  # the vLLM adapter's own provenance of a live Request
            return vllm.provenance_of(r.vllm, geometry)
        return Provenance(geometry, r.tokens, r.hashes, device_events=True)

    def extras(r: Req) -> Provenance:
        feature = MmFeature(f"img-{r.req_id}", offset=40, length=64)
        return Provenance(
            geometry,
            r.tokens,
            r.hashes,
            lora_id=3,
            lora_name="adapter-a",
            mm_features=(feature,),
            device_events=True,
        )

    sides: dict[str, Callable[[], Iterator[Step]]] = {
        "kvhex": lambda: kvhex_steps(trace, shape, plain),
        "kvhex+": lambda: kvhex_steps(trace, shape, extras),
    }
    if vllm is not None:
        sides["vllm"] = lambda: vllm_steps(trace, shape, vllm)
    names = list(sides)
    first = run_pass(sides, names, keep=True)  # untimed: warms every side up
    if vllm is not None:
        ours = described_blocks(first["kvhex"].payloads or [])
        if ours != described_blocks(first["vllm"].payloads or []):
            raise SystemExit(f"{shape.label}: kvhex and vLLM announce different blocks")
    samples: dict[str, list[float]] = {}
    for p in range(args.repeats):
        turn = names[p % len(names) :] + names[: p % len(names)]  # each side first in turn
        for name, done in run_pass(sides, turn).items():
            stores, removals = done.seconds
            samples.setdefault(f"{name} stores", []).append(stores / n_chunks * 1e6)
            both = (stores + removals) / n_chunks * 1e6
            samples.setdefault(f"{name} removals", []).append(both)
        if vllm is not None:
            for case in ("stores", "removals"):
                theirs_us = samples[f"vllm {case}"][-1]
                for name in ("kvhex", "kvhex+"):
                    ratio = samples[f"{name} {case}"][-1] / theirs_us
                    samples.setdefault(f"ratio {name} {case}", []).append(ratio)
    r = summarize(samples)
    _emit_cost(shape, n_requests=n_requests, n_chunks=n_chunks, first=first, r=r, report=report)


def _emit_cost(
    shape: Shape,
    *,
    n_requests: int,
    n_chunks: int,
    first: dict[str, Pass],
    r: dict[str, float],
    report: Report,
) -> None:
    vllm = "vllm stores" in r
    report.say(
        f"{shape.label} per chunk, {shape.chunks_per_request} chunks per request: "
        f"{n_chunks:,} stored chunks of {n_requests:,} requests per pass"
    )
    report.say(f"  {'case':<24}{'kvhex us':>9}{'vLLM us':>9}{'ratio':>7}{'95% CI':>11}")
    cases = (
        ("stores", "kvhex", "stores", "full events per stored chunk"),
        ("stores + removals", "kvhex", "removals", "full events + removals per stored chunk"),
        ("stores, LoRA + 1 mm", "kvhex+", "stores", "full events with LoRA + mm per stored chunk"),
    )
    for label, side, case, row in cases:
        ours = r[f"{side} {case}"]
        theirs = r.get(f"vllm {case}")
        ratio = r.get(f"ratio {side} {case}")
        interval = (r.get(f"ratio {side} {case} low"), r.get(f"ratio {side} {case} high"))
        if vllm:
            figures = f"{theirs:>9.2f}{ratio:>7.2f}{interval_text(*interval):>11}"
        else:
            figures = f"{'-':>9}{'-':>7}{'-':>11}"
        report.say(f"  {label:<24}{ours:>9.2f}" + figures)
        baseline = VLLM if side == "kvhex" else f"{VLLM} (extra_keys deferred)"
        report.row(
            f"{row}, {shape.label}",
            ours,
            theirs,
            unit="us/chunk",
            baseline_name=baseline,
            ratio=ratio,
            interval=interval,
        )
    per = {name: _per_chunk(done, n_chunks) for name, done in first.items()}
    events = ", ".join(f"{WHO[n]} {per[n][0]}" for n in ("kvhex", "vllm") if n in per)
    wire = ", ".join(f"{WHO[n]} {per[n][1]}" for n in ("kvhex", "vllm", "kvhex+") if n in per)
    report.say(f"  events per stored chunk: {events}")
    report.say(f"  wire bytes per stored chunk: {wire}")
    ours_b = first["kvhex"].bytes[0] / n_chunks
    theirs_b = first["vllm"].bytes[0] / n_chunks if vllm else None
    if theirs_b:
        report.say(f"  wire bytes of stores, kvhex/vLLM: {ours_b / theirs_b:.2f}")
    report.row(
        f"wire bytes per stored chunk, {shape.label}",
        ours_b,
        theirs_b,
        unit="B/chunk",
        baseline_name=VLLM,
    )


WHO = {"kvhex": "kvhex", "vllm": "vLLM", "kvhex+": "kvhex with LoRA + mm"}


def _per_chunk(done: Pass, n_chunks: int) -> tuple[str, str]:
    """Events and wire bytes per stored chunk of one side's pass, stores (+ removals)."""
    (stores, removals), (b_stores, b_removals) = done.events, done.bytes
    return (
        f"{stores / n_chunks:.3f} (+{removals / n_chunks:.3f} removals)",
        f"{b_stores / n_chunks:,.0f} (+{b_removals / n_chunks:,.0f} removals)",
    )


def request(i: int, chunks: int, shape: Shape) -> tuple[ReqContext, list[OffloadKey]]:
    """A request of ``chunks`` chunks with a LoRA and a multimodal feature, its positions
    recorded, and its chunk keys (hashes made up: memory, not hashing, is measured)."""
    geometry = shape.geometry
    n_tokens = chunks * shape.tokens_per_chunk
    tokens = list(range(i, i + n_tokens))
    tph = shape.tokens_per_block
    hashes = [(i * 1_000_003 + j).to_bytes(32, "big") for j in range(n_tokens // tph)]
    prov = Provenance(
        geometry=geometry,
        token_ids=tokens,
        block_hashes=hashes,
        lora_id=3,
        lora_name="adapter-a",
        mm_features=(MmFeature(f"img-{i}", offset=40, length=64),),
        device_events=True,
    )
    ctx = ReqContext(f"req-{i}", provenance=prov)
    per_chunk = shape.blocks_per_chunk
    keys = [make_offload_key(hashes[(c + 1) * per_chunk - 1], 0) for c in range(chunks)]
    for c, key in enumerate(keys):  # as at prepare_store
        ctx.record_position(key, (c + 1) * shape.tokens_per_chunk)
    return ctx, keys


def snapshot(ctx: ReqContext, key: OffloadKey) -> tuple[Any, ...]:
    """What a snapshot design keeps per stored chunk until its last removal."""
    p = record_of(ctx, key)
    assert p is not None
    return (
        tuple(p.block_hashes),
        p.parent_block_hash,
        tuple(p.token_ids),
        p.block_size,
        p.lora_id,
        p.lora_name,
        tuple(p.extra_keys or ()),
        p.group_idx,
    )


MEMORY_CHUNKS = 8
"""Chunks per request of the memory section (16 blocks x 16 tokens each)."""


def retained_per_chunk(
    resident: int, build: Callable[[int], Any], keep: Callable[[list[Any]], Any]
) -> float:
    """Bytes still allocated per chunk once the requests are gone: ``keep(reqs)`` builds the
    event state from live requests (``build(i)`` each); then the requests (tokens, hashes,
    contexts) are dropped, as when they finished, and only what the event state still
    references remains."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    reqs = [build(i) for i in range(resident // MEMORY_CHUNKS)]
    state = keep(reqs)
    del reqs
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del state
    return retained / resident


def bench_memory(resident: int, vllm: Vllm | None, report: Report) -> None:
    shape = SHAPES[0]

    def build(i: int) -> tuple[ReqContext, list[OffloadKey]]:
        return request(i, MEMORY_CHUNKS, shape)

    def kvhex_state(reqs: list[tuple[ReqContext, list[OffloadKey]]]) -> tuple[Announcer, Any]:
        announcer, translator = Announcer(), EventTranslator(shape.geometry)
        raw = [Stored(tuple(keys), CPU, ctx) for ctx, keys in reqs]
        translator.translate(announcer.order(raw))
        return announcer, translator

    def snapshot_state(reqs: list[tuple[ReqContext, list[OffloadKey]]]) -> dict[bytes, Any]:
        return {k: snapshot(ctx, k) for ctx, keys in reqs for k in keys}

    ours = retained_per_chunk(resident, build, kvhex_state)
    theirs = retained_per_chunk(resident, build, snapshot_state)
    report.say(
        f"event state for {resident:,} resident chunks of finished requests: kvhex "
        f"{ours:,.0f} B/chunk (announcer + detached hashes), snapshot design "
        f"{theirs:,.0f} B/chunk, ratio {ours / theirs:.3f}"
    )
    report.row(
        "retained event state per resident chunk",
        ours,
        theirs,
        unit="B/chunk",
        baseline_name="snapshot-payload design",
    )
    if vllm is None:
        return
    group = vllm.group_config(shape)
    n_tokens = MEMORY_CHUNKS * shape.tokens_per_chunk

    def vllm_build(i: int) -> Any:
        return vllm.request(f"req-{i}", list(range(i, i + n_tokens)), shape.tokens_per_block)

    def vllm_state(reqs: list[Any]) -> Any:
        tracker = vllm.tracker(group)
        per_chunk = shape.blocks_per_chunk
        raw = []
        for req in reqs:
            keys = [
                make_offload_key(req.block_hashes[(c + 1) * per_chunk - 1], 0)
                for c in range(MEMORY_CHUNKS)
            ]
            for c, key in enumerate(keys):
                tracker.record_store(req, group, c, key)
            raw.append(vllm.raw(tuple(keys), removed=False))
        for _ in tracker.take_events(raw):
            pass
        return tracker

    real = retained_per_chunk(resident, vllm_build, vllm_state)
    report.say(
        f"  vLLM's OffloadingEventsTracker, the same chunks (no LoRA or mm feature): "
        f"{real:,.0f} B/chunk, kvhex/vLLM {ours / real:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chunks", type=int, default=8192, help="stored chunks per pass and chunk shape"
    )
    parser.add_argument(
        "--resident", type=int, default=40_000, help="resident chunks of the memory section"
    )
    add_repeats(parser)
    args = parse(parser, QUICK)
    report = Report("events", args)
    vllm, why = load_vllm()
    if vllm is None:
        report.say(
            f"vllm: not importable ({why}): vLLM's side not measured "
            "(run it with .venv-vllm/bin/python)"
        )
    else:
        if vllm.int_hashes != INT_HASHES:
            raise SystemExit("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES read differently")
        report.say(
            f"vllm {vllm.version}: OffloadingEventsTracker fed real vllm.v1.request.Request "
            "objects (sha256 block hashes); both sides checked to announce the same blocks"
        )
    report.say(
        f"{PER_STEP} requests per step; timed passes: {args.repeats}, the sides interleaved "
        "step by step; "
        f"hashes published as {'64-bit ints' if INT_HASHES else 'bytes'} "
        "(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); us per stored chunk"
    )
    for shape in SHAPES:
        bench_cost(shape, args, vllm, report)
    bench_memory(args.resident, vllm, report)
    report.finish()


if __name__ == "__main__":
    main()
