"""kvhex inside a real vLLM engine on the CPU (vLLM's CPU build, offline ``LLM``, one process).

Every scenario runs the same prompts as a baseline engine without offloading and without a
prefix cache (everything recomputed), and requires identical greedy tokens. The device prefix
cache holds 16 blocks, so a flush prompt between turns evicts the shared prefix from it: a
later turn finds the prefix only where kvhex kept it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

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

TURNS = range(4)  # the turns the session's baseline holds (conftest.baseline)
HOST_CHUNKS = 256
SMALL_HOST_CHUNKS = 16
"""Room for one flush's 14 chunks (a request's stores must fit at once), so two flushes evict
the prefix from host memory too (``evict``)."""


LOADING_OFF = {"loading": {"mode": "off"}}
"""Every hit loaded: these tests are of the tiers serving the prefix, not of the
load-or-recompute decision (the tiny model's prefill is so fast that, once a load's steps
are measured, recomputing its 320-token prefix is the faster choice; the decision is tested by
``test_the_ttft_bench_reports_each_tier_loaded_recomputed_and_decided`` here and in
``tests/vllm/test_connector.py``)."""


def host_only(chunks: int = HOST_CHUNKS) -> dict[str, Any]:
    return {"cpu_bytes_to_use": chunks * CHUNK_BYTES, "kvhex": dict(LOADING_OFF)}


def with_files(root: Path, chunks: int = SMALL_HOST_CHUNKS) -> dict[str, Any]:
    return {
        **host_only(chunks),
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": str(root),
                "enable_kv_events": True,
                "kvhex": {"capacity_bytes": 64 << 20},
            }
        ],
    }


def run_turns(
    llm: Any, served_by: Any, between: Any
) -> tuple[list[list[int]], list[int], list[int]]:
    """Every turn's prompt: its greedy tokens, its cached tokens, and how much
    ``served_by(llm)`` grew during it; ``between(llm, turn)`` runs after each turn."""
    outputs, cached, served = [], [], []
    for t in TURNS:
        before = served_by(llm)
        tokens, hit = generate(llm, prompt(t))
        outputs.append(tokens)
        cached.append(hit)
        served.append(served_by(llm) - before)
        between(llm, t)
    return outputs, cached, served


def one_flush(llm: Any, turn: int) -> None:
    """A flush prompt: the prefix leaves the 16-block device cache."""
    generate(llm, flush(turn))


def assert_prefix_served(
    outputs: list[list[int]],
    cached: list[int],
    served: list[int],
    baseline: list[list[int]],
    at_least: int,
) -> None:
    """The baseline's tokens in every turn; from the second on, the whole prefix cached with
    at least ``at_least`` chunks of it served by the tier."""
    assert outputs == baseline
    for t in TURNS[1:]:
        assert cached[t] == len(PREFIX), f"turn {t}"
        assert served[t] >= at_least, f"turn {t}"


def in_turns(baseline: dict[int, list[int]]) -> list[list[int]]:
    return [baseline[t] for t in TURNS]


def evict(llm: Any, turn: int) -> None:
    """Two flush prompts: the prefix leaves the device and a host tier of
    ``SMALL_HOST_CHUNKS``; every job they started has finished."""
    for f in (2 * turn, 2 * turn + 1):
        generate(llm, flush(f))
    settle(llm)


def settle(llm: Any) -> None:
    """Step until every tier job finished (prompts shorter than a block store nothing)."""
    manager = kvhex_manager(llm)
    for _ in range(200):
        if not manager.has_pending_work():
            return
        generate(llm, [7, 8, 9])
    raise AssertionError("kvhex still had work in flight after 200 steps")


def file_tier(llm: Any) -> Any:
    (store,) = kvhex_manager(llm).tier_stores
    return store


def promoted(llm: Any) -> int:
    return int(kvhex_manager(llm).stats().tiers[0].keys_promoted)


def host_loads(llm: Any) -> int:
    return int(kvhex_manager(llm).stats().primary.loads)


def test_host_memory_serves_a_prefix_the_device_lost(
    model: Path, baseline: dict[int, list[int]]
) -> None:
    with offline_engine(model, kv_transfer_config=kvhex_transfer(host_only())) as llm:
        outputs, cached, loads = run_turns(llm, host_loads, one_flush)
    assert cached[0] == 0
    # the device kept at most one block of the prefix: the host tier served the rest
    assert_prefix_served(outputs, cached, loads, in_turns(baseline), at_least=9)


def test_a_third_party_transfer_named_in_vllms_config_moves_the_host_tiers_bytes(
    model: Path,
    baseline: dict[int, list[int]],
    counting_site: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kvhex.transfer`` picks the CPU worker's copier from the ``kvhex.transfers`` entry
    points as ``[run] transfer`` does for ``kvhex run``: the example counting transfer,
    installed as a user would, does every store and load of the engine's host tier."""
    monkeypatch.syspath_prepend(str(counting_site))  # its entry point, as pip installed it
    report = tmp_path / "counts.json"
    extra = {
        **host_only(),
        "kvhex": {
            **LOADING_OFF,
            "transfer": "counting",
            "transfer_options": {"report_path": str(report)},
        },
    }
    with offline_engine(model, kv_transfer_config=kvhex_transfer(extra)) as llm:
        outputs, cached, loads = run_turns(llm, host_loads, one_flush)
        stats = kvhex_manager(llm).stats().primary
    assert_prefix_served(outputs, cached, loads, in_turns(baseline), at_least=9)
    counts = json.loads(report.read_text())  # written when the worker closed its transfer
    assert counts["store"]["failed"] == counts["load"]["failed"] == 0
    assert counts["store"]["jobs"] > 0
    assert counts["load"]["jobs"] > 0
    assert counts["load"]["nbytes"] >= sum(loads) * CHUNK_BYTES
    assert stats.loads == sum(loads)


