"""kvhex inside vLLM 0.33: an offloading spec, a secondary tier and a connector.

* :class:`KvhexOffloadingSpec` (``spec_name``): vLLM's ``OffloadingSpec`` whose manager is
  kvhex's engine (host tier in vLLM's shared region + kvhex tiers); drop-in for vLLM's CPU and
  tiering specs' configuration keys.
* :class:`KvhexSecondaryTier` (a ``secondary_tiers`` entry ``type``): any kvhex tier inside
  vLLM's own ``TieringOffloadingSpec``.
* :class:`KvhexOffloadingConnector` (``kv_connector``): vLLM's ``OffloadingConnector`` whose
  KV events carry kvhex's full provenance.
* :func:`register`: the ``vllm.general_plugins`` entry point naming all three to vLLM.

vLLM resolves these names with ``getattr`` on this module; each is imported on first access,
so importing this package (or :mod:`kvhex.vllm.settings`) needs no vLLM.
See docs/vllm.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhex.vllm.connector import KvhexOffloadingConnector
    from kvhex.vllm.manager import KvhexOffloadingManager
    from kvhex.vllm.plugin import register
    from kvhex.vllm.spec import KvhexOffloadingSpec
    from kvhex.vllm.tier import KvhexSecondaryTier

__all__ = [
    "KvhexOffloadingConnector",
    "KvhexOffloadingManager",
    "KvhexOffloadingSpec",
    "KvhexSecondaryTier",
    "register",
]

_HOME = {
    "KvhexOffloadingConnector": "connector",
    "KvhexOffloadingManager": "manager",
    "KvhexOffloadingSpec": "spec",
    "KvhexSecondaryTier": "tier",
    "register": "plugin",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
