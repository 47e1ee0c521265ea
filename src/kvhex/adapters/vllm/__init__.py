"""kvhex.vllm's old name, kept for one release: vLLM configurations written for earlier kvhex
name ``kvhex.adapters.vllm`` in ``module_path`` or ``spec_module_path``, and vLLM resolves the
class with ``getattr`` on that module. Each name forwards to :mod:`kvhex.vllm`, which is
imported on first access (so importing this module needs no vLLM). Write ``kvhex.vllm``: this
alias warns (``DeprecationWarning``) and goes in the next release.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = [
    "KvhexOffloadingConnector",
    "KvhexOffloadingManager",
    "KvhexOffloadingSpec",
    "KvhexSecondaryTier",
    "register",
]

warnings.warn(
    "kvhex.adapters.vllm is now kvhex.vllm; name kvhex.vllm in vLLM's module_path and "
    "spec_module_path (the old name goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("kvhex.vllm"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
