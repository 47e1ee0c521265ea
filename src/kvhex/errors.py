"""Every error kvhex raises, in one tree.

::

    KvhexError
    ├── ConfigError(ValueError)        bad configuration; lists every bad path at once
    ├── PluginError(ImportError)       an entry point that cannot be found, loaded or used
    ├── InvalidKeyError(ValueError)    a key of the wrong type or length
    ├── StateError(RuntimeError)       a call the tier's state machine does not allow
    ├── TierError(RuntimeError)        a storage tier failed
    │   └── TierUnavailable            the tier cannot be reached or used at all
    └── TransferError(RuntimeError)    a device <-> host copy failed

Each error also subclasses the built-in it behaves like, so callers that only know the
standard library still catch it. Errors carry structured fields and build their message
from them. Expected outcomes (a miss, a full tier, a block that fails its checksum: counted,
dropped and reported as a failed get) are return values, never exceptions.

This module imports nothing from kvhex: every layer, the domain included, may raise from it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "InvalidKeyError",
    "KvhexError",
    "MissingPackage",
    "PluginError",
    "StateError",
    "TierError",
    "TierUnavailable",
    "TransferError",
]


class KvhexError(Exception):
    """Root of every error kvhex raises on purpose."""


ConfigIssue = tuple[str, str]
"""One configuration problem: (JSON-path-like location such as ``$.primary.capacity_bytes``,
what is wrong there)."""


class ConfigError(KvhexError, ValueError):
    """A configuration was rejected. ``issues`` holds every problem found, not just the first.

    ``source`` names where the configuration came from (a file path, ``"dict"``, or the vLLM
    ``kv_connector_extra_config``) so an operator knows which file to open.
    """

    def __init__(self, issues: Iterable[ConfigIssue], source: str | None = None) -> None:
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        self.source = source
        super().__init__(self._message())

    @property
    def paths(self) -> tuple[str, ...]:
        """The locations of every issue, in the order found."""
        return tuple(path for path, _ in self.issues)

    def _message(self) -> str:
        where = f" in {self.source}" if self.source else ""
        lines = [f"invalid kvhex configuration{where} ({len(self.issues)} problem(s)):"]
        lines.extend(f"  {path}: {problem}" for path, problem in self.issues)
        return "\n".join(lines)


class PluginError(KvhexError, ImportError):
    """An entry point could not be found, imported or used.

    Names the entry-point group, the entry point, the distribution that declared it and a
    hint that fixes it (usually an install command).
    """

    def __init__(
        self,
        problem: str,
        *,
        group: str,
        name: str,
        distribution: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.problem = problem
        self.group = group
        self.plugin_name = name
        self.distribution = distribution
        self.hint = hint
        dist = f" from distribution {distribution!r}" if distribution else ""
        msg = f"{group} entry point {name!r}{dist}: {problem}"
        if hint:
            msg += f" (hint: {hint})"
        super().__init__(msg, name=name)


class MissingPackage(KvhexError, ImportError):
    """An optional package kvhex needs for what was asked is not installed. Names the module
    and the install command of the kvhex extra that declares it."""

    def __init__(self, module: str, hint: str) -> None:
        self.module = module
        self.hint = hint
        super().__init__(f"needs {module}, not installed: {hint}", name=module)


class InvalidKeyError(KvhexError, ValueError):
    """A key is not an ``OffloadKey`` of the expected shape (bytes, fixed length)."""

    def __init__(self, key: object, reason: str) -> None:
        self.key = key
        self.reason = reason
        shown = key.hex() if isinstance(key, bytes) else repr(key)
        super().__init__(f"invalid offload key {shown[:80]}: {reason}")


class StateError(KvhexError, RuntimeError):
    """A call the state machine does not allow, e.g. completing a load that was never pinned.

    Raised before any state changes: the call is all-or-nothing.
    """

    def __init__(self, operation: str, key: bytes, state: str) -> None:
        self.operation = operation
        self.key = key
        self.state = state
        super().__init__(f"{operation}: key {key.hex()[:80]} is {state}")


class TierError(KvhexError, RuntimeError):
    """A storage tier failed. ``tier`` names it; ``key`` and ``job_id`` when known."""

    def __init__(
        self,
        problem: str,
        *,
        tier: str,
        key: bytes | None = None,
        job_id: int | None = None,
    ) -> None:
        self.problem = problem
        self.tier = tier
        self.key = key
        self.job_id = job_id
        parts = [f"tier {tier!r}"]
        if job_id is not None:
            parts.append(f"job {job_id}")
        if key is not None:
            parts.append(f"key {key.hex()[:80]}")
        super().__init__(f"{', '.join(parts)}: {problem}")


class TierUnavailable(TierError):
    """The tier cannot be reached or used (missing bucket, unwritable root, server down).

    ``option`` names the tier's own option that would fix it, where the tier knows one: a
    constructor argument, dotted into a mapping one (``"url"``, ``"path"``,
    ``"storage_options.key"``). Composition reports the error at that option's key.
    """

    def __init__(
        self,
        problem: str,
        *,
        tier: str,
        option: str | None = None,
        key: bytes | None = None,
        job_id: int | None = None,
    ) -> None:
        self.option = option
        super().__init__(problem, tier=tier, key=key, job_id=job_id)


class TransferError(KvhexError, RuntimeError):
    """A device <-> host copy failed, or was given a job or tensors that do not fit its layout.

    ``job_id`` names the job and ``field`` the job field or constructor argument at fault
    (``"slots"``, ``"block_ids"``, ``"kv_caches"``, ...) when known.
    """

    def __init__(
        self, problem: str, *, job_id: int | None = None, field: str | None = None
    ) -> None:
        self.problem = problem
        self.job_id = job_id
        self.field = field
        where = f"transfer job {job_id}: " if job_id is not None else ""
        what = f"{field}: " if field is not None else ""
        super().__init__(f"{where}{what}{problem}")
