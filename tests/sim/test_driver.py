"""The replay driver on CPU tensors: hits and promotions are counted where they come from,
and the integrity check catches a block that comes back wrong."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import torch

from kvhex.adapters.memory import MemoryTierStore
from kvhex.adapters.torch import TorchBlockTransfer, TorchHostBuffer
from kvhex.domain import KvGeometry, KvGroup, LruPolicy, PrimaryTier
from kvhex.domain.slot_layout import SlotLayout
from kvhex.domain.transfer import TransferResult
from kvhex.errors import ConfigError
from kvhex.service.engine import OffloadEngine
from kvhex.service.tiering import TieringManager
from kvhex.sim.driver import Replay, run_all
from kvhex.sim.workload import Request

LAYERS, PAGE, BPC, TOKENS = 2, 64, 2, 4
GEOMETRY = KvGeometry((KvGroup(0, TOKENS, BPC),), TOKENS)


Stack = tuple[OffloadEngine, TorchBlockTransfer, list[torch.Tensor]]


@pytest.fixture
def tier_and_stack() -> Iterator[tuple[MemoryTierStore, Stack]]:
    layout = SlotLayout([PAGE] * LAYERS, [0] * LAYERS, [BPC])
    host = TorchHostBuffer(8, layout.slot_bytes)
    tier = MemoryTierStore(host, capacity_bytes=64 * layout.slot_bytes, name="mem")
    engine = OffloadEngine(TieringManager(PrimaryTier(8, LruPolicy(8)), [tier], host=host))
    kv = [torch.zeros((64, PAGE), dtype=torch.uint8) for _ in range(LAYERS)]
    transfer = TorchBlockTransfer(host, kv, tensor_groups=[0] * LAYERS, blocks_per_chunk=[BPC])
    yield tier, (engine, transfer, kv)
    transfer.close()
    engine.shutdown()
    host.close()


@pytest.fixture
def stack(tier_and_stack: tuple[MemoryTierStore, Stack]) -> Stack:
    return tier_and_stack[1]


def requests() -> list[Request]:
    a = tuple(range(48))  # 6 chunks of 8 tokens: two requests overflow the 8 host slots
    b = tuple(range(100, 148))
    return [Request("a1", a), Request("b1", b), Request("a2", a + (7,) * 9), Request("b2", b)]


def test_hits_come_from_the_host_and_from_promotions(
    stack: tuple[OffloadEngine, TorchBlockTransfer, list[torch.Tensor]],
) -> None:
    engine, transfer, kv = stack
    replay = Replay(engine, transfer, kv, GEOMETRY, tier_names=["mem"])
    report = run_all(replay, requests())
    assert report.requests == 4
    assert report.chunks == 6 + 6 + 7 + 6
    assert report.hits["mem"] > 0  # b1 pushed a1 out of the host tier: a2 was promoted
    assert report.intact
    assert report.blocks_checked == sum(report.hits.values()) * BPC * LAYERS
    assert report.tiers["mem"][0].nbytes > 0
    assert report.events["BlockStored", "CPU"] > 0
    assert report.placeholders == 0


def test_a_block_that_comes_back_wrong_is_caught(
    stack: tuple[OffloadEngine, TorchBlockTransfer, list[torch.Tensor]],
) -> None:
    engine, transfer, kv = stack
    real_poll = transfer.poll

    def corrupting_poll() -> list[TransferResult]:
        results = real_poll()
        for layer in kv:  # a bit flips in every device block after each copy
            layer[:, 5] ^= 1
        return results

    transfer.poll = corrupting_poll  # type: ignore[method-assign]
    replay = Replay(engine, transfer, kv, GEOMETRY, tier_names=["mem"])
    report = run_all(replay, requests())
    assert report.blocks_bad > 0
    assert not report.intact
    assert report.as_dict()["integrity"]["verdict"] == "CORRUPT"


def test_requests_are_taken_one_at_a_time_until_the_duration_is_up(stack: Stack) -> None:
    engine, transfer, kv = stack
    taken = 0

    def endless() -> Iterator[Request]:
        nonlocal taken
        for i in itertools.count():
            taken += 1
            yield Request(f"r{i}", tuple(range(i, i + 24)))

    told: list[tuple[int, int | None]] = []
    replay = Replay(engine, transfer, kv, GEOMETRY, tier_names=["mem"])
    started = time.perf_counter()
    report = run_all(
        replay,
        endless(),
        duration_s=0.3,
        progress=lambda _, done, total: told.append((done, total)),
    )
    assert time.perf_counter() - started < 10
    assert report.requests == taken > 0  # none was made ahead of its turn
    assert report.seconds >= 0.3
    assert told[-1] == (taken, None)


def test_nothing_loaded_back_is_unchecked_not_intact(stack: Stack) -> None:
    engine, transfer, kv = stack
    replay = Replay(engine, transfer, kv, GEOMETRY, tier_names=["mem"])
    report = run_all(replay, requests()[:1])
    assert report.blocks_checked == 0
    assert report.verdict == "unchecked"
    assert report.as_dict()["integrity"]["verdict"] == "unchecked"
    assert report.ok  # nothing went wrong either


def test_failed_tier_puts_are_reported_and_not_ok(
    tier_and_stack: tuple[MemoryTierStore, Stack],
) -> None:
    tier, (engine, transfer, kv) = tier_and_stack
    tier.fail_next_puts(3)
    replay = Replay(engine, transfer, kv, GEOMETRY, tier_names=["mem"])
    report = run_all(replay, requests())
    assert report.tier_failures == {"mem": {"puts_failed": 3}}
    assert report.as_dict()["tier_failures"] == {"mem": {"puts_failed": 3}}
    assert not report.ok


def test_a_request_larger_than_the_device_cache_names_device_blocks(stack: Stack) -> None:
    engine, transfer, kv = stack
    replay = Replay(engine, transfer, kv, GEOMETRY, tier_names=["mem"])
    with pytest.raises(ConfigError, match=r"\[run\].device_blocks holds: raise it to at least 66"):
        replay.run_request(Request("huge", tuple(range(33 * TOKENS * BPC))))
