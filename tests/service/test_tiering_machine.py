"""A hypothesis state machine over one primary and two in-memory secondary tiers: random
interleavings of store, completion (ok or failed), lookup with promotion, device loads, step
end, request finish, reset and injected faults. Checked at every step: ref counts never below
-1; eviction only ever takes evictable chunks; every readable host slot holds exactly the bytes
stored for its key; replaying the raw events per tier reproduces each tier's resident key set;
every Stored names the request whose work stored it.

And for the public events, announced as an engine announces them (the ``Announcer`` of
``announcer_for``: no ownership names, so both secondary tiers are one residency, STORAGE
LOCAL): the stream is parent-first (every full BlockStored's parent is announced in some
residency and not removed since, as a radix-tree index needs); a consumer that keeps a plain
set per residency (stores add, removals delete, no reference counts: Dynamo's indexer)
reconstructs exactly what the tiers hold there, less the keys waiting for their parent, and a
key waits only while its parent is announced nowhere; every full BlockStored's hashes
recompute from its tokens, parent and extra keys."""

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
from kvhex.domain.tiers import TierIdentity
from kvhex.domain.translate import EventTranslator
from kvhex.service import TieringManager
from kvhex.service.engine import announcer_for
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
        self.replayed: dict[TierIdentity, set[OffloadKey]] = {}
        self.announcer = announcer_for(self.tiers)
        self.translator = EventTranslator(GEOMETRY)
        self.public: dict[tuple[str | None, str | None, str | None], set[bytes | int]] = {}
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
        for event in raw:
            resident = self.replayed.setdefault(event.tier, set())
            if isinstance(event, Stored):
                assert event.ctx is not None
                assert any(event.ctx is c for c in self.all_contexts), "foreign context"
                resident.update(event.keys)
            elif isinstance(event, Removed):
                resident.difference_update(event.keys)
            else:
                assert isinstance(event, Cleared)
                resident.clear()
        self._replay_public(self.translator.translate(self.announcer.order(raw)))
        refs = {key(n): self.primary.ref_count(key(n)) for n in range(12)}
        readable = {k for k, ref in refs.items() if ref is not None and ref >= 0}
        host = self.primary.identity
        assert self.replayed.get(host, set()) == readable
        for store in self.tiers:
            assert self.replayed.get(store.identity, set()) == set(store.keys())
        self._check_public(host, [(host, readable)])
        storage = self.tiers[0].identity
        self._check_public(storage, [(t.identity, set(t.keys())) for t in self.tiers])

    def _replay_public(self, events: list[object]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                where = (event.medium, event.locality, event.ownership)
                assert event.ownership is None, "an ownership name reached the stream"
                if not event.is_placeholder:
                    parent = event.parent_block_hash
                    assert parent is None or any(parent in s for s in self.public.values()), (
                        "a block announced before its parent"
                    )
                    assert event.token_ids, "a full store names its tokens"
                    got = recompute(
                        parent,  # type: ignore[arg-type]
                        event.token_ids,
                        event.block_size,
                        event.extra_keys,
                        len(event.block_hashes),
                    )
                    assert got == event.block_hashes, "hashes do not recompute"
                self.public.setdefault(where, set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                where = (event.medium, event.locality, event.ownership)
                self.public.setdefault(where, set()).difference_update(event.block_hashes)

    def _check_public(
        self, where: TierIdentity, tiers: list[tuple[TierIdentity, set[OffloadKey]]]
    ) -> None:
        """What a set-keeping consumer holds on ``where``'s public residency is what the tiers
        announced there hold, less their keys waiting for a parent announced nowhere."""
        expected: set[OffloadKey] = set()
        for tier, keys in tiers:
            waiting = self.announcer.waiting(tier)
            for k in waiting:
                n = DOC_HASHES.index(k[:-4])
                assert n > 0, "a request's first chunk waits"
                assert not self.announcer.is_announced(key(n - 1)), (
                    "a key waits though its parent is announced"
                )
            expected |= keys - waiting
        public = self.announcer.public(where)
        locality = public.locality.value if public.locality else None
        published = self.public.get((public.medium.name, locality, public.ownership), set())
        assert published == {k[:-4] for k in expected}, f"public replay differs on {public}"

    def teardown(self) -> None:
        self.manager.shutdown()


TestTieringMachine = TieringMachine.TestCase
TestTieringMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