def _x86_fp8_kv() -> bool:
    """Whether this CPU has what vLLM's CPU attention needs for an fp8 KV cache."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512f" in flags or "amx_tile" in flags


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            {"kv_cache_dtype": "fp8"},
            marks=pytest.mark.skipif(
                not _x86_fp8_kv(),
                reason="vLLM's CPU backend keeps an fp8 KV cache only on x86 with AVX-512 or "
                "AMX, which this CPU lacks: run on a machine whose /proc/cpuinfo lists avx512f "
                "or amx_tile",
            ),
        ),
        {"dtype": "float16"},
        {"dtype": "float32"},
        {"block_size": 2 * BLOCK, "num_gpu_blocks_override": 9},
    ],
    ids=["fp8 KV cache", "float16", "float32", "64-token blocks"],
)
def test_every_kv_layout_of_the_cpu_backend_round_trips_through_host_memory(
    model: Path, layout: dict[str, Any]
) -> None:
    """The CPU attention backend keeps one layout (blocks, heads, tokens, K and V), in the
    model's dtype or fp8, with blocks of any multiple of 32 tokens: each against its own
    baseline."""
    with offline_engine(model, enable_prefix_caching=False, **layout) as llm:
        baseline = [generate(llm, prompt(t))[0] for t in TURNS]
    with offline_engine(model, kv_transfer_config=kvhex_transfer(host_only()), **layout) as llm:
        outputs, cached, loads = run_turns(llm, host_loads, one_flush)
    chunks = len(PREFIX) // layout.get("block_size", BLOCK)
    assert_prefix_served(outputs, cached, loads, baseline, at_least=chunks - 1)


def test_the_file_tier_serves_the_prefix_when_host_memory_is_too_small(
    model: Path, baseline: dict[int, list[int]], tmp_path: Path
) -> None:
    with offline_engine(model, kv_transfer_config=kvhex_transfer(with_files(tmp_path))) as llm:
        outputs, cached, from_files = run_turns(llm, promoted, evict)
    assert_prefix_served(outputs, cached, from_files, in_turns(baseline), at_least=9)


def test_a_reset_with_the_connector_then_hits_again(
    model: Path, baseline: dict[int, list[int]], tmp_path: Path
) -> None:
    """A reset while a device -> host copy is still due (a request finished in the step
    before, its store not yet run by the worker): promotions wait until vLLM's workers
    flushed that copy (vLLM 0.33 says so; on 0.32 kvhex counts steps), then the file tier,
    which kept its data, serves the prefix again."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs, cached, from_files = {}, {}, {}
    with offline_engine(model, kv_transfer_config=kvhex_transfer(with_files(tmp_path))) as llm:
        manager = kvhex_manager(llm)
        outputs[0], _ = generate(llm, prompt(0))
        settle(llm)
        engine = llm.llm_engine
        once = SamplingParams(temperature=0, max_tokens=1)
        engine.add_request("due", TokensPrompt(prompt_token_ids=flush(9)), once)
        while engine.has_unfinished_requests():  # prefill: its store job goes out next step
            engine.step()
        assert manager.stats().primary.pending > 0
        assert llm.reset_prefix_cache(reset_connector=True)
        assert manager.stats().primary.resident == 0
        assert manager.promotions_held
        for t in TURNS[1:]:
            evict(llm, t)
            assert not manager.promotions_held
            before = promoted(llm)
            outputs[t], cached[t] = generate(llm, prompt(t))
            from_files[t] = promoted(llm) - before
    assert outputs == baseline
    for t in TURNS[1:]:
        assert cached[t] == len(PREFIX), f"turn {t}"
        assert from_files[t] >= 9, f"turn {t}"


