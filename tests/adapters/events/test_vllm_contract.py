"""vLLM's written KV-event contract (vLLM's ``docs/features/kv_events.md``, which vLLM pins by
``tests/v1/core/test_kv_events_contract.py``), checked on kvhex's wire bytes by a reader that
knows nothing but the contract: a raw msgpack decode, no kvhex or vLLM struct.

* Shape: a batch is the array ``[ts, events, data_parallel_rank]`` (readers take trailing
  elements), each event a map with a ``type``; required fields are always sent (nil where
  unset), optional ones only when set, for every combination of optional fields.
* Integer hashes are the last 8 bytes of the digest, never of the group-suffixed key.
* Each copy is announced and withdrawn once: kvhex's engine over memory tiers (stores,
  cascades, evictions, promotions, failures, resets) publishing vLLM's bytes, read by a
  consumer counting references per (publisher, rank, hash, medium, group, locality,
  ownership): no removal names a copy it does not hold, and after every step it holds one
  reference per block the tiers hold.
* Where vLLM is installed, both ways: vLLM's decoder reads kvhex's bytes, and the contract
  reader reads vLLM's own bytes as it reads kvhex's, for every combination.

test_wire.py pins the bytes of five sample batches against goldens recorded from vLLM 0.33;
this module pins the rules every batch must follow.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Iterator, Sequence
from itertools import combinations
from typing import Any, ClassVar, NamedTuple

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvhex.adapters.events import wire
from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain import (
    LookupResult,
    LruPolicy,
    OffloadKey,
    PrimaryTier,
    Removed,
    ReqContext,
    Stored,
    make_offload_key,
)
from kvhex.domain import events as domain
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.primary import PRIMARY_IDENTITY
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.domain.translate import EventTranslator
from kvhex.service import EventPipeline, OffloadEngine, TieringManager
from kvhex.service.engine import announcer_for
from tests.adapters.events.test_wire import KINDS, _listify
from tests.domain.requests import chunk_key, make_request
from tests.service.harness import SLOT_BYTES, payload

# -- the contract, as written, and a reader that knows nothing else ----------------------

STORED_REQUIRED = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"
)  # fmt: skip
STORED_OPTIONAL = (
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
    "ownership", "session_id",
)  # fmt: skip
STORED_BEYOND = ("lookahead_token_ids",)
"""vLLM 0.33's ``BlockStored`` fields beyond the written contract: optional, omitted unset."""
CONTRACT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "BlockStored": (STORED_REQUIRED, STORED_OPTIONAL + STORED_BEYOND),
    "BlockRemoved": (("block_hashes", "medium"), ("group_idx", "locality", "ownership")),
    "AllBlocksCleared": ((), ()),
}
MASK_64 = (1 << 64) - 1

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed in this environment; run this module with .venv-vllm "
    "(vllm==0.33.0, `make vllm-test`) or .venv-vllm32 (`make vllm32-test`) to check kvhex's "
    "bytes against vLLM's own kv_events structs",
)


class Batch(NamedTuple):
    """A batch as the contract reader sees it: each event a map holding every field the
    contract names (``None`` where an optional one was not sent)."""

    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None


def read_batch(sent: bytes) -> Batch:
    """Read a batch by the contract alone: a positional array whose trailing elements are
    ignored, events as maps tagged by ``type`` whose keys the contract does not name are
    ignored."""
    raw = msgspec.msgpack.decode(sent)
    assert isinstance(raw, list), raw
    assert len(raw) >= 2, raw
    ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    assert isinstance(ts, int | float), ts
    assert rank is None or isinstance(rank, int), rank
    return Batch(ts, [_read_event(e) for e in events], rank)


def _read_event(raw: dict[str, Any]) -> dict[str, Any]:
    assert raw.get("type") in CONTRACT, raw
    required, optional = CONTRACT[raw["type"]]
    assert [name for name in required if name not in raw] == [], raw
    event = {"type": raw["type"], **{name: raw[name] for name in required}}
    event.update({name: raw.get(name) for name in optional})
    for h in [*event.get("block_hashes", ()), event.get("parent_block_hash")]:
        assert h is None or isinstance(h, bytes) or (isinstance(h, int) and 0 <= h <= MASK_64), h
    return event


