from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from kvhex.bootstrap import build_policy, build_primary_tier
from kvhex.config import PrimaryConfig
from kvhex.domain import ArcPolicy, LruPolicy
from kvhex.errors import ConfigError, PluginError
from kvhex.plugins import POLICIES, SINKS, TIERS, TRANSFERS, Registry
from kvhex.testing import EvictionPolicyContract


def test_builtins_are_entry_points_of_the_kvhex_distribution() -> None:
    registry = Registry.discover()
    specs = {s.name: s for s in registry.specs(POLICIES)}
    assert {"lru", "arc"} <= set(specs)
    assert specs["lru"].distribution == "kvhex"
    assert specs["lru"].value == "kvhex.domain.policies.lru:LruPolicy"
    assert registry.load(POLICIES, "lru") is LruPolicy
    assert registry.load(POLICIES, "arc") is ArcPolicy


def test_discovery_imports_nothing_and_load_all_reports_origin() -> None:
    registry = Registry.discover([POLICIES])
    report = registry.load_all()
    origins = {(p.spec.name, p.spec.distribution) for p in report.loaded}
    assert {("lru", "kvhex"), ("arc", "kvhex")} <= origins
    assert report.failed == ()
    assert any(line.startswith("kvhex.policies lru: loaded from kvhex") for line in report.lines())


def test_third_party_policy_is_found_loaded_and_passes_the_contract(with_fifo: Path) -> None:
    registry = Registry.discover()
    spec = next(s for s in registry.specs(POLICIES) if s.name == "fifo")
    assert (spec.distribution, spec.version) == ("kvhex-fifo-policy", "1.2.3")
    factory = registry.load(POLICIES, "fifo")
    assert factory.__module__ == "kvhex_fifo_policy"

    class Suite(EvictionPolicyContract):
        def make_policy(self, capacity: int):  # type: ignore[no-untyped-def]
            return factory(capacity)

    suite = Suite()
    for name in dir(suite):
        if name.startswith("test_"):
            getattr(suite, name)()


def test_third_party_policy_drives_a_primary_tier_from_config(with_fifo: Path) -> None:
    registry = Registry.discover()
    config = PrimaryConfig(capacity_bytes=4096, policy="fifo")  # type: ignore[arg-type]
    tier = build_primary_tier(config, slot_bytes=1024, registry=registry)
    assert tier.num_slots == 4
    assert type(tier._policy).__name__ == "FifoPolicy"


def test_failed_import_names_group_entry_point_distribution_and_hint(with_fifo: Path) -> None:
    registry = Registry.discover()
    with pytest.raises(PluginError) as info:
        registry.load(POLICIES, "broken")
    err = info.value
    assert (err.group, err.plugin_name, err.distribution) == (
        "kvhex.policies",
        "broken",
        "kvhex-fifo-policy",
    )
    assert err.hint == "pip install 'kvhex-fifo-policy[fast]'"
    assert "ModuleNotFoundError" in str(err)
    assert isinstance(err, ImportError)
    report = registry.load_all(POLICIES)
    assert [e.plugin_name for e in report.failed] == ["broken"]
    assert "fifo" in {p.spec.name for p in report.loaded}


def test_duplicate_names_are_refused_unless_replacement_is_asked(with_shadow: Path) -> None:
    with pytest.raises(PluginError, match="already declared by distribution") as info:
        Registry.discover()
    assert info.value.plugin_name == "lru"
    registry = Registry.discover(replace=True)
    assert registry.load(POLICIES, "lru").__name__ == "ShadowLru"
    report = registry.load_all(POLICIES)
    assert [(old.distribution, new.distribution) for old, new in report.replaced] == [
        ("kvhex", "kvhex-shadow-lru")
    ]


def test_unknown_names_list_the_available_ones() -> None:
    registry = Registry.discover()
    with pytest.raises(PluginError, match=r"available: .*arc.*lru"):
        registry.load(POLICIES, "nope")
    with pytest.raises(ConfigError) as info:
        build_policy("nope", 4, registry, path="$.primary.policy")
    assert info.value.paths == ("$.primary.policy",)
    assert "available: arc, lru" in str(info.value)


