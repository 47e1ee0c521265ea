"""docs/configuration.md documents every key of the configuration model, and nothing else."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import attrs

from kvhex.config import KvhexConfig
from kvhex.config.loader import loads_toml

DOC = Path(__file__).parent.parent.parent / "docs" / "configuration.md"


def _model_keys(cls: type, prefix: str) -> set[str]:
    keys: set[str] = set()
    for field in attrs.fields(cls):
        inner = typing.get_args(field.type)[0] if typing.get_origin(field.type) is tuple else None
        if isinstance(field.type, type) and attrs.has(field.type):
            keys |= _model_keys(field.type, f"{prefix}{field.name}.")
        elif isinstance(inner, type) and attrs.has(inner):  # an array of tables
            keys |= _model_keys(inner, f"{prefix}{field.name}.")
        else:
            keys.add(f"{prefix}{field.name}")
    return keys


def _documented_keys() -> set[str]:
    section = None
    keys: set[str] = set()
    for line in DOC.read_text().splitlines():
        heading = re.match(r"## `\[\[?(\w+(?:\.\w+)*)\]\]?`", line)
        if heading:
            section = heading.group(1)
            continue
        row = re.match(r"\| `(\w+)` \|", line)
        if row and section:
            keys.add(f"{section}.{row.group(1)}")
    return keys


def test_every_config_key_is_documented_and_no_stale_key_remains() -> None:
    assert _documented_keys() == _model_keys(KvhexConfig, "")


def test_the_readme_configuration_loads() -> None:
    readme = (DOC.parent.parent / "README.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", readme, flags=re.S)
    assert blocks, "README shows a configuration"
    for block in blocks:
        config = loads_toml(block, source="README.md")
        assert config.tiers, "the README example configures secondary tiers"
