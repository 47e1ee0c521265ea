"""Playing an engine against kvhex: scheduler-side calls on an ``OffloadEngine`` and
worker-side copies through a ``BlockTransfer`` over a device KV cache.

Per request: look its full chunks up (stepping the engine while promotions or probes are in
flight), load the hit prefix from host slots into device blocks and check every loaded block
against the bytes that were stored for its key, "compute" the rest (write the bytes its keys
stand for), store the new chunks, finish the request. The device cache is not a prefix cache:
every hit comes from the offload tiers, so they are exercised on every turn.

A block's bytes are a function of its key, layer and position (a random base page XOR the
key's first 8 bytes and the block index, tiled): a block loaded under the wrong key, torn, or
from the wrong layer never compares equal.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from kvhex.domain.events import AllBlocksCleared, BlockRemoved, BlockStored, PublicEvent
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.jobs import JobId
from kvhex.domain.keys import OffloadKey, make_offload_key
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult
from kvhex.domain.transfer import TransferJob, TransferKind, TransferResult
from kvhex.errors import ConfigError
from kvhex.ports.transfer import BlockTransfer
from kvhex.service.engine import OffloadEngine
from kvhex.sim.workload import Request, context

TIER_FAILURES = (
    "puts_failed",
    "gets_failed",
    "probes_failed",
    "submit_errors",
    "poll_errors",
)
"""The counters of a secondary tier (``TierStats``) that mean its storage failed a job."""

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS


@attrs.define
class Direction:
    """Bytes moved one way and the time spent moving them."""

    nbytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float | None:
        """GB/s, or ``None`` when nothing moved."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 and self.nbytes else None


@attrs.define
class RunReport:
    """What a replay did and saw. ``tiers`` maps a tier name to ``(put, get)``."""

    requests: int = 0
    tokens: int = 0
    chunks: int = 0
    hits: Counter[str] = attrs.field(factory=Counter)
    """Chunks served, by where they came from (``host``, or a secondary tier's name)."""
    stores: int = 0
    device_store: Direction = attrs.field(factory=Direction)
    device_load: Direction = attrs.field(factory=Direction)
    tiers: dict[str, tuple[Direction, Direction]] = attrs.field(factory=dict)
    events: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    """Public events by (type, medium)."""
    placeholders: int = 0
    blocks_checked: int = 0
    blocks_bad: int = 0
    failed_transfers: int = 0
    tier_failures: dict[str, dict[str, int]] = attrs.field(factory=dict)
    """Per secondary tier, its non-zero :data:`TIER_FAILURES` counters (a full disk, a store
    that went away)."""
    seconds: float = 0.0
    tokens_per_chunk: int = 0

    @property
    def intact(self) -> bool:
        """No loaded block differed from the stored one, and no copy failed."""
        return self.blocks_bad == 0 and self.failed_transfers == 0

    @property
    def verdict(self) -> str:
        """``intact`` (blocks were checked, all equal), ``CORRUPT``, or ``unchecked`` (no
        block was loaded back, so nothing could be compared)."""
        if not self.intact:
            return "CORRUPT"
        return "intact" if self.blocks_checked else "unchecked"

    @property
    def ok(self) -> bool:
        """Nothing went wrong: intact (or unchecked) and no tier job failed."""
        return self.intact and not self.tier_failures

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        hit_total = sum(self.hits.values())
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "chunks_looked_up": self.chunks,
            "chunk_hit_rate": hit_total / self.chunks if self.chunks else 0.0,
            "hits": {
                source: {
                    "chunks": n,
                    "rate": n / self.chunks if self.chunks else 0.0,
                    "tokens": n * self.tokens_per_chunk,
                }
                for source, n in sorted(self.hits.items())
            },
            "chunks_stored": self.stores,
            "transfers": {
                "device->host": _direction(self.device_store),
                "host->device": _direction(self.device_load),
                **{
                    f"{name} {way}": _direction(d)
                    for name, (put, get) in self.tiers.items()
                    for way, d in (("put", put), ("get", get))
                },
            },
            "events": {f"{kind} {medium}": n for (kind, medium), n in sorted(self.events.items())},
            "placeholder_events": self.placeholders,
            "integrity": {
                "blocks_checked": self.blocks_checked,
                "blocks_bad": self.blocks_bad,
                "failed_transfers": self.failed_transfers,
                "verdict": self.verdict,
            },
            "tier_failures": self.tier_failures,
            "seconds": self.seconds,
        }


def _direction(d: Direction) -> dict[str, Any]:
    return {"bytes": d.nbytes, "seconds": d.seconds, "gbps": d.gbps}