def read_sent(sent: bytes) -> Batch:
    """``read_batch``, after checking what a publisher may send: the batch's three elements,
    no key the contract (or vLLM's struct) does not name, no optional field sent unset."""
    raw = msgspec.msgpack.decode(sent)
    assert len(raw) == 3, raw
    for event in raw[1]:
        required, optional = CONTRACT[event["type"]]
        assert set(event) <= {"type", *required, *optional}, event
        sent_unset = [name for name in optional if name in event and event[name] is None]
        assert sent_unset == [], event
    return read_batch(sent)


# -- every event shape -----------------------------------------------------------------

H0, H1, H2 = b"\x00" * 32, b"\x01" * 32, b"\x02" * 32
STORED_REQUIRED_VALUES: list[dict[str, Any]] = [
    dict(zip(STORED_REQUIRED, [[1, MASK_64], None, [], 0, None, None, None], strict=True)),
    dict(zip(STORED_REQUIRED, [[H1, H2], H0, [*range(8)], 4, 7, "CPU", "lora"], strict=True)),
]
OPTIONAL_VALUES: dict[str, Any] = {
    "extra_keys": [("lora", ("img-1", 2), "salt"), None],
    "group_idx": 0,  # falsy, but set: sent
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 128,
    "locality": "REMOTE",
    "ownership": "s3",
    "session_id": "sess-1",
    "lookahead_token_ids": [[9, 10], [11, 12]],
}
TS, RANK = 1700000000.5, 2


def shapes() -> Iterator[tuple[str, dict[str, Any], tuple[str, ...]]]:
    """``(type, fields, optional fields set)`` for each variant of the required fields with
    every subset of the optional ones set."""
    removed = [{"block_hashes": [H1, 5], "medium": medium} for medium in (None, "STORAGE")]
    for kind, variants in [("BlockStored", STORED_REQUIRED_VALUES), ("BlockRemoved", removed)]:
        optional = CONTRACT[kind][1]
        for required in variants:
            for n in range(len(optional) + 1):
                for chosen in combinations(optional, n):
                    yield kind, {**required, **{f: OPTIONAL_VALUES[f] for f in chosen}}, chosen
    yield "AllBlocksCleared", {}, ()


def kvhex_bytes(kind: str, fields: dict[str, Any]) -> bytes:
    return wire.encode_batch(domain.EventBatch(TS, [KINDS[kind](**fields)], RANK))


def test_every_shape_sends_its_required_fields_and_exactly_the_optional_ones_set() -> None:
    count = 0
    for kind, fields, chosen in shapes():
        sent = kvhex_bytes(kind, fields)
        batch = read_sent(sent)
        (raw,) = msgspec.msgpack.decode(sent)[1]
        required, optional = CONTRACT[kind]
        assert set(raw) == {"type", *required, *chosen}, (kind, chosen)
        expected = {"type": kind, **dict.fromkeys((*required, *optional)), **fields}
        assert batch == (TS, [{k: _listify(v) for k, v in expected.items()}], RANK), chosen
        count += 1
    assert count == 2 * 2**8 + 2 * 2**3 + 1


def test_readers_take_trailing_batch_elements_and_event_keys_they_do_not_know() -> None:
    """A later vLLM may append batch elements and add event fields: the contract reader and
    kvhex's own decoder (``kvhex events``, the replay reader) read the batch as before."""
    kind, fields, _ = next(s for s in shapes() if s[0] == "BlockStored" and len(s[2]) == 8)
    sent = kvhex_bytes(kind, fields)
    raw = msgspec.msgpack.decode(sent)
    raw[1][0]["future_field"] = [1, 2]
    later = msgspec.msgpack.encode([*raw, {"publisher_id": "p"}, 3])
    assert read_batch(later) == read_batch(sent)
    assert wire.decode_batch(later) == wire.decode_batch(sent)


