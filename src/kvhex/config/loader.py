"""Loading configuration from TOML, JSON, a mapping or vLLM's extra config through kvhex's own
cattrs converter.

Never the global converter: kvhex's hooks (strict scalars, constrained types, forbidden extra
keys, tagged unions, lists that must be lists) must not leak into, or be changed by, the host
application. Every problem becomes one ``(path, problem)`` issue of a single ``ConfigError``:
cattrs' nested errors give the paths, a ``ConfigError`` raised inside the model (checks across
keys) is placed under the path of the object that raised it, and an error whose message
starts with one of its class's keys (``alpha: must be ...``) is placed at that key.
"""

from __future__ import annotations

import difflib
import functools
import json
import tomllib
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.cols import homogenous_tuple_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)
from cattrs.gen import make_dict_structure_fn

from kvhex.config.model import CHECKS, HINT, KvhexConfig, TaggedUnion, Unsupported
from kvhex.config.vllm import (
    SOURCE,
    TIER_ENTRIES,
    VllmExtraConfig,
    VllmTierEntry,
    tier_issues,
)
from kvhex.errors import ConfigError, ConfigIssue

T = TypeVar("T")

_UNIONS = (TIER_ENTRIES,)


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
    """A fresh converter with kvhex's hooks; extra keys are errors."""
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _strict(int))
    converter.register_structure_hook(float, _strict(float, int))
    converter.register_structure_hook(str, _strict(str))
    converter.register_structure_hook(bool, _strict(bool))
    for new_type, check in CHECKS.items():
        converter.register_structure_hook(new_type, _checked(check))
    converter.register_structure_hook_factory(_is_unsupported, _unsupported)
    converter.register_structure_hook_factory(_is_tuple_of, lambda t: _list_only(t, converter))
    converter.register_structure_hook_factory(_has_rest, lambda t: _with_rest(t, converter))
    for union in _UNIONS:
        converter.register_structure_hook(union.type, _tagged(union, converter))
    return converter


def _checked(check: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _: Any) -> Any:
        return check(value)

    return hook


def _is_unsupported(cls: Any) -> bool:
    return typing.get_origin(cls) is typing.Annotated and any(
        isinstance(m, Unsupported) for m in cls.__metadata__
    )


def _unsupported(cls: Any) -> Callable[[Any, Any], Any]:
    why = next(m for m in cls.__metadata__ if isinstance(m, Unsupported)).why

    def hook(value: Any, _: Any) -> Any:
        if value is None or value == "":
            return value
        raise ValueError(why)

    return hook


def _is_tuple_of(cls: Any) -> bool:
    args = typing.get_args(cls)
    return typing.get_origin(cls) is tuple and len(args) == 2 and args[1] is Ellipsis


class _NotAList(TypeError):
    """A list was expected; ``_issues`` words it with the key's name."""

    def __init__(self, value: Any) -> None:
        self.table = isinstance(value, Mapping)
        what = "a table/object" if self.table else f"{type(value).__name__} {value!r}"
        super().__init__(f"expected a list, got {what}")


