"""Two live engines, one shared pool (issue 33): what one engine stored in a pool of kvhex's,
another engine, started beside it with the same configuration, serves from the pool, with the
tokens of a run without offloading. The pool is a Valkey 3-node cluster (the ``valkey`` tier)
or one bucket of a real S3 server (SeaweedFS), written by the ``fsspec`` tier or by the
``obj`` entry (kvhex's NIXL OBJ tier).

Each engine is vLLM's CPU build with kvhex's connector in a process of its own
(tests/vllm/engine_process.py), with host memory of its own and the pool as its one secondary
tier. Engine B starts before A stored anything, so it knows the prefix only from the pool:
its own tier lists nothing at start-up and finds A's blocks by asking the pool. Every hit is
loaded (``loading.mode = "off"``): what is tested is the pool, not the load-or-recompute
decision, which on a busy machine can rightly recompute the tiny model's prefix.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.adapters.storage.valkey.servers import Server, client, start_cluster
from tests.vllm.engine import BLOCK, CHUNK_BYTES, ENGINE_SKIP, PREFIX, prompt
from tests.vllm.engine_process import EngineProcess, side_by_side

pytestmark = [
    pytest.mark.skipif(ENGINE_SKIP is not None, reason=ENGINE_SKIP or ""),
    # the baseline engine runs in this process: its start-up warns about vLLM's deprecations
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

HOST_CHUNKS = 16
"""Each engine's own host memory: room for one prompt's blocks."""
POOL_BYTES = 64 * (CHUNK_BYTES + 4096)
"""The pool's capacity: 64 blocks, each with its 4 KiB header area."""
PROMPT = prompt(0)
"""``PREFIX`` (10 full blocks) and a partial block of its own."""
PREFIX_TOKENS = len(PREFIX)
PREFIX_BLOCKS = PREFIX_TOKENS // BLOCK


@attrs.frozen
class SharedPool:
    """A pool both engines use: their ``secondary_tiers`` entry, and what the pool holds,
    asked of the server itself (each block's offload key in hex)."""

    entry: dict[str, Any]
    blocks: Callable[[], set[str]]


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Three ``valkey-server`` cluster nodes on loopback, for this module's tests."""
    nodes = start_cluster(tmp_path_factory.mktemp("valkey-cluster"))
    yield nodes
    for node in nodes:
        node.kill()


def valkey_pool(nodes: list[Server]) -> SharedPool:
    """A prefix of its own on the cluster (every node a seed), through kvhex's ``valkey``
    tier; its blocks are the keys ``PREFIX/<namespace digest>/<key hex>`` on any node."""
    prefix = f"kv-{uuid.uuid4().hex[:8]}"
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    entry = {
        "type": "KvhexSecondaryTier",
        "tier": "valkey",
        "url": f"valkey://{seeds}/{prefix}",
        "capacity_bytes": POOL_BYTES,
    }

    def blocks() -> set[str]:
        names = set()
        for node in nodes:  # each primary holds its slots' keys
            for name in client(node.port).scan_iter(match=f"{prefix}/*", count=1000):
                names.add(name.decode().rsplit("/", 1)[1])
        return names - {"config.json"}

    return SharedPool(entry, blocks)