def test_integer_hashes_are_the_last_8_bytes_of_the_digest_not_of_the_key() -> None:
    """Full stores (one hash, and a chain long enough for the bulk conversion), placeholders
    and removals, with group-suffixed keys: every integer is the digest's last 8 bytes, sent
    as an unsigned 64-bit integer."""
    group = KvGroup(3, tokens_per_block=4)
    geometry = KvGeometry((KvGroup(0, tokens_per_block=4), group), tokens_per_hash=4)
    ctx = make_request("r", list(range(100, 144)), geometry)
    assert ctx.provenance is not None
    digests = list(ctx.provenance.block_hashes)
    keys = [chunk_key(ctx, c, group) for c in range(11)]
    odd = bytes(range(24)) + bytes.fromhex("fedcba9876543210")  # the top bit set
    placeholder = make_offload_key(odd, 0x0A0B0C0D)
    cpu, disk = TierIdentity(Medium.CPU), TierIdentity(Medium.STORAGE, Locality.LOCAL)
    events = EventTranslator(geometry, int_hashes=True).translate(
        [
            Stored((keys[0],), cpu, ctx),
            Stored(tuple(keys[1:]), cpu, ctx),
            Stored((placeholder,), disk, None),
            Removed(tuple(keys), cpu),
            Removed((placeholder,), disk),
        ]
    )
    sent = read_sent(wire.encode_batch(domain.EventBatch(TS, events, RANK))).events

    def low(h: bytes) -> int:
        return int.from_bytes(h[-8:], "big")

    assert [(e["type"], e["block_hashes"], e.get("parent_block_hash")) for e in sent] == [
        ("BlockStored", [low(digests[0])], None),
        ("BlockStored", [low(d) for d in digests[1:11]], low(digests[0])),
        ("BlockStored", [0xFEDCBA9876543210], None),
        ("BlockRemoved", [low(d) for d in digests[:11]], None),
        ("BlockRemoved", [0xFEDCBA9876543210], None),
    ]
    assert [e["group_idx"] for e in sent] == [3, 3, 0x0A0B0C0D, 3, 0x0A0B0C0D]
    published = {h for e in sent for h in e["block_hashes"]}
    assert not published & {low(k) for k in [*keys, placeholder]}, "a key's bytes published"


# -- one removal per announced copy, on the engine's real output -------------------------

Copy = tuple[str, int | None, bytes | int, str | None, int | None, str | None, str | None]
"""(publisher, rank, hash, medium, group, locality, ownership): one announced copy."""
PUBLISHER = "kvhex-0"


