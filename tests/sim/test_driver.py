"""The replay driver on CPU tensors: hits and promotions are counted where they come from,
and the integrity check catches a block that comes back wrong."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvhex.adapters.memory import MemoryTierStore
from kvhex.adapters.torch import TorchBlockTransfer, TorchHostBuffer
from kvhex.domain import KvGeometry, KvGroup, LruPolicy, PrimaryTier
from kvhex.domain.slot_layout import SlotLayout
from kvhex.domain.transfer import TransferResult
from kvhex.service.engine import OffloadEngine
from kvhex.service.tiering import TieringManager
from kvhex.sim.driver import Replay, run_all
from kvhex.sim.workload import Request

LAYERS, PAGE, BPC, TOKENS = 2, 64, 2, 4
GEOMETRY = KvGeometry((KvGroup(0, TOKENS, BPC),), TOKENS)


@pytest.fixture
def stack() -> Iterator[tuple[OffloadEngine, TorchBlockTransfer, list[torch.Tensor]]]:
    layout = SlotLayout([PAGE] * LAYERS, [0] * LAYERS, [BPC])
    host = TorchHostBuffer(8, layout.slot_bytes)
    tier = MemoryTierStore(host, capacity_bytes=64 * layout.slot_bytes, name="mem")
    engine = OffloadEngine(TieringManager(PrimaryTier(8, LruPolicy(8)), [tier], host=host))
    kv = [torch.zeros((64, PAGE), dtype=torch.uint8) for _ in range(LAYERS)]
    transfer = TorchBlockTransfer(host, kv, tensor_groups=[0] * LAYERS, blocks_per_chunk=[BPC])
    yield engine, transfer, kv
    transfer.close()
    engine.shutdown()
    host.close()


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
