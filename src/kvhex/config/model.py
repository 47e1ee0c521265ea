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
    "KvhexConfig",
    "PluginName",
    "PositiveInt",
    "PrimaryConfig",
]

PositiveInt = NewType("PositiveInt", int)
"""An ``int`` (not a ``bool``) greater than zero."""

PluginName = NewType("PluginName", str)
"""The name of an entry point: lower-case letters, digits, ``_``, ``-`` and ``.``."""

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


CHECKS: dict[Any, Callable[[Any], Any]] = {
    PositiveInt: _positive_int,
    PluginName: _plugin_name,
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


@attrs.frozen(kw_only=True)
class KvhexConfig:
    """Everything kvhex needs to build its tiers.

    Attributes:
        primary: the host-memory primary tier.
    """

    primary: PrimaryConfig