def s3_pool(s3: Any, kind: str) -> SharedPool:
    """A bucket of its own on the session's SeaweedFS, written by the ``fsspec`` tier
    (``kind == "fsspec"``) or the ``obj`` entry; its blocks are the objects
    ``kv/<namespace digest>/<k0k1>/<key hex>.blk``."""
    import boto3

    admin = s3.users["admin"]
    bucket = f"kvhex-pool-{uuid.uuid4().hex[:12]}"
    s3_client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id=admin["key"],
        aws_secret_access_key=admin["secret"],
        region_name="us-east-1",
    )
    s3_client.create_bucket(Bucket=bucket)
    entry: dict[str, Any]
    if kind == "fsspec":
        entry = {
            "type": "KvhexSecondaryTier",
            "tier": "fsspec",
            "url": f"s3://{bucket}/kv",
            "capacity_bytes": POOL_BYTES,
            "storage_options": {
                "endpoint_url": s3.endpoint,
                "key": admin["key"],
                "secret": admin["secret"],
            },
        }
    else:
        store = {
            "bucket": bucket,
            "endpoint_override": s3.endpoint,
            "access_key": admin["key"],
            "secret_key": admin["secret"],
        }
        entry = {
            "type": "obj",
            "store_config": store,
            "prefix": "kv",
            "kvhex": {"capacity_bytes": POOL_BYTES},
        }

    def blocks() -> set[str]:
        names = set()
        for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                name = item["Key"].rsplit("/", 1)[1]
                if name.endswith(".blk"):
                    names.add(name.removesuffix(".blk"))
        return names

    return SharedPool(entry, blocks)


@pytest.fixture(params=["valkey", "fsspec", "obj"], ids=["valkey cluster", "s3 fsspec", "s3 obj"])
def pool(request: pytest.FixtureRequest) -> SharedPool:
    """Each pool the engines share, fresh for each test."""
    if request.param == "valkey":
        return valkey_pool(request.getfixturevalue("valkey_cluster"))
    if request.param == "obj":
        pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl==1.5.1) is not installed")
    return s3_pool(request.getfixturevalue("s3_auth_server"), request.param)


def engine_spec(model: Path, tmp_path: Path, name: str, pool: SharedPool) -> dict[str, Any]:
    """An engine with host memory of its own and the pool as its one secondary tier, loading
    every hit, publishing its events on an endpoint of its own."""
    extra = {
        "cpu_bytes_to_use": HOST_CHUNKS * CHUNK_BYTES,
        "secondary_tiers": [pool.entry],
        "kvhex": {"loading": {"mode": "off"}},
    }
    return {
        "model": str(model),
        "extra": extra,
        "events": {
            "endpoint": f"ipc://{tmp_path / f'kv-events-{name}'}",
            "replay_endpoint": f"ipc://{tmp_path / f'kv-replay-{name}'}",
        },
    }


@contextlib.contextmanager
def two_engines(
    model: Path, tmp_path: Path, pool: SharedPool
) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    """Engines A and B on ``pool``, started side by side."""
    specs = {name: engine_spec(model, tmp_path, name, pool) for name in ("a", "b")}
    with side_by_side(specs, tmp_path) as (a, b):
        yield a, b


def test_a_second_engine_serves_the_prefix_the_first_stored_in_the_pool(
    model: Path, baseline: dict[int, list[int]], pool: SharedPool, tmp_path: Path
) -> None:
    with two_engines(model, tmp_path, pool) as (a, b):
        answer, cached = a.generate(PROMPT)
        a.settle()
        held_a = a.pool(PROMPT)
        assert cached == 0  # A computed the prefix ...
        assert all(held_a.tier), held_a  # ... and stored it in the pool
        assert held_a.keys_put == PREFIX_BLOCKS, held_a
        assert pool.blocks() == set(held_a.keys)  # the server holds those blocks, no other

        held_b = b.pool(PROMPT)
        assert held_b.keys == held_a.keys  # one namespace, one key per block
        assert not any(held_b.cpu + held_b.tier), held_b  # B holds none of it
        output, cached = b.generate(PROMPT)
        b.settle()
        held_b = b.pool(PROMPT)
        assert cached == PREFIX_TOKENS  # every block of the prefix loaded, none computed ...
        assert held_b.keys_promoted == PREFIX_BLOCKS, held_b  # ... all of them from the pool
        assert all(held_b.cpu), held_b
        assert held_b.keys_put == 0, held_b  # B stored nothing in the pool
        assert not any(held_b.tier), held_b
        assert pool.blocks() == set(held_a.keys)
    assert answer == output == baseline[0]
