"""The Prometheus collector scraped over real HTTP: values agree with the engine's stats, the
host application's registry is the only one touched, and bad addresses are named."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from kvhex.adapters.metrics.prometheus import (
    METRICS,
    parse_metrics_address,
    register_metrics,
    serve_metrics,
)
from kvhex.domain import ReqContext
from kvhex.errors import ConfigError
from kvhex.service import EventPipeline, OffloadEngine
from tests.adapters.metrics.scrape import scrape, value
from tests.service.harness import SLOT_BYTES, World


class _Sink:
    def __init__(self) -> None:
        self.batches = 0

    def publish(self, batch: object) -> None:
        self.batches += 1

    def close(self) -> None:
        pass


SINK = _Sink()


@pytest.fixture
def world() -> Iterator[tuple[World, OffloadEngine]]:
    world = World(num_slots=2, tiers=1, tier_capacity_slots=3)
    SINK.batches = 0
    engine = OffloadEngine(world.manager, EventPipeline(sinks=[SINK]))
    yield world, engine
    engine.shutdown()


def _work(world: World, engine: OffloadEngine) -> None:
    a = ReqContext("a")
    for ids in ([1, 2], [3, 4]):
        world.store(ids, a)
        for tier in world.tiers:
            tier.drain()
        world.step(2)
        engine.take_events()
    b = ReqContext("b")
    world.lookup([3, 4, 2], b)  # host, host, mem0's probe (1 left mem0 for 4)
    world.step()
    world.tiers[0].drain()
    world.step()
    world.lookup([2], b)  # a hit on mem0: promotion
    world.step()
    world.tiers[0].drain()
    world.step(2)
    engine.take_events()


def test_a_scrape_over_http_agrees_with_the_engines_stats(
    world: tuple[World, OffloadEngine],
) -> None:
    w, engine = world
    registry = CollectorRegistry()
    register_metrics(engine, registry)
    server = serve_metrics(registry, "127.0.0.1:0")
    try:
        before = scrape(server.url)
        assert value(before, "kvhex_tier_lookups_total", tier="host", medium="CPU") == 0
        _work(w, engine)
        after = scrape(server.url)
    finally:
        server.close()
    stats = engine.stats()
    tier = stats.tiers[0]
    host = {"tier": "host", "medium": "CPU"}
    mem = {"tier": "mem0", "medium": "STORAGE"}
    assert value(after, "kvhex_tier_lookups_total", **host) == stats.lookups == 4
    assert value(after, "kvhex_tier_hits_total", **host) == stats.host_hits == 2
    assert value(after, "kvhex_tier_misses_total", **host) == 2
    assert value(after, "kvhex_tier_lookups_total", **mem) == tier.lookups == 2
    assert value(after, "kvhex_tier_hits_total", **mem) == tier.hits == 1
    assert value(after, "kvhex_tier_promoted_blocks_total", **mem, result="ok") == 1
    assert value(after, "kvhex_tier_jobs_total", **mem, kind="put", result="ok") == tier.puts_ok
    assert value(after, "kvhex_tier_jobs_total", **mem, kind="get", result="ok") == 1
    assert value(after, "kvhex_tier_bytes_total", **mem, direction="put") == 4 * SLOT_BYTES
    assert value(after, "kvhex_tier_bytes_total", **mem, direction="get") == SLOT_BYTES
    count = value(after, "kvhex_tier_job_seconds_count", **mem, kind="put")
    assert count == tier.put_latency.count == tier.puts_ok
    inf = value(after, "kvhex_tier_job_seconds_bucket", **mem, kind="put", le="+Inf")
    assert inf == count
    assert value(after, "kvhex_tier_evictions_total", **mem) == tier.blocks_removed == 1
    assert value(after, "kvhex_tier_resident_blocks", **mem) == 3
    assert value(after, "kvhex_tier_used_bytes", **mem) == 3 * SLOT_BYTES
    assert value(after, "kvhex_tier_capacity_bytes", **mem) == 3 * SLOT_BYTES
    assert value(after, "kvhex_tier_capacity_bytes", **host) == 2 * SLOT_BYTES
    assert value(after, "kvhex_tier_evictions_total", **host) == stats.primary.evictions > 0
    stored = value(after, "kvhex_events_published_total", type="BlockStored", medium="STORAGE")
    assert stored == stats.events.published[("BlockStored", "STORAGE")] == 4
    # no geometry: every store is a placeholder (1 of them twice: host memory, then mem0)
    assert value(after, "kvhex_events_stored_keys_total", payload="full") == 0
    placeholders = value(after, "kvhex_events_stored_keys_total", payload="placeholder")
    assert placeholders == stats.events.placeholder_stores == 4 + 4 + 1
    sent = value(after, "kvhex_sink_batches_sent_total", sink="0:_Sink")
    assert sent == SINK.batches > 0
    assert value(after, "kvhex_sink_batches_dropped_total", sink="0:_Sink") == 0
    # the in-memory tier counts no damage: no series rather than a zero that would lie
    assert value(after, "kvhex_tier_corrupt_blocks_total", -1.0, **mem) == -1


def test_every_listed_metric_is_exported_and_nothing_else(
    world: tuple[World, OffloadEngine],
) -> None:
    w, engine = world
    registry = CollectorRegistry()
    register_metrics(engine, registry, labels={"engine": "e0"})
    _work(w, engine)
    families = {f.name: f for f in registry.collect()}
    assert set(families) == {name for name, *_ in METRICS}
    for name, kind, labels, _ in METRICS:
        assert families[name].type == kind
        for sample in families[name].samples:
            assert sample.labels["engine"] == "e0"
            assert set(sample.labels) - {"le"} == {"engine", *labels}


def test_the_host_applications_registry_is_the_only_one_touched(
    world: tuple[World, OffloadEngine],
) -> None:
    _, engine = world
    before = set(REGISTRY._names_to_collectors)
    registry = CollectorRegistry()
    collector = register_metrics(engine, registry)
    assert set(REGISTRY._names_to_collectors) == before
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        register_metrics(engine, registry)  # a second engine needs its own registry
    registry.unregister(collector)
    register_metrics(engine, registry)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("9400", "is not HOST:PORT"),
        ("127.0.0.1:", "is not HOST:PORT"),
        ("127.0.0.1:http", "is not HOST:PORT"),
        (":9400", "is not HOST:PORT"),
        ("127.0.0.1:70000", "port 70000 is outside 0-65535"),
        ("metrics.example:9400", "is not an IP address"),
    ],
)
def test_a_bad_address_is_named(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as err:
        parse_metrics_address(text)
    assert err.value.paths == ("--metrics-addr",)


def test_addresses_that_parse() -> None:
    assert parse_metrics_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_metrics_address("[::1]:9400") == ("::1", 9400)
    assert parse_metrics_address("localhost:9400") == ("localhost", 9400)


def test_a_port_in_use_is_an_oserror_and_close_frees_the_port(
    world: tuple[World, OffloadEngine],
) -> None:
    _, engine = world
    registry = CollectorRegistry()
    register_metrics(engine, registry)
    server = serve_metrics(registry, "127.0.0.1:0")
    host, port = server.address
    with pytest.raises(OSError, match="in use"):
        serve_metrics(registry, f"{host}:{port}")
    server.close()
    server.close()
    with socket.socket() as probe:
        probe.bind((host, port))  # released
