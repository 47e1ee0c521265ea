from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhex.config import (
    BackpressureConfig,
    KvhexConfig,
    PrimaryConfig,
    TierConfig,
    load_config,
    loads_json,
    loads_toml,
)
from kvhex.domain.backpressure import EmaBackpressure
from kvhex.errors import ConfigError

GOOD = {"primary": {"capacity_bytes": 1 << 30, "policy": "arc", "store_threshold": 2}}
PRIMARY = "[primary]\ncapacity_bytes = 1048576\n"


def _issues(text: str, tmp_path: Path) -> tuple[tuple[str, str], ...]:
    """The issues of the TOML ``text`` loaded from a file; the error names the file."""
    path = tmp_path / "kvhex.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert f"invalid kvhex configuration in {path} " in str(info.value)
    return info.value.issues


def test_dict_toml_and_json_give_the_same_model(tmp_path: Path) -> None:
    from_dict = load_config(GOOD)
    toml = tmp_path / "kvhex.toml"
    toml.write_text('[primary]\ncapacity_bytes = 1073741824\npolicy = "arc"\nstore_threshold = 2\n')
    js = tmp_path / "kvhex.json"
    js.write_text(json.dumps(GOOD))
    assert load_config(toml) == from_dict == load_config(str(js))
    assert from_dict == KvhexConfig(
        primary=PrimaryConfig(capacity_bytes=1 << 30, policy="arc", store_threshold=2)  # type: ignore[arg-type]
    )
    assert from_dict.primary.max_tracker_size == 64_000


def test_every_bad_path_is_reported_at_once() -> None:
    bad = {
        "primary": {
            "capacity_bytes": 0,
            "policy": "LRU!",
            "store_threshhold": 2,
            "max_tracker_size": "big",
        },
        "tierz": [],
        "tiers": [{"type": "fsspec", "options": []}],
        "run": {"device": "gpu"},
    }
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    err = info.value
    assert set(err.paths) == {
        "$.primary.capacity_bytes",
        "$.primary.policy",
        "$.primary.store_threshhold",
        "$.primary.max_tracker_size",
        "$.tierz",
        "$.tiers[0].options",
        "$.run.device",
    }
    text = str(err)
    assert "did you mean 'store_threshold'?" in text
    assert "did you mean 'tiers'?" in text
    assert "must be greater than 0" in text
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-5, "must be greater than 0"),
        (True, "expected an integer, got bool"),
        (1.5, "expected an integer, got float"),
        ("1024", "expected an integer, got str"),
        (None, "expected an integer, got NoneType"),
    ],
)
def test_capacity_must_be_a_positive_integer(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config({"primary": {"capacity_bytes": value}})
    assert info.value.paths == ("$.primary.capacity_bytes",)


def test_missing_required_keys_are_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"primary": {}})
    assert info.value.issues == (
        (
            "$.primary.capacity_bytes",
            "required key is missing (bytes of host memory for KV chunks)",
        ),
    )
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"options": {}}]})
    assert info.value.paths == ("$.primary", "$.tiers[0].type")
    assert "(a kvhex.tiers entry point: fsspec, nixl, valkey, memory" in str(info.value)


def test_a_non_table_section_is_a_type_error_at_its_path() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"primary": 5})
    assert info.value.paths == ("$.primary",)


