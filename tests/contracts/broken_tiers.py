"""Tiers that break one duty of the port each, built on the public API of
``MemoryTierStore`` (a wrapper per fault), for the contract kit to catch.

Each fault reproduces the symptom of a bug found in a real tier: a get that found a key
missing drops the put of it that completed meanwhile; a put that skipped a key another put
was writing leaves it unknown to the tier; ``delete([k, k])`` raises; ``delete`` frees room
only later; jobs queued at ``close`` are lost; submits after ``close`` are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvhex.adapters.memory import MemoryTierStore
from kvhex.domain.events import Removed, TierEvent
from kvhex.domain.jobs import JobId, JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import TierIdentity
from kvhex.ports.host_buffer import HostBuffer

__all__ = [
    "AcceptsWorkAfterClose",
    "DrainIsNotAMethod",
    "FreesRoomLate",
    "LosesJobsAtClose",
    "MissedGetDropsKey",
    "OverlappingPutsForgetKey",
    "RaisesOnDuplicateDelete",
    "Wrapped",
]


class Wrapped:
    """Forwards the TierStore port to a ``MemoryTierStore``; subclasses break one duty."""

    def __init__(self, host: HostBuffer, capacity_blocks: int) -> None:
        self.inner = MemoryTierStore(host, capacity_bytes=capacity_blocks * host.slot_bytes)
        self.extra: list[TierEvent] = []  # announced after the inner tier's events

    @property
    def identity(self) -> TierIdentity:
        return self.inner.identity

    def submit_put(self, job: TierJob) -> None:
        self.inner.submit_put(job)

    def submit_get(self, job: TierJob) -> None:
        self.inner.submit_get(job)

    def submit_probe(self, job: TierJob) -> None:
        self.inner.submit_probe(job)

    def poll(self) -> list[JobResult]:
        return self.inner.poll()

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.delete(keys)

    def drain(self) -> None:
        self.inner.drain()

    def close(self) -> None:
        self.inner.close()

    def take_events(self) -> list[TierEvent]:
        events, self.extra = self.inner.take_events() + self.extra, []
        return events


class MissedGetDropsKey(Wrapped):
    """A get that found a key missing announces it removed when its result is polled, though
    a put stored it meanwhile and the tier still serves it."""

    def __init__(self, host: HostBuffer, capacity_blocks: int) -> None:
        super().__init__(host, capacity_blocks)
        self.gets: dict[JobId, TierJob] = {}

    def submit_get(self, job: TierJob) -> None:
        self.gets[job.job_id] = job
        super().submit_get(job)

    def poll(self) -> list[JobResult]:
        results = super().poll()
        for result in results:
            job = self.gets.pop(result.job_id, None)
            if job is not None and not result.success:
                missed = set(job.keys) - set(result.ok_keys or ())
                dropped = tuple(k for k in job.keys if k in missed and k in self.inner)
                if dropped:
                    self.extra.append(Removed(dropped, self.identity))
        return results


class OverlappingPutsForgetKey(Wrapped):
    """A key two puts in flight share is stored and announced, but the tier forgets it: a
    delete of it announces and removes nothing."""

    def __init__(self, host: HostBuffer, capacity_blocks: int) -> None:
        super().__init__(host, capacity_blocks)
        self.writing: dict[JobId, set[OffloadKey]] = {}
        self.forgotten: set[OffloadKey] = set()

    def submit_put(self, job: TierJob) -> None:
        for keys in self.writing.values():
            self.forgotten |= keys & set(job.keys)
        self.writing[job.job_id] = set(job.keys)
        super().submit_put(job)

    def poll(self) -> list[JobResult]:
        results = super().poll()
        for result in results:
            self.writing.pop(result.job_id, None)
        return results

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        super().delete([k for k in keys if k not in self.forgotten])


class RaisesOnDuplicateDelete(Wrapped):
    """``delete`` naming a key twice raises ``KeyError`` after removing it once."""

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        super().delete(list(dict.fromkeys(keys)))
        if len(set(keys)) != len(keys):
            raise KeyError(keys[0])


class FreesRoomLate(Wrapped):
    """``delete`` takes effect only after the next poll's jobs ran: a put right after it at
    full capacity evicts other blocks."""

    def __init__(self, host: HostBuffer, capacity_blocks: int) -> None:
        super().__init__(host, capacity_blocks)
        self.later: list[OffloadKey] = []

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        self.later += keys

    def submit_put(self, job: TierJob) -> None:
        super().submit_put(job)
        self.inner.drain()  # the put runs now, before the deletion
        later, self.later = self.later, []
        super().delete(later)


class LosesJobsAtClose(Wrapped):
    """Jobs still queued at ``close`` are never reported."""

    def close(self) -> None:
        super().close()
        self.inner.poll()  # the failed results, dropped


class AcceptsWorkAfterClose(Wrapped):
    """Submits after ``close`` are silently ignored instead of refused."""

    closed = False

    def close(self) -> None:
        super().close()
        self.closed = True

    def submit_put(self, job: TierJob) -> None:
        if not self.closed:
            super().submit_put(job)


class DrainIsNotAMethod(Wrapped):
    """Has every name of the port, but ``drain`` is not callable."""

    drain: Any = None
