"""vLLM's extra config -> kvhex settings, and building tiers from them (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.bootstrap import build_tier
from kvhex.config import BackpressureConfig
from kvhex.domain.tiers import Locality
from kvhex.errors import ConfigError
from kvhex.plugins import Registry
from kvhex.vllm.compose import (
    DEFAULT_OBJECT_CAPACITY,
    RegionHostBuffer,
    build_engine,
    build_tier_store,
    check_router,
)
from kvhex.vllm.settings import parse_settings, parse_tier

pytest.importorskip("fsspec")


def _paths(extra: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_settings(extra)
    assert err.value.source == "kv_connector_extra_config"
    return sorted(err.value.paths)


def test_vllms_cpu_and_tiering_keys_keep_their_meaning() -> None:
    settings = parse_settings(
        {
            "spec_name": "KvhexOffloadingSpec",
            "cpu_bytes_to_use": 4.0 * (1 << 30),  # --kv-offloading-size gives a float
            "eviction_policy": "arc",
            "store_threshold": 0,
            "max_tracker_size": 10,
            "offload_prompt_only": False,
            "self_describing_kv_events": True,
            "block_size": 32,
            "tier_poll_interval_s": 0.01,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": "/mnt/kv",
                    "n_read_threads": 4,
                    "n_write_threads": 2,
                    "enable_kv_events": True,
                    "locality": "REMOTE",
                },
                {
                    "type": "obj",
                    "store_config": {
                        "bucket": "kv",
                        "endpoint_override": "127.0.0.1:9000",
                        "access_key": "a",
                        "secret_key": "s",
                    },
                    "prefix": "/team/",
                },
            ],
        }
    )
    assert settings.cpu_bytes_to_use == 4 << 30
    assert (settings.policy, settings.store_threshold, settings.max_tracker_size) == ("arc", 1, 10)
    fs, obj = settings.tiers
    assert (fs.plugin, fs.name, fs.enable_kv_events, fs.locality) == (
        "fsspec",
        "fs",
        True,
        Locality.REMOTE,
    )
    assert fs.options == {"url": "/mnt/kv", "io_threads": 6, "locality": Locality.REMOTE}
    assert fs.default_capacity
    assert (obj.plugin, obj.name, obj.enable_kv_events, obj.locality) == (
        "nixl",
        "obj1",
        False,
        None,
    )
    assert obj.options == {
        "url": "s3://kv/team",
        "endpoint_url": "http://127.0.0.1:9000",
        "access_key": "a",
        "secret_key": "s",
        "region": "us-east-1",
        "locality": None,
    }


def test_kvhex_only_settings_live_in_kvhex_sub_objects() -> None:
    settings = parse_settings(
        {
            "cpu_bytes_to_use": 1 << 20,
            "kvhex": {"policy": "fifo"},
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": "/kv",
                    "kvhex": {
                        "name": "nvme",
                        "capacity_bytes": 1 << 30,
                        "backpressure": {"high_water_s": 2.0, "low_water_s": 1.0},
                    },
                },
                {"type": "KvhexSecondaryTier", "tier": "memory", "capacity_bytes": 99},
            ],
        }
    )
    assert settings.policy == "fifo"
    nvme, memory = settings.tiers
    assert (nvme.name, nvme.options["capacity_bytes"], nvme.default_capacity) == (
        "nvme",
        1 << 30,
        False,
    )
    assert nvme.backpressure is not None
    assert nvme.backpressure.high_water_s == 2.0
    assert (memory.plugin, memory.name, memory.options) == (
        "memory",
        "memory1",
        {"capacity_bytes": 99},
    )


def test_every_problem_is_reported_at_once_with_its_path() -> None:
    assert _paths(
        {
            "cpu_bytes_to_use": True,
            "eviction_polcy": "lru",
            "store_threshold": "2",
            "offload_prompt_only": 1,
            "cache_policy_module_path": "my.policies",
            "backpressure": {},
            "kvhex": {"policy": 3, "tiers": []},
            "secondary_tiers": [
                {"type": "fs"},
                {"type": "obj", "store_config": {"bucket": "b", "session_token": "t"}},
                {"type": "p2p"},
                "fs",
                {"type": "fs", "root_dir": "/x", "locality": "nearby", "n_read_threads": 0},
                {"type": "KvhexSecondaryTier"},
            ],
        }
    ) == sorted(
        [
            "$.cpu_bytes_to_use",
            "$.eviction_polcy",
            "$.store_threshold",
            "$.offload_prompt_only",
            "$.cache_policy_module_path",
            "$.backpressure",
            "$.kvhex.policy",
            "$.kvhex.tiers",
            "$.secondary_tiers[0].root_dir",
            "$.secondary_tiers[1].store_config.endpoint_override",
            "$.secondary_tiers[1].store_config.session_token",
            "$.secondary_tiers[2].type",
            "$.secondary_tiers[3]",
            "$.secondary_tiers[4].locality",
            "$.secondary_tiers[4].n_read_threads",
            "$.secondary_tiers[5].tier",
        ]
    )


def test_typos_get_a_suggestion_and_missing_keys_say_so() -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"cpu_bytes_to_use": 10, "eviction_polcy": "lru"})
    assert "did you mean 'eviction_policy'" in str(err.value)
    with pytest.raises(ConfigError, match=r"\$\.cpu_bytes_to_use: required key is missing"):
        parse_settings({})


def test_threshold_with_tiers_and_duplicate_names_are_refused() -> None:
    tiers = [
        {"type": "fs", "root_dir": "/a"},
        {"type": "fs", "root_dir": "/b", "kvhex": {"name": "fs"}},
    ]
    assert _paths({"cpu_bytes_to_use": 10, "store_threshold": 2, "secondary_tiers": tiers}) == [
        "$.secondary_tiers[1].kvhex.name",
        "$.store_threshold",
    ]
    assert parse_settings({"cpu_bytes_to_use": 10, "store_threshold": 2}).store_threshold == 2


def test_tier_options_are_checked_against_the_tier_before_building(tmp_path: Path) -> None:
    host = MemoryHostBuffer(4, 64)
    registry = Registry.discover()
    with pytest.raises(ConfigError) as err:
        build_tier("memory", host, registry, {"capacity": 5}, path="$.t")
    assert sorted(err.value.paths) == ["$.t.capacity", "$.t.capacity_bytes"]
    with pytest.raises(ConfigError, match=r"unknown kvhex tier 'nope'; available: .*memory"):
        build_tier("nope", host, registry, {}, path="$.t")
    with pytest.raises(ConfigError) as err:
        build_tier("memory", host, registry, {"capacity_bytes": 0}, path="$.t")
    assert err.value.paths == ("$.t.capacity_bytes",)  # the tier's ValueError names it
    with pytest.raises(ConfigError) as err:
        build_tier("memory", host, registry, {"capacity_bytes": 64, "locality": "far"}, path="$.t")
    assert err.value.paths == ("$.t.locality",)
    tier = build_tier(
        "memory", host, registry, {"capacity_bytes": 64, "locality": "remote"}, path="$.t"
    )
    assert tier.identity.locality is Locality.REMOTE


def test_drop_in_tiers_build_kvhex_tiers_with_names_namespaces_and_capacities(
    tmp_path: Path,
) -> None:
    settings = parse_settings(
        {
            "cpu_bytes_to_use": 4 * 4096,
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(tmp_path / "a" / "b"), "locality": "LOCAL"},
                {"type": "KvhexSecondaryTier", "tier": "memory", "capacity_bytes": 1 << 20},
            ],
        }
    )
    backing = bytearray(4 * 4096)
    host = RegionHostBuffer(memoryview(backing), 4, 4096)
    engine, stores = build_engine(
        settings, host, registry=Registry.discover(), namespace={"model": "m"}, record_events=True
    )
    files, memory = stores
    assert files.identity.ownership == "fs"
    assert files.identity.locality is Locality.LOCAL
    assert memory.identity.ownership == "memory1"
    assert getattr(files, "namespace", {}).get("model") == "m"
    assert 0 < getattr(files, "capacity_bytes", 0) < DEFAULT_OBJECT_CAPACITY
    host.slot_view(3)[:] = b"\x05" * 4096
    assert backing[3 * 4096] == 5
    engine.shutdown()
    with pytest.raises(IndexError):
        host.slot_view(0)


def test_an_unknown_policy_is_named_and_nothing_stays_open(tmp_path: Path) -> None:
    settings = parse_settings(
        {
            "cpu_bytes_to_use": 4096,
            "eviction_policy": "nosuch",
            "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}],
        }
    )
    host = RegionHostBuffer(memoryview(bytearray(4096)), 1, 4096)
    with pytest.raises(ConfigError) as err:
        build_engine(settings, host, registry=Registry.discover(), namespace={}, record_events=True)
    assert err.value.paths == ("$.eviction_policy",)
    tier = parse_tier({"type": "KvhexSecondaryTier", "tier": "nope"}, "$.x")
    with pytest.raises(ConfigError, match=r"\$\.x\.tier: unknown kvhex tier 'nope'"):
        build_tier_store(tier, host, Registry.discover(), {})


# -- checks at load time: one model, the same paths as TOML ----------------------------------
def test_missing_keys_say_what_they_hold() -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"secondary_tiers": [{"type": "fs"}, {"type": "obj", "store_config": {}}]})
    assert dict(err.value.issues) == {
        "$.cpu_bytes_to_use": "required key is missing (bytes of host memory for KV chunks)",
        "$.secondary_tiers[0].root_dir": "required key is missing (the tier's directory)",
        "$.secondary_tiers[1].store_config.bucket": (
            "required key is missing (an existing bucket's name)"
        ),
        "$.secondary_tiers[1].store_config.endpoint_override": (
            "required key is missing (the S3 endpoint: host:port, or a URL with its scheme)"
        ),
    }


def test_empty_roots_urls_and_buckets_are_refused_naming_the_key() -> None:
    assert _paths(
        {
            "cpu_bytes_to_use": 10,
            "secondary_tiers": [
                {"type": "fs", "root_dir": ""},
                {"type": "fs", "root_dir": "  ", "kvhex": {"name": "other"}},
                {"type": "KvhexSecondaryTier", "tier": "fsspec", "url": ""},
                {"type": "obj", "store_config": {"bucket": "", "endpoint_override": "h:1"}},
            ],
        }
    ) == [
        "$.secondary_tiers[0].root_dir",
        "$.secondary_tiers[1].root_dir",
        "$.secondary_tiers[3].store_config.bucket",
    ]
    with pytest.raises(ConfigError) as err:  # alone, the url's entry is checked as a whole
        parse_settings(
            {
                "cpu_bytes_to_use": 10,
                "secondary_tiers": [{"type": "KvhexSecondaryTier", "tier": "fsspec", "url": " "}],
            }
        )
    ((path, problem),) = err.value.issues
    assert path == "$.secondary_tiers[0].url"
    assert "must not be empty" in problem
    with pytest.raises(ConfigError, match=r"\$\.x\.url: must not be empty"):
        parse_tier({"type": "KvhexSecondaryTier", "tier": "fsspec", "url": ""}, "$.x")


def test_tiers_that_are_not_a_list_are_refused() -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"cpu_bytes_to_use": 10, "secondary_tiers": {"type": "fs"}})
    assert err.value.issues == (("$.secondary_tiers", "expected a list, got a table/object"),)


def test_names_repeated_or_invalid_are_named_where_they_were_set() -> None:
    tiers = [
        {"type": "KvhexSecondaryTier", "tier": "memory", "name": "kv"},
        {"type": "KvhexSecondaryTier", "tier": "memory", "name": "kv"},
        {"type": "fs", "root_dir": "/a", "kvhex": {"name": "kv"}},
        {"type": "KvhexSecondaryTier", "tier": "memory", "name": 5},
    ]
    assert _paths({"cpu_bytes_to_use": 10, "secondary_tiers": tiers}) == [
        "$.secondary_tiers[1].name",
        "$.secondary_tiers[2].kvhex.name",
        "$.secondary_tiers[3].name",
    ]
    bad = [{"type": "fs", "root_dir": "/b", "kvhex": {"name": "no spaces"}}]
    assert _paths({"cpu_bytes_to_use": 10, "secondary_tiers": bad}) == [
        "$.secondary_tiers[0].kvhex.name"
    ]


def test_tier_backpressure_is_kvhex_s_one_model() -> None:
    settings = parse_settings(
        {
            "cpu_bytes_to_use": 10,
            "secondary_tiers": [
                {"type": "fs", "root_dir": "/kv", "kvhex": {"backpressure": {"warmup": 0}}}
            ],
        }
    )
    assert settings.tiers[0].backpressure == BackpressureConfig(warmup=0)
    extra = {
        "cpu_bytes_to_use": 10,
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": "/kv",
                "kvhex": {"backpressure": {"low_water_s": 2.0, "high_water_s": 1.0}},
            }
        ],
    }
    with pytest.raises(ConfigError) as err:
        parse_settings(extra)
    ((path, problem),) = err.value.issues
    assert path == "$.secondary_tiers[0].kvhex.backpressure.low_water_s"
    assert "between 0 and high_water_s (1.0)" in problem


# -- checks when the engine is built, before any tier is -----------------------------------
def test_a_tier_capacity_below_one_chunk_is_refused_before_any_tier_is_built(
    tmp_path: Path,
) -> None:
    first = tmp_path / "first"
    settings = parse_settings(
        {
            "cpu_bytes_to_use": 2 * 4096,
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(first)},
                {"type": "fs", "root_dir": str(tmp_path / "b"), "kvhex": {"capacity_bytes": 4095}},
            ],
        }
    )
    host = RegionHostBuffer(memoryview(bytearray(2 * 4096)), 2, 4096)
    with pytest.raises(ConfigError) as err:
        build_engine(settings, host, registry=Registry.discover(), namespace={}, record_events=True)
    ((path, problem),) = err.value.issues
    assert path == "$.secondary_tiers[1].kvhex.capacity_bytes"
    assert problem.startswith("4095 bytes hold no block of 4096 bytes")
    assert err.value.source == "kv_connector_extra_config"
    assert not first.exists()


def test_a_tier_that_cannot_start_is_named_at_root_dir(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    settings = parse_settings(
        {
            "cpu_bytes_to_use": 2 * 4096,
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(tmp_path / "a")},
                {"type": "fs", "root_dir": str(not_a_directory)},
            ],
        }
    )
    host = RegionHostBuffer(memoryview(bytearray(2 * 4096)), 2, 4096)
    with pytest.raises(ConfigError) as err:
        build_engine(settings, host, registry=Registry.discover(), namespace={}, record_events=True)
    ((path, problem),) = err.value.issues
    assert path == "$.secondary_tiers[1].root_dir"
    assert problem.startswith("kvhex tier 'fsspec' cannot start: cannot use root")


@pytest.mark.parametrize(
    ("case", "key", "words"),
    [
        ("bucket", "bucket", "bucket 'kvhex-no-such-bucket' does not exist (NoSuchBucket)"),
        ("access_key", "access_key", "access key id is not known to the server"),
        ("secret_key", "secret_key", "wrong secret key (SignatureDoesNotMatch)"),
    ],
)
def test_an_obj_tier_that_cannot_start_names_the_store_config_key(
    s3_auth_server: Any, case: str, key: str, words: str
) -> None:
    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl==1.5.1) is not installed")
    admin = s3_auth_server.users["admin"]
    store = {
        "bucket": s3_auth_server.bucket,
        "endpoint_override": s3_auth_server.endpoint,
        "access_key": admin["key"],
        "secret_key": admin["secret"],
    }
    store[case] = {
        "bucket": "kvhex-no-such-bucket",
        "access_key": "AKIAKVHEXUNKNOWNKEY1",
        "secret_key": "kvhex-wrong-secret-value",
    }[case]
    settings = parse_settings(
        {"cpu_bytes_to_use": 2 * 4096, "secondary_tiers": [{"type": "obj", "store_config": store}]}
    )
    host = RegionHostBuffer(memoryview(bytearray(2 * 4096)), 2, 4096)
    with pytest.raises(ConfigError) as err:
        build_engine(settings, host, registry=Registry.discover(), namespace={}, record_events=True)
    ((path, problem),) = err.value.issues
    assert path == f"$.secondary_tiers[0].store_config.{key}"
    assert problem.startswith("kvhex tier 'nixl' cannot start")
    assert words in problem
    for secret in (store["access_key"], store["secret_key"], admin["secret"]):
        assert secret not in str(err.value)


def test_a_tier_entry_s_codec_chain_is_built_with_the_kv_dtype_and_refused_where_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVHEX_CODEC_KEY", "4d" * 32)
    paths = _paths(
        {
            "cpu_bytes_to_use": 4 * 4096,
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(tmp_path / "kv"), "kvhex": {"codec": "zstd"}},
            ],
        }
    )
    assert paths == ["$.secondary_tiers[0].kvhex.codec"]
    settings = parse_settings(
        {
            "cpu_bytes_to_use": 4 * 4096,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(tmp_path / "kv"),
                    "kvhex": {"codec": ["fp8", {"name": "zstd", "shuffle": 0}, "aes-gcm"]},
                }
            ],
        }
    )
    backing = bytearray(4 * 4096)
    host = RegionHostBuffer(memoryview(backing), 4, 4096)
    namespace = {"model": "m", "kv_cache_dtype": "bfloat16"}
    engine, (files,) = build_engine(
        settings, host, registry=Registry.discover(), namespace=namespace, record_events=True
    )
    chain = getattr(files, "codec", None)
    assert chain is not None
    assert chain.names == ["fp8", "zstd", "aes-gcm"]
    assert chain.description[0]["dtype"] == "bfloat16"  # the engine's KV dtype
    engine.shutdown()
    obj = parse_tier(
        {
            "type": "obj",
            "store_config": {"bucket": "b", "endpoint_override": "127.0.0.1:9"},
            "kvhex": {"codec": ["zstd"]},
        },
        "$.secondary_tiers[0]",
    )
    with pytest.raises(ConfigError) as err:
        build_tier_store(obj, host, Registry.discover(), namespace)
    assert err.value.paths == ("$.secondary_tiers[0].kvhex.codec",)


# -- kvhex.router: start-up warnings at the keys of the extra config ----------------------------
def _router_warnings(
    tmp_path: Path, kvhex: dict[str, Any], *, topic: str | None, int_hashes: bool
) -> list[dict[str, Any]]:
    """The ``router_config_mismatch`` entries logged for an engine of every kind of entry."""
    settings = parse_settings(
        {
            "cpu_bytes_to_use": 4 * 4096,
            "kvhex": kvhex,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(tmp_path / "fs"),
                    "enable_kv_events": True,
                    "kvhex": {"medium": "SHARED_STORAGE"},
                },
                {
                    "type": "KvhexSecondaryTier",
                    "tier": "memory",
                    "capacity_bytes": 1 << 20,
                    "enable_kv_events": True,
                    "locality": "REMOTE",
                    "medium": "CPU_PINNED",
                },
                {
                    "type": "KvhexSecondaryTier",
                    "tier": "memory",
                    "capacity_bytes": 1 << 20,
                    "enable_kv_events": True,
                    "kvhex": {"announce_ownership": True},
                },
                {  # never announced: nothing of it reaches a router
                    "type": "KvhexSecondaryTier",
                    "tier": "memory",
                    "capacity_bytes": 1 << 20,
                    "medium": "SHARED_STORAGE",
                },
            ],
        }
    )
    host = RegionHostBuffer(memoryview(bytearray(4 * 4096)), 4, 4096)
    engine, stores = build_engine(
        settings, host, registry=Registry.discover(), namespace={"model": "m"}, record_events=True
    )
    try:
        with structlog.testing.capture_logs() as logs:
            found = check_router(
                settings, stores, int_hashes=int_hashes, topic=topic, block_sizes=[16]
            )
    finally:
        engine.shutdown()
    logged = [dict(e) for e in logs if e["event"] == "router_config_mismatch"]
    assert [e["finding"] for e in logged] == [f.line() for f in found]  # one each
    return logged


def test_kvhex_router_warns_once_per_finding_at_the_extra_config_keys(tmp_path: Path) -> None:
    dynamo = _router_warnings(
        tmp_path, {"router": "dynamo", "router_block_size": 32}, topic="kv", int_hashes=False
    )
    assert [(e["key"], e["rule"], e["effect"]) for e in dynamo] == [
        ("$.secondary_tiers[0].kvhex.medium", "medium", "drops"),
        ("$.secondary_tiers[1].locality", "locality", "drops"),
        ("$.secondary_tiers[2].kvhex.announce_ownership", "ownership", "drops"),
        ("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "hash_form", "drops"),
        ("$.kvhex.router_block_size", "block_size", "drops"),
    ]
    assert all(e["source"] == "kv_connector_extra_config" for e in dynamo)
    assert dynamo[3]["fix"] == "set VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES to 1"
    router = _router_warnings(tmp_path, {"router": "vllm-router"}, topic="kv", int_hashes=False)
    assert [(e["key"], e["rule"], e["effect"]) for e in router] == [
        ("$.secondary_tiers[0].kvhex.medium", "medium", "miscredits"),
        ("$.secondary_tiers[1].medium", "medium", "miscredits"),  # the tier's own option
        ("$.secondary_tiers[2].kvhex.announce_ownership", "ownership", "miscredits"),
        ("vLLM's kv_events_config.topic (--kv-events-config)", "topic", "drops"),
    ]
    assert router[3]["finding"] == (
        "vllm-router 0.1.17 drops every event with ZMQ topic 'kv': it reads only the empty "
        "topic (0.1.17 has no topic setting); fix: set vLLM's kv_events_config.topic "
        '(--kv-events-config) to ""'
    )


def test_without_kvhex_router_nothing_is_checked(tmp_path: Path) -> None:
    assert _router_warnings(tmp_path, {}, topic="kv", int_hashes=False) == []


def test_the_router_keys_are_read_and_checked() -> None:
    settings = parse_settings(
        {"cpu_bytes_to_use": 4096, "kvhex": {"router": "dynamo", "router_block_size": 16}}
    )
    assert (settings.router, settings.router_block_size) == ("dynamo", 16)
    assert _paths({"cpu_bytes_to_use": 4096, "kvhex": {"router": "sglang"}}) == ["$.kvhex.router"]
    assert _paths({"cpu_bytes_to_use": 4096, "kvhex": {"router_block_size": 16}}) == [
        "$.kvhex.router_block_size"
    ]
