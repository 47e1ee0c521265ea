"""``Histogram``: cumulative bucket counts of observed values (job latencies, in seconds).

Prometheus-shaped: ``bounds`` are the buckets' upper bounds (inclusive, ascending), and an
implicit last bucket holds everything above them. Observing is one ``bisect`` and two adds, so
the tiering service can keep one per tier and job kind without a metrics library.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Sequence

import attrs

JOB_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Job latency buckets (seconds): a host-memory copy (~100 us) to a slow object store."""


def _ascending(_: object, __: object, bounds: tuple[float, ...]) -> None:
    if not bounds or any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"bucket bounds must be non-empty and strictly ascending: {bounds}")


@attrs.define(slots=True)
class Histogram:
    """Counts per bucket (``counts[i]``: values ``<= bounds[i]`` and above the bound before;
    ``counts[-1]``: above every bound), their ``sum`` and ``count``."""

    bounds: tuple[float, ...] = attrs.field(default=JOB_SECONDS_BUCKETS, validator=_ascending)
    counts: list[int] = attrs.field(init=False)
    sum: float = attrs.field(init=False, default=0.0)
    count: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count one value."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, values <= it)`` per bucket, ``inf`` last (Prometheus' ``le``)."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def copy(self) -> Histogram:
        """An independent snapshot."""
        snapshot = Histogram(self.bounds)
        snapshot.counts = list(self.counts)
        snapshot.sum = self.sum
        snapshot.count = self.count
        return snapshot

    @classmethod
    def of(
        cls, values: Sequence[float], bounds: Sequence[float] = JOB_SECONDS_BUCKETS
    ) -> Histogram:
        """A histogram of ``values`` (tests and benchmarks)."""
        histogram = cls(tuple(bounds))
        for value in values:
            histogram.observe(value)
        return histogram
