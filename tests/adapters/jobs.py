"""Driving one tier job to completion from a test: submit, then poll until its result."""

from __future__ import annotations

import itertools
import time

from kvhex.domain import JobId, JobKind, JobResult, OffloadKey, TierJob, make_offload_key
from kvhex.ports.tier_store import TierStore

_ids = itertools.count(1)


def key(i: int) -> OffloadKey:
    """The offload key of test chunk ``i`` (group 0)."""
    return make_offload_key(i.to_bytes(32, "big"), 0)


def run(
    store: TierStore, kind: JobKind, ids: list[int], slots: list[int] | None = None
) -> JobResult:
    """Submit one job over chunks ``ids`` (slots default to 0..n-1) and wait for its result."""
    keys = tuple(key(i) for i in ids)
    job_slots = (
        () if kind is JobKind.PROBE else tuple(slots if slots is not None else range(len(ids)))
    )
    job = TierJob(JobId(next(_ids)), kind, keys, job_slots)
    submit = {
        JobKind.PUT: store.submit_put,
        JobKind.GET: store.submit_get,
        JobKind.PROBE: store.submit_probe,
    }[kind]
    submit(job)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for result in store.poll():
            assert result.job_id == job.job_id, "a result for a job never submitted"
            return result
        time.sleep(0.002)
    raise AssertionError(f"job {job.job_id} never finished")
