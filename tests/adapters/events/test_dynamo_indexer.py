"""kvhex's ZMQ event sink and a real KV-aware router's index on loopback (Dynamo's standalone
KV indexer, tests/dynamo.py): the model of its crediting checked against it; a real engine's
stream credited as the engine's tiers really hold their blocks at the end; an indexer that
registered late, or lost a batch on the way, getting the rest from the sink's replay socket
(batches older than the sink's window as its snapshot).

The engine here publishes hashes as integers (``EventTranslator(int_hashes=True)``, vLLM's
default): the indexer decodes no other kind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvhex.adapters.events.wire import BlockStored as WireStored
from kvhex.adapters.events.wire import decode_batch
from kvhex.adapters.events.zmq import ZmqEventSink
from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain import LruPolicy, PrimaryTier
from kvhex.domain.events import BlockRemoved, BlockStored, EventBatch
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult
from kvhex.domain.translate import EventTranslator
from kvhex.service import EventPipeline, OffloadEngine, TieringManager
from tests.domain.requests import chunk_key, make_request
from tests.dynamo import Chains, Credit, DynamoIndexer, expected_credit

BLOCK = 4
GROUP = KvGroup(0, tokens_per_block=BLOCK, blocks_per_chunk=2)
GEO = KvGeometry((GROUP,), tokens_per_hash=BLOCK)
HOST_SLOTS = 4
TIER_CHUNKS = 8
"""The host keeps 4 chunks and the memory tier 8 of the 14 the workload stores: both evict."""


def tokens(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


SHARED = tokens(1000, 16)  # two chunks every "a" prompt starts with
PROMPTS = [
    [*SHARED, *tokens(2000, 8)],
    tokens(3000, 24),
    [*SHARED, *tokens(4000, 8)],
    tokens(5000, 16),
    tokens(6000, 24),
    [*SHARED, *tokens(7000, 11)],  # a partial tail: never stored
    tokens(8000, 8),
]

PROBE_TOKENS = 900_000
"""Probes store tokens from here on, which no prompt shares."""


def int64(block_hash: bytes) -> int:
    """A hash as the engine publishes it: the low 64 bits of its big-endian value."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class Engine:
    """kvhex's engine on in-memory tiers (a host tier, a ``STORAGE`` tier behind it),
    publishing each step's events to ``sink`` with integer hashes."""

    def __init__(self, sink: ZmqEventSink) -> None:
        host = MemoryHostBuffer(HOST_SLOTS, 32)
        self.tier = MemoryTierStore(
            host, capacity_bytes=TIER_CHUNKS * 32, name="mem", complete_after_polls=1
        )
        self.primary = PrimaryTier(HOST_SLOTS, LruPolicy(HOST_SLOTS))
        self.manager = TieringManager(self.primary, [self.tier], host=host)
        translator = EventTranslator(GEO, int_hashes=True)
        self.engine = OffloadEngine(self.manager, EventPipeline(translator, [sink]))
        self.requests: list[ReqContext] = []
        self.blocks: dict[OffloadKey, list[bytes]] = {}
        """Every chunk a request named: its blocks' hashes."""

    def serve(self, prompts: list[list[int]]) -> None:
        """Each prompt in a step of its own, as an engine serves it: its leading chunks the
        host holds are used, the rest stored; then steps until the tier's jobs finished."""
        engine = self.engine
        for prompt in prompts:
            ctx = make_request(f"r{len(self.requests)}", prompt, GEO)
            self.requests.append(ctx)
            engine.on_new_request(ctx)
            assert ctx.provenance is not None
            hashes = ctx.provenance.block_hashes
            per = GROUP.blocks_per_chunk
            keys = [chunk_key(ctx, c, GROUP) for c in range(len(hashes) // per)]
            self.blocks.update({k: hashes[c * per : (c + 1) * per] for c, k in enumerate(keys)})
            hits = 0
            for key in keys:
                if engine.lookup(key, ctx) is not LookupResult.HIT:
                    break
                hits += 1
            engine.touch(keys[:hits], ctx)
            plan = engine.prepare_store(keys[hits:], ctx)
            if plan is not None and plan.keys:
                engine.complete_store(plan.keys, ctx)
            engine.on_schedule_end()
            engine.take_events()
            engine.on_request_finished(ctx)
        for _ in range(10):
            engine.on_schedule_end()
            engine.take_events()
            if not engine.has_pending_work():
                return
        raise AssertionError("the engine still had tier jobs in flight")

    def held(self) -> tuple[list[bytes], list[bytes]]:
        """The blocks held now: in host memory, and in the ``STORAGE`` tier."""
        host = [k for k in self.blocks if self.primary.lookup(k) is LookupResult.HIT]
        tier = self.tier.keys()  # readable keys (a MemoryTierStore is no mapping)
        return (
            [h for k in host for h in self.blocks[k]],
            [h for k in tier for h in self.blocks[k]],
        )

    def expected(self) -> dict[int, Credit]:
        """Each prompt's credit from what the tiers hold now: host memory as cpu, the
        ``STORAGE`` tier as disk."""
        chains = Chains(BLOCK)
        for ctx in self.requests:
            assert ctx.provenance is not None
            chains.add(ctx.provenance.token_ids, ctx.provenance.block_hashes)
        host, tier = self.held()
        cpu, disk = chains.held(host), chains.held(tier)
        return {
            i: expected_credit(prompt(ctx), BLOCK, cpu=cpu, disk=disk)
            for i, ctx in enumerate(self.requests)
        }


def prompt(ctx: ReqContext) -> list[int]:
    assert ctx.provenance is not None
    return list(ctx.provenance.token_ids)


def credits(indexer: DynamoIndexer, requests: list[ReqContext]) -> dict[int, Credit]:
    return {i: indexer.credit(prompt(ctx)) for i, ctx in enumerate(requests)}


def probe(sink: ZmqEventSink) -> Callable[[int], list[int]]:
    """Publishes the n-th probe: one block of tokens no prompt shares, in host memory."""

    def publish(n: int) -> list[int]:
        block = tokens(PROBE_TOKENS + n * BLOCK, BLOCK)
        stored = BlockStored([(1 << 62) + n], None, block, BLOCK, None, "CPU", None)
        sink.publish(EventBatch(time.time(), [stored]))
        return block

    return publish


@pytest.fixture
def sink(request: pytest.FixtureRequest) -> Iterator[ZmqEventSink]:
    """A sink on free loopback ports keeping its last 10,000 batches for replay (or as many as
    the test's parameter says; older ones are replayed as a snapshot)."""
    window = getattr(request, "param", 10_000)
    sink = ZmqEventSink("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=window)
    yield sink
    sink.close()


class LossyLink:
    """A hop between a publisher's PUB socket and its subscribers that forwards every message
    but the first one storing a block the test names: a batch lost on the way."""

    def __init__(self, upstream: str, lose: set[int]) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.lose = lose
        """Block hashes: the first message storing any of them is not forwarded."""
        self.lost: list[int] = []
        """The sequence numbers not forwarded."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._forward, daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(20):
                continue
            topic, seq, payload = self._sub.recv_multipart()
            events = decode_batch(payload).events
            stores = {h for e in events if isinstance(e, WireStored) for h in e.block_hashes}
            if not self.lost and stores & self.lose:
                self.lost.append(int.from_bytes(seq, "big"))
                continue
            self._pub.send_multipart((topic, seq, payload))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()


LAST = PROMPTS[-1]
"""The last prompt: one chunk, stored last, so host memory still holds it at the end."""


@pytest.fixture
def link(sink: ZmqEventSink) -> Iterator[LossyLink]:
    """Loses the batch announcing the last prompt's chunk in host memory."""
    ctx = make_request("last", LAST, GEO)
    assert ctx.provenance is not None
    link = LossyLink(sink.endpoint, {int64(h) for h in ctx.provenance.block_hashes})
    yield link
    link.close()


def stored(hashes: list[int], parent: int | None, block: list[int], medium: str) -> BlockStored:
    return BlockStored(hashes, parent, block, BLOCK, None, medium, None)


def test_the_model_of_its_crediting_agrees_with_the_indexer_across_media(
    dynamo_indexer: DynamoIndexer, sink: ZmqEventSink
) -> None:
    indexer = dynamo_indexer
    indexer.register(1, sink.endpoint, sink.replay_endpoint, BLOCK)
    indexer.await_stream(probe(sink))
    a, b, c, d = (tokens(10_000 * i, 4 * BLOCK) for i in range(1, 5))

    def blocks(prompt: list[int], n: int) -> tuple[int, ...]:
        return tuple(prompt[: n * BLOCK])

    events = [
        # gpu, then cpu, then storage: each walk continues the one before
        stored([11], None, a[:4], "GPU"),
        stored([12], 11, a[4:8], "CPU"),
        stored([13, 14], 12, a[8:16], "STORAGE"),
        # cpu, storage, cpu: the last block counts for neither walk
        stored([21], None, b[:4], "CPU"),
        stored([22], 21, b[4:8], "STORAGE"),
        stored([23], 22, b[8:12], "CPU"),
        # a child before its parent in host memory: linked when the parent comes
        stored([32], 31, c[4:8], "CPU"),
        stored([31], None, c[:4], "CPU"),
        # announced twice, removed once: gone (no reference counts)
        stored([41, 42], None, d[:8], "CPU"),
        stored([41, 42], None, d[:8], "CPU"),
        BlockRemoved([42], "CPU"),
    ]
    sink.publish(EventBatch(time.time(), events))
    held = {
        "gpu": {blocks(a, 1)},
        "cpu": {blocks(a, 2), blocks(b, 1), blocks(b, 3), blocks(c, 1), blocks(c, 2), blocks(d, 1)},
        "disk": {blocks(a, 3), blocks(a, 4), blocks(b, 2)},
    }
    prompts = {"a": a, "b": b, "c": c, "d": d}
    want = {name: expected_credit(p, BLOCK, **held) for name, p in prompts.items()}
    assert want == {
        "a": Credit(4, 8, 16),
        "b": Credit(0, 4, 8),
        "c": Credit(0, 8, 8),
        "d": Credit(0, 4, 4),
    }

    def observe() -> dict[str, Credit]:
        return {name: indexer.credit(p) for name, p in prompts.items()}

    assert indexer.settle(observe, want) == want, indexer.context()


@pytest.mark.parametrize(
    "sink",
    [
        pytest.param(10_000, id="every-batch-kept"),
        pytest.param(2, id="older-batches-as-a-snapshot"),
    ],
    indirect=True,
)
def test_an_indexer_registered_late_gets_the_earlier_batches_from_the_replay(
    dynamo_indexer: DynamoIndexer, sink: ZmqEventSink
) -> None:
    indexer = dynamo_indexer
    engine = Engine(sink)
    engine.serve(PROMPTS[:5])
    indexer.register(1, sink.endpoint, sink.replay_endpoint, BLOCK)
    # only a batch arriving after the registration makes it ask for the ones before
    indexer.await_stream(probe(sink))
    engine.serve(PROMPTS[5:])
    want = engine.expected()
    # the replay alone brought prompt 4's credit: only the STORAGE tier holds it now, and it
    # announced those blocks before the registration
    assert want[4] == Credit(0, 0, len(PROMPTS[4])), want
    assert want[5].cpu >= len(SHARED), want  # host memory holds a prefix too
    assert Credit(0, 0, 0) in want.values(), "a prompt evicted from both tiers"
    got = indexer.settle(lambda: credits(indexer, engine.requests), want)
    assert got == want, indexer.context()


def test_a_batch_lost_on_the_way_is_fetched_from_the_replay(
    dynamo_indexer: DynamoIndexer, sink: ZmqEventSink, link: LossyLink
) -> None:
    indexer = dynamo_indexer
    indexer.register(1, link.endpoint, sink.replay_endpoint, BLOCK)
    indexer.await_stream(probe(sink))
    engine = Engine(sink)
    engine.serve(PROMPTS)
    want = engine.expected()
    assert want[len(PROMPTS) - 1].cpu == len(LAST), want  # held in host memory at the end
    got = indexer.settle(lambda: credits(indexer, engine.requests), want)
    assert len(link.lost) == 1  # the batch storing it in host memory, never forwarded
    assert got == want, indexer.context()