class WireSink:
    """An event sink keeping each batch as the bytes vLLM's ZMQ publisher sends."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, batch: domain.EventBatch) -> None:
        self.payloads.append(wire.encode_batch(batch))

    def close(self) -> None:
        pass


class RefCountingConsumer:
    """A router's index as the contract asks for: one reference per announced copy, each
    removal takes one back; a removal of a copy it does not hold is a no-op (noted here)."""

    def __init__(self) -> None:
        self.refs: Counter[Copy] = Counter()
        self.unheld_removals: list[Copy] = []
        self.kinds: Counter[tuple[str, str | None]] = Counter()
        self.read = 0

    def take(self, payloads: list[bytes]) -> None:
        for sent in payloads[self.read :]:
            batch = read_sent(sent)
            for event in batch.events:
                self.kinds[event["type"], event.get("medium")] += 1
                publisher = (PUBLISHER, batch.data_parallel_rank)
                if event["type"] == "AllBlocksCleared":
                    for copy in [c for c in self.refs if c[:2] == publisher]:
                        del self.refs[copy]
                    continue
                where = (event["medium"], event["group_idx"], event["locality"], event["ownership"])
                for h in event["block_hashes"]:
                    copy = (*publisher, h, *where)
                    if event["type"] == "BlockStored":
                        self.refs[copy] += 1
                    elif self.refs[copy] > 1:
                        self.refs[copy] -= 1
                    elif not self.refs.pop(copy, 0):
                        self.unheld_removals.append(copy)
        self.read = len(payloads)


class Stack:
    """kvhex's engine over its host tier and memory tiers (``tiers``: capacity in chunks and
    polls to finish a job, each), publishing vLLM's bytes to a ``RefCountingConsumer``; its
    requests all read one document of 12 chunks (their hashes chain)."""

    def __init__(
        self,
        hashes_per_chunk: int,
        *,
        owned: bool,
        slots: int = 6,
        tiers: Sequence[tuple[int, int]] = ((5, 1), (9, 2)),
    ) -> None:
        group = KvGroup(0, tokens_per_block=4, blocks_per_chunk=hashes_per_chunk)
        geometry = KvGeometry((group,), tokens_per_hash=4)
        document = make_request("doc", list(range(1000, 1000 + 48 * hashes_per_chunk)), geometry)
        self.provenance = document.provenance
        assert self.provenance is not None
        self.keys = [chunk_key(document, n, group) for n in range(12)]
        digests, per = self.provenance.block_hashes, hashes_per_chunk
        self.hashes = {k: digests[n * per : (n + 1) * per] for n, k in enumerate(self.keys)}
        self.host = MemoryHostBuffer(slots, SLOT_BYTES)
        self.tiers = [
            MemoryTierStore(
                self.host, capacity_bytes=c * SLOT_BYTES, name=f"m{i}", complete_after_polls=p
            )
            for i, (c, p) in enumerate(tiers)
        ]
        manager = TieringManager(PrimaryTier(slots, LruPolicy(slots)), self.tiers, host=self.host)
        self.sink = WireSink()
        pipeline = EventPipeline(EventTranslator(geometry), [self.sink], data_parallel_rank=RANK)
        owners = [t.identity for t in self.tiers] if owned else []
        self.engine = OffloadEngine(manager, pipeline, announcer_for(self.tiers, owners))
        self.consumer = RefCountingConsumer()

    def request(self, name: str, *, provenance: bool = True) -> ReqContext:
        ctx = ReqContext(name, provenance=self.provenance if provenance else None)
        self.engine.on_new_request(ctx)
        return ctx

    def store(self, chunks: Sequence[int], ctx: ReqContext, then: str = "ok") -> list[OffloadKey]:
        """Device -> host store of ``chunks``, completed ("ok", "fail") or left in flight
        ("later": the keys returned complete later)."""
        plan = self.engine.prepare_store([self.keys[n] for n in chunks], ctx)
        if plan is None:
            return []
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            self.host.slot_view(slot)[:] = payload(k)
        if then != "later":
            self.engine.complete_store(plan.keys, ctx, then == "ok")
        return plan.keys

    def load(self, chunks: Sequence[int], ctx: ReqContext, patience: int) -> None:
        """Look ``chunks`` up as an engine does (promoting from the tiers, waiting up to
        ``patience`` steps), then load those that hit."""
        waiting = (LookupResult.RETRY, LookupResult.HIT_PENDING)
        for _ in range(patience + 1):
            answers = [self.engine.lookup(self.keys[k], ctx) for k in chunks]
            if not any(a in waiting for a in answers):
                break
            self.engine.on_schedule_end()
        hits = [self.keys[k] for k, a in zip(chunks, answers, strict=True) if a is LookupResult.HIT]
        if hits:
            self.engine.prepare_load(hits, ctx)
            self.engine.touch(hits, ctx)
            self.engine.complete_load(hits, ctx)

    def settle(self, ctx: ReqContext) -> None:
        """End a step and poll the tiers (a lookup does): their jobs report."""
        self.engine.on_schedule_end()
        self.engine.lookup(self.keys[0], ctx)

    def held(self) -> Counter[Copy]:
        """One reference per block of each key the tiers hold readable, in the residency
        each tier is announced in, less the keys waiting for a parent announced nowhere."""
        announcer = self.engine.announcer
        copies: set[Copy] = set()
        holdings = [(PRIMARY_IDENTITY, self.engine.host_keys())]
        for tier, keys in holdings + [(t.identity, t.keys()) for t in self.tiers]:
            public = announcer.public(tier)
            where = (public.medium.name, 0, public.locality and public.locality.value)
            for k in set(keys) - announcer.waiting(tier):
                copies.update(
                    (PUBLISHER, RANK, h, *where, public.ownership) for h in self.hashes[k]
                )
        return Counter(copies)

    def check(self) -> None:
        """Publish this step's events; the consumer reads them and holds what the tiers do."""
        self.engine.take_events()
        self.consumer.take(self.sink.payloads)
        assert self.consumer.unheld_removals == [], "a removal of a copy never announced"
        assert self.consumer.refs == self.held()


def walk(stack: Stack) -> None:
    """Each situation once, checked after each (two tiers of 3 chunks, 4 host slots)."""
    a = stack.request("a")
    for chunks in ([0, 1], [2, 3]):  # host stores, then cascades: the tiers evict chunk 0
        stack.store(chunks, a)
        stack.check()
        stack.settle(a)
        stack.check()
    stack.store([4, 5], a)  # the host evicts, the tiers reserve room for the cascades
    stack.check()
    late = stack.store([6], a, "later")
    stack.store([7], a, "fail")
    stack.engine.complete_store(late, a, False)  # failed stores: evictions, no store
    stack.check()
    stack.tiers[1].fail_next_puts()
    stack.settle(a)  # m1's put fails: m0 alone holds chunks 4 and 5
    stack.check()
    stack.engine.reset()  # the host's chunks removed one by one; the tiers keep theirs
    stack.check()
    stack.load([3, 4, 5], stack.request("b"), patience=4)  # promoted back to the host
    stack.check()
    assert len(stack.engine.host_keys()) == 3


