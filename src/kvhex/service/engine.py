"""``OffloadEngine``: the facade an serving engine calls.

Its methods mirror vLLM's ``OffloadingManager`` contract (lookup, prepare_load, touch,
complete_load, prepare_store, complete_store, on_new_request, on_request_finished,
on_schedule_end, take_events, has_pending_work, reset, shutdown, stats), so an engine adapter
is a thin translation. It owns the lifecycle: after ``shutdown`` every call raises
``StateError`` instead of touching released host memory.

It is closed: callers never reach the tiering manager or the event pipeline behind it. What
they read is in ``stats()`` (every tier's counters, the events published); what they tune or
observe has a method of its own (``set_geometry``, ``set_load_mode``, ``observe_prefill``,
``observe_jobs``, ``add_sink``). An adapter calling per chunk takes the per-chunk and
per-request calls once, as ``calls()``: the tiering manager's own methods, without this
facade's frame in between, refusing after ``shutdown`` as this facade does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence, Sized
from typing import TYPE_CHECKING, Any, NamedTuple

from kvhex.domain.announce import Announcer
from kvhex.domain.cost import LoadMode
from kvhex.domain.events import PublicEvent, TierEvent
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.jobs import JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.primary import PRIMARY_IDENTITY, StorePlan
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult, OffloadPolicy, TierIdentity
from kvhex.ports.event_sink import EventSink
from kvhex.ports.tier_store import TierStore, tier_identities
from kvhex.service.events import EventPipeline
from kvhex.service.stats import TieringStats
from kvhex.service.tiering import TieringManager, refused

if TYPE_CHECKING:
    from kvhex.domain._hostslots import HitPath


def announcer_for(tiers: Iterable[TierStore], owned: Collection[TierIdentity] = ()) -> Announcer:
    """The announcer of an engine over ``tiers``: each tier announced with its medium and
    locality and, unless its identity is in ``owned``, no ownership name. Routers read a
    residency by medium and locality (Dynamo's indexer drops every event that names an
    ownership, as it drops localities but ``LOCAL``); vLLM's own file and object tiers name
    none either. A ``PeerView`` tier's other instances' blocks are announced as the tier.
    The host primary tier's events are exact (``Announcer``'s ``exact``)."""
    publish_as = {}
    for store in tiers:
        tier = store.identity
        public = tier if tier in owned else TierIdentity(tier.medium, tier.locality, None)
        for identity in tier_identities(store):
            publish_as[identity] = public
    return Announcer(publish_as, exact=(PRIMARY_IDENTITY,))


class EngineCalls(NamedTuple):
    """An engine's per-chunk and per-request calls, each the tiering manager's own bound
    method (``OffloadEngine.calls``): the same arguments, answers and errors as the facade's
    methods of the same names, and like them refusing (``StateError``) once the engine is shut
    down. ``lookup_host`` is ``lookup(key, ctx, promote=False)``."""

    lookup: Callable[[OffloadKey, ReqContext], LookupResult]
    lookup_host: Callable[[OffloadKey, ReqContext], LookupResult]
    touch: Callable[[Sequence[OffloadKey], ReqContext], None]
    prepare_load: Callable[[Sequence[OffloadKey], ReqContext], list[int]]
    complete_load: Callable[[Sequence[OffloadKey], ReqContext], None]
    prepare_store: Callable[[Sequence[OffloadKey], ReqContext], StorePlan | None]
    complete_store: Callable[[Sequence[OffloadKey], ReqContext, bool], None]
    on_new_request: Callable[[ReqContext], OffloadPolicy]
    on_request_finished: Callable[[ReqContext], None]


class OffloadEngine:
    """What an engine talks to: a tiering manager behind vLLM's manager contract."""

    __slots__ = ("_announcer", "_closed", "_has_tiers", "_manager", "_pipeline")

    def __init__(
        self,
        manager: TieringManager,
        pipeline: EventPipeline | None = None,
        announcer: Announcer | None = None,
    ) -> None:
        """Args:
        manager: the tiering manager.
        pipeline: translates raw tier events into public events with provenance and
            publishes them to its sinks (default: translation only, no sink).
        announcer: orders the tiers' raw events parent-first and says under which identity
            each tier is announced (default: :func:`announcer_for` the manager's tiers, no
            ownership names).
        """
        self._manager = manager
        self._pipeline = pipeline or EventPipeline()
        self._announcer = announcer or announcer_for(manager.tier_stores)
        self._closed = False
        self._has_tiers = bool(manager.stats().tiers)  # the tiers are fixed at construction

    def _live(self, operation: str) -> TieringManager:
        if self._closed:
            raise refused(operation)
        return self._manager

    def lookup(self, key: OffloadKey, ctx: ReqContext, *, promote: bool = True) -> LookupResult:
        """Is the chunk offloaded and readable? See ``TieringManager.lookup``. With
        ``promote=False`` only host memory answers (no promotion starts): for an engine
        that must keep host slots free of new writes for a while (after a reset, until its
        workers confirmed that no late device copy still writes them)."""
        if promote:  # (the manager refuses every call once shut down)
            return self._manager.lookup(key, ctx)
        return self._manager.lookup_host(key)

    def calls(self) -> EngineCalls:
        """The per-chunk and per-request calls (lookup, touch, loads, stores, request
        lifecycle) as the tiering manager's own bound methods, without this facade's frame in
        between: for an engine adapter that calls them per chunk, per step."""
        m = self._live("calls")
        return EngineCalls(
            m.lookup,
            m.lookup_host,
            m.touch,
            m.prepare_load,
            m.complete_load,
            m.prepare_store,
            m.complete_store,
            m.on_new_request,
            m.on_request_finished,
        )

    def hit_path(
        self,
        fallback: Callable[[OffloadKey, Any], Any],
        hit: object,
        miss: object,
        idle: Sequence[Sized] = (),
    ) -> HitPath | None:
        """A native callable answering ``hit`` (``miss``) for a lookup that ``lookup`` would
        answer ``HIT`` from host memory (``MISS`` with no secondary tier), and
        ``fallback(key, engine_ctx)`` otherwise; ``None`` where the native module was not
        built. See ``TieringManager.hit_path``."""
        return self._live("hit_path").hit_path(fallback, hit, miss, idle)

    def plan_ahead(
        self, runs: Sequence[Sequence[OffloadKey]], ctx: ReqContext, *, busy: bool = False
    ) -> None:
        """The scheduler will look up ``runs`` (one run of keys per KV group, in prefix
        order) for ``ctx``, with other requests in the engine (``busy``) or none: decide load
        or recompute now where every answer is known. See ``TieringManager.plan_ahead``."""
        self._live("plan_ahead").plan_ahead(runs, ctx, busy=busy)

    def load_source(self, key: OffloadKey, ctx: ReqContext) -> TierIdentity | None:
        """The secondary tier a ``HIT`` of ``key`` for ``ctx`` was promoted from, ``None``
        for host memory. See ``TieringManager.load_source``."""
        return self._live("load_source").load_source(key, ctx)

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]:
        """Pin the host slots of ``keys`` (answered ``HIT``) for a device load."""
        return self._manager.prepare_load(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Mark ``keys`` recently used in every tier."""
        self._manager.touch(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """The device load of ``keys`` finished."""
        self._manager.complete_load(keys, ctx)

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> StorePlan | None:
        """Reserve host slots for new keys; ``None`` when the host tier is full."""
        return self._manager.prepare_store(keys, ctx)

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """The device -> host store of ``keys`` finished (or failed)."""
        self._manager.complete_store(keys, ctx, success)

    def on_new_request(self, ctx: ReqContext) -> OffloadPolicy:
        """First sight of a request; its offload policy."""
        return self._manager.on_new_request(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No more submissions for ``ctx`` (completions may still arrive)."""
        self._manager.on_request_finished(ctx)

    def on_schedule_end(self) -> None:
        """Once per scheduler step."""
        self._manager.on_schedule_end()

    def take_events(self, exclude: Collection[TierIdentity] = ()) -> list[PublicEvent]:
        """This step's public events (primary tier first, then each tier in order), with
        full provenance where the storing request's context resolves them; also published
        as one batch to the pipeline's sinks. Events of the tiers in ``exclude`` are
        dropped (tiers configured silent)."""
        return self._pipeline.process(self.take_raw_events(exclude))

    def take_raw_events(self, exclude: Collection[TierIdentity] = ()) -> list[TierEvent]:
        """This step's raw tier events as they are announced (public identities, each
        residency's keys once, stores parent-first in chains: see ``Announcer``), untranslated
        and unpublished, for a host engine that translates them itself (vLLM's own events
        tracker); ``exclude`` as for ``take_events``. Either this or ``take_events`` drains a
        step's events, not both."""
        if self._closed:
            raise refused("take_events")
        raw = self._manager.take_events()
        if exclude:
            raw = [event for event in raw if event.tier not in exclude]
        return self._announcer.order(raw)

    def set_geometry(self, geometry: KvGeometry | None) -> None:
        """Describe full events with ``geometry`` (the model's KV groups) from now on; load
        decisions count the tokens a key saves from it."""
        self._pipeline.set_geometry(geometry)
        self._manager.set_geometry(geometry)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The host engine computed ``tokens`` tokens in ``seconds`` (one step): the prefill
        speed load decisions compare loads with."""
        self._manager.observe_prefill(tokens, seconds)

    def observe_load_wait(self, ctx: ReqContext, seconds: float, *, promoted: bool) -> None:
        """``ctx``'s load was done ``seconds`` after its lookup, its prefix loaded from host
        memory alone or ``promoted`` from a secondary tier: a load's cost in engine steps,
        which load decisions weigh against recomputing."""
        self._manager.observe_load_wait(ctx, seconds, promoted=promoted)

    def set_load_mode(self, mode: LoadMode) -> None:
        """Decide secondary-tier hits as ``mode`` says from now on (``OFF``: promote every
        hit at its first lookup); decisions already taken for active requests stand."""
        self._manager.set_load_mode(mode)

    def observe_jobs(self, observer: Callable[[int, TierJob, JobResult, float], None]) -> None:
        """Call ``observer(tier_index, job, result, latency_s)`` for every put and get a
        secondary tier finishes from now on (``tier_index`` as in ``stats().tiers``; latency:
        submission to the result reaching the engine). One observer; a second call replaces
        the first."""
        self._manager.observe_jobs(observer)

    def add_sink(self, sink: EventSink) -> None:
        """Publish every later step's batch to ``sink`` too (closed at shutdown)."""
        self._pipeline.add_sink(sink)

    @property
    def slot_bytes(self) -> int:
        """Bytes per host slot (one chunk of every layer and group); 0 without a host
        buffer, or once a clean shutdown released it."""
        return self._manager.slot_bytes

    def host_keys(self) -> list[OffloadKey]:
        """The keys host memory holds readable now (not being written), in no order: what
        a ``lookup`` would answer ``HIT`` from host memory; for operators and tests."""
        return self._live("host_keys").host_keys()

    @property
    def has_secondary_tiers(self) -> bool:
        """Whether any tier lies behind host memory."""
        return self._has_tiers

    def has_pending_work(self) -> bool:
        """Keep the engine stepping while True: jobs in flight, step-end work queued, or a
        tier's own work due (see ``next_poll_at``). False once shut down."""
        return not self._closed and self._manager.has_pending_work()

    def next_poll_at(self) -> float | None:
        """When a tier's own work (a peer view's scan, a server's drops) next wants a step
        (``time.monotonic``; a time past: now), or ``None`` when none is scheduled or once
        shut down: an engine that sleeps while it has no request wakes then, so an idle
        server still announces what that work finds. Plain reads, from any thread."""
        return None if self._closed else self._manager.next_poll_at()

    def reset(self) -> int:
        """Drain tiers and empty the host tier (persistent tiers keep their data). Returns
        the host slots device copies may still write or read (see ``TieringManager.reset``)."""
        return self._live("reset").reset()

    def shutdown(self) -> None:
        """Close every tier (reverse order), then the host buffer. Idempotent once it
        succeeded; a failed shutdown raises ``TierError`` and may be retried."""
        if self._closed:
            return
        self._manager.shutdown()
        self._closed = True
        # the final events still go out
        self._pipeline.process(self._announcer.order(self._manager.take_events()))
        self._pipeline.close()

    def stats(self) -> TieringStats:
        """Counters of the host tier, every secondary tier and the events published."""
        return self._manager.stats(self._pipeline.stats())

    @property
    def announcer(self) -> Announcer:
        """Orders and relabels the tiers' events before they are announced."""
        return self._announcer