class Replay:
    """Replays requests through ``engine`` with ``transfer`` moving blocks between
    ``kv_caches`` (one ``(num_blocks, page_bytes)`` uint8 tensor per layer, one KV group) and
    the engine's host slots."""

    def __init__(
        self,
        engine: OffloadEngine,
        transfer: BlockTransfer,
        kv_caches: Sequence[torch.Tensor],
        geometry: KvGeometry,
        *,
        seed: int = 0,
        tier_names: Sequence[str] = (),
        step_wait_s: float = 0.0005,
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.kv = list(kv_caches)
        self.group = geometry.groups[0]
        self.geometry = geometry
        self.bpc = self.group.blocks_per_chunk
        self.tokens_per_chunk = self.group.tokens_per_chunk
        self.page = int(self.kv[0].shape[1])
        if self.page % 8:
            raise ValueError(f"page_bytes must be a multiple of 8, got {self.page}")
        self.num_blocks = int(self.kv[0].shape[0])
        gen = torch.Generator().manual_seed(seed)
        device = self.kv[0].device
        self.base = [
            torch.randint(0, 256, (self.page,), dtype=torch.uint8, generator=gen).to(device)
            for _ in self.kv
        ]
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.report = RunReport(tokens_per_chunk=self.tokens_per_chunk)
        self.tier_names = list(tier_names)
        self._next_job = 0
        self._results: dict[JobId, TransferResult] = {}
        self._step_wait = step_wait_s

    # -- one request ---------------------------------------------------------------------
    def run_request(self, request: Request) -> None:
        """Replay one request to completion (its stores are handed to the engine)."""
        engine = self.engine
        ctx = context(request, self.geometry)
        engine.on_new_request(ctx)
        n = len(request.tokens) // self.tokens_per_chunk
        hashes = ctx.provenance.block_hashes if ctx.provenance else []
        per_chunk = self.tokens_per_chunk // self.geometry.tokens_per_hash
        keys = [
            make_offload_key(hashes[(i + 1) * per_chunk - 1], self.group.group_idx)
            for i in range(n)
        ]
        promoted_before = self._promoted()
        hits = self._lookup(keys, ctx)
        blocks = self._take_blocks(n * self.bpc)
        try:
            if hits:
                engine.touch(keys[:hits], ctx)
                slots = engine.prepare_load(keys[:hits], ctx)
                ok = self._copy(TransferKind.LOAD, slots, blocks[: hits * self.bpc])
                engine.complete_load(keys[:hits], ctx)
                if ok:
                    self._check(keys[:hits], blocks)
            self._compute(keys[hits:], blocks[hits * self.bpc :])
            plan = engine.prepare_store(keys[hits:], ctx)
            if plan is not None and plan.keys:
                index = {k: i * self.bpc for i, k in enumerate(keys)}
                bpc = self.bpc
                chunk_blocks = [b for k in plan.keys for b in blocks[index[k] : index[k] + bpc]]
                ok = self._copy(TransferKind.STORE, plan.slots, chunk_blocks)
                engine.complete_store(plan.keys, ctx, success=ok)
                self.report.stores += len(plan.keys) if ok else 0
        finally:
            engine.on_request_finished(ctx)
            self.free.extend(blocks)
        # chunks promoted while this request looked up were promoted for it
        from_tiers = 0
        for name, before, after in zip(
            self.tier_names, promoted_before, self._promoted(), strict=True
        ):
            gained = min(after - before, hits - from_tiers)
            if gained > 0:
                self.report.hits[name] += gained
                from_tiers += gained
        if hits - from_tiers:
            self.report.hits["host"] += hits - from_tiers
        self.report.requests += 1
        self.report.tokens += len(request.tokens)
        self.report.chunks += n
        self.step()

    def _lookup(self, keys: list[OffloadKey], ctx: ReqContext) -> int:
        """Leading chunks that are readable, stepping the engine while answers are pending.

        As vLLM's scheduler does: each pass asks every key until the first miss (a pending
        answer does not stop it, so every tier probe and load decision of the prefix starts
        in the same step), and repeats while any answer was pending."""
        deadline = time.monotonic() + 30
        while True:
            leading = 0  # HITs before the first other answer
            pending = False
            for key in keys:
                result = self.engine.lookup(key, ctx)
                if result is _MISS:
                    break
                if result is _HIT:
                    leading += 0 if pending else 1
                else:
                    pending = True
            if not pending or time.monotonic() > deadline:
                return leading  # never settled: what is readable now, the rest recomputed
            self.step()
            time.sleep(self._step_wait)

    # -- device blocks -------------------------------------------------------------------
    def _take_blocks(self, n: int) -> list[int]:
        if n > len(self.free):  # a workload checked against the device cache never gets here
            raise ConfigError(
                [
                    (
                        "$.run.device_blocks",
                        f"a request needs {n} device blocks, more than the {len(self.free)} "
                        f"[run].device_blocks holds: raise it to at least {n}",
                    )
                ]
            )
        return [self.free.pop() for _ in range(n)]

    def _patterns(self, keys: Sequence[OffloadKey]) -> torch.Tensor:
        """Eight bytes per block of ``keys``' chunks, from the key and the block's index:
        ``(n * bpc, 1, 8)``."""
        words = [
            int.from_bytes(bytes(k[:8]), "little") ^ (j * 0x9E3779B97F4A7C15 % (1 << 64))
            for k in keys
            for j in range(self.bpc)
        ]
        raw = b"".join(w.to_bytes(8, "little") for w in words)
        pattern = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return pattern.view(-1, 1, 8).to(self.base[0].device)

    def _expected(self, patterns: torch.Tensor, layer: int) -> torch.Tensor:
        """The bytes of those blocks in ``layer``: its base page XOR the tiled patterns."""
        base = self.base[layer].view(1, self.page // 8, 8)
        return (base ^ patterns).view(-1, self.page)

    def _compute(self, keys: Sequence[OffloadKey], blocks: list[int]) -> None:
        if not keys:
            return
        patterns = self._patterns(keys)
        index = torch.tensor(blocks[: len(keys) * self.bpc], device=self.kv[0].device)
        for layer, cache in enumerate(self.kv):
            cache.index_copy_(0, index, self._expected(patterns, layer))

    def _check(self, keys: Sequence[OffloadKey], blocks: list[int]) -> None:
        patterns = self._patterns(keys)
        index = torch.tensor(blocks[: len(keys) * self.bpc], device=self.kv[0].device)
        for layer, cache in enumerate(self.kv):
            got = cache.index_select(0, index)
            self.report.blocks_bad += int((got != self._expected(patterns, layer)).any(dim=1).sum())
        self.report.blocks_checked += len(keys) * self.bpc * len(self.kv)

    def _copy(self, kind: TransferKind, slots: Sequence[int], blocks: list[int]) -> bool:
        """One whole-chunk copy, waited for; False when it failed."""
        job_id = JobId(self._next_job)
        self._next_job += 1
        job = TransferJob(job_id, kind, slots, blocks)
        if kind is TransferKind.STORE:
            self.transfer.submit_store(job)
        else:
            self.transfer.submit_load(job)
        self.transfer.wait([job_id])
        while job_id not in self._results:
            for result in self.transfer.poll():
                self._results[result.job_id] = result
        result = self._results.pop(job_id)
        report = self.report
        direction = report.device_store if kind is TransferKind.STORE else report.device_load
        if result.success:
            direction.nbytes += result.nbytes
            direction.seconds += result.seconds or 0.0
        else:
            self.report.failed_transfers += 1
        return result.success

    # -- engine steps --------------------------------------------------------------------
    def step(self) -> None:
        """End a scheduler step: the engine submits and polls tier jobs; events are counted."""
        self.engine.on_schedule_end()
        self._count(self.engine.take_events())

    def drain(self, timeout_s: float = 60.0) -> None:
        """Step until the engine has no work in flight (cascades finished)."""
        deadline = time.monotonic() + timeout_s
        while self.engine.has_pending_work() and time.monotonic() < deadline:
            self.step()
            time.sleep(self._step_wait)
        self.step()

    def _count(self, events: list[PublicEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.report.events["BlockStored", event.medium or "-"] += 1
                self.report.placeholders += event.is_placeholder
            elif isinstance(event, BlockRemoved):
                self.report.events["BlockRemoved", event.medium or "-"] += 1
            elif isinstance(event, AllBlocksCleared):
                self.report.events["AllBlocksCleared", "-"] += 1

    def _promoted(self) -> list[int]:
        return [t.keys_promoted for t in self.engine.stats().tiers]

    def finish(self) -> RunReport:
        """Fill in the tiers' traffic and failures; call after ``drain``."""
        for t in self.engine.stats().tiers:
            self.report.tiers[t.name] = (
                Direction(t.bytes_put, t.put_seconds),
                Direction(t.bytes_got, t.get_seconds),
            )
            failed = {name: getattr(t, name) for name in TIER_FAILURES if getattr(t, name)}
            if failed:
                self.report.tier_failures[t.name] = failed
        return self.report


def run_all(
    replay: Replay,
    requests: Iterable[Request],
    *,
    duration_s: float | None = None,
    total: int | None = None,
    progress: Callable[[Replay, int, int | None], None] | None = None,
) -> RunReport:
    """Replay ``requests`` in order, taking each only when its turn comes (an endless
    iterator is fine with ``duration_s``), stopping once ``duration_s`` has passed; drain the
    engine and report. ``total`` is what ``progress`` is told the run aims at."""
    start = time.perf_counter()
    deadline = None if duration_s is None else start + duration_s
    for i, request in enumerate(requests):
        replay.run_request(request)
        if progress is not None:
            progress(replay, i + 1, total)
        if deadline is not None and time.perf_counter() >= deadline:
            break
    replay.drain()
    report = replay.finish()
    report.seconds = time.perf_counter() - start
    return report