@pytest.mark.parametrize("owned", [False, True], ids=["one-storage-residency", "owned-tiers"])
def test_a_reference_counting_consumer_holds_exactly_what_the_tiers_hold(owned: bool) -> None:
    """With ``owned`` each tier is a residency of its own; else the two are one, whose
    removal goes out when the last tier lets a chunk go."""
    stack = Stack(2, owned=owned, slots=4, tiers=((3, 1), (3, 1)))
    walk(stack)
    kinds = stack.consumer.kinds
    assert [kinds["BlockStored", m] >= 3 for m in ("CPU", "STORAGE")] == [True, True]
    assert [kinds["BlockRemoved", m] >= 2 for m in ("CPU", "STORAGE")] == [True, True]
    assert kinds["AllBlocksCleared", None] == 0, "a reset clears the host tier alone"
    stack.engine.shutdown()


class ContractMachine(RuleBasedStateMachine):
    """Random stores, completions (ok, failed, late), lookups with promotion, steps,
    finishes, resets and injected tier faults, ``Stack.check`` after each."""

    hashes_per_chunk: ClassVar[int] = 2
    owned: ClassVar[bool] = False
    placeholders: ClassVar[bool] = False  # every fourth request external: no provenance

    def __init__(self) -> None:
        super().__init__()
        self.stack = Stack(self.hashes_per_chunk, owned=self.owned)
        self.requests: list[ReqContext] = []
        self.outstanding: list[tuple[ReqContext, list[OffloadKey]]] = []
        self.made = 0
        for _ in range(3):
            self._new_request()

    def _new_request(self) -> None:
        external = self.placeholders and self.made % 4 == 3
        self.requests.append(self.stack.request(f"r{self.made % 3}", provenance=not external))
        self.made += 1

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
        ctx = self.requests[i % len(self.requests)]
        keys = self.stack.store(range(start, start + n), ctx, then)
        if then == "later" and keys:
            self.outstanding.append((ctx, keys))

    @precondition(lambda self: self.outstanding)
    @rule(i=st.integers(0, 10), ok=st.booleans())
    def complete_store(self, i: int, ok: bool) -> None:
        ctx, keys = self.outstanding.pop(i % len(self.outstanding))
        self.stack.engine.complete_store(keys, ctx, ok)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 10), n=st.integers(1, 8), patience=st.integers(0, 3))
    def load_prefix(self, i: int, n: int, patience: int) -> None:
        self.stack.load(range(n), self.requests[i % len(self.requests)], patience)

    @rule(n=st.integers(1, 3))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.stack.engine.on_schedule_end()

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 10))
    def finish(self, i: int) -> None:
        self.stack.engine.on_request_finished(self.requests.pop(i % len(self.requests)))

    @rule()
    def reset(self) -> None:
        self.stack.engine.reset()
        self.outstanding.clear()  # the engine drops completions from before a reset

    @rule(tier=st.integers(0, 1), kind=st.sampled_from(["put", "get", "partial", "probe"]))
    def inject_fault(self, tier: int, kind: str) -> None:
        store = self.stack.tiers[tier]
        if kind == "partial":
            store.partial_next_get(self.stack.keys[::2])
        else:
            getattr(store, f"fail_next_{kind}s")()

    @invariant()
    def the_consumer_holds_what_the_tiers_hold(self) -> None:
        self.stack.check()

    def teardown(self) -> None:
        self.stack.engine.shutdown()


class OwnedTiersMachine(ContractMachine):
    owned = True


class PlaceholderMachine(ContractMachine):
    # one hash per chunk: the machine's model of what the tiers hold names every hash of a
    # held key, where a placeholder announces only the tail one (the two-hash case is
    # test_a_placeholder_copy_is_withdrawn_with_the_hashes_it_announced)
    hashes_per_chunk = 1
    placeholders = True


FAST = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestOneStorageResidency = ContractMachine.TestCase
TestOneStorageResidency.settings = FAST
TestOwnedTiers = OwnedTiersMachine.TestCase
TestOwnedTiers.settings = FAST
TestPlaceholders = PlaceholderMachine.TestCase
TestPlaceholders.settings = FAST


