"""A hypothesis state machine over one primary and two in-memory secondary tiers: random
interleavings of store, completion (ok or failed), lookup with promotion, device loads, step
end, request finish, reset and injected faults. Checked at every step: ref counts never below
-1; eviction only ever takes evictable chunks; every readable host slot holds exactly the bytes
stored for its key; replaying the raw events per (medium, ownership) reproduces each tier's
resident key set; every Stored names the request whose work stored it. And for the public
events: a consumer that reference-counts announcements per (medium, ownership) and ignores
removals of unknown hashes reconstructs exactly each tier's resident block hashes, and every
full BlockStored's hashes recompute from its tokens, parent and extra keys."""

from __future__ import annotations

from collections.abc import Container

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain import (
    Cleared,
    LookupResult,
    LruPolicy,
    OffloadKey,
    PrimaryTier,
    Removed,
    ReqContext,
    Stored,
)
from kvhex.domain.events import BlockRemoved, BlockStored
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.translate import EventTranslator
from kvhex.service import TieringManager
from tests.domain.requests import make_request, recompute
from tests.service.harness import SLOT_BYTES, payload

GROUP = KvGroup(0, tokens_per_block=4)
GEOMETRY = KvGeometry((GROUP,), tokens_per_hash=4)
# one shared document of 12 chunks: every request is a prefix of it (hashes chain)
DOCUMENT = make_request("doc", list(range(1000, 1048)), GEOMETRY)
assert DOCUMENT.provenance is not None
DOC_HASHES = list(DOCUMENT.provenance.block_hashes)


def key(n: int) -> OffloadKey:
    """Chunk ``n`` of the shared document."""
    return OffloadKey(DOC_HASHES[n] + b"\0\0\0\0")


SLOTS = 6
IDS = st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True)


class CheckedLru(LruPolicy):
    """LRU that verifies, at the moment of eviction, that every victim is evictable."""

    tier: PrimaryTier | None = None

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        victims = super().evict(n, protected)
        if victims is not None and self.tier is not None:
            for victim in victims:
                assert self.tier.ref_count(victim) == 0, "evicted a pinned or pending chunk"
                assert victim not in protected
        return victims


class TieringMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.host = MemoryHostBuffer(SLOTS, SLOT_BYTES)
        policy = CheckedLru(SLOTS)
        self.primary = PrimaryTier(SLOTS, policy)
        policy.tier = self.primary
        self.tiers = [
            MemoryTierStore(
                self.host, capacity_bytes=cap * SLOT_BYTES, name=f"m{i}", complete_after_polls=polls
            )
            for i, (cap, polls) in enumerate([(5, 1), (9, 2)])
        ]
        self.manager = TieringManager(self.primary, self.tiers, host=self.host)
        self.requests: list[ReqContext] = []
        self.all_contexts: list[ReqContext] = []
        self.outstanding: list[tuple[ReqContext, list[OffloadKey]]] = []
        self.replayed: dict[tuple[str, str | None], set[OffloadKey]] = {}
        self.translator = EventTranslator(GEOMETRY)
        self.counts: dict[tuple[str | None, str | None], dict[bytes | int, int]] = {}
        for _ in range(3):
            self._new_request()

    def _ctx(self, i: int) -> ReqContext:
        return self.requests[i % len(self.requests)]

    def _new_request(self) -> None:
        n = len(self.all_contexts)
        # ids repeat (identity matters); every fourth request is external work with no
        # provenance (its events are placeholders)
        prov = None if n % 4 == 3 else DOCUMENT.provenance
        ctx = ReqContext(f"r{n % 3}", provenance=prov)
        self.manager.on_new_request(ctx)
        self.requests.append(ctx)
        self.all_contexts.append(ctx)

    @rule()
    def new_request(self) -> None:
        self._new_request()

    @precondition(lambda self: self.requests)
    @rule(
        i=st.integers(0, 10),
        start=st.integers(0, 8),
        n=st.integers(1, 4),
        then=st.sampled_from(["ok", "ok", "fail", "later"]),
    )
    def store(self, i: int, start: int, n: int, then: str) -> None:
        ctx = self._ctx(i)
        ids = range(start, start + n)
        plan = self.manager.prepare_store([key(n) for n in ids], ctx)
        if plan is None:
            return
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            self.host.slot_view(slot)[:] = payload(k)  # the device writes the chunk
        if then == "later":
            self.outstanding.append((ctx, plan.keys))
        else:
            self.manager.complete_store(plan.keys, ctx, then == "ok")

    @precondition(lambda self: self.outstanding)
    @rule(i=st.integers(0, 10), ok=st.booleans())
    def complete_store(self, i: int, ok: bool) -> None:
        ctx, plan_keys = self.outstanding.pop(i % len(self.outstanding))
        self.manager.complete_store(plan_keys, ctx, ok)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 10), n=st.integers(1, 8), patience=st.integers(0, 3))
    def lookup_and_load(self, i: int, n: int, patience: int) -> None:
        """A request looks up its prefix (chunks 0..n-1) as an engine does: while the answer
        is RETRY or HIT_PENDING it waits up to ``patience`` steps, then loads the hit prefix."""
        ctx = self._ctx(i)
        waiting = (LookupResult.RETRY, LookupResult.HIT_PENDING)
        for _ in range(patience + 1):
            answers = [self.manager.lookup(key(k), ctx) for k in range(n)]
            if not any(a in waiting for a in answers):
                break
            self.manager.on_schedule_end()
        hits = [key(k) for k, a in enumerate(answers) if a is LookupResult.HIT]
        if hits:
            slots = self.manager.prepare_load(hits, ctx)
            for k, slot in zip(hits, slots, strict=True):
                assert bytes(self.host.slot_view(slot)) == payload(k), "wrong bytes loaded"
            self.manager.touch(hits, ctx)
            self.manager.complete_load(hits, ctx)

    @rule(n=st.integers(1, 3))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.manager.on_schedule_end()

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 10))
    def finish(self, i: int) -> None:
        ctx = self.requests.pop(i % len(self.requests))
        self.manager.on_request_finished(ctx)

    @rule()
    def reset(self) -> None:
        self.manager.reset()
        self.outstanding.clear()  # the engine drops completions from before a reset

    @rule(tier=st.integers(0, 1), kind=st.sampled_from(["put", "get", "partial", "probe"]), ids=IDS)
    def inject_fault(self, tier: int, kind: str, ids: list[int]) -> None:
        store = self.tiers[tier]
        if kind == "put":
            store.fail_next_puts()
        elif kind == "get":
            store.fail_next_gets()
        elif kind == "probe":
            store.fail_next_probes()
        else:
            store.partial_next_get([key(n) for n in ids])

    @invariant()
    def ref_counts_are_sane(self) -> None:
        for k in (key(n) for n in range(12)):
            ref = self.primary.ref_count(k)
            assert ref is None or ref >= -1

    @invariant()
    def readable_host_slots_hold_the_stored_bytes(self) -> None:
        for n in range(12):
            k = key(n)
            ref = self.primary.ref_count(k)
            if ref is not None and ref >= 0:
                slot = self.primary.slot_of(k)
                assert slot is not None
                assert bytes(self.host.slot_view(slot)) == payload(k)

    @invariant()
    def replayed_events_reproduce_every_tier(self) -> None:
        raw = self.manager.take_events()
        self._replay_public(self.translator.translate(list(raw)))
        for event in raw:
            where = (event.tier.medium.name, event.tier.ownership)
            resident = self.replayed.setdefault(where, set())
            if isinstance(event, Stored):
                assert event.ctx is not None
                assert any(event.ctx is c for c in self.all_contexts), "foreign context"
                resident.update(event.keys)
            elif isinstance(event, Removed):
                resident.difference_update(event.keys)
            else:
                assert isinstance(event, Cleared)
                resident.clear()
        refs = {key(n): self.primary.ref_count(key(n)) for n in range(12)}
        readable = {k for k, ref in refs.items() if ref is not None and ref >= 0}
        assert self.replayed.get(("CPU", None), set()) == readable
        for store in self.tiers:
            where = (store.identity.medium.name, store.identity.ownership)
            assert self.replayed.get(where, set()) == set(store.keys())
        self._check_public(("CPU", None), readable)
        for store in self.tiers:
            self._check_public(
                (store.identity.medium.name, store.identity.ownership), set(store.keys())
            )

    def _replay_public(self, events: list[object]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                counts = self.counts.setdefault((event.medium, event.ownership), {})
                for h in event.block_hashes:
                    counts[h] = counts.get(h, 0) + 1
                if not event.is_placeholder:
                    assert event.token_ids, "a full store names its tokens"
                    got = recompute(
                        event.parent_block_hash,
                        event.token_ids,  # type: ignore[arg-type]
                        event.block_size,
                        event.extra_keys,
                        len(event.block_hashes),
                    )
                    assert got == event.block_hashes, "hashes do not recompute"
            elif isinstance(event, BlockRemoved):
                counts = self.counts.setdefault((event.medium, event.ownership), {})
                for h in event.block_hashes:
                    if counts.get(h, 0) > 0:  # removals of unknown hashes are ignored
                        counts[h] -= 1

    def _check_public(self, where: tuple[str, str | None], keys: set[OffloadKey]) -> None:
        counts = self.counts.get(where, {})
        published = {h for h, n in counts.items() if n > 0}
        assert published == {k[:-4] for k in keys}, f"public replay differs on {where}"

    def teardown(self) -> None:
        self.manager.shutdown()


TestTieringMachine = TieringMachine.TestCase
TestTieringMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