def test_python_construction_validates_the_same_way() -> None:
    with pytest.raises(ValueError, match="capacity_bytes: must be greater than 0"):
        PrimaryConfig(capacity_bytes=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy: expected a string"):
        PrimaryConfig(capacity_bytes=1, policy=3)  # type: ignore[arg-type]


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read file") as info:
        load_config(missing)
    assert info.value.source == str(missing)
    yaml = tmp_path / "kvhex.yaml"
    yaml.write_text("primary: {}")
    with pytest.raises(ConfigError, match=r"unknown config file type '\.yaml'"):
        load_config(yaml)
    broken = tmp_path / "broken.toml"
    broken.write_text("[primary\ncapacity_bytes = 1")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(broken)
    assert str(broken) in str(info.value)


def test_text_loaders_and_top_level_shape() -> None:
    assert loads_toml("[primary]\ncapacity_bytes = 8\n").primary.capacity_bytes == 8
    with pytest.raises(ConfigError, match="not valid JSON"):
        loads_json("{")
    with pytest.raises(ConfigError, match="expected a table/object, got list"):
        loads_json("[1, 2]")


def test_the_converter_is_private() -> None:
    import cattrs

    load_config(GOOD)
    # kvhex's strict hooks never leak into the global converter
    assert cattrs.structure("12", int) == 12


# -- checks across keys, at load time (before anything is built) ---------------------------
def test_a_store_threshold_with_tiers_is_refused_at_load_time(tmp_path: Path) -> None:
    text = PRIMARY + 'store_threshold = 2\n[[tiers]]\ntype = "memory"\n'
    ((path, problem),) = _issues(text, tmp_path)
    assert path == "$.primary.store_threshold"
    assert "cannot be used with secondary tiers" in problem
    assert "set it to 1, or remove the tiers" in problem
    assert loads_toml(PRIMARY + "store_threshold = 2\n").primary.store_threshold == 2
    with pytest.raises(ConfigError) as info:  # built in Python: the same check
        KvhexConfig(
            primary=PrimaryConfig(capacity_bytes=8, store_threshold=3),  # type: ignore[arg-type]
            tiers=(TierConfig(type="memory"),),  # type: ignore[arg-type]
        )
    assert info.value.paths == ("$.primary.store_threshold",)


def test_two_tiers_of_one_name_are_refused(tmp_path: Path) -> None:
    text = PRIMARY + (
        '[[tiers]]\ntype = "memory"\n'
        '[[tiers]]\ntype = "memory"\n'  # its name defaults to its type too
        '[[tiers]]\ntype = "fsspec"\nname = "memory"\n'
        '[[tiers]]\ntype = "fsspec"\nname = "disk"\n'
    )
    issues = _issues(text, tmp_path)
    assert [path for path, _ in issues] == ["$.tiers[1].name", "$.tiers[2].name"]
    assert "tier name 'memory' is already used by $.tiers[0]" in issues[0][1]
    assert "give each tier a name of its own" in issues[0][1]


def test_a_tier_name_must_be_a_name(tmp_path: Path) -> None:
    ((path, problem),) = _issues(
        PRIMARY + '[[tiers]]\ntype = "memory"\nname = "my tier"\n', tmp_path
    )
    assert path == "$.tiers[0].name"
    assert "letters, digits" in problem


@pytest.mark.parametrize("key", ["tiers", "sinks"])
def test_a_table_where_a_list_belongs_says_how_to_write_the_list(key: str, tmp_path: Path) -> None:
    ((path, problem),) = _issues(PRIMARY + f'[{key}]\ntype = "memory"\n', tmp_path)
    assert path == f"$.{key}"
    assert problem == (
        f"expected a list, got a table/object; in TOML write each entry as its own [[{key}]] table"
    )


def test_a_string_where_a_list_belongs_is_not_read_as_characters() -> None:
    with pytest.raises(ConfigError) as info:
        loads_toml('tiers = "fsspec"\n' + PRIMARY)
    assert info.value.issues == (("$.tiers", "expected a list, got str 'fsspec'"),)
    with pytest.raises(ConfigError) as info:
        loads_json('{"primary": {"capacity_bytes": 8}, "sinks": {"type": "log"}}')
    assert info.value.paths == ("$.sinks",)
    assert "[[sinks]]" in str(info.value)


@pytest.mark.parametrize("url", ["", "   "])
def test_an_empty_tier_url_is_refused_naming_the_key(url: str, tmp_path: Path) -> None:
    text = PRIMARY + f'[[tiers]]\ntype = "fsspec"\noptions = {{ url = "{url}" }}\n'
    ((path, problem),) = _issues(text, tmp_path)
    assert path == "$.tiers[0].options.url"
    assert "must not be empty" in problem
    assert "working directory" in problem


def test_semantic_errors_of_a_json_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kvhex.json"
    path.write_text(json.dumps({"primary": {"capacity_bytes": 8}, "tiers": [{"type": "Bad!"}]}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.source, info.value.paths) == (str(path), ("$.tiers[0].type",))


# -- backpressure, one model for TOML, JSON, Python and vLLM -------------------------------
def test_a_tier_takes_backpressure_inline_or_as_a_table(tmp_path: Path) -> None:
    inline = loads_toml(
        PRIMARY + '[[tiers]]\ntype = "memory"\nbackpressure = { high_water_s = 2, alpha = 0.5 }\n'
    )
    table = loads_toml(
        PRIMARY + '[[tiers]]\ntype = "memory"\n[tiers.backpressure]\nhigh_water_s = 2\n'
        "alpha = 0.5\n"
    )
    assert inline == table
    config = inline.tiers[0].backpressure
    assert config == BackpressureConfig(high_water_s=2.0, alpha=0.5)
    assert (config.low_water_s, config.warmup, config.probe_every) == (0.5, 3, 8)
    policy = config.policy()
    assert isinstance(policy, EmaBackpressure)
    assert (policy.alpha, policy.high_water_s, policy.low_water_s) == (0.5, 2.0, 0.5)
    assert config.policy() is not policy, "one policy per tier and engine"
    assert loads_toml(PRIMARY + '[[tiers]]\ntype = "memory"\n').tiers[0].backpressure is None


@pytest.mark.parametrize(
    ("table", "path", "words"),
    [
        ({"alpha": 0}, "alpha", "must be in (0, 1]"),
        ({"alpha": 1.5}, "alpha", "must be in (0, 1]"),
        ({"high_water_s": -1}, "high_water_s", "must be >= 0"),
        ({"low_water_s": 3}, "low_water_s", "between 0 and high_water_s (1.0)"),
        ({"warmup": -1}, "warmup", "must be >= 0"),
        ({"probe_every": 0}, "probe_every", "must be >= 1"),
        ({"probe_every": 1.5}, "probe_every", "expected int"),
        ({"alpha": "fast"}, "alpha", "expected float"),
        ({"high_water": 2}, "high_water", "did you mean 'high_water_s'?"),
    ],
)
def test_bad_backpressure_is_named_at_its_key(
    table: dict[str, object], path: str, words: str
) -> None:
    config = {
        "primary": {"capacity_bytes": 8},
        "tiers": [{"type": "memory", "backpressure": table}],
    }
    with pytest.raises(ConfigError) as info:
        load_config(config)
    ((where, problem),) = info.value.issues
    assert where == f"$.tiers[0].backpressure.{path}"
    assert words in problem


def test_backpressure_built_in_python_is_checked_the_same_way() -> None:
    with pytest.raises(ValueError, match=r"^alpha: must be in \(0, 1\]"):
        BackpressureConfig(alpha=0.0)
    with pytest.raises(TypeError, match="warmup: expected an integer"):
        BackpressureConfig(warmup=1.5)  # type: ignore[arg-type]


def test_vllm_tiers_and_toml_tiers_share_one_backpressure_model() -> None:
    from kvhex.config import load_vllm_config

    extra = load_vllm_config(
        {
            "cpu_bytes_to_use": 8,
            "secondary_tiers": [
                {"type": "fs", "root_dir": "/kv", "kvhex": {"backpressure": {"high_water_s": 2}}}
            ],
        }
    )
    toml = loads_toml(PRIMARY + '[[tiers]]\ntype = "memory"\nbackpressure = { high_water_s = 2 }\n')
    assert extra.secondary_tiers[0].kvhex.backpressure == toml.tiers[0].backpressure
