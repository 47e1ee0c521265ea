"""Two live engines on one file root, and a real KV-aware router's index (Dynamo's standalone
KV indexer, tests/dynamo.py) subscribed to both: a block either engine can load from the shared
root is credited to both, and to neither once it is gone (docs/tiers.md, "The peer view").

Each engine is vLLM's CPU build with kvhex's connector in a process of its own
(tests/vllm/engine_process.py), publishing on its own ZMQ endpoint: engine A is instance 1,
engine B instance 2. Both run one file tier on the same root; A's holds 15 blocks, so that a
flush prompt evicts everything A stored before it. Without the peer view the index credits B
nothing of what A stored, although B loads it: the second test is that control.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.dynamo import NOTHING, Credit, DynamoIndexer, expected_credit
from tests.vllm.engine import BLOCK, CHUNK_BYTES, ENGINE_SKIP, PREFIX, flush, prompt
from tests.vllm.engine_process import EngineProcess, Held, side_by_side

pytestmark = pytest.mark.skipif(ENGINE_SKIP is not None, reason=ENGINE_SKIP or "")

HOST_CHUNKS = 16
"""Host memory for one flush prompt's blocks: two flush prompts evict every earlier one."""
FILE_BLOCK_BYTES = CHUNK_BYTES + 4096
"""What one block costs in the file tier (its 4 KiB header area included)."""
OWNER_FILE_BLOCKS = 15
"""A's file tier: one flush prompt's 15 blocks, so each flush evicts everything older."""
PEER_SCAN_S = 0.2
"""How often each engine's peer view scans the root (when the view is on)."""
PROMPT = prompt(0)
"""The prompt A serves first: ``PREFIX`` (10 full blocks) and a partial block of its own."""
PREFIX_TOKENS = len(PREFIX)


def engine_spec(
    model: Path, tmp_path: Path, name: str, *, peers: bool, file_blocks: int
) -> dict[str, Any]:
    """An engine with a small host tier and a file tier on the shared root ``tmp_path/files``
    (its blocks announced ``LOCAL``, which Dynamo credits), publishing on its own endpoint."""
    kvhex: dict[str, Any] = {"capacity_bytes": file_blocks * FILE_BLOCK_BYTES}
    if peers:
        kvhex |= {"announce_peers": True, "peer_scan_interval_s": PEER_SCAN_S}
    files = {
        "type": "fs",
        "root_dir": str(tmp_path / "files"),
        "enable_kv_events": True,
        "locality": "LOCAL",
        "kvhex": kvhex,
    }
    return {
        "model": str(model),
        "extra": {
            "cpu_bytes_to_use": HOST_CHUNKS * CHUNK_BYTES,
            "secondary_tiers": [files],
            # every hit loaded: the router's credit is tested, not the load-or-recompute
            # decision (which recomputes the tiny model's prefix once a load's steps are known)
            "kvhex": {"loading": {"mode": "off"}},
        },
        # vLLM's publisher binds ipc endpoints: no port to find free, nothing on the network
        "events": {
            "endpoint": f"ipc://{tmp_path / f'kv-events-{name}'}",
            "replay_endpoint": f"ipc://{tmp_path / f'kv-replay-{name}'}",
        },
    }


@contextlib.contextmanager
def two_engines(
    model: Path, tmp_path: Path, *, peers: bool
) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    """Engines A (the owner: a small file tier) and B (room to spare), started side by
    side, each with the peer view on or off."""
    specs = {
        "a": engine_spec(model, tmp_path, "a", peers=peers, file_blocks=OWNER_FILE_BLOCKS),
        "b": engine_spec(model, tmp_path, "b", peers=peers, file_blocks=256),
    }
    with side_by_side(specs, tmp_path) as (a, b):
        yield a, b


def connect(indexer: DynamoIndexer, instance_id: int, engine: EngineProcess) -> None:
    """Register ``engine`` as ``instance_id`` and wait until its stream reaches the index."""
    events = engine.spec["events"]
    indexer.register(instance_id, events["endpoint"], events["replay_endpoint"], BLOCK)
    await_stream(indexer, instance_id, engine, 0)


def await_stream(indexer: DynamoIndexer, instance_id: int, engine: EngineProcess, tag: int) -> None:
    """Serve probes (a block of tokens no other prompt shares) until one reaches the index:
    the indexer then has asked the replay for anything it missed, and has everything the
    engine published before (one publisher's batches arrive in order)."""
    deadline = time.monotonic() + 60
    for n in itertools.count():
        probe = [1000 + instance_id, tag, n, *range(BLOCK - 3)]
        engine.generate(probe)
        wait = time.monotonic() + 0.5
        while time.monotonic() < wait:
            if indexer.credit(probe, instance_id) != NOTHING:
                return
            time.sleep(0.01)
        assert time.monotonic() < deadline, f"no probe reached the index{indexer.context()}"


def blocks(tokens: list[int], flags: list[bool]) -> frozenset[tuple[int, ...]]:
    """The token prefixes ending the blocks of ``tokens`` that ``flags`` mark."""
    return frozenset(tuple(tokens[: (i + 1) * BLOCK]) for i, held in enumerate(flags) if held)


