"""A third-party tier that cannot start blames its own option (``TierUnavailable(option=...)``)
and composition reports the error at that option's key, as it does for kvhex's own tiers:
from kvhex's configuration and from vLLM's, a nested option included; a tier that blames
none is reported at its entry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.bootstrap import build_engine
from kvhex.config import load_config
from kvhex.errors import ConfigError, TierUnavailable
from kvhex.plugins import TIERS, Registry
from kvhex.ports.host_buffer import HostBuffer
from kvhex.vllm.compose import RegionHostBuffer
from kvhex.vllm.compose import build_engine as build_vllm_engine
from kvhex.vllm.settings import parse_settings

SLOT = 4096


class LedgerTierStore(MemoryTierStore):
    """A tier as a third party would write one: blocks in memory, and a ledger it must open
    at start-up, named by options kvhex has never heard of."""

    def __init__(
        self,
        host: HostBuffer,
        *,
        capacity_bytes: int,
        ledger: Mapping[str, Any],
        name: str = "ledger",
    ) -> None:
        if ledger.get("dsn") == "ledger://down":
            raise TierUnavailable("the ledger does not answer", tier=name, option="ledger.dsn")
        if ledger.get("dsn") == "ledger://odd":
            raise TierUnavailable("the ledger is in an odd state", tier=name)
        super().__init__(host, capacity_bytes=capacity_bytes, name=name)


@pytest.fixture
def registry() -> Registry:
    registry = Registry.discover()
    registry.register(TIERS, "ledger", LedgerTierStore)
    return registry


def _kvhex_fails(registry: Registry, dsn: str) -> ConfigError:
    tier = {"type": "ledger", "options": {"capacity_bytes": SLOT, "ledger": {"dsn": dsn}}}
    config = load_config({"primary": {"capacity_bytes": 4 * SLOT}, "tiers": [tier]})
    with pytest.raises(ConfigError) as info:
        build_engine(config, MemoryHostBuffer(4, SLOT), registry, namespace={}, source="t.toml")
    return info.value


def test_the_option_a_third_party_tier_blames_is_the_key_reported(registry: Registry) -> None:
    ((path, problem),) = _kvhex_fails(registry, "ledger://down").issues
    assert path == "$.tiers[0].options.ledger.dsn"
    assert problem == "kvhex tier 'ledger' cannot start: the ledger does not answer"


def test_a_tier_that_blames_no_option_is_reported_at_its_entry(registry: Registry) -> None:
    ((path, problem),) = _kvhex_fails(registry, "ledger://odd").issues
    assert path == "$.tiers[0]"
    assert problem.endswith("the ledger is in an odd state")


def test_inside_vllm_the_blamed_option_is_the_entry_s_own_key(registry: Registry) -> None:
    entry = {
        "type": "KvhexSecondaryTier",
        "tier": "ledger",
        "kvhex": {"capacity_bytes": SLOT},
        "ledger": {"dsn": "ledger://down"},
    }
    settings = parse_settings({"cpu_bytes_to_use": 2 * SLOT, "secondary_tiers": [entry]})
    host = RegionHostBuffer(memoryview(bytearray(2 * SLOT)), 2, SLOT)
    with pytest.raises(ConfigError) as info:
        build_vllm_engine(settings, host, registry=registry, namespace={}, record_events=True)
    ((path, problem),) = info.value.issues
    assert path == "$.secondary_tiers[0].ledger.dsn"
    assert problem.endswith("the ledger does not answer")


def test_a_tier_that_starts_is_built(registry: Registry) -> None:
    tier = {"type": "ledger", "options": {"capacity_bytes": SLOT, "ledger": {"dsn": "ok"}}}
    config = load_config({"primary": {"capacity_bytes": 4 * SLOT}, "tiers": [tier]})
    engine, (tier_store,) = build_engine(config, MemoryHostBuffer(4, SLOT), registry, namespace={})
    assert isinstance(tier_store, LedgerTierStore)
    engine.shutdown()
