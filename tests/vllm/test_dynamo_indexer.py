"""A real KV-aware router's index on a real engine's events: Dynamo's standalone KV indexer
(tests/dynamo.py) subscribed to vLLM's ZMQ publisher while kvhex offloads (vLLM's CPU build,
offline ``LLM``, one process; tests/vllm/engine.py).

The engine serves a, c, d, a, b, c, d: a and b share a 320-token prefix, c and d are flush
prompts that push it out of the 24-block device cache and of the small host tier, so later
turns are served from kvhex's host and file tiers. Afterwards the indexer credits each prompt
exactly as the device cache and kvhex's tiers hold its blocks, and every prefix kvhex served
at least as many tokens as the engine took from cache, at the tier holding it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.dynamo import Chains, Credit, DynamoIndexer, expected_credit
from tests.vllm.engine import (
    BLOCK,
    CHUNK_BYTES,
    ENGINE_SKIP,
    PREFIX,
    block_hashes,
    flush,
    generate,
    kvhex_manager,
    kvhex_transfer,
    offline_engine,
    prompt,
    scheduler,
)

pytestmark = [
    pytest.mark.skipif(ENGINE_SKIP is not None, reason=ENGINE_SKIP or ""),
    pytest.mark.usefixtures("one_process"),
    # vLLM's engine start-up warns about its own deprecations; kvhex's code warns nothing
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

DEVICE_BLOCKS = 24
HOST_CHUNKS = 16
"""Room for one flush prompt's 14 chunks: the next one evicts the shared prefix."""


def int64(block_hash: bytes) -> int:
    """A hash as vLLM publishes it by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def settle(llm: Any) -> None:
    """Step until every tier job finished (prompts shorter than a block store nothing)."""
    manager = kvhex_manager(llm)
    for _ in range(200):
        if not manager.has_pending_work():
            return
        generate(llm, [7, 8, 9])
    raise AssertionError("kvhex still had work in flight after 200 steps")


def held_now(llm: Any) -> dict[str, list[int]]:
    """The blocks (published hashes) the device cache, host memory and the file tier hold."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    manager = kvhex_manager(llm)
    (files,) = manager.tier_stores
    device = scheduler(llm).kv_cache_manager.block_pool.cached_block_hash_to_block._cache
    return {
        "gpu": [int64(get_block_hash(k)) for k in device],
        "cpu": [int64(k[:-4]) for k in manager.engine.host_keys()],
        "disk": [int64(k[:-4]) for k in files.keys()],  # noqa: SIM118 (a tier, no mapping)
    }


def test_the_indexer_credits_each_prefix_kvhex_served_at_the_tier_holding_it(
    model: Path, dynamo_indexer: DynamoIndexer, tmp_path: Path
) -> None:
    from vllm.config import KVEventsConfig

    indexer = dynamo_indexer
    # vLLM's publisher binds ipc and wildcard endpoints (and connects to any other): ipc keeps
    # it off the network, and no port picked free can be taken before the engine binds it
    endpoint = f"ipc://{tmp_path / 'kv-events'}"
    replay = f"ipc://{tmp_path / 'kv-replay'}"
    events = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay
    )
    config = kvhex_transfer(
        {
            "cpu_bytes_to_use": HOST_CHUNKS * CHUNK_BYTES,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(tmp_path / "files"),
                    "enable_kv_events": True,
                    "kvhex": {"capacity_bytes": 64 << 20},
                }
            ],
            # every hit loaded: the indexer's credit is tested, not the load-or-recompute
            # decision (which recomputes the tiny model's prefix once a load's steps are known)
            "kvhex": {"loading": {"mode": "off"}},
        }
    )
    a, b, c, d = prompt(0), prompt(1), flush(0), flush(1)
    assert len(PREFIX) == 320
    assert a[: len(PREFIX)] == b[: len(PREFIX)]
    turns = [a, c, d, a, b, c, d]
    chains = Chains(BLOCK)
    served: list[tuple[list[int], int]] = []  # (prompt, cached tokens) of turns kvhex served
    with offline_engine(
        model,
        kv_transfer_config=config,
        kv_events_config=events,
        num_gpu_blocks_override=DEVICE_BLOCKS,
    ) as llm:
        indexer.register(1, endpoint, replay, BLOCK)
        manager = kvhex_manager(llm)
        for tokens in turns:
            loads = manager.stats().primary.loads
            output, cached = generate(llm, tokens)
            settle(llm)
            # the device caches blocks the generated tokens complete too
            sequence = [*tokens, *output]
            chains.add(sequence, [int64(h) for h in block_hashes(sequence)])
            if manager.stats().primary.loads > loads:
                served.append((tokens, cached))
        held = {tier: chains.held(blocks) for tier, blocks in held_now(llm).items()}
        want = {i: expected_credit(p, BLOCK, **held) for i, p in enumerate((a, b, c, d))}

        def observe() -> dict[int, Credit]:
            return {i: indexer.credit(p) for i, p in enumerate((a, b, c, d))}

        got = indexer.settle(observe, want)  # while the publisher can still replay
    assert len(served) >= 3, served  # the second a, c and d came from kvhex's tiers
    assert got == want, indexer.context()
    for tokens, cached in served:
        blocks = {tuple(tokens[: (i + 1) * BLOCK]) for i in range(cached // BLOCK)}
        tier = "cpu" if blocks <= held["gpu"] | held["cpu"] else "disk"
        credit = indexer.credit(tokens)
        assert getattr(credit, tier) >= cached, (tier, credit, cached, indexer.context())