def test_unknown_group_is_refused() -> None:
    with pytest.raises(PluginError, match="unknown entry-point group"):
        Registry.discover(["kvhex.nope"])


def test_objects_are_checked_against_the_port() -> None:
    registry = Registry.discover([POLICIES])

    class NotAPolicy:
        def __init__(self, capacity: int) -> None:
            pass

        def evict(self) -> None:
            pass

    with pytest.raises(PluginError, match="lacks EvictionPolicy methods: insert, remove"):
        registry.register(POLICIES, "bad", NotAPolicy)
    with pytest.raises(PluginError, match="expected a policy class or factory"):
        registry.register(POLICIES, "bad", 42)
    fake = [
        EntryPoint("weird", "builtins:repr", POLICIES),
        EntryPoint("crashy", "builtins:len", POLICIES),
    ]
    plain = Registry.discover([POLICIES], found=fake)
    assert plain.load(POLICIES, "weird") is repr  # callable factory: accepted, checked on build
    with pytest.raises(ConfigError, match="built a str, not an EvictionPolicy"):
        build_policy("weird", 4, plain, path="$.primary.policy")
    with pytest.raises(ConfigError, match="failed to build: TypeError"):
        build_policy("crashy", 4, plain, path="$.primary.policy")


def test_register_refuses_duplicates_without_replace() -> None:
    registry = Registry.discover([POLICIES])
    with pytest.raises(PluginError, match="already declared"):
        registry.register(POLICIES, "lru", ArcPolicy)
    registry.register(POLICIES, "lru", ArcPolicy, replace=True)
    assert registry.load(POLICIES, "lru") is ArcPolicy


def test_the_torch_and_memory_transfers_are_builtin_entry_points_that_load() -> None:
    from kvhex.adapters.memory import MemoryBlockTransfer
    from kvhex.adapters.torch import TorchBlockTransfer

    registry = Registry.discover([TRANSFERS])
    assert registry.names(TRANSFERS) == ["memory", "torch"]
    assert registry.load(TRANSFERS, "memory") is MemoryBlockTransfer
    spec = next(s for s in registry.specs(TRANSFERS) if s.name == "torch")
    assert spec.distribution == "kvhex"
    assert spec.value == "kvhex.adapters.torch:TorchBlockTransfer [torch]"
    assert spec.install_hint() == "pip install 'kvhex[torch]'"
    assert registry.load(TRANSFERS, "torch") is TorchBlockTransfer
    report = registry.load_all(TRANSFERS)
    assert report.failed == ()
    with pytest.raises(PluginError, match=r"available: .*torch"):
        registry.load(TRANSFERS, "nope")
    with pytest.raises(PluginError, match="lacks BlockTransfer methods: submit_store"):
        registry.register(TRANSFERS, "bad", ArcPolicy)


def test_every_event_sink_is_a_builtin_entry_point_that_loads() -> None:
    registry = Registry.discover([SINKS])
    assert registry.names(SINKS) == ["jsonl", "log", "memory", "zmq"]
    report = registry.load_all(SINKS)
    assert report.failed == ()
    zmq_spec = next(s for s in registry.specs(SINKS) if s.name == "zmq")
    assert zmq_spec.install_hint() == "pip install 'kvhex[zmq]'"


def test_primary_capacity_must_hold_one_slot() -> None:
    registry = Registry.discover()
    config = PrimaryConfig(capacity_bytes=100)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        build_primary_tier(config, slot_bytes=1024, registry=registry)
    assert info.value.paths == ("$.primary.capacity_bytes",)
    with pytest.raises(ValueError, match="slot_bytes"):
        build_primary_tier(config, slot_bytes=0, registry=registry)


def test_the_memory_tier_is_a_builtin_entry_point_checked_against_the_port() -> None:
    from kvhex.adapters.memory import MemoryTierStore

    registry = Registry.discover([TIERS])
    assert registry.load(TIERS, "memory") is MemoryTierStore
    with pytest.raises(PluginError, match="lacks TierStore methods: take_events, submit_put"):
        registry.register(TIERS, "bad", ArcPolicy)
