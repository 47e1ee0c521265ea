from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhex.config import KvhexConfig, PrimaryConfig, load_config, loads_json, loads_toml
from kvhex.errors import ConfigError

GOOD = {"primary": {"capacity_bytes": 1 << 30, "policy": "arc", "store_threshold": 2}}


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
    assert info.value.issues == (("$.primary.capacity_bytes", "required key is missing"),)


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
