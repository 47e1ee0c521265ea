"""Transfer jobs between the host primary tier and a secondary tier, and their results.

A job owns its ``ReqContext`` while in flight: the context rides the job into the tier and
back in the result's processing, so a put that completes long after its request finished is
still attributed to exactly that request (never to "whatever request now has that id").

``slots[i]`` is the host slot of ``keys[i]``. For a put the slots are pinned (readable, never
evicted) until the job's result is processed; for a get they are reserved write-pending slots
the tier fills. A probe names keys only and asks which exist.
"""

from __future__ import annotations

import enum
from typing import NewType

import attrs

from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext

__all__ = ["JobId", "JobKind", "JobResult", "TierJob"]

JobId = NewType("JobId", int)


class JobKind(enum.Enum):
    """What a job asks of a tier."""

    PUT = "put"
    """Copy host slots into the tier (a cascade)."""
    GET = "get"
    """Copy the tier's blocks into reserved host slots (a promotion)."""
    PROBE = "probe"
    """Report which keys exist in the tier."""


@attrs.frozen(slots=True, eq=False)
class TierJob:
    """One batched request to a tier. Compared by identity (a job is an event in time)."""

    job_id: JobId
    kind: JobKind
    keys: tuple[OffloadKey, ...]
    slots: tuple[int, ...] = ()
    ctx: ReqContext | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind is not JobKind.PROBE and len(self.slots) != len(self.keys):
            raise ValueError(
                f"job {self.job_id}: {len(self.keys)} keys but {len(self.slots)} slots"
            )


@attrs.frozen(slots=True)
class JobResult:
    """What a tier reports for one finished job.

    Attributes:
        job_id: the job this answers.
        success: every key succeeded.
        ok_keys: for a failed get, the keys that did load (partial success); ``None`` means
            every key shares the fate given by ``success``.
        found: for a probe, the keys that exist.
        nbytes: bytes moved, when known.
        seconds: wall time from submission to completion, when measured (feeds admission).
        error: a short description of the failure, for logs and stats.
    """

    job_id: JobId
    success: bool
    ok_keys: frozenset[OffloadKey] | None = None
    found: frozenset[OffloadKey] = frozenset()
    nbytes: int = 0
    seconds: float | None = None
    error: str | None = None
