"""The engine's counters as its readers see them (metrics adapters, the CLI, tests): one
snapshot type per part, gathered in one ``TieringStats``.

``TierStats`` is also the live record a ``TierDriver`` counts into (``snapshot`` copies it);
the others are built as copies. Every count is cumulative since the engine started (a reset
keeps them), gauges say what is true at the snapshot. The Prometheus metrics built on them are
listed in ``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kvhex.domain.cost import LoadMode
from kvhex.domain.histogram import Histogram
from kvhex.domain.jobs import JobKind
from kvhex.domain.primary import PrimaryStats
from kvhex.domain.tiers import Medium


@attrs.define
class TierStats:
    """Cumulative counters of one secondary tier: its driver's, and the few its owner adds
    (``promotion_slot_failures``, ``cascades_dropped``, ``keys_dropped``,
    ``admission_ema_s``)."""

    name: str
    medium: Medium = Medium.STORAGE
    """The medium the tier announces (its metrics' ``medium`` label)."""
    puts_submitted: int = 0
    puts_ok: int = 0
    puts_failed: int = 0
    keys_put: int = 0
    gets_submitted: int = 0
    gets_ok: int = 0
    gets_failed: int = 0
    keys_promoted: int = 0
    keys_failed_to_promote: int = 0
    promotion_slot_failures: int = 0
    probes_submitted: int = 0
    probes_failed: int = 0
    cascades_dropped: int = 0
    keys_dropped: int = 0
    submit_errors: int = 0
    poll_errors: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    put_seconds: float = 0.0
    """Time with at least one put running (jobs overlapping in time count once)."""
    get_seconds: float = 0.0
    """Time with at least one get running."""
    in_flight: int = 0
    puts_in_flight: int = 0
    gets_in_flight: int = 0
    keys_in_flight_put: int = 0
    """Host slots the puts in flight read (pinned until they finish)."""
    keys_in_flight_get: int = 0
    """Host slots the gets (promotions) in flight write."""
    lookups: int = 0
    """Lookups that asked this tier (the host tier did not hold the key)."""
    hits: int = 0
    """Lookups this tier answered ``HIT`` (each starts a promotion or finds no host room)."""
    misses: int = 0
    """Lookups this tier answered ``MISS`` (the rest were ``RETRY``: probe not back yet)."""
    blocks_stored: int = 0
    """Keys the tier announced ``Stored`` (adoptions at start-up included)."""
    blocks_removed: int = 0
    """Keys the tier announced ``Removed`` (evicted, deleted, lost or found corrupt)."""
    resident_blocks: int = 0
    """Keys readable now, by the tier's own events (a ``Cleared`` sets it to 0)."""
    used_bytes: int | None = None
    """Bytes held (an ``Occupancy`` tier's answer at the snapshot; ``None``: it does not say)."""
    capacity_bytes: int | None = None
    """Bytes the tier may hold (as ``used_bytes``)."""
    corrupt_blocks: int | None = None
    """Blocks a get found damaged (a ``TierHealth`` tier's count at the snapshot; ``None``:
    it does not count)."""
    lost_blocks: int | None = None
    """Blocks dropped as unreadable, corrupt ones included (as ``corrupt_blocks``)."""
    io_errors: int | None = None
    """Storage operations that failed outside a job's per-block outcome (as
    ``corrupt_blocks``)."""
    refused_blocks: int | None = None
    """Blocks a keyed codec refused to a request of another tenant (a ``TenantRefusals``
    tier's count; ``None``: it does not count)."""
    admission_ema_s: float | None = None
    """The admission policy's moving average of put latency (a backpressure policy's, once
    it measured one; ``None`` otherwise)."""
    put_latency: Histogram = attrs.field(factory=Histogram)
    """Seconds from a put's submission to its result reaching the manager."""
    get_latency: Histogram = attrs.field(factory=Histogram)
    """Seconds from a get's (promotion's) submission to its result reaching the manager."""
    _put_until: float = attrs.field(default=0.0, repr=False, eq=False)
    _get_until: float = attrs.field(default=0.0, repr=False, eq=False)

    def add_busy(self, kind: JobKind, start: float, end: float) -> None:
        """Add a job that ran from ``start`` to ``end`` to the busy time of its direction,
        counting only what does not overlap the jobs added before (results arrive about in
        completion order, so this is the union of the intervals)."""
        if kind is JobKind.PUT:
            self.put_seconds += max(0.0, end - max(start, self._put_until))
            self._put_until = max(self._put_until, end)
        elif kind is JobKind.GET:
            self.get_seconds += max(0.0, end - max(start, self._get_until))
            self._get_until = max(self._get_until, end)


@attrs.define
class LoadStats:
    """Cumulative decisions: one per complete scan that held secondary-tier chunks, and one
    per prefix held by host memory alone once a load's wait was measured (its chunks count
    as loaded or recomputed too)."""

    loaded_all: int = 0
    """Plans that loaded every matched chunk."""
    loaded_part: int = 0
    """Plans that loaded a leading part and recomputed the rest."""
    recomputed: int = 0
    """Plans that loaded no secondary-tier chunk."""
    explored: int = 0
    """Plans that loaded although the estimate said recompute (to re-measure the tier)."""
    chunks_loaded: int = 0
    """Secondary-tier chunks chosen for loading (host chunks, in a host-only plan)."""
    chunks_recomputed: int = 0
    """Secondary-tier chunks left to the engine to recompute (host chunks, in a host-only
    plan)."""
    last_load_s: float = 0.0
    """The latest plan's estimated load seconds."""
    last_recompute_s: float = 0.0
    """The latest plan's estimated recompute seconds for the same chunks."""
    wait_host_s: float = 0.0
    """What a load from host memory costs a request in engine steps (``LoadWaits``)."""
    wait_promote_s: float = 0.0
    """What a promoting load costs a request beyond its gets (``LoadWaits``)."""


@attrs.frozen
class SinkStats:
    """One event sink's batches."""

    name: str
    """The sink's type name (its metrics label is ``<position>:<name>``)."""
    batches_sent: int = 0
    """Batches the sink took."""
    batches_dropped: int = 0
    """Batches the sink refused (its ``publish`` raised): lost for that sink."""


@attrs.frozen
class EventStats:
    """What the event pipeline published and how its translator described the stores."""

    published: Mapping[tuple[str, str], int] = attrs.field(factory=dict)
    """Public events published (to the sinks, or taken by the host engine), per (event
    type, medium); ``AllBlocksCleared`` carries no medium and counts under ``""``."""
    batches_published: int = 0
    """Non-empty batches handed to the sinks."""
    publish_failures: int = 0
    """Batches a sink refused, summed over the sinks."""
    sinks: tuple[SinkStats, ...] = ()
    """Each sink, in order."""
    full_stores: int = 0
    """Keys announced stored with their full provenance (hashes, parent, tokens, extra keys)."""
    placeholder_stores: int = 0
    """Keys announced stored as placeholders (no tokens, block size 0: external work, shapes
    the translator cannot describe, token-mutating requests)."""


@attrs.frozen
class TieringStats:
    """Primary-tier stats and one ``TierStats`` per secondary tier, in order."""

    primary: PrimaryStats
    tiers: tuple[TierStats, ...]
    active_requests: int
    """Requests seen and not finalized: not finished, or, with secondary tiers, finished with
    host stores, cascades or promotions still to go out."""
    jobs_in_flight: int
    lookups: int = 0
    """Lookups asked: ``host_hits`` plus every lookup host memory could not answer ``HIT``."""
    host_hits: int = 0
    """Keys answered ``HIT`` from host memory, once per key and step (the scheduler asks
    again while a request waits; counting in the lookup itself would cost every hit)."""
    loading: LoadStats = attrs.field(factory=LoadStats)
    """Load-or-recompute decisions."""
    prefill_tokens_per_s: float | None = None
    """The engine's prefill speed the decisions use (``None``: not known yet)."""
    load_mode: LoadMode = LoadMode.OFF
    """How secondary-tier hits are decided (``OFF``: every hit promoted at once)."""
    events: EventStats = attrs.field(factory=EventStats)
    """The event pipeline's counts (an ``OffloadEngine``'s stats; empty from the manager)."""