def credit_of(held: Held, *, peers: bool) -> Credit:
    """What the index should credit an engine with for ``PROMPT``: its device's blocks, its
    host memory's, and on disk its own file tier's, or with the peer view every block on the
    root."""
    disk = held.root if peers else held.disk
    return expected_credit(
        PROMPT,
        BLOCK,
        gpu=blocks(PROMPT, held.gpu),
        cpu=blocks(PROMPT, held.cpu),
        disk=blocks(PROMPT, disk),
    )


def test_both_engines_are_credited_for_a_prefix_one_stored_and_neither_once_it_left(
    model: Path, dynamo_indexer: DynamoIndexer, tmp_path: Path
) -> None:
    indexer = dynamo_indexer
    with two_engines(model, tmp_path, peers=True) as (a, b):
        connect(indexer, 1, a)
        connect(indexer, 2, b)
        answer, cached = a.generate(PROMPT)
        a.settle()
        assert cached == 0
        held_a, held_b = a.held(PROMPT), b.held(PROMPT)
        assert all(held_a.disk), held_a  # A stored the prefix in its own file tier
        assert all(held_b.root), held_b  # B finds it on the root
        assert not any(held_b.gpu + held_b.cpu + held_b.disk), held_b  # B holds none of it
        want_b = credit_of(held_b, peers=True)
        assert want_b == Credit(0, 0, PREFIX_TOKENS)  # only the peer view can credit B

        def observe() -> tuple[dict[int, Credit], bool]:
            a.step()  # each engine polls its tier: its peer view scans the root
            b.step()
            ha, hb = a.held(PROMPT), b.held(PROMPT)
            views = (ha.peer_blocks, hb.peer_blocks) == (hb.own_blocks, ha.own_blocks)
            return {1: indexer.credit(PROMPT, 1), 2: indexer.credit(PROMPT, 2)}, views

        # each view announces exactly what the other engine holds
        want = ({1: credit_of(held_a, peers=True), 2: want_b}, True)
        assert want[0][1].disk == PREFIX_TOKENS
        assert indexer.settle(observe, want) == want, indexer.context()

        # B can load it: from the shared root, the tokens A computed
        output, cached = b.generate(PROMPT)
        b.settle()
        assert (output, cached) == (answer, PREFIX_TOKENS)
        held_b = b.held(PROMPT)
        assert all(held_b.cpu), held_b  # promoted into B's host memory ...
        assert not any(held_b.disk), held_b  # ... and never stored in B's own file tier

        # The owner evicts it. A's two flush prompts push the prefix out of A's device cache
        # (16 usable blocks: one flush prompt takes all 16), host memory (16 chunks: each
        # flush prompt stores up to 15) and file tier (15 blocks, least recently used
        # first). B's two flush prompts push it out of B's device cache and host memory,
        # the same way; B never stored it on the root (above). So no engine holds any block
        # of the prefix in any medium, its own or the root (checked below), and the index
        # must credit neither with any of it: no gpu or cpu block to start a match, no disk
        # block to continue one. Each view still announces exactly what the other engine
        # holds (the flush prompts' blocks).
        for turn in (0, 1):
            a.generate(flush(turn))
        a.settle()
        for turn in (2, 3):
            b.generate(flush(turn))
        b.settle()
        for engine in (a, b):
            held = engine.held(PROMPT)
            assert not any(held.gpu + held.cpu + held.disk + held.root), held
        want = ({1: NOTHING, 2: NOTHING}, True)
        assert indexer.settle(observe, want) == want, indexer.context()


def test_without_the_peer_view_the_engine_that_did_not_store_a_prefix_is_not_credited(
    model: Path, dynamo_indexer: DynamoIndexer, tmp_path: Path
) -> None:
    indexer = dynamo_indexer
    with two_engines(model, tmp_path, peers=False) as (a, b):
        connect(indexer, 1, a)
        connect(indexer, 2, b)
        answer, _ = a.generate(PROMPT)
        a.settle()
        held_b = b.held(PROMPT)
        assert all(held_b.root), held_b
        assert not any(held_b.gpu + held_b.cpu + held_b.disk), held_b
        # B steps for as long as a few scans of the view would take (it has none), then
        # serves a probe: once it reached the index, so did everything B published before
        until = time.monotonic() + 5 * PEER_SCAN_S
        while time.monotonic() < until:
            b.step()
        await_stream(indexer, 2, b, 1)
        want = {1: credit_of(a.held(PROMPT), peers=False), 2: NOTHING}
        assert want[1].disk == PREFIX_TOKENS

        def observe() -> dict[int, Credit]:
            return {1: indexer.credit(PROMPT, 1), 2: indexer.credit(PROMPT, 2)}

        assert indexer.settle(observe, want) == want, indexer.context()
        # yet B loads it from the shared root: the router just does not know
        output, cached = b.generate(PROMPT)
        assert (output, cached) == (answer, PREFIX_TOKENS)
