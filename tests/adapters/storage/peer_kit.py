"""What the record and peer-view tests share: requests whose chunks a tier stores with their
context, jobs run to completion, events collected until a condition holds, and the public
blocks a stream of raw events announces (through the announcer and the translator, as an
engine announces them)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from kvhex.domain import JobId, JobKind, JobResult, OffloadKey, ReqContext, TierJob
from kvhex.domain.announce import Announcer
from kvhex.domain.events import BlockStored, Removed, Stored, TierEvent
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.tiers import TierIdentity
from kvhex.domain.translate import EventTranslator
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from tests.domain.requests import chunk_key, make_request

TierStoreT = TypeVar("TierStoreT", bound=TierStore)
GROUP = KvGroup(0, tokens_per_block=4, blocks_per_chunk=2)
GEO = KvGeometry((GROUP,), tokens_per_hash=4)
DEADLINE_S = 30.0
_ids = itertools.count(50_000)

Block = tuple[Any, ...]
"""One published block: its hash, parent hash, tokens, block size, extra keys, group, kind,
window, LoRA id and name."""


def request(
    req_id: str, chunks: int, base: int = 1000, **prov: Any
) -> tuple[ReqContext, list[OffloadKey]]:
    """A request of ``chunks`` whole chunks (token ids from ``base``) and their keys."""
    ctx = make_request(
        req_id, list(range(base, base + chunks * GROUP.tokens_per_chunk)), GEO, **prov
    )
    return ctx, [chunk_key(ctx, c, GROUP) for c in range(chunks)]


def fill(host: HostBuffer, slots: Iterable[int], seed: int) -> None:
    for s in slots:
        host.slot_view(s)[:] = bytes([(seed + s) % 251]) * host.slot_bytes


def started(store: TierStoreT) -> TierStoreT:
    """``store`` once the blocks it adopted at start-up are announced (an object store reads
    their records after start-up): drained and polled."""
    store.drain()
    assert store.poll() == []
    return store


def run_job(store: TierStore, job: TierJob) -> JobResult:
    """Submit ``job`` and poll until its result."""
    submit = {
        JobKind.PUT: store.submit_put,
        JobKind.GET: store.submit_get,
        JobKind.PROBE: store.submit_probe,
    }[job.kind]
    submit(job)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        for result in store.poll():
            assert result.job_id == job.job_id
            return result
        time.sleep(0.002)
    raise AssertionError(f"job {job.job_id} never finished")


def put(
    store: TierStore, keys: list[OffloadKey], ctx: ReqContext | None, slots: list[int] | None = None
) -> JobResult:
    slots = list(range(len(keys))) if slots is None else slots
    return run_job(store, TierJob(JobId(next(_ids)), JobKind.PUT, tuple(keys), tuple(slots), ctx))


def get(store: TierStore, keys: list[OffloadKey], slots: list[int]) -> JobResult:
    return run_job(store, TierJob(JobId(next(_ids)), JobKind.GET, tuple(keys), tuple(slots)))


class Events:
    """The events a tier announced so far, per identity, replayed as residencies."""

    def __init__(self, store: TierStore) -> None:
        self.store = store
        self.raw: list[TierEvent] = []
        self.resident: dict[TierIdentity, set[OffloadKey]] = {}

    def take(self) -> list[TierEvent]:
        """Poll the tier once and take its events (replayed: a Stored of a key already
        resident, or a Removed of one that is not, fails the test)."""
        self.store.poll()
        events = self.store.take_events()
        for event in events:
            held = self.resident.setdefault(event.tier, set())
            if isinstance(event, Stored):
                again = held.intersection(event.keys)
                assert not again, f"stored twice on {event.tier}"
                held.update(event.keys)
            elif isinstance(event, Removed):
                absent = set(event.keys) - held
                assert not absent, f"removed while not stored on {event.tier}"
                held.difference_update(event.keys)
        self.raw += events
        return events

    def until(self, check: Callable[[], bool], what: str) -> None:
        """Take events until ``check()`` holds (polling the tier), or fail naming ``what``."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            self.take()
            if check():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"never: {what}")
            time.sleep(0.005)

    def held(self, tier: TierIdentity) -> set[OffloadKey]:
        return self.resident.get(tier, set())

    def stores(self, tier: TierIdentity) -> list[Stored]:
        return [e for e in self.raw if isinstance(e, Stored) and e.tier == tier]


def parent_first_in_each(stores: list[Stored], chain: list[OffloadKey]) -> bool:
    """Whether each of ``stores`` names the keys of ``chain`` it holds in chain order (a
    scan that saw a job's blocks half-published announces them in two events)."""
    return all(
        (at := [chain.index(k) for k in event.keys if k in chain]) == sorted(at) for event in stores
    )


def blocks(raw: Iterable[TierEvent]) -> tuple[dict[bytes, Block], list[bytes]]:
    """The full blocks and the placeholder hashes ``raw`` announces (ordered and deduplicated
    by an announcer, translated), whatever tier announced them."""
    events = EventTranslator(GEO).translate(Announcer().order(raw))
    full: dict[bytes, Block] = {}
    placeholders: list[bytes] = []
    for event in events:
        if not isinstance(event, BlockStored):
            continue
        if not event.token_ids:
            placeholders += [bytes(h) for h in event.block_hashes]
            continue
        size = event.block_size
        assert len(event.token_ids) == size * len(event.block_hashes)  # what routers require
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            full[bytes(h)] = (
                parent,
                event.token_ids[i * size : (i + 1) * size],
                size,
                event.extra_keys[i] if event.extra_keys else None,
                event.group_idx,
                event.kv_cache_spec_kind,
                event.kv_cache_spec_sliding_window,
                event.lora_id,
                event.lora_name,
            )
            parent = h
    return full, placeholders
