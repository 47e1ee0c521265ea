"""The configuration model: attrs classes, validated the same way from Python and from files.

Constrained scalar types are ``NewType``s with one check function each; that function is both
the attrs validator (for configs built in Python) and kvhex's cattrs structure hook (for
configs loaded from TOML, JSON, dicts or vLLM's ``kv_connector_extra_config``), so every bad
value is reported with its path, all at once. Checks across keys (a store threshold with
tiers, two tiers of one name) run when the whole object is built, before anything else is,
and raise ``ConfigError`` with paths from the object (``$.primary.store_threshold``); the
loader places them under the object's own path.
"""

# No ``from __future__ import annotations`` here: cattrs reads these annotations at runtime.

import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NewType

import attrs

from kvhex.domain.backpressure import EmaBackpressure
from kvhex.domain.cost import LoadMode
from kvhex.domain.routers import PROFILES
from kvhex.domain.tiers import Locality
from kvhex.errors import ConfigError, ConfigIssue

PositiveInt = NewType("PositiveInt", int)
"""An ``int`` (not a ``bool``) greater than zero."""

PluginName = NewType("PluginName", str)
"""The name of an entry point: lower-case letters, digits, ``_``, ``-`` and ``.``."""

NonNegativeInt = NewType("NonNegativeInt", int)
"""An ``int`` (not a ``bool``) of at least zero."""

ByteCount = NewType("ByteCount", int)
"""A number of bytes greater than zero; a float is accepted and truncated (vLLM's
``--kv-offloading-size`` gives one)."""

NonEmptyStr = NewType("NonEmptyStr", str)
"""A string with at least one character that is not white space."""

TierName = NewType("TierName", str)
"""A tier's ownership name: 1-64 letters, digits, ``_``, ``-``, ``.`` (a letter or digit
first)."""

DeviceChoice = NewType("DeviceChoice", str)
"""Where ``kvhex run`` keeps its device KV cache: ``auto``, ``cpu`` or ``cuda``."""

RouterName = NewType("RouterName", str)
"""A KV-aware router kvhex knows (``kvhex.domain.routers.PROFILES``): ``dynamo``,
``vllm-router``."""

_DEVICES = ("auto", "cpu", "cuda")

_PLUGIN_NAME = re.compile(r"[a-z0-9][a-z0-9_.\-]{0,63}")
_TIER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def _positive_int(value: Any) -> PositiveInt:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")
    return PositiveInt(value)


def _non_negative_int(value: Any) -> NonNegativeInt:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return NonNegativeInt(value)


def _byte_count(value: Any) -> ByteCount:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number of bytes, got {type(value).__name__} {value!r}")
    if not value >= 1:  # NaN too
        raise ValueError(f"must be at least 1 byte, got {value!r}")
    return ByteCount(int(value))


def _non_empty_str(value: Any) -> NonEmptyStr:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
    if not value.strip():
        raise ValueError(f"must not be empty, got {value!r}")
    return NonEmptyStr(value)


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


def _router_name(value: Any) -> RouterName:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
    if value not in PROFILES:
        known = ", ".join(repr(name) for name in sorted(PROFILES))
        raise ValueError(f"must be a router kvhex knows ({known}), got {value!r}")
    return RouterName(value)


def check_router_block_size(router: str | None, block_size: int | None) -> str | None:
    """Why ``router_block_size`` cannot be used with ``router`` (``None``: it can)."""
    if block_size is not None and router is None:
        return "router_block_size: applies with router, which is not set"
    return None


Options = NewType("Options", dict)  # type: ignore[type-arg]
"""A table of keyword arguments for a plugin's factory (string keys, any values)."""


def _options(value: Any) -> Options:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"expected a table of options, got {type(value).__name__} {value!r}")
    return Options(dict(value))


CodecList = NewType("CodecList", list)  # type: ignore[type-arg]
"""A tier's codec chain: ``kvhex.codecs`` entry-point names, or tables with a ``name``."""


def _codec_list(value: Any) -> CodecList:
    ok = isinstance(value, list) and all(
        isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("name"), str))
        for v in value
    )
    if not ok:
        raise TypeError(f"expected a list of codec names (or tables with a name), got {value!r}")
    return CodecList(list(value))


