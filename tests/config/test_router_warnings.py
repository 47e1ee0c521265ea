"""``[events] router``: at start-up kvhex logs one ``router_config_mismatch`` warning per
setting whose events that router would silently drop or miscredit, at the key to change,
with the fix; a configuration that agrees with its router, or names none, logs nothing."""

from __future__ import annotations

from typing import Any

import pytest
import structlog

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.bootstrap import build_engine
from kvhex.config import load_config
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.errors import ConfigError
from kvhex.plugins import Registry

SLOT = 4096
SOURCE = "kvhex.toml"


def geometry(block_size: int) -> KvGeometry:
    return KvGeometry((KvGroup(0, block_size, 2),), block_size)


def memory_tier(name: str, **options: Any) -> dict[str, Any]:
    return {"type": "memory", "name": name, "options": {"capacity_bytes": 4 * SLOT, **options}}


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.discover()


def warnings_of(
    registry: Registry,
    config: dict[str, Any],
    *,
    block_size: int = 16,
) -> list[dict[str, Any]]:
    """The ``router_config_mismatch`` entries logged while ``config`` is built."""
    loaded = load_config({"primary": {"capacity_bytes": 4 * SLOT}, **config})
    with structlog.testing.capture_logs() as logs:
        engine, _ = build_engine(
            loaded,
            MemoryHostBuffer(4, SLOT),
            registry,
            geometry=geometry(block_size),
            source=SOURCE,
        )
    engine.shutdown()
    return [dict(entry) for entry in logs if entry["event"] == "router_config_mismatch"]


def test_every_setting_dynamo_drops_is_one_warning_at_its_key(registry: Registry) -> None:
    logged = warnings_of(
        registry,
        {
            "tiers": [
                memory_tier("shared", medium="SHARED_STORAGE"),
                memory_tier("remote", locality="REMOTE"),
                {**memory_tier("owned"), "announce_ownership": True},
                memory_tier("also_shared", medium="SHARED_STORAGE"),
                memory_tier("fine", medium="DISK"),
            ],
            "events": {"router": "dynamo", "router_block_size": 32, "int_block_hashes": False},
        },
    )
    assert [(e["key"], e["rule"], e["effect"]) for e in logged] == [
        ("$.tiers[0].options.medium", "medium", "drops"),
        ("$.tiers[1].options.locality", "locality", "drops"),
        ("$.tiers[2].announce_ownership", "ownership", "drops"),
        ("$.tiers[3].options.medium", "medium", "drops"),
        ("$.events.int_block_hashes", "hash_form", "drops"),
        ("$.events.router_block_size", "block_size", "drops"),
    ]
    assert all(e["log_level"] == "warning" for e in logged)
    assert all(e["router"] == "dynamo 1.6.1" and e["source"] == SOURCE for e in logged)
    by_key = {e["key"]: e for e in logged}
    assert by_key["$.tiers[0].options.medium"]["finding"] == (
        "dynamo 1.6.1 drops events with medium 'SHARED_STORAGE': it reads only the media CPU, "
        "CPU_PINNED, DISK, EXTERNAL, GPU, STORAGE (or none); fix: set "
        "$.tiers[0].options.medium to 'STORAGE'"
    )
    assert by_key["$.tiers[1].options.locality"]["fix"] == (
        "set $.tiers[1].options.locality to 'LOCAL' (only if every instance the router sends "
        "to can load from the tier)"
    )
    assert by_key["$.tiers[2].announce_ownership"]["fix"] == (
        "set $.tiers[2].announce_ownership to false"
    )
    assert by_key["$.events.int_block_hashes"]["fix"] == "set $.events.int_block_hashes to true"
    assert by_key["$.events.router_block_size"]["finding"] == (
        "dynamo 1.6.1 drops stores with block_size 16: it reads block_size 32 only "
        "($.events.router_block_size); fix: configure the router for block size 16 (the "
        "block_size each worker is registered with) and set $.events.router_block_size to 16, "
        "or serve with block size 32"
    )


def test_every_setting_vllm_router_drops_or_miscredits_is_one_warning(
    registry: Registry,
) -> None:
    logged = warnings_of(
        registry,
        {
            "tiers": [
                memory_tier("pinned", medium="CPU_PINNED"),
                memory_tier("remote", locality="REMOTE"),  # read whatever its locality
                {**memory_tier("owned"), "announce_ownership": True},
            ],
            "sinks": [
                {"type": "memory"},
                {"type": "zmq", "options": {"endpoint": "tcp://127.0.0.1:*", "topic": "kv"}},
            ],
            "events": {"router": "vllm-router", "int_block_hashes": False},
        },
        block_size=32,  # and no router_block_size: vllm-router's default is 16
    )
    assert [(e["key"], e["rule"], e["effect"]) for e in logged] == [
        ("$.tiers[0].options.medium", "medium", "miscredits"),
        ("$.tiers[2].announce_ownership", "ownership", "miscredits"),  # as external: 0.6
        ("$.sinks[1].options.topic", "topic", "drops"),
        ("$.events.router_block_size", "block_size", "drops"),
    ]
    by_key = {e["key"]: e for e in logged}
    assert by_key["$.tiers[0].options.medium"]["fix"] == ("set $.tiers[0].options.medium to 'CPU'")
    assert by_key["$.sinks[1].options.topic"]["fix"] == 'set $.sinks[1].options.topic to ""'
    assert by_key["$.events.router_block_size"]["finding"].startswith(
        "vllm-router 0.1.17 drops stores with block_size 32: it reads block_size 16 only "
        "(--kv-event-block-size default; $.events.router_block_size not set)"
    )


@pytest.mark.parametrize("router", ["dynamo", "vllm-router"])
def test_a_configuration_that_agrees_with_its_router_logs_nothing(
    registry: Registry, router: str
) -> None:
    logged = warnings_of(
        registry,
        {
            "tiers": [memory_tier("local"), memory_tier("disk", medium="DISK", locality=None)],
            "sinks": [{"type": "zmq", "options": {"endpoint": "tcp://127.0.0.1:*"}}],
            "events": {"router": router, "router_block_size": 16},
        },
    )
    assert logged == []


def test_without_a_router_nothing_is_checked(registry: Registry) -> None:
    logged = warnings_of(
        registry,
        {
            "tiers": [memory_tier("shared", medium="SHARED_STORAGE", locality="REMOTE")],
            "events": {"int_block_hashes": False},
        },
    )
    assert logged == []


@pytest.mark.parametrize(
    ("events", "key", "says"),
    [
        ({"router": "llm-d"}, "$.events.router", "must be a router kvhex knows"),
        ({"router_block_size": 16}, "$.events.router_block_size", "applies with router"),
        (
            {"router": "dynamo", "router_block_size": 0},
            "$.events.router_block_size",
            "greater than 0",
        ),
    ],
)
def test_a_bad_router_setting_is_an_error_at_its_key(
    events: dict[str, Any], key: str, says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"primary": {"capacity_bytes": SLOT}, "events": events})
    assert info.value.paths == (key,)
    assert says in str(info.value)
