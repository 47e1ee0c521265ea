"""``TierStore``: a secondary tier's storage medium (files, an object store, memory, ...).

Every call comes from the tiering manager (or a third party driving the port) on one thread
and must not block on IO, except ``drain`` and ``close``. Jobs are submitted, then reported
exactly once through ``poll``, in whatever order they finish. The tier owns the events of the
storage it owns (``take_events``): it announces ``Stored(keys, identity, job.ctx)`` when a put
made keys readable, ``Removed`` when keys stop being readable (eviction, corruption, loss,
a delete where it ``Deletes``), and nothing for failures; replaying its events (Stored adds,
Removed removes) gives exactly the keys it holds.

Any number of jobs may name the same key at once, and the events must stay true in every
order they finish: a put of a key another put is writing leaves it to that one; a get or probe
that found a key missing never undoes a later put of it. kvhex's own tiers get this from the
domain's :class:`~kvhex.domain.residency.Residency`, and ``kvhex.testing``'s contract kit
checks it for any tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvhex.domain.jobs import JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import TierIdentity
from kvhex.ports.events import EventSource


@runtime_checkable
class TierStore(EventSource, Protocol):
    """A secondary tier. Built with the ``HostBuffer`` whose slots its jobs name."""

    @property
    def identity(self) -> TierIdentity:
        """Medium, locality and ownership name announced in this tier's events."""
        ...

    def submit_put(self, job: TierJob) -> None:
        """Copy ``job.slots`` into the tier under ``job.keys``, asynchronously.

        The slots stay pinned (unchanged, not evicted) until the job's result was polled. Keys
        already present may be skipped. Never raises for an IO failure: that is a failed
        ``JobResult``. Raises ``TierError`` only when the tier cannot accept work at all.
        """
        ...

    def submit_get(self, job: TierJob) -> None:
        """Copy the blocks of ``job.keys`` into the reserved ``job.slots``, asynchronously.

        A block that is missing, truncated or fails its integrity check fails the job (or is
        left out of ``ok_keys`` for a partial success); a corrupt block is never written into
        a slot reported as loaded.
        """
        ...

    def submit_probe(self, job: TierJob) -> None:
        """Find out which of ``job.keys`` exist, asynchronously; reported as ``found``."""
        ...

    def poll(self) -> list[JobResult]:
        """Results of jobs finished since the last call, each job exactly once. Never blocks."""
        ...

    def drain(self) -> None:
        """Block until every submitted job finished; their results are then in ``poll``.

        Does not abort a transfer mid-flight; queued jobs may be cancelled but are then
        reported as failed.
        """
        ...

    def close(self) -> None:
        """Release threads, files and connections. Idempotent. Jobs still queued fail."""
        ...


@runtime_checkable
class Deletes(Protocol):
    """Optional for a ``TierStore``: removes blocks on request. kvhex's own tiers have it;
    the tiering manager never calls it (a tier makes room by evicting on its own), so a
    third-party tier may leave it out. ``kvhex.testing``'s kit runs its delete checks only
    for tiers that have it."""

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        """Remove ``keys`` (absent and repeated keys are ignored) and announce the removal of
        those present, once each. Called on the thread that submits the tier's jobs; never
        blocks on IO (the blocks may go later). From this call on no get serves them, and the
        room they held is available to the next put."""
        ...


@runtime_checkable
class RequestAware(Protocol):
    """Optional: a tier that wants request lifecycle callbacks."""

    def wants_every_chunk(self, ctx: ReqContext) -> bool:
        """True when the tier needs every chunk of this request (REQUEST_LEVEL), also those
        the host tier already holds. Called once per request, at its start."""
        ...

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """The request used ``keys`` (recency hint). Never blocks."""
        ...

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No more submissions for ``ctx`` will follow (jobs may still be in flight)."""
        ...


@runtime_checkable
class Occupancy(Protocol):
    """Optional for a ``TierStore``: how full it is, for metrics (read from the scheduler
    thread or a metrics scrape; plain attribute reads, never IO)."""

    @property
    def used_bytes(self) -> int:
        """Bytes held by readable blocks and reserved by puts in flight."""
        ...

    @property
    def capacity_bytes(self) -> int:
        """Bytes the tier may hold."""
        ...


@runtime_checkable
class Indexed(Protocol):
    """Optional for a ``TierStore`` whose own index is the truth about what it holds (the
    storage is its alone, as a local file tier's is): lookups ask it at once instead of
    probing, so a hit costs the engine no step of waiting for a probe, and load-or-recompute
    can be decided while the scheduler looks the request up."""

    def held_now(self, key: OffloadKey) -> bool | None:
        """``True`` when a get submitted now would find ``key`` (readable, not being
        written or removed); ``False`` when the tier does not hold it; ``None`` when only a
        probe can tell (for instance while blocks found at start-up are being adopted).
        Called on the thread that submits the tier's jobs, per key per lookup: a dict read,
        never IO."""
        ...


@runtime_checkable
class PeerView(Protocol):
    """Optional for a ``TierStore`` on storage other instances share: it also announces the
    blocks the other instances hold there (which its gets can load), under
    ``peer_identity``, and their removal when it sees them go. The engine announces the two
    identities as one residency: a key is announced while this instance or another holds
    it. Its ``take_events`` then holds events of both identities."""

    @property
    def peer_identity(self) -> TierIdentity:
        """The identity of the other instances' blocks in this tier's events (never its
        ``identity``)."""
        ...


@runtime_checkable
class ScheduledWork(Protocol):
    """Optional for a ``TierStore`` that does work of its own between the engine's jobs,
    started and applied by ``poll`` (a peer view's scans of the shared storage, blocks a
    server dropped): its events are announced only when the engine polls. An engine that
    stops stepping while it has no request (vLLM's, when idle) asks when to poll again, so
    that an idle server still announces and withdraws what this work finds on time."""

    def next_poll_at(self) -> float | None:
        """When ``poll`` next has work of the store's own to start or apply, on
        ``time.monotonic``'s clock: a time already past while such work is due, in flight
        or finished and not yet applied (poll again soon); ``None`` when none is scheduled
        (closed, or nothing of its own to do). Called on the scheduler thread between
        polls, and by an engine's idle timer on a thread of its own: plain reads, never IO
        or a lock; never raises."""
        ...


def tier_identities(store: TierStore) -> tuple[TierIdentity, ...]:
    """Every identity ``store``'s events carry: its own, and a ``PeerView``'s other
    instances' one."""
    if isinstance(store, PeerView):
        return store.identity, store.peer_identity
    return (store.identity,)
