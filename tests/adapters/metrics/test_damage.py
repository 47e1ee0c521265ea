"""An operator sees a corrupt block: a file tier built from a configuration, one block spoiled
on disk, a get that finds it; the tier's damage counts in the engine's stats and in a real
Prometheus scrape over HTTP."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.metrics.prometheus import register_metrics, serve_metrics
from kvhex.adapters.storage.format import HEADER_AREA
from kvhex.bootstrap import build_engine
from kvhex.config import load_config
from kvhex.domain import LookupResult, ReqContext
from kvhex.plugins import Registry
from kvhex.ports import TierHealth
from kvhex.service import OffloadEngine
from tests.adapters.metrics.scrape import scrape, value
from tests.service.harness import keys

SLOT = 4096
FILES = {"tier": "files", "medium": "STORAGE"}


def _step(engine: OffloadEngine) -> None:
    """One scheduler step; the file tier works on its own threads meanwhile."""
    engine.on_schedule_end()
    time.sleep(0.002)


def _settle(engine: OffloadEngine) -> None:
    """Step until no job is in flight."""
    deadline = time.monotonic() + 10
    while engine.has_pending_work():
        assert time.monotonic() < deadline, "the file tier never finished its jobs"
        _step(engine)


def _spoil(path: str, offset: int) -> None:
    """Flip the first payload byte of the block whose header is at ``offset`` in ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset + HEADER_AREA)
        byte = f.read(1)
        f.seek(offset + HEADER_AREA)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_block_reaches_the_stats_and_a_prometheus_scrape(tmp_path: Path) -> None:
    config = load_config(
        {
            "primary": {"capacity_bytes": 4 * SLOT},
            "tiers": [
                {
                    "type": "fsspec",
                    "name": "files",
                    "options": {"url": str(tmp_path), "capacity_bytes": 16 * SLOT},
                }
            ],
            "loading": {"mode": "off"},
        }
    )
    host = MemoryHostBuffer(4, SLOT)
    engine, (files,) = build_engine(config, host, Registry.discover())
    registry = CollectorRegistry()
    register_metrics(engine, registry)
    server = serve_metrics(registry, "127.0.0.1:0")
    try:
        assert isinstance(files, TierHealth)
        writer = ReqContext("writer")
        plan = engine.prepare_store(keys(1, 2), writer)
        assert plan is not None
        for slot in plan.slots:
            host.slot_view(slot)[:] = bytes([slot + 1]) * SLOT
        engine.complete_store(plan.keys, writer)  # cascades both chunks to the file tier
        engine.on_request_finished(writer)
        _settle(engine)
        before = scrape(server.url)
        assert value(before, "kvhex_tier_corrupt_blocks_total", **FILES) == 0
        engine.reset()  # host memory forgets the chunks; the file tier keeps them

        _spoil(*files.location(keys(1)[0]))
        reader = ReqContext("reader")
        deadline = time.monotonic() + 10
        while True:  # probe, promote, read: the damaged block is never served
            answers = [engine.lookup(k, reader) for k in keys(1, 2)]
            if LookupResult.RETRY not in answers and LookupResult.HIT_PENDING not in answers:
                break
            assert time.monotonic() < deadline, f"still {answers}"
            _step(engine)
        assert answers == [LookupResult.MISS, LookupResult.HIT]
        engine.take_events()

        tier = engine.stats().tiers[0]
        assert (tier.corrupt_blocks, tier.lost_blocks, tier.io_errors) == (1, 1, 0)
        assert tier.keys_failed_to_promote == 1
        assert tier.blocks_removed == 1  # announced removed, so routers forget it too
        after = scrape(server.url)
        assert value(after, "kvhex_tier_corrupt_blocks_total", **FILES) == 1
        assert value(after, "kvhex_tier_lost_blocks_total", **FILES) == 1
        assert value(after, "kvhex_tier_io_errors_total", **FILES) == 0
        assert value(after, "kvhex_tier_evictions_total", **FILES) == 1
    finally:
        server.close()
        engine.shutdown()