def _locality(value: Any) -> Locality:
    if isinstance(value, Locality):
        return value
    if isinstance(value, str) and value.upper() in Locality.__members__:
        return Locality[value.upper()]
    raise ValueError(f"must be 'LOCAL', 'REMOTE' or 'SHARED', got {value!r}")


def check_tier_name(value: Any) -> TierName:
    """A tier's ownership name: 1-64 letters, digits, ``_``, ``-``, ``.`` (not first)."""
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
    if not _TIER_NAME.fullmatch(value):
        raise ValueError(
            f"must be 1-64 letters, digits, '_', '-' or '.' (a letter or digit first), "
            f"got {value!r}"
        )
    return TierName(value)


HINT = "hint"
"""Field metadata: what a required key holds, said when it is missing."""


CHECKS: dict[Any, Callable[[Any], Any]] = {
    Options: _options,
    CodecList: _codec_list,
    PositiveInt: _positive_int,
    NonNegativeInt: _non_negative_int,
    ByteCount: _byte_count,
    NonEmptyStr: _non_empty_str,
    TierName: check_tier_name,
    PluginName: _plugin_name,
    DeviceChoice: _device_choice,
    RouterName: _router_name,
    Locality: _locality,
}
"""Check function per constrained type; used by validators and structure hooks alike."""


@attrs.frozen
class Unsupported:
    """Marks a key kvhex knows and refuses: ``Annotated[Any, Unsupported(why)]``. Any value but
    ``None`` or ``""`` is an error at the key, saying ``why`` (and what to do instead)."""

    why: str


@attrs.frozen
class TaggedUnion:
    """A union of attrs classes told apart by the value of one key, for the converter.

    Attributes:
        type: the union (``A | B``) as fields name it.
        key: the key whose value picks the class (``type``).
        members: the class of each value.
        noun: what an entry is, for messages (``"tier"``).
        hint: said after an unknown value (what the values mean).
    """

    type: Any
    key: str
    members: Mapping[str, type]
    noun: str
    hint: str = ""


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

    capacity_bytes: PositiveInt = attrs.field(
        validator=_validator(_positive_int), metadata={HINT: "bytes of host memory for KV chunks"}
    )
    policy: PluginName = attrs.field(default=PluginName("lru"), validator=_validator(_plugin_name))
    store_threshold: PositiveInt = attrs.field(
        default=PositiveInt(1), validator=_validator(_positive_int)
    )
    max_tracker_size: PositiveInt = attrs.field(
        default=PositiveInt(64_000), validator=_validator(_positive_int)
    )


STORE_THRESHOLD_WITH_TIERS = (
    "store_threshold >= 2 cannot be used with secondary tiers: a chunk promoted from a tier "
    "reserves its host slot as a store, which the threshold refuses until the chunk was "
    "offered that often, so tier hits would be answered as misses (vLLM's "
    "TieringOffloadingSpec refuses it too); set it to 1, or remove the tiers"
)
"""Why a store threshold and secondary tiers are refused together (TOML and vLLM alike)."""


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def duplicate_tier_names(tiers: Iterable[tuple[str, str, str]]) -> list[ConfigIssue]:
    """An issue at each name key that repeats an earlier tier's name.

    Args:
        tiers: per tier, in order: its name, its entry's path, the path of the key that
            names it.
    """
    first: dict[str, str] = {}
    issues: list[ConfigIssue] = []
    for name, entry, key in tiers:
        if name in first:
            issues.append(
                (
                    key,
                    f"tier name {name!r} is already used by {first[name]}; give each tier a "
                    "name of its own (it names its stats and logs, and the ownership of its "
                    "events where they announce one)",
                )
            )
        else:
            first[name] = entry
    return issues


def empty_url(options: Mapping[str, Any], path: str) -> list[ConfigIssue]:
    """An issue at ``path`` when ``options`` holds a ``url`` that is an empty string (or only
    white space): a file tier would open its root in the working directory."""
    url = options.get("url")
    if isinstance(url, str) and not url.strip():
        return [
            (
                path,
                f"must not be empty, got {url!r}: give the tier's directory or "
                "s3://bucket/prefix (an empty url would put the tier in the working directory)",
            )
        ]
    return []


def _ema_default(name: str) -> Any:
    return inspect.signature(EmaBackpressure).parameters[name].default


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__} {value!r}")
    return value


