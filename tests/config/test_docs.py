"""docs/configuration.md documents every key of the configuration model, and nothing else."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import attrs

from kvhex.config import KvhexConfig
from kvhex.config.loader import loads_toml

DOC = Path(__file__).parent.parent.parent / "docs" / "configuration.md"


def _table(annotation: object) -> type | None:
    """The attrs class a key holds: itself, an array of it, or it or nothing."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is tuple or (args and len(args) == 1):
        annotation = args[0]  # tuple[X, ...], X | None
    return annotation if isinstance(annotation, type) and attrs.has(annotation) else None


def _model_keys(cls: type, prefix: str) -> set[str]:
    keys: set[str] = set()
    for field in attrs.fields(cls):
        table = _table(field.type)
        if table is not None:
            keys |= _model_keys(table, f"{prefix}{field.name}.")
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


def _vllm_section() -> str:
    text = (DOC.parent / "vllm.md").read_text()
    start = text.index("## Configuration (`kv_connector_extra_config`)")
    return text[start : text.index("\n## ", start + 1)]


def _key_tables(section: str) -> list[set[str]]:
    """The keys of each ``| key | ... |`` table of ``section``, in order."""
    tables: list[set[str]] = []
    rows: list[str] = []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            rows.append(line)
            continue
        if rows and rows[0].startswith("| key |"):
            tables.append({m.group(1) for r in rows[2:] if (m := re.match(r"\| `(\w+)` \|", r))})
        rows = []
    return tables


def test_vllm_keys_are_documented_and_no_stale_key_remains() -> None:
    from kvhex.config.vllm import VllmExtraConfig, VllmTierOptions

    section = _vllm_section()
    top, tier_kvhex = _key_tables(section)
    read_by_vllm = re.search(r"Keys vLLM's connector itself reads \(([^)]*)\)", section)
    assert read_by_vllm is not None
    left_to_vllm = set(re.findall(r"`(\w+)`", read_by_vllm.group(1)))
    assert top | left_to_vllm == {f.name for f in attrs.fields(VllmExtraConfig)}
    assert not top & left_to_vllm
    assert tier_kvhex == {f.name for f in attrs.fields(VllmTierOptions)}


def test_the_documented_backpressure_defaults_are_the_model_s() -> None:
    from kvhex.config import BackpressureConfig

    text = DOC.read_text()
    start = text.index("## `[tiers.backpressure]`")
    section = text[start : text.index("\n## ", start)]
    defaults = dict(re.findall(r"\| `(\w+)` \| [^|]+ \| `([^`]+)` \|", section))
    assert {k: float(v) for k, v in defaults.items()} == attrs.asdict(BackpressureConfig())
