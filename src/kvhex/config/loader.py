"""Loading configuration from TOML, JSON or a mapping through kvhex's own cattrs converter.

Never the global converter: kvhex's hooks (strict scalars, constrained types, forbidden extra
keys) must not leak into, or be changed by, the host application.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)

from kvhex.config.model import CHECKS, KvhexConfig
from kvhex.errors import ConfigError, ConfigIssue

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["load_config", "loads_json", "loads_toml", "make_converter", "structure"]

T = TypeVar("T")


def _strict(expected: type[Any], *also: type[Any]) -> Any:
    accepted = (expected, *also)

    def hook(value: Any, _: Any) -> Any:
        if isinstance(value, bool) and expected is not bool:
            raise TypeError(f"expected {expected.__name__}, got bool {value!r}")
        if not isinstance(value, accepted):
            raise TypeError(f"expected {expected.__name__}, got {type(value).__name__} {value!r}")
        return expected(value)

    return hook


def make_converter() -> cattrs.Converter:
    """A fresh converter with kvhex's strict hooks; extra keys are errors."""
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _strict(int))
    converter.register_structure_hook(float, _strict(float, int))
    converter.register_structure_hook(str, _strict(str))
    converter.register_structure_hook(bool, _strict(bool))
    for new_type, check in CHECKS.items():
        converter.register_structure_hook(new_type, _checked(check))
    return converter


def _checked(check: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _: Any) -> Any:
        return check(value)

    return hook


_CONVERTER = make_converter()


def structure(data: Any, cls: type[T], *, source: str = "dict") -> T:
    """Build ``cls`` from plain data, or raise one ``ConfigError`` listing every bad path."""
    if not isinstance(data, Mapping):
        raise ConfigError([("$", f"expected a table/object, got {type(data).__name__}")], source)
    try:
        return _CONVERTER.structure(data, cls)
    except Exception as exc:
        issues = list(_issues(exc, "$", cls))
        raise ConfigError(issues or [("$", str(exc))], source) from exc


def _issues(exc: BaseException, path: str, cls: Any) -> Iterator[ConfigIssue]:
    if isinstance(exc, ClassValidationError | IterableValidationError):
        with_notes, without = exc.group_exceptions()
        for inner, note in with_notes:
            if isinstance(note, AttributeValidationNote):
                field_cls = _field_type(cls, note.name)
                yield from _issues(inner, f"{path}.{note.name}", field_cls)
            else:
                yield from _issues(inner, f"{path}[{note.index!r}]", note.type)
        for inner in without:
            yield from _issues(inner, path, cls)
    elif isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        for key in sorted(exc.extra_fields):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            yield (f"{path}.{key}", f"unknown key{hint}; known keys: {', '.join(known)}")
    elif isinstance(exc, KeyError):
        yield (path, "required key is missing")
    else:
        yield (path, str(exc))


def _field_type(cls: Any, name: str) -> Any:
    if attrs.has(cls):
        for field in attrs.fields(cls):
            if field.name == name:
                return field.type
    return None


def loads_toml(text: str, *, source: str = "<toml>") -> KvhexConfig:
    """Parse TOML text into a ``KvhexConfig``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([("$", f"not valid TOML: {exc}")], source) from exc
    return structure(data, KvhexConfig, source=source)


def loads_json(text: str, *, source: str = "<json>") -> KvhexConfig:
    """Parse JSON text into a ``KvhexConfig``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([("$", f"not valid JSON: {exc}")], source) from exc
    return structure(data, KvhexConfig, source=source)


def load_config(source: Mapping[str, Any] | str | Path) -> KvhexConfig:
    """Load a ``KvhexConfig`` from a mapping, or from a ``.toml`` or ``.json`` file path.

    Raises:
        ConfigError: the file is missing, unreadable, malformed or of an unknown kind, or the
            content does not fit the model; every bad path is listed.
    """
    if isinstance(source, Mapping):
        return structure(source, KvhexConfig, source="dict")
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(
            [("$", f"unknown config file type {suffix!r}; use .toml or .json")], str(path)
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("$", f"cannot read file: {exc.strerror or exc}")], str(path)) from exc
    if suffix == ".toml":
        return loads_toml(text, source=str(path))
    return loads_json(text, source=str(path))