@attrs.frozen(kw_only=True)
class BackpressureConfig:
    """Cascade admission of one secondary tier: kvhex's ``EmaBackpressure`` (an EMA of put
    latency in seconds per put job, with hysteresis), whose defaults and checks these are.

    Attributes:
        alpha: weight of the newest latency in the average, in (0, 1].
        high_water_s: average put seconds above which cascades to the tier are dropped.
        low_water_s: average below which they are admitted again (0 <= low <= high).
        warmup: puts measured before pressure can turn on.
        probe_every: under pressure, every n-th cascade still goes (to keep measuring).
    """

    alpha: float = attrs.field(default=_ema_default("alpha"), validator=_validator(_number))
    high_water_s: float = attrs.field(
        default=_ema_default("high_water_s"), validator=_validator(_number)
    )
    low_water_s: float = attrs.field(
        default=_ema_default("low_water_s"), validator=_validator(_number)
    )
    warmup: int = attrs.field(default=_ema_default("warmup"), validator=_validator(_integer))
    probe_every: int = attrs.field(
        default=_ema_default("probe_every"), validator=_validator(_integer)
    )

    def __attrs_post_init__(self) -> None:
        self.policy()  # the domain checks the values; each error starts with its key

    def policy(self) -> EmaBackpressure:
        """A new admission policy with these settings (one per tier and engine)."""
        return EmaBackpressure(
            self.alpha, self.high_water_s, self.low_water_s, self.warmup, self.probe_every
        )


LOAD_MODES = tuple(m.value for m in LoadMode)


def _load_mode(value: Any) -> str:
    if value not in LOAD_MODES:
        raise ValueError(f"must be one of {', '.join(map(repr, LOAD_MODES))}, got {value!r}")
    return str(value)


def _rate(value: Any) -> float | None:
    if value is None:
        return None
    number = _number(value)
    if not (0 < number < float("inf")):
        raise ValueError(f"must be a positive number of tokens per second, got {value!r}")
    return number


@attrs.frozen(kw_only=True)
class LoadingConfig:
    """Load or recompute a matched prefix that secondary tiers hold (docs/loading.md).

    Attributes:
        mode: ``auto``: load what the measured costs say is faster than recomputing;
            ``off``: load every hit (as vLLM does); ``fixed``: load secondary-tier hits only
            when they hold at least ``min_tokens`` tokens.
        min_tokens: ``fixed``: the tokens a request's secondary-tier hits must hold.
        prefill_tokens_per_s: the engine's prefill speed; default: measured from its steps.
        explore_every: ``auto``: every n-th plan that would recompute a tier's chunks loads
            them, so a tier judged slow is measured again.
    """

    mode: str = attrs.field(default="auto", validator=_validator(_load_mode))
    min_tokens: int = attrs.field(default=0, validator=_validator(_non_negative_int))
    prefill_tokens_per_s: float | None = attrs.field(default=None, validator=_validator(_rate))
    explore_every: PositiveInt = attrs.field(
        default=PositiveInt(64), validator=_validator(_positive_int)
    )

    def __attrs_post_init__(self) -> None:
        if self.min_tokens and self.mode != LoadMode.FIXED.value:
            raise ValueError(f"min_tokens: applies to mode 'fixed' only (mode is {self.mode!r})")
        if self.mode == LoadMode.FIXED.value and not self.min_tokens:
            raise ValueError("min_tokens: mode 'fixed' needs a number of tokens > 0")


@attrs.frozen(kw_only=True)
class TierConfig:
    """One secondary tier, in lookup order.

    Attributes:
        type: the ``kvhex.tiers`` entry point (``fsspec``, ``nixl``, ``memory`` or a third
            party's).
        name: the tier's name in stats and logs, and its ownership where events name it
            (default: ``type``); unique among the tiers.
        options: keyword arguments of the tier's factory (besides the host buffer), checked
            against its signature before anything is built.
        backpressure: drop cascades to this tier while its puts are slow (default: every
            cascade is submitted).
        announce_ownership: name the tier as the ``ownership`` of its events. Off by
            default: routers read a residency by medium and locality, and Dynamo's indexer
            drops every event that names an ownership (docs/events.md).
    """

    type: PluginName = attrs.field(
        validator=_validator(_plugin_name),
        metadata={
            HINT: "a kvhex.tiers entry point: fsspec, nixl, valkey, memory, or a third party's"
        },
    )
    name: str | None = attrs.field(default=None, validator=_validator(_optional(check_tier_name)))
    options: Options = attrs.field(factory=lambda: Options({}), validator=_validator(_options))
    backpressure: BackpressureConfig | None = None
    announce_ownership: bool = False


