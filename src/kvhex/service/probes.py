"""Asynchronous existence probes for one secondary tier, shared across requests.

A lookup of a key the tier has not answered for yet returns ``RETRY`` and queues the key in
this step's batch; at step end the tier's ``TierDriver`` sends the batch as one probe job;
once the result is polled, lookups answer ``HIT`` or ``MISS``. A key is probed at most once
while its answer is pending, whoever asks. Answers live while some unfinished request asked for
the key, and an in-flight probe is kept so a new request can still share it. A key whose load
failed answers ``MISS`` (and the driver marks it missing, so it is never re-promoted in a loop,
vLLM #49176).
"""

from __future__ import annotations

import enum

from kvhex.domain.jobs import JobId
from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult


class _Phase(enum.Enum):
    QUEUED = 1
    IN_FLIGHT = 2
    RESOLVED = 3


class _Probe:
    __slots__ = ("found", "job", "phase", "requesters")

    def __init__(self) -> None:
        self.phase = _Phase.QUEUED
        self.found = False
        self.job: JobId | None = None
        self.requesters: set[ReqContext] = set()


class ProbeCache:
    """Probe state of one tier. Scheduler thread only; no IO."""

    __slots__ = ("_batch", "_by_request", "_probes")

    def __init__(self) -> None:
        self._probes: dict[OffloadKey, _Probe] = {}
        self._batch: list[OffloadKey] = []
        self._by_request: dict[ReqContext, set[OffloadKey]] = {}

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """``HIT``/``MISS`` once answered, else ``RETRY`` (queuing a probe the first time)."""
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = _Probe()
            self._batch.append(key)
        if ctx not in probe.requesters:
            probe.requesters.add(ctx)
            self._by_request.setdefault(ctx, set()).add(key)
        if probe.phase is _Phase.RESOLVED:
            return LookupResult.HIT if probe.found else LookupResult.MISS
        return LookupResult.RETRY

    def peek(self, key: OffloadKey) -> bool | None:
        """The answer known for ``key`` (``None``: not probed, or its probe not back yet),
        without queuing a probe or registering anyone."""
        probe = self._probes.get(key)
        if probe is None or probe.phase is not _Phase.RESOLVED:
            return None
        return probe.found

    def take_batch(self) -> list[OffloadKey]:
        """This step's queued keys (each once), to send as one probe job."""
        batch, self._batch = self._batch, []
        return [k for k in batch if (p := self._probes.get(k)) and p.phase is _Phase.QUEUED]

    def sent(self, keys: list[OffloadKey], job: JobId) -> None:
        """The batch went out as ``job``."""
        for key in keys:
            probe = self._probes.get(key)
            if probe is not None:
                probe.phase = _Phase.IN_FLIGHT
                probe.job = job

    def resolve(
        self, job: JobId, keys: tuple[OffloadKey, ...], found: frozenset[OffloadKey], ok: bool
    ) -> None:
        """Apply a probe job's answer. A failed probe answers ``MISS`` (logged by the caller)."""
        for key in keys:
            probe = self._probes.get(key)
            if probe is None or probe.job != job:
                continue
            if not probe.requesters:
                del self._probes[key]
                continue
            probe.phase = _Phase.RESOLVED
            probe.found = ok and key in found

    def set_answer(self, keys: list[OffloadKey] | tuple[OffloadKey, ...], found: bool) -> None:
        """Record what the manager learned otherwise: a put stored ``keys`` (found) or a get
        failed on them (missing). Only keys some request still asks about are kept."""
        for key in keys:
            probe = self._probes.get(key)
            if probe is not None:
                probe.phase = _Phase.RESOLVED
                probe.found = found
                probe.job = None

    def forget_request(self, ctx: ReqContext) -> None:
        """``ctx`` finished: drop its interest; answers nobody needs are deleted (in-flight
        probes are kept until their result, which then finds no requester)."""
        for key in self._by_request.pop(ctx, ()):
            probe = self._probes.get(key)
            if probe is None:
                continue
            probe.requesters.discard(ctx)
            if not probe.requesters and probe.phase is not _Phase.IN_FLIGHT:
                del self._probes[key]

    def clear(self) -> None:
        """Forget everything (after a reset drained in-flight probes)."""
        self._probes.clear()
        self._batch.clear()
        self._by_request.clear()

    @property
    def pending(self) -> bool:
        """Keys queued for the next batch."""
        return bool(self._batch)

    def __len__(self) -> int:
        return len(self._probes)
