"""The adapters satisfy vLLM's abstract interfaces and vLLM's factories build them by name."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (make test runs this in .venv-vllm)")

from vllm.v1.kv_offload.base import OffloadingManager, OffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from kvhex.errors import ConfigError
from kvhex.vllm import (
    KvhexOffloadingManager,
    KvhexOffloadingSpec,
    KvhexSecondaryTier,
)
from tests.vllm.helpers import PAGE, offloading_config


@pytest.fixture
def managers() -> Iterator[list[Any]]:
    """Managers the test builds; shut down (releasing vLLM's shared region) however it ends."""
    built: list[Any] = []
    yield built
    for manager in built:
        manager.shutdown()


def test_the_adapters_implement_every_abstract_method() -> None:
    for cls, base in (
        (KvhexOffloadingSpec, OffloadingSpec),
        (KvhexOffloadingManager, OffloadingManager),
        (KvhexSecondaryTier, SecondaryTierManager),
    ):
        assert issubclass(cls, base)
        assert not inspect.isabstract(cls), f"{cls.__name__}: {cls.__abstractmethods__}"


def test_vllm_loads_the_general_plugin_which_registers_every_name() -> None:
    code = (
        "import vllm.plugins as p;"
        "from vllm.v1.kv_offload.factory import OffloadingSpecFactory as S;"
        "from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory as T;"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as C;"
        "p.load_general_plugins();"
        "print(S.get_spec_cls({'spec_name': 'KvhexOffloadingSpec'}).__name__,"
        " T.get_tier_class({'type': 'KvhexSecondaryTier'}).__name__,"
        " C.get_connector_class_by_name('KvhexOffloadingConnector').__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert out.stdout.split() == [
        "KvhexOffloadingSpec",
        "KvhexSecondaryTier",
        "KvhexOffloadingConnector",
    ]


@pytest.mark.parametrize("module", ["kvhex.vllm", "kvhex.adapters.vllm"])
def test_the_spec_factory_builds_it_from_a_module_path_alone(
    module: str, tmp_path: Path, managers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvhex.adapters.vllm``, the package's name before it moved beside the CLI, still builds
    the same spec for a release (configurations name it), warning that it is going."""
    extra = {
        "spec_name": "KvhexOffloadingSpec",
        "spec_module_path": module,
        "cpu_bytes_to_use": 8 * PAGE,
        "eviction_policy": "arc",
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv")}],
    }
    # vLLM prefers a registered name (kvhex's general plugin registers it) to the module path
    monkeypatch.delitem(OffloadingSpecFactory._registry, "KvhexOffloadingSpec", raising=False)
    sys.modules.pop("kvhex.adapters.vllm", None)  # the alias warns on its first import
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = OffloadingSpecFactory.create_spec(offloading_config(extra))
    moved = [w for w in caught if "kvhex.adapters.vllm is now kvhex.vllm" in str(w.message)]
    assert [w.category for w in moved] == ([DeprecationWarning] if "adapters" in module else [])
    assert isinstance(spec, KvhexOffloadingSpec)
    manager = spec.get_manager()
    managers.append(manager)
    assert spec.get_manager() is manager
    assert isinstance(manager, KvhexOffloadingManager)
    stats = manager.stats()
    assert stats.primary.num_slots == 8
    assert [t.name for t in stats.tiers] == ["fs"]
    manager.shutdown()
    manager.shutdown()  # idempotent


def test_an_unknown_transfer_is_refused_when_the_spec_is_built_listing_the_installed() -> None:
    with pytest.raises(ConfigError) as err:
        KvhexOffloadingSpec(
            offloading_config({"cpu_bytes_to_use": 8 * PAGE, "kvhex": {"transfer": "nope"}})
        )
    assert err.value.paths == ("$.kvhex.transfer",)
    assert "unknown transfer 'nope'; available: memory, torch" in str(err.value)


def test_host_memory_too_small_for_one_chunk_is_a_config_error() -> None:
    spec = KvhexOffloadingSpec(offloading_config({"cpu_bytes_to_use": PAGE - 1}))
    with pytest.raises(ConfigError) as err:
        spec.get_manager()
    assert err.value.paths == ("$.cpu_bytes_to_use",)


def test_events_stay_off_when_vllm_events_are_off(managers: list[Any]) -> None:
    spec = KvhexOffloadingSpec(offloading_config({"cpu_bytes_to_use": 4 * PAGE}, events=False))
    manager = spec.get_manager()
    managers.append(manager)
    from vllm.v1.kv_offload.base import ReqContext

    from tests.vllm.helpers import key

    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    assert manager.prepare_store([key(1)], ctx) is not None
    manager.complete_store([key(1)], ctx)
    assert list(manager.take_events()) == []


def _reset_with_a_copy_in_flight(tmp_path: Path, managers: list[Any], busy: str | None) -> Any:
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    from tests.vllm.helpers import key

    extra = {
        "cpu_bytes_to_use": 4 * PAGE,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv")}],
    }
    manager = KvhexOffloadingSpec(offloading_config(extra)).get_manager()
    managers.append(manager)
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    assert manager.prepare_store([key(1)], ctx) is not None
    manager.complete_store([key(1)], ctx)
    while manager.has_pending_work():
        manager.on_schedule_end(ScheduleEndContext((), ()))
    if busy == "store":  # a device -> host copy the workers have not reported yet
        assert manager.prepare_store([key(2)], ctx) is not None
    elif busy == "load":  # a host -> device copy of key 1 the workers have not reported yet
        assert manager.lookup(key(1), ctx).name == "HIT"
        manager.prepare_load([key(1)], ctx)
    manager.reset_cache()
    return manager, ctx


def test_promotions_wait_after_a_reset_until_vllm_reports_the_flush(
    tmp_path: Path, managers: list[Any]
) -> None:
    """As vLLM's tiering manager: a late device copy may still write freed host slots. vLLM
    0.33 says when its workers reported every flushed job; vLLM 0.32 never does, so kvhex
    waits for the second schedule end."""
    from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext

    from kvhex.vllm._compat import RESET_FLUSH_STEPS, SIGNALS_RESET_FLUSHED
    from tests.vllm.helpers import key

    manager, ctx = _reset_with_a_copy_in_flight(tmp_path, managers, busy="store")
    assert manager.promotions_held
    assert manager.lookup(key(1), ctx) is LookupResult.MISS  # held: host tier only
    if SIGNALS_RESET_FLUSHED:
        for _ in range(5):
            manager.on_schedule_end(ScheduleEndContext((), ()))
            assert manager.lookup(key(1), ctx) is LookupResult.MISS
        manager.on_reset_flushed()
    else:
        for _ in range(RESET_FLUSH_STEPS - 1):
            manager.on_schedule_end(ScheduleEndContext((), ()))
            assert manager.lookup(key(1), ctx) is LookupResult.MISS
        manager.on_schedule_end(ScheduleEndContext((), ()))
    assert manager.lookup(key(1), ctx) is LookupResult.RETRY  # the file tier is asked again


def test_promotions_go_on_after_a_reset_with_no_copy_in_flight(
    tmp_path: Path, managers: list[Any]
) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    from tests.vllm.helpers import key

    manager, ctx = _reset_with_a_copy_in_flight(tmp_path, managers, busy=None)
    assert not manager.promotions_held
    assert manager.lookup(key(1), ctx) is LookupResult.RETRY


def test_a_device_load_in_flight_at_a_reset_holds_promotions_too(
    tmp_path: Path, managers: list[Any]
) -> None:
    manager, _ = _reset_with_a_copy_in_flight(tmp_path, managers, busy="load")
    assert manager.promotions_held


def test_a_second_reset_keeps_the_hold_an_earlier_one_still_owes(
    tmp_path: Path, managers: list[Any]
) -> None:
    """The first reset freed the slots its copies still write; the second finds nothing in
    flight, but the first one's flush is still owed."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    from kvhex.vllm._compat import RESET_FLUSH_STEPS, SIGNALS_RESET_FLUSHED

    manager, _ = _reset_with_a_copy_in_flight(tmp_path, managers, busy="store")
    manager.on_schedule_end(ScheduleEndContext((), ()))
    manager.reset_cache()
    assert manager.promotions_held
    if SIGNALS_RESET_FLUSHED:
        manager.on_reset_flushed()
    else:  # the count starts again at the second reset
        for _ in range(RESET_FLUSH_STEPS):
            assert manager.promotions_held
            manager.on_schedule_end(ScheduleEndContext((), ()))
    assert not manager.promotions_held


def test_an_unsupported_vllm_version_is_refused_naming_the_supported_ones() -> None:
    from kvhex.vllm._compat import VLLM_VERSION, installed_version

    assert VLLM_VERSION in {(0, 32), (0, 33)}
    assert installed_version("0.32.0+cpu") == (0, 32)
    assert installed_version("0.33.0") == (0, 33)
    for other in ("0.31.2", "0.34.0", "1.0", "dev"):
        with pytest.raises(ImportError, match=r"supports vLLM 0\.32 and 0\.33; vLLM .* is"):
            installed_version(other)


# -- kvhex.router: start-up warnings read vLLM's own settings too ------------------------------
def _router_logs(build: Any) -> list[dict[str, Any]]:
    import structlog

    with structlog.testing.capture_logs() as logs:
        build()
    return [e for e in logs if e["event"] == "router_config_mismatch"]


@pytest.mark.parametrize(("events", "warned"), [(True, True), (False, False)])
def test_kvhex_router_checks_vllms_block_size_when_the_manager_is_built(
    managers: list[Any], events: bool, warned: bool
) -> None:
    """vllm-router reads block size 16 unless told: a 32-token block is dropped. With vLLM's
    events off nothing is published, so nothing is checked. Offline (no connector) vLLM's
    publisher topic is unknown and not checked."""
    extra = {"cpu_bytes_to_use": 4 * PAGE, "kvhex": {"router": "vllm-router"}}
    spec = KvhexOffloadingSpec(
        offloading_config(extra, events=events, tokens_per_block=32, tokens_per_hash=32)
    )
    logged = _router_logs(lambda: managers.append(spec.get_manager()))
    assert [(e["key"], e["rule"]) for e in logged] == (
        [("$.kvhex.router_block_size", "block_size")] if warned else []
    )
    if warned:
        assert logged[0]["finding"].startswith(
            "vllm-router 0.1.17 drops stores with block_size 32: it reads block_size 16 only "
            "(--kv-event-block-size default; $.kvhex.router_block_size not set)"
        )
    told = {**extra, "kvhex": {"router": "vllm-router", "router_block_size": 32}}
    spec = KvhexOffloadingSpec(offloading_config(told, tokens_per_block=32, tokens_per_hash=32))
    assert _router_logs(lambda: managers.append(spec.get_manager())) == []


@pytest.mark.parametrize(
    ("connector", "router", "expected"),
    [
        (  # kvhex's connector publishes the tier as it is
            "KvhexOffloadingConnector",
            "dynamo",
            [
                ("$.secondary_tiers[0].kvhex.medium", "medium"),
                ("$.secondary_tiers[0].locality", "locality"),
            ],
        ),
        # vLLM's own tracker names it STORAGE with no locality (kvhex warns that it does)
        ("OffloadingConnector", "dynamo", []),
        (
            "KvhexOffloadingConnector",
            "vllm-router",
            [
                ("$.secondary_tiers[0].kvhex.medium", "medium"),
                ("vLLM's kv_events_config.topic (--kv-events-config)", "topic"),
            ],
        ),
        (
            "OffloadingConnector",
            "vllm-router",
            [("vLLM's kv_events_config.topic (--kv-events-config)", "topic")],
        ),
    ],
)
def test_kvhex_router_reads_vllms_topic_and_connector_from_the_engine(
    tmp_path: Path, connector: str, router: str, expected: list[tuple[str, str]]
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhex.vllm import register
    from tests.vllm.scheduler import BLOCK, kv_cache_config, vllm_config

    register()  # the connector's name (vLLM's general plugin, in a served vLLM)
    extra = {
        "spec_name": "KvhexOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "kvhex": {"router": router, "router_block_size": BLOCK},
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": str(tmp_path / "kv"),
                "enable_kv_events": True,
                "locality": "SHARED",
                "kvhex": {"medium": "SHARED_STORAGE"},
            }
        ],
    }
    config = vllm_config(tmp_path / "model", extra, connector)
    assert config.kv_events_config is not None
    config.kv_events_config.topic = "kv"
    built: list[Any] = []

    def build() -> None:
        built.append(
            KVConnectorFactory.create_connector(
                config, KVConnectorRole.SCHEDULER, kv_cache_config()
            )
        )

    try:
        logged = _router_logs(build)
    finally:
        for made in built:
            made.shutdown()
    assert [(e["key"], e["rule"]) for e in logged] == expected