def test_a_placeholder_copy_is_withdrawn_with_the_hashes_it_announced() -> None:
    stack = Stack(2, owned=False, slots=4, tiers=((8, 1),))
    full = stack.request("full")
    stack.store([0], full)  # CPU and, once the cascade lands, STORAGE: both hashes
    stack.settle(full)
    stack.engine.reset()  # CPU withdraws both hashes; STORAGE keeps the chunk
    stack.check()
    stack.store([0], stack.request("external", provenance=False))  # CPU: the tail hash alone
    stack.engine.take_events()
    assert [len(e["block_hashes"]) for e in read_batch(stack.sink.payloads[-1]).events] == [1]
    stack.engine.reset()  # CPU withdraws its placeholder copy
    stack.check()


# -- vLLM's own structs ------------------------------------------------------------------


@needs_vllm
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vLLM's and torch's imports
def test_vllms_structs_declare_the_contract() -> None:  # pragma: no cover - needs vLLM
    from vllm.distributed import kv_events as v

    for kind, (required, optional) in CONTRACT.items():
        struct = getattr(v, kind)
        fields = struct.__struct_fields__
        n_required = len(fields) - len(struct.__struct_defaults__)
        assert set(fields[:n_required]) == set(required), kind
        written = set(optional) - set(STORED_BEYOND)
        assert written <= set(fields[n_required:]) <= set(optional), kind
        assert struct.__struct_config__.tag_field == "type"
    assert v.KVEventBatch.__struct_config__.array_like
    assert v.KVEventBatch.__struct_fields__ == ("ts", "events", "data_parallel_rank")


@needs_vllm
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_vllm_and_kvhex_agree_on_every_shape() -> None:  # pragma: no cover - needs vLLM
    """vLLM's decoder reads kvhex's bytes into the structs vLLM builds from the same fields
    (on vLLM 0.33, kvhex's bytes are vLLM's); the contract reader reads vLLM's bytes as it
    reads kvhex's. A field beyond the installed vLLM's struct (vLLM 0.32 has no
    ``lookahead_token_ids``) is one vLLM's decoder skips."""
    from vllm.distributed import kv_events as v

    decoder = msgspec.msgpack.Decoder(v.KVEventBatch)
    for kind, fields, chosen in shapes():
        known = set(getattr(v, kind).__struct_fields__)
        theirs = {name: value for name, value in fields.items() if name in known}
        event = getattr(v, kind)(**theirs)
        vllm_sent = msgspec.msgpack.encode(v.KVEventBatch(TS, [event], RANK))
        ours = kvhex_bytes(kind, fields)
        assert msgspec.msgpack.encode(decoder.decode(ours)) == vllm_sent, (kind, chosen)
        if known == set(getattr(wire, kind).__struct_fields__):
            assert ours == vllm_sent, (kind, chosen)
        expected = read_batch(ours)
        expected.events[0].update(dict.fromkeys(fields.keys() - theirs.keys()))
        assert read_batch(vllm_sent) == expected, (kind, chosen)


@needs_vllm
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_vllms_hash_conversion_of_the_same_keys_gives_kvhexs_integers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # pragma: no cover - needs vLLM
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    digests = [bytes([n]) * 24 + bytes.fromhex("fedcba98765432") + bytes([n]) for n in range(12)]
    keys = [make_offload_key(d, [0, 1, 0x0A0B0C0D][n % 3]) for n, d in enumerate(digests)]
    cpu = TierIdentity(Medium.CPU)
    events = EventTranslator(int_hashes=True).translate(
        [Stored(tuple(keys), cpu, None), Removed(tuple(keys), cpu)]
    )
    sent = read_sent(wire.encode_batch(domain.EventBatch(TS, events, RANK))).events
    theirs = [maybe_convert_block_hash(BlockHash(get_offload_block_hash(k))) for k in keys]
    stored = [h for e in sent if e["type"] == "BlockStored" for h in e["block_hashes"]]
    removed = [h for e in sent if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert stored == theirs
    assert sorted(removed) == sorted(theirs)


@needs_vllm
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_vllms_decoder_reads_the_engines_stream() -> None:  # pragma: no cover - needs vLLM
    from vllm.distributed import kv_events as v

    stack = Stack(2, owned=True, slots=4, tiers=((3, 1), (3, 1)))
    walk(stack)
    decoder = msgspec.msgpack.Decoder(v.KVEventBatch)
    assert len(stack.sink.payloads) >= 8
    for sent in stack.sink.payloads:
        assert read_batch(msgspec.msgpack.encode(decoder.decode(sent))) == read_batch(sent)
    stack.engine.shutdown()
