"""The configuration model: attrs classes, validated the same way from Python and from files.

Constrained scalar types are ``NewType``s with one check function each; that function is both
the attrs validator (for configs built in Python) and kvhex's cattrs structure hook (for
configs loaded from TOML, JSON, dicts or vLLM's ``kv_connector_extra_config``), so every bad
value is reported with its path, all at once.
"""

# No ``from __future__ import annotations`` here: cattrs reads these annotations at runtime.

import re
from collections.abc import Callable
from typing import Any, NewType

import attrs

__all__ = [
    "CHECKS",
    "DeviceChoice",
    "KvhexConfig",
    "Options",
    "PluginName",
    "PositiveInt",
    "PrimaryConfig",
    "RunConfig",
    "SinkConfig",
    "TierConfig",
]

PositiveInt = NewType("PositiveInt", int)
"""An ``int`` (not a ``bool``) greater than zero."""

PluginName = NewType("PluginName", str)
"""The name of an entry point: lower-case letters, digits, ``_``, ``-`` and ``.``."""

DeviceChoice = NewType("DeviceChoice", str)
"""Where ``kvhex run`` keeps its device KV cache: ``auto``, ``cpu`` or ``cuda``."""

_DEVICES = ("auto", "cpu", "cuda")

_PLUGIN_NAME = re.compile(r"[a-z0-9][a-z0-9_.\-]{0,63}")


def _positive_int(value: Any) -> PositiveInt:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")
    return PositiveInt(value)


def _plugin_name(value: Any) -> PluginName:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
    if not _PLUGIN_NAME.fullmatch(value):
        raise ValueError(
            f"must be an entry-point name (lower-case letters, digits, '_', '-', '.'), "
            f"got {value!r}"
        )
    return PluginName(value)


def _device_choice(value: Any) -> DeviceChoice:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
    if value not in _DEVICES:
        raise ValueError(f"must be one of {', '.join(_DEVICES)}, got {value!r}")
    return DeviceChoice(value)


Options = NewType("Options", dict)  # type: ignore[type-arg]
"""A table of keyword arguments for a plugin's factory (string keys, any values)."""


def _options(value: Any) -> Options:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"expected a table of options, got {type(value).__name__} {value!r}")
    return Options(dict(value))


CHECKS: dict[Any, Callable[[Any], Any]] = {
    Options: _options,
    PositiveInt: _positive_int,
    PluginName: _plugin_name,
    DeviceChoice: _device_choice,
}
"""Check function per constrained type; used by validators and structure hooks alike."""


def _validator(check: Callable[[Any], Any]) -> Callable[[Any, "attrs.Attribute[Any]", Any], None]:
    def validate(_: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
        try:
            check(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{attribute.name}: {exc}") from None

    return validate


@attrs.frozen(kw_only=True)
class PrimaryConfig:
    """The host-memory primary tier.

    Attributes:
        capacity_bytes: host memory for KV chunks; the slot count is this divided by the
            engine's bytes per chunk (at least one slot must fit).
        policy: eviction policy, an entry point of ``kvhex.policies`` (``lru``, ``arc``, or a
            third party's).
        store_threshold: offers a chunk needs before it is stored (1 = store on first offer).
        max_tracker_size: keys whose offers are counted when ``store_threshold`` > 1.
    """

    capacity_bytes: PositiveInt = attrs.field(validator=_validator(_positive_int))
    policy: PluginName = attrs.field(default=PluginName("lru"), validator=_validator(_plugin_name))
    store_threshold: PositiveInt = attrs.field(
        default=PositiveInt(1), validator=_validator(_positive_int)
    )
    max_tracker_size: PositiveInt = attrs.field(
        default=PositiveInt(64_000), validator=_validator(_positive_int)
    )


def _optional_name(_: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise TypeError(f"{attribute.name}: expected a non-empty string, got {value!r}")


@attrs.frozen(kw_only=True)
class TierConfig:
    """One secondary tier, in lookup order.

    Attributes:
        type: the ``kvhex.tiers`` entry point (``fsspec``, ``nixl``, ``memory`` or a third
            party's).
        name: the tier's ownership name in events, stats and logs (default: ``type``).
        options: keyword arguments of the tier's factory (besides the host buffer), checked
            against its signature before anything is built.
    """

    type: PluginName = attrs.field(validator=_validator(_plugin_name))
    name: str | None = attrs.field(default=None, validator=_optional_name)
    options: Options = attrs.field(factory=lambda: Options({}), validator=_validator(_options))


@attrs.frozen(kw_only=True)
class SinkConfig:
    """One event sink; every batch of public events goes to every sink.

    Attributes:
        type: the ``kvhex.sinks`` entry point (``jsonl``, ``zmq``, ``log``, ``memory`` or a
            third party's).
        options: keyword arguments of the sink's factory, checked against its signature.
    """

    type: PluginName = attrs.field(validator=_validator(_plugin_name))
    options: Options = attrs.field(factory=lambda: Options({}), validator=_validator(_options))


@attrs.frozen(kw_only=True)
class RunConfig:
    """What ``kvhex run`` replays and on what synthetic model (flags override these).

    Attributes:
        requests: requests to replay (the default workload, or the first of a workload file).
        seed: seed of the synthetic workload and the KV bytes.
        layers: layers of the synthetic model (one device KV tensor each).
        page_bytes: bytes per layer per device block.
        tokens_per_block: tokens per device block (and per hash block).
        blocks_per_chunk: device blocks per offloaded chunk (one host slot).
        device_blocks: device KV blocks per layer (the engine's GPU cache).
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda``.
    """

    requests: PositiveInt = attrs.field(
        default=PositiveInt(240), validator=_validator(_positive_int)
    )
    seed: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    layers: PositiveInt = attrs.field(default=PositiveInt(8), validator=_validator(_positive_int))
    page_bytes: PositiveInt = attrs.field(
        default=PositiveInt(8192), validator=_validator(_positive_int)
    )
    tokens_per_block: PositiveInt = attrs.field(
        default=PositiveInt(16), validator=_validator(_positive_int)
    )
    blocks_per_chunk: PositiveInt = attrs.field(
        default=PositiveInt(4), validator=_validator(_positive_int)
    )
    device_blocks: PositiveInt = attrs.field(
        default=PositiveInt(1024), validator=_validator(_positive_int)
    )
    device: DeviceChoice = attrs.field(
        default=DeviceChoice("auto"), validator=_validator(_device_choice)
    )


@attrs.frozen(kw_only=True)
class KvhexConfig:
    """Everything kvhex needs to build its tiers.

    Attributes:
        primary: the host-memory primary tier.
        tiers: secondary tiers, in lookup and cascade order.
        sinks: where public KV events go.
        run: what ``kvhex run`` replays.
    """

    primary: PrimaryConfig
    tiers: tuple[TierConfig, ...] = ()
    sinks: tuple[SinkConfig, ...] = ()
    run: RunConfig = attrs.field(factory=RunConfig)