@attrs.frozen(kw_only=True)
class SinkConfig:
    """One event sink; every batch of public events goes to every sink.

    Attributes:
        type: the ``kvhex.sinks`` entry point (``jsonl``, ``zmq``, ``log``, ``memory`` or a
            third party's).
        options: keyword arguments of the sink's factory, checked against its signature.
    """

    type: PluginName = attrs.field(
        validator=_validator(_plugin_name),
        metadata={HINT: "a kvhex.sinks entry point: jsonl, zmq, log, memory, or a third party's"},
    )
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
        transfer: the ``kvhex.transfers`` entry point that copies between the device KV
            cache (torch tensors) and the host tier (``torch``, or a third party's).
        transfer_options: keyword arguments of the transfer's factory besides what the run
            passes it (the host buffer, the KV tensors, ``tensor_groups``,
            ``blocks_per_chunk``).
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
    transfer: PluginName = attrs.field(
        default=PluginName("torch"), validator=_validator(_plugin_name)
    )
    transfer_options: Options = attrs.field(
        factory=lambda: Options({}), validator=_validator(_options)
    )


@attrs.frozen(kw_only=True)
class EventsConfig:
    """How KV events are announced (the same for every sink).

    Attributes:
        int_block_hashes: publish block hashes as the low 64 bits of their big-endian value,
            as vLLM does by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); Dynamo's
            indexer decodes no other form. ``false`` publishes the hashes' bytes.
        router: the KV-aware router that reads these events (``dynamo``, ``vllm-router``):
            at start-up, kvhex warns (``router_config_mismatch``) about every setting whose
            events that router would drop or miscredit (docs/events.md).
        router_block_size: the block size that router reads (vllm-router's
            ``--kv-event-block-size``, Dynamo's registered ``block_size``); default: the
            router's own default (vllm-router: 16; Dynamo has none, so it is not checked).
    """

    int_block_hashes: bool = True
    router: RouterName | None = attrs.field(
        default=None, validator=_validator(_optional(_router_name))
    )
    router_block_size: PositiveInt | None = attrs.field(
        default=None, validator=_validator(_optional(_positive_int))
    )

    def __attrs_post_init__(self) -> None:
        problem = check_router_block_size(self.router, self.router_block_size)
        if problem is not None:
            raise ValueError(problem)


@attrs.frozen(kw_only=True)
class KvhexConfig:
    """Everything kvhex needs to build its tiers.

    Attributes:
        primary: the host-memory primary tier.
        tiers: secondary tiers, in lookup and cascade order.
        sinks: where public KV events go.
        run: what ``kvhex run`` replays.
        loading: load or recompute prefixes held by secondary tiers.
        events: how KV events are announced.
    """

    primary: PrimaryConfig = attrs.field(metadata={HINT: "the [primary] table"})
    tiers: tuple[TierConfig, ...] = ()
    sinks: tuple[SinkConfig, ...] = ()
    run: RunConfig = attrs.field(factory=RunConfig)
    loading: LoadingConfig = attrs.field(factory=LoadingConfig)
    events: EventsConfig = attrs.field(factory=EventsConfig)

    def __attrs_post_init__(self) -> None:
        """Checks across keys, before anything is built.

        Raises:
            ConfigError: ``store_threshold`` >= 2 with tiers; two tiers of one name (a tier's
                name defaults to its type); a tier's ``url`` option empty.
        """
        issues: list[ConfigIssue] = []
        if self.tiers and self.primary.store_threshold >= 2:
            issues.append(("$.primary.store_threshold", STORE_THRESHOLD_WITH_TIERS))
        issues += duplicate_tier_names(
            (t.name or t.type, f"$.tiers[{i}]", f"$.tiers[{i}].name")
            for i, t in enumerate(self.tiers)
        )
        for i, tier in enumerate(self.tiers):
            issues += empty_url(tier.options, f"$.tiers[{i}].options.url")
        if issues:
            raise ConfigError(issues)
