"""Two engines sharing one file root, each publishing its events to a real KV-aware router's
index (Dynamo's standalone indexer, tests/dynamo.py): with ``announce_peers`` the index
credits both instances with the blocks one of them stored, since both can load them, and
neither once they are gone."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhex.adapters.events.zmq import ZmqEventSink
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.domain import LruPolicy, PrimaryTier
from kvhex.domain.events import BlockStored, EventBatch
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality
from kvhex.domain.translate import EventTranslator
from kvhex.service import EventPipeline, OffloadEngine, TieringManager
from tests.domain.requests import chunk_key, make_request
from tests.dynamo import NOTHING, Credit, DynamoIndexer

BLOCK = 4
GROUP = KvGroup(0, tokens_per_block=BLOCK, blocks_per_chunk=2)
GEO = KvGeometry((GROUP,), tokens_per_hash=BLOCK)
HOST_SLOTS = 4
SLOT = 64
NS = {"model": "tiny", "dtype": "float16"}
PROMPTS = [list(range(base, base + 24)) for base in (1000, 2000, 3000)]


class Instance:
    """An engine with a host tier and a file tier on the shared ``root`` (announcing the
    other instances' blocks there), publishing each step to its own ZMQ sink."""

    def __init__(self, root: Path) -> None:
        self.sink = ZmqEventSink("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        host = MemoryHostBuffer(HOST_SLOTS, SLOT)
        self.tier = FsspecTierStore(
            host,
            str(root),
            capacity_bytes=1 << 20,
            namespace=NS,
            locality=Locality.LOCAL,  # what Dynamo credits (docs/tiers.md)
            announce_peers=True,
            peer_scan_interval_s=0.05,
        )
        manager = TieringManager(
            PrimaryTier(HOST_SLOTS, LruPolicy(HOST_SLOTS)), [self.tier], host=host
        )
        translator = EventTranslator(GEO, int_hashes=True)  # Dynamo decodes no other hashes
        self.engine = OffloadEngine(manager, EventPipeline(translator, [self.sink]))

    def serve(self, prompt: list[int], req_id: str) -> list[OffloadKey]:
        """Store every chunk of ``prompt`` (host memory, then the file tier), and wait for
        the file tier's jobs."""
        engine = self.engine
        ctx = make_request(req_id, prompt, GEO)
        engine.on_new_request(ctx)
        keys = [chunk_key(ctx, c, GROUP) for c in range(len(prompt) // GROUP.tokens_per_chunk)]
        plan = engine.prepare_store(keys, ctx)
        assert plan is not None
        assert list(plan.keys) == keys
        engine.complete_store(plan.keys, ctx)
        self.step()
        engine.on_request_finished(ctx)
        deadline = time.monotonic() + 30
        while engine.has_pending_work():
            assert time.monotonic() < deadline, "the tier's jobs never finished"
            self.step()
            time.sleep(0.002)
        return keys

    def step(self) -> None:
        self.engine.on_schedule_end()
        self.engine.take_events()

    def close(self) -> None:
        self.engine.shutdown()
        self.sink.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Instance, Instance]]:
    a, b = Instance(tmp_path), Instance(tmp_path)
    yield a, b
    a.close()
    b.close()


def connect(indexer: DynamoIndexer, instance_id: int, instance: Instance) -> None:
    """Register ``instance`` and publish probes (a host-memory block of tokens no prompt
    shares) until one reaches the index, so it asked the replay for anything it missed."""
    sink = instance.sink
    indexer.register(instance_id, sink.endpoint, sink.replay_endpoint, BLOCK)
    base = 900_000 + 1000 * instance_id
    deadline = time.monotonic() + 30
    for n in itertools.count():
        block = list(range(base + n * BLOCK, base + (n + 1) * BLOCK))
        probe = BlockStored([(1 << 62) + base + n], None, block, BLOCK, None, "CPU", None)
        sink.publish(EventBatch(time.time(), [probe]))
        wait = time.monotonic() + 0.2
        while time.monotonic() < wait:
            if indexer.credit(block, instance_id) != NOTHING:
                return
            time.sleep(0.01)
        assert time.monotonic() < deadline, f"no probe reached the index{indexer.context()}"


def test_the_router_credits_every_instance_that_can_load_a_shared_block(
    dynamo_indexer: DynamoIndexer, pair: tuple[Instance, Instance]
) -> None:
    indexer = dynamo_indexer
    a, b = pair
    connect(indexer, 1, a)
    connect(indexer, 2, b)
    stored = [a.serve(p, f"r{i}") for i, p in enumerate(PROMPTS)]

    def observe() -> dict[int, list[int]]:
        b.step()  # b polls its tier: its peer view scans the root
        a.step()
        found = [indexer.credits(p) for p in PROMPTS]
        return {i: [c.get(i, NOTHING).disk for c in found] for i in (1, 2)}

    want = {1: [24, 24, 24], 2: [24, 24, 24]}  # every block of every prompt, on both
    assert indexer.settle(observe, want) == want, indexer.context()
    assert indexer.credit(PROMPTS[0], 2) == Credit(0, 0, 24)  # b holds nothing of its own
    a.tier.delete(stored[0])  # a's blocks of the first prompt go: b can load them no more
    want = {1: [0, 24, 24], 2: [0, 24, 24]}
    assert indexer.settle(observe, want) == want, indexer.context()
