"""``KvhexOffloadingConnector``: vLLM's offloading connector with kvhex's event provenance.

vLLM's ``OffloadingManager`` API hands a manager only a ``ReqContext`` (request id, transfer
params), never the ``Request``; vLLM's own events tracker therefore snapshots payloads in the
scheduler. This connector is vLLM's ``OffloadingConnector`` plus these hooks, used only when the
spec's manager is kvhex's:

* ``on_new_request``: kvhex's context of the request gets the live ``Request`` (references
  to its tokens and hashes, never copies), so every store, cascade and promotion job the
  request starts carries its provenance, however late the job completes;
* ``get_num_new_matched_tokens``: with load-or-recompute decisions on, the request's matched
  prefix is planned before vLLM looks it up, wherever host memory and the tiers know their
  answers now (``TieringManager.plan_ahead``): its lookups then answer as decided, a
  promotion or a miss, and the request never waits a step for a plan. A request that will
  load waits from this lookup until the workers report its load finished
  (``update_connector_output``; or ``build_connector_meta`` sees it scheduled to compute):
  that wait (from host memory, or with a promotion) is what decisions count a load's engine
  steps as (``LoadWaits``), measured and counted only while no other request is in the
  engine: a busy engine's steps run for the others anyway, and a load's wait there is theirs
  (recomputing would cost every request of the batch its prefill instead);
* ``build_connector_meta``: a step that schedules nothing while kvhex's tiers have jobs in
  flight (a request waits for its promotion) sleeps ``IDLE_STEP_WAIT_S``: vLLM would step
  again at once, in a loop that holds the GIL, and the tiers' IO threads would get it only
  at the interpreter's switch interval (5 ms a turn: the get job of a 64 MiB promotion from
  files took 1.37 s over 5,700 steps, against 29-37 ms over 25 steps with the sleep);
* ``build_connector_meta`` and ``update_connector_output`` time the engine's steps for
  load-or-recompute decisions: a step that scheduled at least ``PREFILL_MIN_TOKENS`` tokens
  ran from the one call to the other (scheduling, model and sampling; no idle wait); its
  tokens per second is the prefill speed kvhex compares loads with (unless one is
  configured);
* ``take_events``: the step's events come from kvhex's translator (full ``BlockStored`` for
  host stores, secondary-tier stores and promotions; per-key ``BlockRemoved`` on reset) as
  vLLM's own ``kv_events`` structs, which vLLM's scheduler publishes with its publisher. In
  the step whose batch carries the device pool's ``AllBlocksCleared`` (a prefix-cache reset:
  it names no medium, and routers forget every block of this publisher), every block kvhex
  still holds is announced again, parent first (``take_kv_events(device_cleared=True)``);
* ``has_pending_push_work``: an idle engine (no request) steps while kvhex has jobs in
  flight (vLLM's own rule), while a tier's own work is due (a peer view's scan, a server's
  drops), and once after a prefix-cache reset, so that what they change is announced on an
  idle server too; an ``IdleWaker`` thread wakes the engine core when that work falls due.

With any other spec it behaves exactly like ``OffloadingConnector``. Select it with
``kv_connector="KvhexOffloadingConnector"`` (registered by the ``vllm.general_plugins`` entry
point; ``kv_connector_module_path="kvhex.vllm"`` works without it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvhex.domain.geometry import CacheKind, KvGeometry, KvGroup
from kvhex.vllm._compat import EngineHooks, lookup_runs, manager_lock, quiet_events_tracker
from kvhex.vllm._convert import context_of
from kvhex.vllm.idle import IdleWaker
from kvhex.vllm.manager import KvhexOffloadingManager

PREFILL_MIN_TOKENS = 128
"""A step scheduling fewer tokens (decode steps) says little about prefill speed."""

IDLE_STEP_WAIT_S = 0.001
"""How long an empty scheduler step sleeps while kvhex's tiers have work in flight."""
_nap = time.sleep

_KINDS = {kind.value: kind for kind in CacheKind}


def geometry_of_groups(group_configs: Iterable[Any], tokens_per_hash: int) -> KvGeometry:
    """kvhex geometry from the scheduler's ``GroupOffloadConfig``s, with each group's exact
    cache kind and window (as vLLM's own events announce them). A group vLLM keeps only a
    window of is never described in full, whatever its kind."""
    groups = []
    for g in group_configs:
        spec = g.kv_event_group_spec
        kind = _KINDS.get(spec.kv_cache_spec_kind or "", CacheKind.UNKNOWN)
        if g.sliding_window_size_in_chunks is not None and kind.keeps_every_block:
            kind = CacheKind.UNKNOWN
        groups.append(
            KvGroup(
                g.group_idx,
                g.tokens_per_block,
                g.tokens_per_chunk // g.tokens_per_block,
                kind,
                spec.kv_cache_spec_sliding_window,
            )
        )
    return KvGeometry(tuple(groups), tokens_per_hash)


