"""``[loading]`` (TOML) and ``kvhex.loading`` (vLLM): checked at load, each error at its key,
and the engine built with the decider they describe."""

from __future__ import annotations

import tomllib

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.bootstrap import build_engine
from kvhex.config import load_config
from kvhex.config.loader import load_vllm_config, loads_toml
from kvhex.domain.cost import LoadMode
from kvhex.errors import ConfigError
from kvhex.plugins import Registry

BASE = """[primary]
capacity_bytes = 4096
[[tiers]]
type = "memory"
options = {capacity_bytes = 8192}
"""


@pytest.mark.parametrize(
    ("table", "path", "words"),
    [
        ('mode = "sometimes"', "$.loading.mode", "must be one of 'off', 'auto', 'fixed'"),
        ("mode = 1", "$.loading.mode", "expected str, got int 1"),
        ('mode = "auto"\nmin_tokens = 64', "$.loading.min_tokens", "applies to mode 'fixed' only"),
        ('mode = "fixed"', "$.loading.min_tokens", "needs a number of tokens > 0"),
        ("min_tokens = -1", "$.loading.min_tokens", ">= 0"),
        ("prefill_tokens_per_s = 0", "$.loading.prefill_tokens_per_s", "positive number"),
        ('prefill_tokens_per_s = "fast"', "$.loading.prefill_tokens_per_s", "str"),
        ("explore_every = 0", "$.loading.explore_every", "greater than 0"),
        ("explor_every = 2", "$.loading.explor_every", "did you mean 'explore_every'"),
    ],
)
def test_bad_loading_settings_are_named_at_their_key(table: str, path: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        loads_toml(f"{BASE}[loading]\n{table}\n", source="kvhex.toml")
    assert path in err.value.paths, str(err.value)
    assert words in str(err.value)
    assert "kvhex.toml" in str(err.value)


def test_the_vllm_keys_take_the_same_settings_under_kvhex() -> None:
    config = load_vllm_config(
        {"cpu_bytes_to_use": 1 << 20, "kvhex": {"loading": {"mode": "fixed", "min_tokens": 512}}}
    )
    assert (config.kvhex.loading.mode, config.kvhex.loading.min_tokens) == ("fixed", 512)
    with pytest.raises(ConfigError) as err:
        load_vllm_config({"cpu_bytes_to_use": 1 << 20, "kvhex": {"loading": {"mode": "never"}}})
    assert err.value.paths == ("$.kvhex.loading.mode",)


def test_the_engine_decides_as_configured_and_auto_is_the_default() -> None:
    host = MemoryHostBuffer(1, 4096)
    default = load_config(tomllib.loads(BASE))
    engine, _ = build_engine(default, host, Registry.discover())
    try:
        assert engine.stats().load_mode is LoadMode.AUTO
        assert engine.stats().prefill_tokens_per_s is None  # measured
    finally:
        engine.shutdown()
    configured = loads_toml(f'{BASE}[loading]\nmode = "off"\nprefill_tokens_per_s = 5000\n')
    engine, _ = build_engine(configured, MemoryHostBuffer(1, 4096), Registry.discover())
    try:
        assert engine.stats().load_mode is LoadMode.OFF
        assert engine.stats().prefill_tokens_per_s == 5000
    finally:
        engine.shutdown()
