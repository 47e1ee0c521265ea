"""``KvhexOffloadingManager``: vLLM's ``OffloadingManager`` backed by kvhex's ``OffloadEngine``.

vLLM's scheduler-side offloading connector calls it exactly as it calls vLLM's own CPU or
tiering manager. Each method translates arguments (vLLM's ``ReqContext`` carries kvhex's,
key collections become lists, host slots become ``CPULoadStoreSpec``) and forwards to the
engine, whose methods mirror this contract.

Events leave in one of two forms:

* ``take_events()``: vLLM ``OffloadingEvent``s, which vLLM's own events tracker turns into
  ``BlockStored`` / ``BlockRemoved`` (with vLLM's payload snapshots when
  ``self_describing_kv_events`` is on). This is what vLLM's stock ``OffloadingConnector``
  calls.
* ``take_kv_events()``: vLLM ``kv_events`` structs translated by kvhex, with the provenance
  each job's request context carries (so completions after the request finished, secondary
  stores and promotions are full events). ``KvhexOffloadingConnector`` calls this one.

A tier whose entry did not set ``enable_kv_events`` stays silent, and nothing is announced
when vLLM's KV events are off, as in vLLM.

After a reset no promotion may write host slots that a late device copy of a job flushed by
the reset could still write: when device copies were in flight at the reset (host slots
write-pending for a device store or pinned for a device load), lookups answer from host
memory alone until vLLM 0.33 calls
``on_reset_flushed``, or on vLLM 0.32 (which never does) until the second schedule end after
the reset (``compat.RESET_FLUSH_STEPS`` says why that is late enough).

Threading: scheduler thread only (kvhex runs no tier-poll thread), so ``lock`` is vLLM's
default no-op (vLLM 0.32 has none).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from time import perf_counter
from types import MethodType
from typing import Any

from vllm.distributed import kv_events as vev
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvhex.domain.geometry import KvGeometry
from kvhex.domain.holdings import StreamHoldings
from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult, TierIdentity
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.service.engine import OffloadEngine
from kvhex.service.stats import TieringStats
from kvhex.vllm._compat import RESET_FLUSH_STEPS, SIGNALS_RESET_FLUSHED
from kvhex.vllm._convert import (
    LOOKUP,
    by_position,
    context_of,
    offloading_events,
    policy_of,
    provenance_of,
    vllm_events,
)
from kvhex.vllm.metrics import VllmMetrics, cache_hit_source

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
_VHIT, _VMISS = vbase.LookupResult.HIT, vbase.LookupResult.MISS
_store_output = by_position(
    vbase.PrepareStoreOutput, ("keys_to_store", "store_spec", "evicted_keys")
)
_NO_CONTEXT = ReqContext(req_id="")
"""The last context asked about before any was: paired with no vLLM context, never used."""


class KvhexOffloadingManager(vbase.OffloadingManager):
    """vLLM's manager contract over an ``OffloadEngine`` (host tier + kvhex tiers)."""

    def __init__(
        self,
        engine: OffloadEngine,
        *,
        events_enabled: bool,
        silent_tiers: Collection[TierIdentity] = (),
        geometry: KvGeometry | None = None,
        on_shutdown: Callable[[], None] | None = None,
        tier_stores: Sequence[TierStore] = (),
        host: HostBuffer | None = None,
        store_threshold: int = 1,
    ) -> None:
        """Args:
        engine: the kvhex engine (host primary tier, secondary tiers, event pipeline).
        events_enabled: vLLM's global ``enable_kv_cache_events``; when off, nothing is
            announced.
        silent_tiers: tiers whose events are dropped (their entry lacks
            ``enable_kv_events``).
        geometry: the model's KV groups, for full events (see ``incoming``).
        on_shutdown: called after the engine shut down (releases vLLM's region).
        tier_stores: the engine's secondary tiers, in order (for operators and tests).
        host: the engine's host buffer (vLLM's region; for operators and tests).
        store_threshold: the host tier's (vLLM's metrics count skipped stores from 2).
        """
        self._engine = engine
        self._events_enabled = events_enabled
        self._silent = frozenset(silent_tiers)
        self._geometry = geometry
        self._on_shutdown = on_shutdown
        self._tier_stores = tuple(tier_stores)
        self._host = host
        self._shut = False
        self._incoming: Any = None
        # after a reset, until vLLM's workers reported every job in flight at the reset, no
        # promotion may write into host slots a late device copy could still write (vLLM's
        # tiering manager holds promotions the same way); on vLLM 0.32 the number of
        # schedule ends still to wait for, there being no flush signal
        self._promotions_held = False
        self._held_steps = 0
        # what take_kv_events announced and did not take back: said again when the
        # engine's device clear makes routers forget it
        self._announced = StreamHoldings()
        # per request, when each key's lookups first deferred (RETRY), for the async delay
        self._deferred: dict[str, dict[OffloadKey, float]] = {}
        self._metrics = VllmMetrics(
            engine,
            tier_names=[t.name for t in engine.stats().tiers],
            store_threshold=store_threshold,
        )
        # the hot path's bound calls (the engine's lookup with promotions, or host memory
        # alone while they are held; the per-chunk and per-request calls), and the context of
        # the request vLLM asked about last (it asks about one request's chunks in a row): per
        # lookup, an identity test instead of a state lookup
        self._calls = calls = engine.calls()
        self._lookup = calls.lookup
        self._lookup_delay = self._metrics.lookup_delay_recorder()
        self._last_vctx: vbase.ReqContext | None = None
        self._last_ctx: ReqContext = _NO_CONTEXT
        # vLLM's lookup of a chunk readable in host memory (or, with no secondary tier, of
        # one it does not hold) answered natively, with no Python frame, where the module
        # was built; this class's lookup is its fallback for every other answer
        self._python_lookup = MethodType(KvhexOffloadingManager.lookup, self)
        self._hit_path = engine.hit_path(self._python_lookup, _VHIT, _VMISS, idle=(self._deferred,))
        if self._hit_path is not None:
            self.lookup = self._hit_path  # type: ignore[method-assign,assignment]

    # -- kvhex-side access ---------------------------------------------------------------
    @property
    def engine(self) -> OffloadEngine:
        """The kvhex engine behind this manager."""
        return self._engine

    @property
    def tier_stores(self) -> tuple[TierStore, ...]:
        """The secondary tiers behind host memory, in lookup order."""
        return self._tier_stores

    @property
    def host(self) -> HostBuffer | None:
        """The host buffer the engine's slots live in (``None`` when not given)."""
        return self._host

    @property
    def geometry(self) -> KvGeometry | None:
        """The KV groups full events are described with."""
        return self._geometry

    def bind_geometry(self, geometry: KvGeometry) -> None:
        """Use ``geometry`` (the scheduler's exact group kinds) from now on."""
        self._geometry = geometry
        self._engine.set_geometry(geometry)

    @contextmanager
    def incoming(self, request: Any) -> Iterator[None]:
        """While the scheduler announces ``request`` (``on_new_request`` inside this block),
        its context gets the live request as provenance: every store, cascade and promotion
        it starts is then announced in full by ``take_kv_events``."""
        self._incoming = request
        try:
            yield
        finally:
            self._incoming = None

    def stats(self) -> TieringStats:
        """kvhex's counters of the host tier and every secondary tier."""
        return self._engine.stats()

    # -- OffloadingManager ---------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: vbase.ReqContext) -> vbase.LookupResult:
        if req_context is self._last_vctx:  # the same request's next chunk: the hot path
            result = self._lookup(key, self._last_ctx)
            if result is _HIT and not self._deferred:
                return _VHIT
            return self._answer(key, req_context, result, None)
        # a run of lookups for another request: its first resolved one is timed (the
        # sync-delay samples)
        start = perf_counter()
        result = self._lookup(key, self._ctx(req_context))  # (remembered: its next lookups)
        return self._answer(key, req_context, result, start)

    def _answer(
        self,
        key: OffloadKey,
        req_context: vbase.ReqContext,
        result: LookupResult,
        start: float | None,
    ) -> vbase.LookupResult:
        """vLLM's answer for ``result``, with the lookup's metrics: its duration since
        ``start`` when it was timed, the wait of a key whose lookups answered ``RETRY``."""
        if result is _HIT or result is _MISS:
            if self._deferred:  # some key's lookups answered RETRY before
                deferred = self._deferred.get(req_context.req_id)
                since = deferred.pop(key, None) if deferred else None
                if since is not None:
                    self._metrics.on_lookup_wait(since)
            if start is not None:
                self._lookup_delay(perf_counter() - start)
            return _VHIT if result is _HIT else _VMISS
        if result is _RETRY:
            since = perf_counter() if start is None else start
            self._deferred.setdefault(req_context.req_id, {}).setdefault(key, since)
        if start is not None:  # not resolved: the run's next lookup is timed instead
            self._last_vctx, self._last_ctx = None, _NO_CONTEXT
        return LOOKUP[result]

    def get_load_source(self, key: OffloadKey, req_context: vbase.ReqContext) -> Any:
        """Host memory, or the tier (file: ``DISK``; remote: ``EXTERNAL_UNSPECIFIED``) whose
        promotion brought ``key`` in for this request."""
        return cache_hit_source(self._engine.load_source(key, self._ctx(req_context)))

    def get_stats(self) -> Any:
        """vLLM's CPU and tiering metrics since the last call (see ``metrics.py``)."""
        return self._metrics.take()

    # (each key collection as a list, inline: vLLM passes lists, and each job's keys as a set)
    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: vbase.ReqContext
    ) -> CPULoadStoreSpec:
        ctx = self._last_ctx if req_context is self._last_vctx else self._ctx(req_context)
        return CPULoadStoreSpec(
            self._calls.prepare_load(keys if type(keys) is list else list(keys), ctx)
        )

    def touch(self, keys: Collection[OffloadKey], req_context: vbase.ReqContext) -> None:
        ctx = self._last_ctx if req_context is self._last_vctx else self._ctx(req_context)
        self._calls.touch(keys if type(keys) is list else list(keys), ctx)

    def complete_load(self, keys: Collection[OffloadKey], req_context: vbase.ReqContext) -> None:
        ctx = self._last_ctx if req_context is self._last_vctx else self._ctx(req_context)
        self._calls.complete_load(keys if type(keys) is list else list(keys), ctx)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: vbase.ReqContext
    ) -> vbase.PrepareStoreOutput | None:
        ctx = self._last_ctx if req_context is self._last_vctx else self._ctx(req_context)
        plan = self._calls.prepare_store(keys if type(keys) is list else list(keys), ctx)
        if plan is None:
            return None
        return _store_output(plan.keys, CPULoadStoreSpec(plan.slots), plan.evicted)

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        req_context: vbase.ReqContext,
        success: bool = True,
    ) -> None:
        ctx = self._last_ctx if req_context is self._last_vctx else self._ctx(req_context)
        self._calls.complete_store(keys if type(keys) is list else list(keys), ctx, success)

    def on_new_request(self, req_context: vbase.ReqContext) -> vbase.RequestOffloadingContext:
        ctx, _ = context_of(req_context)
        request = self._incoming
        if (
            request is not None
            and self._geometry is not None
            and getattr(request, "request_id", None) == req_context.req_id
        ):
            ctx.provenance = provenance_of(request, self._geometry)
        return policy_of(self._calls.on_new_request(ctx))

    def on_request_finished(self, req_context: vbase.ReqContext) -> None:
        if self._deferred:
            self._deferred.pop(req_context.req_id, None)
        self._calls.on_request_finished(self._ctx(req_context))
        if req_context is self._last_vctx:
            # not kept alive by being the last asked about (its jobs' contexts carry it on)
            self._last_vctx, self._last_ctx = None, _NO_CONTEXT

    def on_schedule_end(self, context: vbase.ScheduleEndContext) -> None:
        self._engine.on_schedule_end()
        self._metrics.on_step_end()
        if self._held_steps:
            self._held_steps -= 1
            self._hold_promotions(self._held_steps > 0)

    def has_pending_work(self) -> bool:
        return self._engine.has_pending_work()

    def next_poll_at(self) -> float | None:
        """When kvhex's tiers' own work next wants a step (``OffloadEngine.next_poll_at``):
        what the connector's idle timer wakes an idle engine for. Plain reads, any thread."""
        return self._engine.next_poll_at()

    def take_events(self) -> Iterable[vbase.OffloadingEvent]:
        """This step's raw events as vLLM ``OffloadingEvent``s, in kvhex's order (host tier
        first, then each tier); for vLLM's own events tracker."""
        raw = self._engine.take_raw_events(self._silent)
        return offloading_events(raw) if self._events_enabled else []

    def take_kv_events(self, *, device_cleared: bool = False) -> list[vev.KVCacheEvent]:
        """This step's events translated by kvhex (full provenance), as vLLM's structs.

        With ``device_cleared`` the engine's device pool published ``AllBlocksCleared`` in
        this step's batch, ahead of these events: it names no medium, so routers forget
        every block of this publisher, kvhex's host and tier copies included. Every block
        kvhex announced and still holds (this step's changes applied) is then announced
        again instead, parent first (``StreamHoldings``), however long ago it was stored;
        a block none of whose ancestors kvhex holds (its parent was the device's) is left
        out, as a radix-tree index would drop it, and so is its removal later.
        """
        if not self._events_enabled:
            self._engine.take_raw_events()  # drained: nothing is announced
            return []
        events = self._engine.take_events(self._silent)
        announced = self._announced
        if events:
            if announced.withheld:  # consumers never heard of these again: no removal
                events = announced.unsaid(events)
            announced.fold(events)
        # after the clear a block whose parent only the device held has none: left out
        return vllm_events(announced.snapshot(orphans=False) if device_cleared else events)

    @property
    def promotions_held(self) -> bool:
        """Whether lookups answer from host memory alone (after a reset, until device copies
        in flight at it were reported)."""
        return self._promotions_held

    def reset_cache(self) -> None:
        # only device copies in flight at the reset can still write or read the freed host
        # slots; with none, promotions go on at once. A hold from an earlier reset whose
        # flush is still owed stays (vLLM 0.33 reports the flushes of both at once).
        device_busy = self._engine.reset()
        if device_busy and self._engine.has_secondary_tiers:
            self._hold_promotions(True)
        if self._promotions_held and not SIGNALS_RESET_FLUSHED:
            self._held_steps = RESET_FLUSH_STEPS

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: every job in flight at the last reset was reported."""
        self._hold_promotions(False)
        self._held_steps = 0

    def shutdown(self) -> None:
        if self._shut:
            return
        self._engine.shutdown()
        self._shut = True
        if self._on_shutdown is not None:
            self._on_shutdown()

    # -- helpers -------------------------------------------------------------------------
    def _hold_promotions(self, held: bool) -> None:
        """Lookups answer from host memory alone (``held``) or from every tier."""
        self._promotions_held = held
        self._lookup = self._calls.lookup_host if held else self._calls.lookup
        if self._hit_path is not None:  # host memory alone: no hit remembered nor counted
            self.lookup = self._python_lookup if held else self._hit_path  # type: ignore[method-assign,assignment]

    def _ctx(self, vctx: vbase.ReqContext) -> ReqContext:
        """kvhex's context of ``vctx`` (created on first sight), remembered as the last
        asked about (vLLM's calls for one request come in a row: touch, prepare_load,
        prepare_store)."""
        if vctx is self._last_vctx:
            return self._last_ctx
        ctx: ReqContext | None = vctx.get_state(ReqContext)
        if ctx is None:
            ctx, _ = context_of(vctx)
        self._last_vctx, self._last_ctx = vctx, ctx
        return ctx
