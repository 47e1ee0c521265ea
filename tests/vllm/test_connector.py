"""kvhex driven through vLLM 0.33's scheduler-side offloading connector, synthetic requests.

The connector, its spec and manager are built by vLLM's own factories from the extra config
(``spec_name`` and ``kv_connector`` resolved through kvhex's general plugin). Transfers are
reported finished by job id, as a worker would; host bytes are written by the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (make test runs this in .venv-vllm)")

import msgspec
from vllm.distributed import kv_events as vev
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvhex.adapters.events import wire
from kvhex.adapters.memory import MemoryEventSink
from kvhex.errors import ConfigError
from kvhex.vllm import (
    KvhexOffloadingConnector,
    KvhexOffloadingManager,
    register,
)
from tests.vllm.scheduler import PAGE, Driver, request, scheduler_connector

PROMPT = list(range(100, 164))  # four blocks of 16 tokens


def _extra(root: Path, **more: Any) -> dict[str, Any]:
    return {
        "spec_name": "KvhexOffloadingSpec",
        "cpu_bytes_to_use": 32 * PAGE,
        "self_describing_kv_events": True,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "enable_kv_events": True}],
        **more,
    }


def _stored(events: list[Any], medium: str) -> list[Any]:
    return [e for e in events if isinstance(e, vev.BlockStored) and e.medium == medium]


@pytest.fixture(autouse=True)
def _registered() -> None:
    register()


@pytest.fixture
def connectors() -> Iterator[list[Any]]:
    """Connectors the test builds; shut down (releasing vLLM's shared region) however the
    test ends."""
    built: list[Any] = []
    yield built
    for connector in built:
        connector.shutdown()


def test_full_provenance_for_host_stores_late_tier_stores_and_promotions(
    tmp_path: Path, connectors: list[Any]
) -> None:
    connector = scheduler_connector(
        tmp_path / "model", _extra(tmp_path / "kv"), "KvhexOffloadingConnector"
    )
    connectors.append(connector)
    assert isinstance(connector, KvhexOffloadingConnector)
    manager = connector.connector_scheduler.manager
    assert isinstance(manager, KvhexOffloadingManager)
    sink = MemoryEventSink()
    manager.engine.add_sink(sink)
    host = manager.host
    assert host is not None
    driver = Driver(connector)

    # request 1: nothing offloaded yet (the file tier is probed first), four chunks stored
    first = request("r1", PROMPT)
    connector.on_new_request(first)
    assert driver.matched(first) == 0
    meta = driver.prefill(first)
    ((job_id, job),) = meta.store_jobs.items()
    slots = job.dst_spec.block_ids.tolist()
    for chunk, slot in enumerate(slots):
        host.slot_view(slot)[:] = bytes([chunk + 1]) * PAGE  # what the worker would copy
    driver.complete([job_id])
    cpu = _stored(driver.events, "CPU")
    # the job's four chunks, one chain as vLLM announces a request's GPU blocks
    assert [e.token_ids for e in cpu] == [PROMPT]
    assert len(cpu[0].block_hashes) == 4
    assert (cpu[0].block_size, cpu[0].kv_cache_spec_kind) == (16, "full_attention")
    assert cpu[0].parent_block_hash is None

    # the request finishes; its cascade to the file tier completes afterwards, still in full
    driver.events.clear()
    driver.finish(first)
    driver.until(lambda: len(_stored(driver.events, "STORAGE")) == 1)
    storage = _stored(driver.events, "STORAGE")
    assert [e.token_ids for e in storage] == [e.token_ids for e in cpu]
    assert [e.block_hashes for e in storage] == [e.block_hashes for e in cpu]
    assert [(e.locality, e.ownership) for e in storage] == [(None, None)]  # vLLM's fs entry

    # reset: the host tier's chunks are announced removed (not AllBlocksCleared)
    driver.events.clear()
    connector.reset_cache()
    driver.events.extend(connector.take_events())
    (removed,) = driver.events
    assert isinstance(removed, vev.BlockRemoved)
    assert removed.medium == "CPU"
    assert sorted(removed.block_hashes) == sorted(h for e in cpu for h in e.block_hashes)

    # request 2 shares the prompt: found in the file tier, promoted, loaded; bytes intact
    driver.events.clear()
    second = request("r2", [*PROMPT, 1, 2, 3])
    connector.on_new_request(second)
    hits = driver.matched(second)
    assert hits == 64
    meta = driver.prefill(second, external=hits)
    ((load_id, load),) = meta.load_jobs.items()
    promoted_slots = load.src_spec.block_ids.tolist()
    assert [bytes(host.slot_view(s)[:1]) for s in promoted_slots] == [
        b"\x01",
        b"\x02",
        b"\x03",
        b"\x04",
    ]
    driver.complete([load_id])
    promoted = _stored(driver.events, "CPU")
    assert [e.token_ids for e in promoted] == [e.token_ids for e in cpu]
    assert [e.block_hashes for e in promoted] == [e.block_hashes for e in cpu]

    # every batch kvhex's translator produced decodes, with vLLM's decoder, into the very
    # structs the connector handed vLLM's publisher
    decoder = msgspec.msgpack.Decoder(vev.KVEventBatch)
    decoded = [e for b in sink.batches for e in decoder.decode(wire.encode_batch(b)).events]
    handed = [*cpu, *storage, removed, *promoted]
    assert sorted(map(repr, decoded)) == sorted(map(repr, handed))
    assert len(decoded) == len(handed)


def test_stock_connector_with_kvhex_spec_uses_vllms_own_tracker(
    tmp_path: Path, connectors: list[Any]
) -> None:
    """Drop-in: only ``spec_name`` changed; vLLM's connector and its events tracker."""
    connector = scheduler_connector(
        tmp_path / "model", _extra(tmp_path / "kv"), "OffloadingConnector"
    )
    connectors.append(connector)
    assert type(connector) is OffloadingConnector
    assert isinstance(connector.connector_scheduler.manager, KvhexOffloadingManager)
    driver = Driver(connector)
    req = request("r1", PROMPT)
    connector.on_new_request(req)
    assert driver.matched(req) == 0
    meta = driver.prefill(req)
    driver.complete(list(meta.store_jobs))
    cpu = _stored(driver.events, "CPU")
    # vLLM's tracker announces each key, in the order kvhex gives them: parent first
    assert [e.token_ids for e in cpu] == [PROMPT[i : i + 16] for i in range(0, 64, 16)]
    assert [e.parent_block_hash for e in cpu[1:]] == [e.block_hashes[-1] for e in cpu[:-1]]
    driver.finish(req)
    driver.until(lambda: len(_stored(driver.events, "STORAGE")) == 4)
    storage = _stored(driver.events, "STORAGE")
    assert [e.token_ids for e in storage] == [e.token_ids for e in cpu]
    assert {(e.locality, e.ownership) for e in storage} == {(None, None)}


def test_kvhex_connector_with_vllms_own_spec_behaves_like_vllms_connector(
    tmp_path: Path, connectors: list[Any]
) -> None:
    extra = {"cpu_bytes_to_use": 32 * PAGE, "self_describing_kv_events": True}
    connector = scheduler_connector(tmp_path / "model", extra, "KvhexOffloadingConnector")
    connectors.append(connector)
    assert not isinstance(connector.connector_scheduler.manager, KvhexOffloadingManager)
    driver = Driver(connector)
    req = request("r1", PROMPT)
    connector.on_new_request(req)
    assert driver.matched(req) == 0
    meta = driver.prefill(req)
    driver.complete(list(meta.store_jobs))
    assert len(_stored(driver.events, "CPU")) == 4


@pytest.mark.parametrize(
    ("change", "paths"),
    [
        ({"cpu_bytes_to_use": "lots"}, ["$.cpu_bytes_to_use"]),
        ({"secondary_tiers": [{"type": "p2p"}]}, ["$.secondary_tiers[0].type"]),
        (
            {"secondary_tiers": [{"type": "fs", "rootdir": "/x"}], "eviction_polcy": "lru"},
            [
                "$.eviction_polcy",
                "$.secondary_tiers[0].rootdir",
                "$.secondary_tiers[0].root_dir",
            ],
        ),
        ({"eviction_policy": "nosuch"}, ["$.eviction_policy"]),
    ],
)
def test_configuration_errors_fail_start_up_naming_the_keys(
    tmp_path: Path, change: dict[str, Any], paths: list[str]
) -> None:
    extra = {**_extra(tmp_path / "kv"), **change}
    with pytest.raises(ConfigError) as err:
        scheduler_connector(tmp_path / "model", extra, "KvhexOffloadingConnector")
    assert sorted(err.value.paths) == sorted(paths)
    assert err.value.source == "kv_connector_extra_config"


@pytest.mark.parametrize("kind", ["KvhexOffloadingConnector", "OffloadingConnector"])
def test_no_events_tracker_state_outlives_what_host_memory_holds(
    tmp_path: Path, connectors: list[Any], kind: str
) -> None:
    """With ``self_describing_kv_events`` (the documented setup), vLLM's own events tracker
    must hold no payload that nothing will ever drop: kvhex's connector publishes kvhex's
    events, so vLLM's tracker records nothing; with vLLM's stock connector the tracker
    translates kvhex's events and drops each payload at its announced removal."""
    host_chunks = 8
    extra = {
        "spec_name": "KvhexOffloadingSpec",
        "cpu_bytes_to_use": host_chunks * PAGE,
        "self_describing_kv_events": True,
    }
    connector = scheduler_connector(tmp_path / "model", extra, kind)
    connectors.append(connector)
    driver = Driver(connector)
    for r in range(40):  # 160 chunks through 8 host slots
        req = request(f"r{r}", [r * 1000 + t for t in range(64)])
        connector.on_new_request(req)
        driver.matched(req)
        meta = driver.prefill(req)
        driver.complete(list(meta.store_jobs))
        driver.finish(req)
    tracker = connector.connector_scheduler._events_tracker  # vLLM's, in both versions
    stored = sum(len(e.block_hashes) for e in _stored(driver.events, "CPU"))
    assert stored == 160  # every store was announced in full either way
    held = len(tracker._pending_event_metadata)
    if kind == "KvhexOffloadingConnector":
        assert held == 0
    else:
        assert held <= host_chunks


def test_an_empty_step_yields_to_the_tiers_only_while_they_work(
    tmp_path: Path, connectors: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM steps again at once after a step that scheduled nothing; while kvhex's tiers have
    jobs in flight that loop would starve their IO threads of the GIL, so such a step sleeps
    (and only such a step)."""
    from kvhex.vllm import connector as module

    naps: list[float] = []
    monkeypatch.setattr(module, "_nap", naps.append)
    probed = {"type": "KvhexSecondaryTier", "tier": "memory", "capacity_bytes": 64 * PAGE}
    extra = {**_extra(tmp_path / "kv"), "secondary_tiers": [probed]}  # asked through probes
    connector = scheduler_connector(tmp_path / "model", extra, "KvhexOffloadingConnector")
    connectors.append(connector)
    driver = Driver(connector)
    manager = connector.connector_scheduler.manager
    driver.step()
    assert naps == []  # nothing in flight
    req = request("r1", PROMPT)
    connector.on_new_request(req)
    hits, _ = connector.get_num_new_matched_tokens(req, 0)
    assert hits is None  # the tier is being probed
    assert manager.has_pending_work()
    driver.step()  # schedules nothing
    assert naps == [module.IDLE_STEP_WAIT_S]
    naps.clear()
    meta = driver.prefill(req)  # schedules the prompt: no nap however busy the tiers are
    assert naps == []
    driver.complete(list(meta.store_jobs))


@pytest.mark.parametrize(
    ("kind", "medium", "published"),
    [("KvhexOffloadingConnector", "DISK", "SHARED"), ("OffloadingConnector", "STORAGE", None)],
)
def test_a_shared_tier_is_announced_shared_where_the_events_can_say_so(
    tmp_path: Path, connectors: list[Any], kind: str, medium: str, published: str | None
) -> None:
    """kvhex's connector publishes the entry's medium and ``locality = SHARED``; vLLM's own
    events have neither (its media are CPU, GPU and STORAGE, its localities LOCAL and
    REMOTE), so with vLLM's connector the tier's events say STORAGE and no locality (and a
    warning says so). The entry's ``kvhex`` object turns the peer view on."""
    tier = {
        "type": "fs",
        "root_dir": str(tmp_path / "kv"),
        "enable_kv_events": True,
        "locality": "shared",
        "kvhex": {"announce_peers": True, "peer_scan_interval_s": 0.5, "medium": "disk"},
    }
    connector = scheduler_connector(
        tmp_path / "model", _extra(tmp_path / "kv", secondary_tiers=[tier]), kind
    )
    connectors.append(connector)
    (store,) = connector.connector_scheduler.manager.tier_stores
    assert store.announce_peers
    driver = Driver(connector)
    req = request("r1", PROMPT)
    connector.on_new_request(req)
    driver.matched(req)
    meta = driver.prefill(req)
    driver.complete(list(meta.store_jobs))
    driver.finish(req)
    driver.until(lambda: bool(_stored(driver.events, medium)))
    assert {e.locality for e in _stored(driver.events, medium)} == {published}


def _offloaded_to_files(driver: Driver, connector: Any) -> None:
    """A request stores ``PROMPT``, finishes, its cascade reaches the file tier; host memory
    is then emptied (reset): the prompt lives in the file tier alone."""
    first = request("writer", PROMPT)
    connector.on_new_request(first)
    assert driver.matched(first) == 0
    meta = driver.prefill(first)
    driver.complete(list(meta.store_jobs))
    driver.finish(first)
    driver.until(lambda: not connector.connector_scheduler.manager.has_pending_work())
    connector.reset_cache()
    driver.step()


@pytest.mark.parametrize(("prefill_tokens_per_s", "answer"), [(1.0, None), (1e12, 0)])
def test_load_or_recompute_is_decided_at_the_requests_first_lookup(
    tmp_path: Path, connectors: list[Any], prefill_tokens_per_s: float, answer: int | None
) -> None:
    """The file tier answers from its own index and the plan is made before vLLM looks the
    request up: a tier worth loading promotes at the first lookup (no probe, no step waiting
    for a plan), one not worth it is recomputed at once (0 tokens: scheduled this step)."""
    loading = {"mode": "auto", "prefill_tokens_per_s": prefill_tokens_per_s}
    extra = _extra(tmp_path / "kv", kvhex={"loading": loading})
    connector = scheduler_connector(tmp_path / "model", extra, "KvhexOffloadingConnector")
    connectors.append(connector)
    engine = connector.connector_scheduler.manager.engine
    driver = Driver(connector)
    _offloaded_to_files(driver, connector)
    probes = engine.stats().tiers[0].probes_submitted

    # the tier's gets were never measured: loaded (to measure them), promoted at once
    second = request("r2", [*PROMPT, 1, 2, 3])
    connector.on_new_request(second)
    assert connector.get_num_new_matched_tokens(second, 0)[0] is None
    driver.step()
    assert engine.stats().tiers[0].gets_submitted == 1  # in the very step of the lookup
    assert driver.matched(second) == 64
    meta = driver.prefill(second, external=64)
    driver.complete(list(meta.load_jobs))
    driver.finish(second)
    connector.reset_cache()
    driver.step()

    # measured now: decided at the first lookup, as the prefill speed says
    third = request("r3", [*PROMPT, 4, 5, 6])
    connector.on_new_request(third)
    assert connector.get_num_new_matched_tokens(third, 0)[0] == answer
    driver.step()
    stats = engine.stats()
    assert stats.tiers[0].probes_submitted == probes  # the tier's index answered every lookup
    assert stats.tiers[0].gets_submitted == (2 if answer is None else 1)
    assert (stats.loading.loaded_all, stats.loading.recomputed) == (
        (2, 0) if answer is None else (1, 1)
    )


def test_a_loads_wait_is_measured_only_while_no_other_request_is_in(
    tmp_path: Path, connectors: list[Any]
) -> None:
    connector = scheduler_connector(
        tmp_path / "model", _extra(tmp_path / "kv"), "KvhexOffloadingConnector"
    )
    connectors.append(connector)
    engine = connector.connector_scheduler.manager.engine
    driver = Driver(connector)
    writer = request("writer", PROMPT)
    connector.on_new_request(writer)
    assert driver.matched(writer) == 0
    driver.complete(list(driver.prefill(writer).store_jobs))
    driver.finish(writer)

    # a load from host memory while another request is in the engine: not measured
    other = request("other", list(range(500, 520)))
    connector.on_new_request(other)
    second = request("r2", [*PROMPT, 1])
    connector.on_new_request(second)
    assert driver.matched(second) == 64
    driver.complete(list(driver.prefill(second, external=64).load_jobs))
    assert engine.stats().loading.wait_host_s == 0
    driver.finish(second)
    driver.finish(other)

    # alone: its wait, from the lookup until it is scheduled to compute, is measured
    third = request("r3", [*PROMPT, 2])
    connector.on_new_request(third)
    assert driver.matched(third) == 64
    driver.complete(list(driver.prefill(third, external=64).load_jobs))
    assert engine.stats().loading.wait_host_s > 0