class KvhexOffloadingConnector(OffloadingConnector):
    """``OffloadingConnector`` whose events carry kvhex's provenance (see module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._kvhex: KvhexOffloadingManager | None = None
        self._step_began: tuple[float, int] | None = None  # (clock, tokens) of this step
        # request id -> (clock at its first lookup that found a load, promoted, its context)
        self._waits: dict[str, tuple[float, bool, Any]] = {}
        self._hooks = EngineHooks(None, None)
        self._device_generation: object | None = None  # the device cache's, last seen
        self._stepped = time.monotonic()  # when build_connector_meta last ran
        self._waker: IdleWaker | None = None
        scheduler = self.connector_scheduler
        if scheduler is not None and isinstance(scheduler.manager, KvhexOffloadingManager):
            self._kvhex = kvhex = scheduler.manager
            config = scheduler.config
            kvhex.bind_geometry(geometry_of_groups(config.kv_group_configs, config.tokens_per_hash))
            # kvhex publishes its own events: vLLM's tracker must not snapshot payloads
            # that nothing would ever drop
            quiet_events_tracker(scheduler)
            self._hooks = hooks = EngineHooks.of_caller()
            if hooks.has_device:
                # a key waiting for a parent of the device's goes out only while the device
                # holds it (a promotion or cascade may finish after the device evicted it)
                kvhex.engine.announcer.see_device(hooks.device_holds)
            if hooks.can_wake and kvhex.tier_stores:
                self._waker = IdleWaker(kvhex.next_poll_at, self._last_step, hooks.wake)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        kvhex = self._kvhex
        if kvhex is None:
            return meta
        self._stepped = time.monotonic()
        self._time_step(kvhex, scheduler_output)
        if self._waits:  # a load that reported no finish (a synchronous one) ends here
            self._end_waits(kvhex, (new.req_id for new in scheduler_output.scheduled_new_reqs))
        if scheduler_output.total_num_scheduled_tokens:
            return meta
        with manager_lock(kvhex):
            working = kvhex.has_pending_work()
        if working:
            # an empty step while kvhex's tiers work: the engine would step again at once
            # and keep the GIL from the tiers' IO threads (each of their turns then waits
            # for the interpreter's switch interval); give them the time instead
            _nap(IDLE_STEP_WAIT_S)
        return meta

    def _time_step(self, kvhex: KvhexOffloadingManager, scheduler_output: Any) -> None:
        tokens = scheduler_output.total_num_scheduled_tokens
        self._step_began = (time.perf_counter(), tokens) if tokens >= PREFILL_MIN_TOKENS else None

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        began, self._step_began = self._step_began, None
        if self._kvhex is None:
            return
        if began is not None:
            with manager_lock(self._kvhex):
                self._kvhex.engine.observe_prefill(began[1], time.perf_counter() - began[0])
        if self._waits and connector_output.finished_recving:
            # the device holds the prefix: the request computes in the next step, as a
            # recomputed one would have in the step of its lookup (time it then spends
            # queued behind other requests is not the load's)
            self._end_waits(self._kvhex, connector_output.finished_recving)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        kvhex = self._kvhex
        ctx = None
        busy = False
        if kvhex is not None and not kvhex.promotions_held:
            found = lookup_runs(self.connector_scheduler, request, num_computed_tokens)
            if found is not None:
                vctx, runs, busy = found
                ctx = context_of(vctx)[0]
                with manager_lock(kvhex):
                    kvhex.engine.plan_ahead(runs, ctx, busy=busy)
        began = time.perf_counter()
        matched: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        if busy:
            # another request shares the engine now: the waits under way would count its
            # steps as the loads' (only an idle engine's waits say what a load costs)
            self._waits.clear()
        elif ctx is not None:
            self._note_wait(request.request_id, ctx, matched[0], began)
        return matched

    def _note_wait(self, req_id: str, ctx: Any, tokens: int | None, began: float) -> None:
        """A lookup that found a prefix to load (``tokens`` > 0) or deferred (``None``: a
        promotion or a probe under way) starts the request's wait, ended when the request is
        done (``update_connector_output``); one that found nothing ends it."""
        known = self._waits.get(req_id)
        if tokens == 0:
            if known is not None:
                del self._waits[req_id]
        elif known is None:
            self._waits[req_id] = (began, tokens is None, ctx)
        elif tokens is None and not known[1]:
            self._waits[req_id] = (known[0], True, ctx)

    def _end_waits(self, kvhex: KvhexOffloadingManager, req_ids: Iterable[str]) -> None:
        """The loads of ``req_ids`` finished (or the requests were scheduled to compute):
        their waits end."""
        waits = self._waits
        if not waits:
            return
        now = time.perf_counter()
        for req_id in req_ids:
            wait = waits.pop(req_id, None)
            if wait is not None:
                with manager_lock(kvhex):
                    kvhex.engine.observe_load_wait(wait[2], now - wait[0], promoted=wait[1])

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        self._waits.pop(request.request_id, None)
        finished: tuple[bool, Any] = super().request_finished(request, block_ids)
        return finished

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Any]:
        self._waits.pop(request.request_id, None)
        finished: tuple[bool, Any] = super().request_finished_all_groups(request, block_ids)
        return finished

    def on_new_request(self, request: Any) -> None:
        if self._kvhex is None:
            super().on_new_request(request)
            return
        with self._kvhex.incoming(request):
            super().on_new_request(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self._kvhex is None:
            events: Iterable[KVCacheEvent] = super().take_events()
            return events
        # the scheduler took the device pool's events just before: a reset since the last
        # step put AllBlocksCleared among them (see EngineHooks.device_generation)
        generation = self._hooks.device_generation()
        cleared = self._device_generation is not None and generation is not self._device_generation
        self._device_generation = generation
        with manager_lock(self._kvhex):
            return self._kvhex.take_kv_events(device_cleared=cleared)

    def has_pending_push_work(self) -> bool:
        """vLLM's rule (transfers or kvhex's jobs in flight, which includes a tier's own
        work due), and once after a reset of the device cache: kvhex then announces again
        what it holds, in the step that publishes the reset's ``AllBlocksCleared``."""
        if super().has_pending_push_work():
            return True
        known = self._device_generation
        return known is not None and self._hooks.device_generation() is not known

    def shutdown(self) -> None:
        if self._waker is not None:
            self._waker.stop()
        super().shutdown()

    def _last_step(self) -> float:
        return self._stepped
