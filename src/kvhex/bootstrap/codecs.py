"""A tier's ``codec`` option, from configuration to a chain: each entry a ``kvhex.codecs``
entry-point name (``"zstd"``) or a table naming one with its options
(``{name = "zstd", level = 3}``), built in order, every problem a ``ConfigIssue`` at the key
that would fix it.

A codec factory that takes ``dtype`` (``fp8``) and is not given one gets the KV cache's, from
the tier's namespace (``kv_cache_dtype``, as the vLLM adapter records it, else ``dtype``).
Building happens while the tier is planned, before any tier is built: a missing master key or
an unknown codec never leaves a half-started engine.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvhex.errors import ConfigIssue, PluginError
from kvhex.plugins import CODECS, Registry
from kvhex.ports.codec import BlockCodec

if TYPE_CHECKING:
    from kvhex.adapters.codecs.chain import CodecChain

DTYPE_FIELDS = ("kv_cache_dtype", "dtype")
"""Namespace fields naming the KV cache's element type, in order of preference."""


def plan_codecs(
    registry: Registry, spec: Any, namespace: Mapping[str, Any] | None, path: str
) -> tuple[CodecChain | None, list[ConfigIssue]]:
    """The chain ``spec`` names (``None`` for an empty list or ``None``), or the issues found
    at ``path`` (``path[i]`` an entry, ``path[i].option`` one of its options). The chain's
    module (and its checksum's package, ``xxhash``) loads only when a chain is named."""
    if spec is None:
        return None, []
    from kvhex.adapters.codecs.chain import CodecChain

    if isinstance(spec, CodecChain):
        return spec, []
    if isinstance(spec, str) or not isinstance(spec, (list, tuple)):
        return None, [(path, f"expected a list of codec names, got {spec!r}")]
    codecs: list[BlockCodec] = []
    issues: list[ConfigIssue] = []
    for i, entry in enumerate(spec):
        at = f"{path}[{i}]"
        if isinstance(entry, BlockCodec):
            codecs.append(entry)  # built in Python by the caller
            continue
        codec = _build(registry, entry, namespace, at, issues)
        if codec is not None:
            codecs.append(codec)
    if issues or not codecs:
        return None, issues
    try:
        return CodecChain(codecs), []
    except ValueError as exc:
        return None, [(path, str(exc))]


def _build(
    registry: Registry,
    entry: Any,
    namespace: Mapping[str, Any] | None,
    at: str,
    issues: list[ConfigIssue],
) -> BlockCodec | None:
    if isinstance(entry, str):
        name, options = entry, {}
    elif isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
        name = entry["name"]
        options = {k: v for k, v in entry.items() if k != "name"}
    else:
        issues.append((at, f"expected a codec name or a table with a name, got {entry!r}"))
        return None
    if name not in registry.names(CODECS):
        available = ", ".join(registry.names(CODECS)) or "none installed"
        issues.append((at, f"unknown codec {name!r}; available: {available}"))
        return None
    try:
        factory = registry.load(CODECS, name)
    except PluginError as exc:
        issues.append((at, str(exc)))
        return None
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    if "dtype" in params and "dtype" not in options and namespace is not None:
        dtype = next((namespace[f] for f in DTYPE_FIELDS if namespace.get(f)), None)
        if dtype is not None:
            options["dtype"] = str(dtype)
    built: Any = None
    try:
        built = factory(**options)
    except TypeError as exc:
        issues.append((at, f"codec {name!r}: {exc}"))
    except ValueError as exc:
        issues.append(_at_option(exc, at, options))
    if built is None or isinstance(built, BlockCodec):
        codec: BlockCodec | None = built
        return codec
    issues.append((at, f"codec {name!r} built a {type(built).__name__}, not a BlockCodec"))
    return None


def _at_option(exc: ValueError, at: str, options: Mapping[str, Any]) -> ConfigIssue:
    """A codec's error at the option it blames: its ``option`` attribute, else the option
    its message starts with (``"level: 1 to 22, ..."``), that prefix then dropped."""
    message = str(exc)
    head, _, rest = message.partition(": ")
    option = getattr(exc, "option", None) or (head if head in options else None)
    if option is None:
        return at, message
    return f"{at}.{option}", rest if head == option else message