def test_an_engine_restart_on_the_same_root_hits_from_files_at_once(
    model: Path, baseline: dict[int, list[int]], tmp_path: Path
) -> None:
    config = kvhex_transfer(with_files(tmp_path))
    with offline_engine(model, kv_transfer_config=config) as llm:
        first, _ = generate(llm, prompt(0))
        settle(llm)
    with offline_engine(model, kv_transfer_config=config) as llm:
        second, cached = generate(llm, prompt(1))
        from_files = promoted(llm)
    assert [first, second] == [baseline[0], baseline[1]]
    assert cached == len(PREFIX)
    assert from_files == len(PREFIX) // BLOCK  # an empty device and host: all from files


def test_a_corrupted_block_is_recomputed_never_served(
    model: Path, baseline: dict[int, list[int]], tmp_path: Path
) -> None:
    hashes = block_hashes(prompt(0))
    with offline_engine(model, kv_transfer_config=kvhex_transfer(with_files(tmp_path))) as llm:
        outputs = {0: generate(llm, prompt(0))[0]}
        evict(llm, 0)
        store = file_tier(llm)
        victim = hashes[5] + (0).to_bytes(4, "big")
        path, offset = store.location(victim)
        with open(path, "r+b") as f:  # one payload byte of the prefix's sixth chunk
            f.seek(offset + 4096 + 100)
            byte = f.read(1)
            f.seek(offset + 4096 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        outputs[1], cached = generate(llm, prompt(1))
        stats = kvhex_manager(llm).stats().tiers[0]
        failed = stats.keys_failed_to_promote
        evict(llm, 1)
        outputs[2], cached_again = generate(llm, prompt(2))
    assert outputs == {t: baseline[t] for t in range(3)}
    assert failed == 1
    assert cached == 5 * BLOCK  # the chunks before the corrupt one, nothing after it
    assert cached_again == len(PREFIX)  # the recomputed chunk was stored again


def test_a_hybrid_model_offloads_both_kv_groups_on_their_shared_tensors(
    tmp_path: Path,
) -> None:
    """Sliding-window and full-attention layers: vLLM's hybrid allocator makes two KV-cache
    groups that overlay the same KV tensors; kvhex's worker stores and loads both."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvhex.vllm.worker import KvhexCpuOffloadingWorker
    from tests.vllm.engine import hybrid_model

    model = hybrid_model(tmp_path / "gemma2")
    blocks = 2 * 17  # the two groups share the device blocks
    with offline_engine(model, enable_prefix_caching=False, num_gpu_blocks_override=blocks) as llm:
        baseline = [generate(llm, prompt(t))[0] for t in TURNS]
    transfer = kvhex_transfer(host_only())
    with offline_engine(model, kv_transfer_config=transfer, num_gpu_blocks_override=blocks) as llm:
        groups = scheduler(llm).kv_cache_config.kv_cache_groups
        worker = get_kv_transfer_group().connector_worker.worker
        outputs, cached, loads = run_turns(llm, host_loads, one_flush)
        shared = worker.transfer.layout.tensor_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == [
        "SlidingWindowSpec",
        "FullAttentionSpec",
    ]
    assert isinstance(worker, KvhexCpuOffloadingWorker)
    assert (0, 1) in shared  # a KV tensor of both groups
    assert_prefix_served(outputs, cached, loads, baseline, at_least=9)


def test_events_on_vllms_zmq_publisher_are_full_and_replay_to_each_tiers_residency(
    model: Path, baseline: dict[int, list[int]], tmp_path: Path
) -> None:
    import time

    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    # vLLM's publisher binds wildcard and ipc endpoints (and connects to the rest); an ipc
    # endpoint keeps it off every network interface
    endpoint = f"ipc://{tmp_path / 'kv-events'}"
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    batches: list[Any] = []
    decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def receive(quiet_ms: int) -> None:
        while sub.poll(quiet_ms):
            *_, payload = sub.recv_multipart()
            batches.append(decoder.decode(payload))

    outputs = {}
    try:
        config = kvhex_transfer(with_files(tmp_path))
        with offline_engine(model, kv_transfer_config=config, kv_events_config=events) as llm:
            sub.connect(endpoint)
            time.sleep(0.5)  # subscribed before the first event
            for t in TURNS:
                outputs[t], _ = generate(llm, prompt(t))
                evict(llm, t)
            receive(1000)
            manager = kvhex_manager(llm)
            in_files = file_tier(llm).keys()
            truth = {
                ("CPU", None): Counter(
                    maybe_convert_block_hash(k[:-4]) for k in manager.engine.host_keys()
                ),
                ("STORAGE", None): Counter(maybe_convert_block_hash(k[:-4]) for k in in_files),
                ("GPU", None): Counter(
                    maybe_convert_block_hash(get_block_hash(k))
                    for k in scheduler(
                        llm
                    ).kv_cache_manager.block_pool.cached_block_hash_to_block._cache
                ),
            }
    finally:
        sub.close(0)
        context.term()
    assert outputs == baseline

    replay: dict[tuple[str, str | None], Counter[Any]] = {}
    media: set[str] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                replay.clear()
            elif isinstance(event, BlockStored):
                media.add(str(event.medium))
                assert event.block_size == BLOCK, event
                assert len(event.token_ids) == BLOCK * len(event.block_hashes), event
                # parent first, across the GPU's events and kvhex's: a radix tree takes it
                parent = event.parent_block_hash
                assert parent is None or any(r[parent] > 0 for r in replay.values()), event
                residency = replay.setdefault((str(event.medium), event.ownership), Counter())
                residency.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                residency = replay.setdefault((str(event.medium), event.ownership), Counter())
                residency.subtract(event.block_hashes)
    assert media == {"GPU", "CPU", "STORAGE"}
    for where, expected in truth.items():
        held = {h for h, n in replay.get(where, Counter()).items() if n > 0}
        assert held == set(expected), where


def test_the_ttft_bench_reports_each_tier_loaded_recomputed_and_decided() -> None:
    import json
    import subprocess
    import sys

    bench = Path(__file__).parent.parent.parent / "bench" / "vllm_e2e.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--quick", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    document = json.loads(out.stdout)
    assert document["bench"] == "vllm_e2e"
    rows = document["rows"]
    assert [row["tier"] for row in rows] == ["host", "file", "slow"]
    for row in rows:
        assert row["baseline_name"] == "faster of load and recompute"
        assert row["ratio"] > 0
        assert row["kvhex"] == row["ttft_decided_s"]
        assert row["baseline"] == min(row["ttft_load_s"], row["ttft_recompute_s"])
    # host memory: loaded, or recomputed where a load's measured step costs more than the
    # 256-token prefill (the quick model's prefill is fast); which depends on the machine
    assert rows[0]["decision"] in {"load", "recompute"}
    assert all(row["ratio_low"] is not None for row in rows)  # several passes: intervals
    # the slow tier's reads take 10x the recompute (--quick): loading loses, kvhex recomputes
    assert rows[2]["ttft_load_s"] > rows[2]["ttft_recompute_s"]
    assert rows[2]["decision"] == "recompute"
    assert "first tokens equal to recompute in every pass: yes" in out.stderr