def _list_only(cls: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    """Tuples of the model take lists (or tuples) only: a string or a table would otherwise
    be iterated into characters or keys."""
    base = homogenous_tuple_structure_factory(cls, converter)

    def hook(value: Any, target: Any) -> Any:
        if not isinstance(value, list | tuple):
            raise _NotAList(value)
        return base(value, target)

    return hook


def _has_rest(cls: Any) -> bool:
    return attrs.has(cls) and any(f.metadata.get("rest") for f in attrs.fields(cls))


def _with_rest(cls: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    """A class with a ``rest`` field (``metadata={"rest": True}``) takes every key that is
    not one of its fields into that field, as a table."""
    base = make_dict_structure_fn(cls, converter)
    rest = next(f.name for f in attrs.fields(cls) if f.metadata.get("rest"))
    known = {f.name for f in attrs.fields(cls)} - {rest}

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table/object, got {type(value).__name__} {value!r}")
        data = {k: v for k, v in value.items() if k in known}
        data[rest] = {k: v for k, v in value.items() if k not in known}
        return base(data, cls)

    return hook


def _tagged(union: TaggedUnion, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    choices = ", ".join(repr(k) for k in union.members)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a {union.noun} object, got {type(value).__name__}")
        if union.key not in value:
            raise ConfigError([(f"$.{union.key}", f"required key is missing (one of {choices})")])
        tag = value[union.key]
        cls = union.members.get(tag) if isinstance(tag, str) else None
        if cls is None:
            hint = f"; {union.hint}" if union.hint else f"; one of {choices}"
            raise ConfigError([(f"$.{union.key}", f"unknown {union.noun} type {tag!r}{hint}")])
        return converter.structure(value, cls)

    return hook


@functools.cache
def _converter() -> cattrs.Converter:
    return make_converter()


def structure(data: Any, cls: type[T], *, source: str = "dict", path: str = "$") -> T:
    """Build ``cls`` from plain data, or raise one ``ConfigError`` listing every bad path
    (paths start at ``path``)."""
    built: T = _structure(data, cls, source, path)
    return built


def _structure(data: Any, cls: Any, source: str, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError([(path, f"expected a table/object, got {type(data).__name__}")], source)
    try:
        return _converter().structure(data, cls)
    except Exception as exc:
        issues = list(_issues(exc, path, toml=source != SOURCE))
        raise ConfigError(issues or [(path, str(exc))], source) from exc


def _issues(exc: BaseException, path: str, cls: Any = None, *, toml: bool) -> Iterator[ConfigIssue]:
    """The issues of a failed structuring, each at its path (``toml``: the configuration may
    be TOML, whose array-of-tables syntax a hint may name)."""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        with_notes, without = exc.group_exceptions()
        for inner, note in with_notes:
            if isinstance(note, AttributeValidationNote):
                where = f"{path}.{note.name}"
                if isinstance(inner, KeyError) and isinstance(exc, ClassValidationError):
                    yield (where, _missing(exc.cl, note.name))
                else:
                    yield from _issues(inner, where, toml=toml)
            else:
                yield from _issues(inner, f"{path}[{note.index!r}]", toml=toml)
        owner = exc.cl if isinstance(exc, ClassValidationError) else None
        for inner in without:  # raised by the class itself (its __init__)
            yield from _issues(inner, path, owner, toml=toml)
    elif isinstance(exc, ConfigError):  # its paths start at the object that raised it
        for where, problem in exc.issues:
            yield (path + where.removeprefix("$"), problem)
    elif isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        for key in sorted(exc.extra_fields):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            yield (f"{path}.{key}", f"unknown key{hint}; known keys: {', '.join(known)}")
    elif isinstance(exc, _NotAList):
        key = path.rsplit(".", 1)[-1]
        toml_table = exc.table and toml
        how = f"; in TOML write each entry as its own [[{key}]] table" if toml_table else ""
        yield (path, f"{exc}{how}")
    elif isinstance(exc, KeyError):
        yield (path, "required key is missing")
    else:
        yield _at_key(str(exc), path, cls)


def _missing(cls: Any, key: str) -> str:
    """The problem of a required key that is missing: what it holds, when the model says."""
    field = attrs.fields_dict(cls).get(key) if attrs.has(cls) else None
    hint = field.metadata.get(HINT) if field is not None else None
    return f"required key is missing ({hint})" if hint else "required key is missing"


def _at_key(message: str, path: str, cls: Any) -> ConfigIssue:
    """``"key: problem"`` raised by a class about one of its keys goes to that key."""
    key, sep, problem = message.partition(": ")
    if sep and attrs.has(cls) and key in attrs.fields_dict(cls):
        return (f"{path}.{key}", problem)
    return (path, message)


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
            content does not fit the model; every bad path is listed, and ``source`` is the
            file's path (``"dict"`` for a mapping).
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
    except UnicodeDecodeError as exc:
        raise ConfigError([("$", f"not UTF-8 text: {exc.reason}")], str(path)) from exc
    if suffix == ".toml":
        return loads_toml(text, source=str(path))
    return loads_json(text, source=str(path))


def load_vllm_config(extra: Mapping[str, Any]) -> VllmExtraConfig:
    """vLLM's ``kv_connector_extra_config`` for ``KvhexOffloadingSpec``.

    Raises:
        ConfigError: every problem, each at the path of its key; ``source`` is
            ``kv_connector_extra_config``.
    """
    return structure(extra, VllmExtraConfig, source=SOURCE)


def load_vllm_tier(entry: Any, *, path: str = "$") -> VllmTierEntry:
    """One ``secondary_tiers`` entry (as vLLM's ``SecondaryTierFactory`` hands it over),
    with paths starting at ``path``.

    Raises:
        ConfigError: every problem in the entry.
    """
    if not isinstance(entry, Mapping):
        raise ConfigError([(path, f"expected a tier object, got {type(entry).__name__}")], SOURCE)
    tier: VllmTierEntry = _structure(entry, VllmTierEntry, SOURCE, path)
    issues = tier_issues([(path, tier)])
    if issues:
        raise ConfigError(issues, SOURCE)
    return tier
